"""`gpudiag repro` from the command line: reproducible JSON, side-by-side fixes, one-line errors."""

import json
import os

import pytest

SHORT = ["--duration", "300"]


def test_the_same_seed_gives_byte_identical_json(cli):
    a = cli("repro", "kv-eviction-storm", "--json", "--seed", "7", *SHORT)
    b = cli("repro", "kv-eviction-storm", "--json", "--seed", "7", *SHORT)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout
    c = cli("repro", "kv-eviction-storm", "--json", "--seed", "8", *SHORT)
    assert c.stdout != a.stdout
    doc = json.loads(a.stdout)
    assert doc["seed"] == 7 and doc["fix"] is None


def test_a_fix_carries_the_unfixed_run_as_its_baseline(cli):
    r = cli("repro", "kv-eviction-storm", "--fix", "chunked-kv", "--json", *SHORT)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["fix"] == "chunked-kv"
    assert doc["baseline_run"]["fix"] is None
    assert doc["baseline_run"]["seed"] == doc["seed"]


def test_the_report_prints_the_incident_table_and_both_runs(cli):
    r = cli("repro", "kv-eviction-storm", "--fix", "paged-kv", *SHORT)
    assert r.returncode == 0, r.stderr
    for text in ("GPU utilization", "TTFT P99", "TPOT P99", "host CPU", "before", "unfixed", "paged-kv",
                 "Verdict"):
        assert text in r.stdout
    assert "Traceback" not in r.stderr


def test_a_findings_fix_is_shown_as_the_command_that_checks_it(cli):
    r = cli("repro", "cpu-starved", env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    checks = [line.split("check a fix:")[1].strip(" │") for line in r.stdout.splitlines() if "check a fix:" in line]
    assert checks and all(c.startswith("gpudiag repro cpu-starved --fix ") for c in checks), checks
    assert "gpudiag repro cpu-starved --fix preprocess-workers" in checks[0]


def test_list_names_every_scenario_and_fix(cli):
    r = cli("repro", "--list", "--json")
    assert r.returncode == 0
    doc = json.loads(r.stdout)
    storm = next(s for s in doc["scenarios"] if s["name"] == "kv-eviction-storm")
    assert set(storm["fixes"]) == {"paged-kv", "chunked-kv", "priority-eviction", "memory-aware-batching"}


@pytest.mark.parametrize("args,needle", [
    (["repro"], "name a scenario; valid: kv-eviction-storm"),
    (["repro", "no-such-scenario"], "valid: kv-eviction-storm"),
    (["repro", "kv-eviction-storm", "--fix", "magic"], "valid: paged-kv"),
    (["repro", "healthy", "--fix", "paged-kv"], "scenario healthy has no fix to check"),
    (["repro", "kv-eviction-storm", "--qps", "-3"], "QPS must be a positive number"),
    (["repro", "kv-eviction-storm", "--qps", "0"], "QPS must be a positive number"),
    (["repro", "kv-eviction-storm", "--block-size", "0"], "block size must be a positive"),
    (["repro", "healthy", "--block-size", "1000000"], "block size 1000000 tokens is too large"),
    (["repro", "kv-eviction-storm", "--gpu", "L4"], "cannot fit"),
    (["repro", "kv-eviction-storm", "--gpu", "TPUv9"], "unknown GPU"),
    (["repro", "kv-eviction-storm", "--model", "gpt-9"], "unknown model"),
    (["repro", "kv-eviction-storm", "--seed", "abc"], "seed"),
    (["repro", "degenerate-grid", "--seed", "-1"], "seed must be a non-negative integer, got -1"),
    (["repro", "healthy", "--seed", "-9223372036854775809"], "seed must be a non-negative integer"),
    (["repro", "kv-eviction-storm", "--duration", "-1"], "duration must be positive"),
    (["repro", "kv-eviction-storm", "--qps", "1e308"], "at most 2,000,000 are simulated"),
    (["repro", "kv-eviction-storm", "--duration", "1e9"], "at most 2,000,000 are simulated"),
    (["repro", "kv-eviction-storm", "--duration", "inf"], "at most 2,000,000 are simulated"),
])
def test_bad_input_gives_one_line_and_exit_2(cli, args, needle):
    r = cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


def test_any_non_negative_seed_runs_however_large(cli):
    for seed in ("0", str(2**32), str(10**30)):
        r = cli("repro", "degenerate-grid", "--json", "--seed", seed, "--duration", "5")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["seed"] == int(seed)


def test_a_terminal_sees_a_progress_bar_and_a_pipe_does_not(tmp_path):
    import os
    import pty
    import subprocess
    import sys

    master, slave = pty.openpty()
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "gpudiag", "repro", "kv-eviction-storm", "--duration", "900"],
                                stdout=stdout, stderr=slave, env=dict(os.environ, COLUMNS="120"))
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=600) == 0
    os.close(master)
    tty_text = b"".join(chunks).decode(errors="replace")
    assert "simulated" in tty_text and "/900 s" in tty_text
    assert "simulated" not in out.read_text()


def test_recovery_is_the_start_of_the_last_run_of_windows_within_the_calm_ones():
    from gpudiag import repro

    calm = [(float(a), [0.2, 0.04]) for a in range(0, 600, 60)]  # limits 0.3 s TTFT, 0.06 s TPOT

    def windows(bad):
        return [(1000.0 + a, [0.9, 0.04] if a in bad else [0.2, 0.05]) for a in range(0, 900, 60)]

    assert repro.recovered_after_s(windows(set()), 1000.0, 2200.0, calm) == 0.0
    assert repro.recovered_after_s(windows({0, 60, 300}), 1000.0, 2200.0, calm) == 360.0
    assert repro.recovered_after_s(windows({840}), 1000.0, 2200.0, calm) is None  # still out at the end
    assert repro.recovered_after_s(windows({0}), 1000.0, 2200.0, []) is None  # no reference to come back to
    tpot_only = [(1000.0, [0.2, 0.1]), (1060.0, [0.2, 0.05])]
    assert repro.recovered_after_s(tpot_only, 1000.0, 2200.0, calm) == 60.0


def test_a_shortened_run_shows_only_the_phases_it_reached_and_names_the_rest_as_not_reached(cli):
    r = cli("repro", "kv-eviction-storm", "--json", "--duration", "3000")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    spans = [(p["name"], p["start_s"], p["end_s"]) for p in doc["phases"]]
    assert spans == [("before", 0, 2700), ("during", 2700, 3000)]
    assert doc["phases"][1]["qps"] > 5  # requests per second of the part that ran, not of the whole phase
    assert [p["name"] for p in doc["phases_not_reached"]] == ["after"]
    text = cli("repro", "kv-eviction-storm", "--duration", "5", env={**os.environ, "COLUMNS": "200"})
    assert text.returncode == 0, text.stderr
    assert "before (0 s–5.00 s)" in text.stdout and "during (" not in text.stdout.split("not reached")[0]
    assert "not reached in this 5.00 s run: during (45m00s–1h15m), after (1h15m–2h00m)" in text.stdout
