"""``gpudiag doctor``: checks as ok / missing / wrong with the fix, and an exit code that means something."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from gpudiag.commands import doctor
from gpudiag.commands.doctor import cuda_checks, find_cuda_runtimes, run_checks

sys.path.insert(0, os.path.dirname(__file__))
from fake_nvml import FakeNvml


def _by_name(result):
    return {(c["feature"], c["name"]): c for c in result["checks"]}


# --- the real machine, through the real command line --------------------------------------


def test_doctor_json_describes_this_node_and_its_exit_code_agrees(cli):
    proc = cli("doctor", "--json")
    result = json.loads(proc.stdout)
    assert proc.returncode == (0 if result["ok"] else 1), proc.stderr
    for c in result["checks"]:
        assert set(c) == {"feature", "name", "status", "detail", "fix", "required"}
        assert c["status"] in ("ok", "missing", "wrong")
        if c["status"] != "ok" and c["required"]:
            assert c["fix"], f"{c['name']} is {c['status']} without a fix"
    nvml = _by_name(result)[("nvml", "NVML")]
    if nvml["status"] != "ok":
        assert nvml["detail"] and nvml["fix"]


def test_asking_for_nvml_on_a_node_without_a_driver_fails_with_the_fix(cli):
    proc = cli("doctor", "--feature", "nvml", "--json")
    result = json.loads(proc.stdout)
    nvml = _by_name(result)[("nvml", "NVML")]
    if nvml["status"] == "ok":
        pytest.skip("this node has a working NVIDIA driver")
    assert proc.returncode == 1 and result["ok"] is False
    assert "libnvidia-ml.so.1" in nvml["detail"] and "install the NVIDIA driver" in nvml["fix"]


def test_a_node_without_a_driver_is_told_so_first_with_what_still_works_and_exits_1(cli):
    result = json.loads(cli("doctor", "--json").stdout)
    if result["driver"]["present"]:
        pytest.skip("this node has a working NVIDIA driver")
    proc = cli("doctor", env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 1 and result["ok"] is False and "nvml" in result["features"]
    nvml = _by_name(result)[("nvml", "NVML")]
    assert nvml["status"] == "missing" and nvml["required"] and "install the NVIDIA driver" in nvml["fix"]
    assert result["without_driver"] == list(doctor.WITHOUT_DRIVER)
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("no NVIDIA driver on this node")  # said first, under the heading
    assert any("gpudiag repro" in line for line in lines) and any("analyze trace" in line for line in lines)
    assert "everything needed is present" not in proc.stdout
    assert lines[-1] == "something needed is missing or wrong (see fix)"


def test_features_that_do_without_a_driver_pass_but_do_not_claim_the_node_is_ready(monkeypatch):
    monkeypatch.setattr(doctor, "nvml_facts", lambda: {"available": False, "reason": "no libnvidia-ml.so.1"})
    node = run_checks()
    assert node["ok"] is False and node["features"][0] == "nvml" and node["driver"]["present"] is False
    asked = run_checks(["torch"])
    assert asked["features"] == ["torch"] and asked["driver"] == {"present": False, "detail": "no libnvidia-ml.so.1"}
    assert [c["required"] for c in asked["checks"] if c["name"] == "NVML"] == [False]


def test_the_text_report_shows_each_fix(cli):
    proc = cli("doctor", "--feature", "cuda")
    assert proc.returncode in (0, 1)
    assert "cuda: CUDA driver" in proc.stdout
    if proc.returncode == 1:
        assert "fix:" in proc.stdout


def test_an_unknown_feature_is_one_error_line(cli):
    proc = cli("doctor", "--feature", "quantum")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "gpudiag: error: unknown feature quantum: choose from nvml, cuda, torch, ebpf, kubernetes"]


@pytest.mark.parametrize("mode", ["off", "auto", "on"])
def test_with_the_agents_config_the_ebpf_checks_follow_its_probes_ebpf(cli, tmp_path, mode):
    config = tmp_path / "agent.toml"
    config.write_text(f'[probes]\nebpf = "{mode}"\n')
    proc = cli("doctor", "--config", config, "--json")
    result = json.loads(proc.stdout)
    assert result["agent_config"] == {"path": str(config), "probes.ebpf": mode}
    ebpf = [c for c in result["checks"] if c["feature"] == "ebpf"]
    if mode == "off":  # the agent will not use them: not checked, not counted
        assert "ebpf" not in result["features"] and not ebpf
    elif mode == "auto":  # the agent runs without them: said, but optional
        assert "ebpf" in result["features"] and ebpf  # this node is root (CI runs as root)
        assert not any(c["required"] for c in ebpf)
    else:  # the agent logs an error without them: required as the checks themselves say, root or not
        assert "ebpf" in result["features"]
        assert {c["name"]: c["required"] for c in ebpf} == {c["name"]: c["required"] for c in doctor.ebpf_checks()}
        assert any(c["required"] for c in ebpf)
    required = [c for c in result["checks"] if c["required"] and c["feature"] in result["features"]]
    assert result["ok"] == all(c["status"] == "ok" for c in required)
    assert proc.returncode == (0 if result["ok"] else 1), proc.stderr


def test_an_explicit_feature_wins_over_the_agents_config(cli, tmp_path):
    config = tmp_path / "agent.toml"
    config.write_text('[probes]\nebpf = "off"\n')
    result = json.loads(cli("doctor", "--config", config, "--feature", "ebpf", "--json").stdout)
    assert result["features"] == ["ebpf"]
    ebpf = {c["name"]: c["required"] for c in result["checks"] if c["feature"] == "ebpf"}
    assert ebpf == {c["name"]: c["required"] for c in doctor.ebpf_checks()} and any(ebpf.values())


def test_a_bad_agent_config_is_one_error_line_naming_the_key(cli, tmp_path):
    config = tmp_path / "agent.toml"
    config.write_text('[probes]\nebpf = "sometimes"\n')
    proc = cli("doctor", "--config", config)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "probes.ebpf" in line and "sometimes" in line
    missing = cli("doctor", "--config", tmp_path / "nope.toml")
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1


# --- versions ----------------------------------------------------------------------------


def test_cuda_runtimes_are_judged_against_the_driver():
    runtimes = [{"kind": "toolkit", "where": "/usr/local/cuda-13.0", "version": "13.0", "source": "h"},
                {"kind": "pip wheel", "where": "nvidia-cuda-runtime-cu12", "version": "12.6.77", "source": "pip"},
                {"kind": "torch build", "where": "torch", "version": "11.8", "source": "torch.version.cuda"}]
    checks = {c["name"].split(" (")[0]: c for c in cuda_checks("12.4", runtimes)}
    assert checks["CUDA driver"]["status"] == "ok"
    new_major = checks["CUDA runtime 13.0"]
    assert new_major["status"] == "wrong" and new_major["required"]
    assert "upgrade the NVIDIA driver" in new_major["fix"]
    minor = checks["CUDA runtime 12.6.77"]
    assert minor["status"] == "ok" and "minor-version compatibility" in minor["detail"]
    assert checks["CUDA runtime 11.8"]["status"] == "ok"


def test_without_a_driver_every_runtime_is_listed_as_unusable():
    (check,) = cuda_checks(None, [{"kind": "toolkit", "where": "/x", "version": "13.0", "source": "h"}])
    assert check["status"] == "missing" and "13.0 (toolkit)" in check["detail"]


def test_the_system_toolkit_is_found_by_its_real_runtime():
    toolkits = [r for r in find_cuda_runtimes() if r["kind"] == "toolkit"]
    if not toolkits:
        pytest.skip("no CUDA toolkit under /usr/local/cuda* on this machine")
    assert all(doctor.parse_version(r["version"]) for r in toolkits)


# --- with a (fake) driver ------------------------------------------------------------------


def test_a_healthy_driver_passes_the_nvml_checks(monkeypatch):
    FakeNvml.node(2, 0, cuda_driver_version=13000).install(monkeypatch)
    result = run_checks(["nvml", "cuda"])
    checks = _by_name(result)
    assert checks[("nvml", "NVML")]["status"] == "ok"
    assert "driver 550.54.15" in checks[("nvml", "NVML")]["detail"]
    assert checks[("nvml", "MIG / vGPU")]["status"] == "ok"
    assert checks[("cuda", "CUDA driver")]["detail"] == "the driver supports CUDA up to 13.0"
    assert result["ok"] is all(c["status"] == "ok" for c in result["checks"] if c["required"])


def test_a_toolkit_newer_than_the_driver_is_wrong(monkeypatch):
    if not any(doctor.parse_version(r["version"]) >= (13, 0) for r in find_cuda_runtimes()):
        pytest.skip("no CUDA 13 runtime on this machine to compare with a CUDA 12 driver")
    FakeNvml.node(1, 0, cuda_driver_version=12040).install(monkeypatch)
    result = run_checks(["cuda"])
    wrong = [c for c in result["checks"] if c["status"] == "wrong"]
    assert wrong and "this driver supports 12.4" in wrong[0]["detail"]
    assert result["ok"] is False


def test_mig_is_flagged_and_a_lost_gpu_fails(monkeypatch):
    fake = FakeNvml.node(2, 0)
    fake.gpus[0].mig_mode = 1
    fake.lose(1)
    fake.install(monkeypatch)
    result = run_checks(["nvml"])
    checks = _by_name(result)
    assert checks[("nvml", "MIG / vGPU")]["status"] == "wrong" and not checks[("nvml", "MIG / vGPU")]["required"]
    assert checks[("nvml", "GPUs lost")]["status"] == "wrong" and "reset" in checks[("nvml", "GPUs lost")]["fix"]
    assert result["ok"] is False


def test_a_gpu_node_with_a_torch_that_sees_no_gpu_is_wrong(monkeypatch):
    FakeNvml.node(1, 0).install(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = run_checks(["torch"])
    sees = _by_name(result)[("torch", "torch sees a GPU")]
    assert sees["status"] == "wrong" and sees["required"] and "CUDA_VISIBLE_DEVICES" in sees["detail"]
    assert result["ok"] is False


def test_without_the_ebpf_module_doctor_says_its_checks_are_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "gpudiag.probes.ebpf_readiness", None)  # import now raises ImportError
    (check,) = doctor.ebpf_checks()
    assert check["status"] == "missing" and "eBPF checks are unavailable" in check["detail"]


def test_the_ebpf_checks_are_included_when_their_module_exists():
    readiness = pytest.importorskip("gpudiag.probes.ebpf_readiness")
    names = [c["name"] for c in doctor.ebpf_checks()]
    assert names == [c["name"] for c in readiness.ebpf_checks()]
