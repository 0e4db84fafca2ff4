"""PyTorch's "CUDA out of memory" messages: whose memory the failed allocation met."""

from __future__ import annotations

from gpudiag.analyzers import oom_message as oom

NEW_COTENANT = (
    "2025-06-10 16:03:27,579 - ERROR - Training failed: CUDA out of memory. Tried to allocate 742.00 MiB. "
    "GPU 0 has a total capacity of 79.15 GiB of which 188.31 MiB is free. Process 3295240 has 78.54 GiB memory "
    "in use. Including non-PyTorch memory, this process has 414.00 MiB memory in use. Of the allocated memory "
    "0 bytes is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
NEW_FRAGMENTED = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of "
    "15.57 GiB of which 1.02 GiB is free. Process 4242 has 14.52 GiB memory in use. Including non-PyTorch memory, "
    "this process has 14.52 GiB memory in use. Of the allocated memory 9.10 GiB is allocated by PyTorch, and "
    "4.90 GiB is reserved by PyTorch but unallocated.")
NEW_CAPACITY = (
    "CUDA out of memory. Tried to allocate 5.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 91.00 MiB "
    "is free. Including non-PyTorch memory, this process has 78.99 GiB memory in use. Of the allocated memory "
    "78.20 GiB is allocated by PyTorch, and 133.00 MiB is reserved by PyTorch but unallocated.")
OLD_FORM = ("RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; "
            "130.35 MiB already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch)")


def _one(text: str):
    (found,) = oom.findings(oom.parse([text]))
    return found


def test_an_oom_with_another_process_holding_the_gpu_is_a_cotenant_naming_that_process():
    f = _one(NEW_COTENANT)
    assert f.kind == "gpu_cotenant" and f.severity.value == "critical"
    assert "3295240" in f.summary and "78.5 GiB" in f.summary and "742.0 MiB" in f.summary
    assert f.details["other_pids"] == [3295240]
    assert f.start_s > 1.7e9  # the log line's own time


def test_an_oom_with_more_than_the_request_free_in_the_pool_is_fragmentation():
    f = _one(NEW_FRAGMENTED)
    assert f.kind == "memory_fragmentation" and f.gpu == 1
    assert "expandable_segments" in " ".join(f.fixes)


def test_an_oom_of_a_process_that_filled_the_device_itself_is_capacity_not_fragmentation():
    f = _one(NEW_CAPACITY)
    assert f.kind == "oom_forecast" and f.details["time_to_oom_s"] == 0
    assert "paged-kv" not in f.fixes and "5.0 GiB asked" in f.summary


def test_the_pre_2_1_message_form_is_read_and_its_pool_figures_kept():
    (ev,) = oom.parse([OLD_FORM])
    assert ev.request_bytes == 36 << 20 and ev.free_bytes == round(47.06 * (1 << 20))
    assert ev.reserved_unallocated_bytes == round(188 * (1 << 20)) - round(130.35 * (1 << 20))
    assert ev.verdict() == "memory_fragmentation"  # 57.65 MiB free in the pool, 36 MiB asked


def test_one_oom_logged_by_several_handlers_counts_once():
    lines = [NEW_COTENANT, NEW_COTENANT.replace("16:03:27,579", "16:03:28,100"), "unrelated line"]
    assert len(oom.parse(lines)) == 2
    assert _one_count(lines) == 1


def _one_count(lines):
    (f,) = oom.findings(oom.parse(lines))
    return f.details["oom_events"]


def test_lines_without_an_oom_give_no_finding():
    assert oom.findings(oom.parse(["CUDA error: out of memory", "all good", ""])) == []


def test_investigate_file_reads_a_log_of_oom_messages_and_names_the_other_tenant(tmp_path, capsys):
    import json

    from gpudiag.cli import main

    log = tmp_path / "train.log"
    log.write_text("\n".join(["2025-06-10 16:00:00,000 - INFO - step 1", NEW_COTENANT, NEW_COTENANT,
                              "2025-06-10 16:04:00,000 - INFO - exiting"]) + "\n")
    code = main(["investigate", "--file", str(log), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1
    (f,) = [f for f in doc["findings"] if f["kind"] == "gpu_cotenant"]
    assert f["severity"] == "critical" and "3295240" in f["summary"]
    assert doc["files"][0]["format"] == "oom-log" and doc["files"][0]["rows"] == 2


def test_a_log_without_an_oom_message_is_not_a_format_gpudiag_reads(tmp_path, capsys):
    from gpudiag.cli import main

    log = tmp_path / "train.log"
    log.write_text("2025-06-10 16:00:00,000 - INFO - step 1\nall good\n")
    assert main(["investigate", "--file", str(log)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "out of memory" in err[0]
