"""Benchmark: what the caching allocator's driver calls and its slow path cost on a real GPU.

The simulated GPU charges host time for the caching allocator's driver calls
(``CostModel`` in reference_engine/sim/sim_gpu.py: cudaMalloc and cudaFree, a
fixed cost plus a cost per GiB, and a cost per allocation retry). Those figures
decide whether the kv-eviction-storm's failed allocations can idle the GPU (the
field report's "utilization fell below 20 %, then pegged"): in the storm's long
phase the simulated allocator retries 3.8 times a second on average and up to
68 times in one second (docs/storm-seeds.md). This script measures them with
torch's own caching allocator. Runs on a CUDA GPU, once, unattended; on a
machine without one it says so and exits 0. Sections, each guarded so one
failure never loses the rest:

1. driver calls -- a fresh segment (cudaMalloc) and its release
   (``empty_cache`` on an idle device: cudaFree) for sizes from 2 MiB to
   16 GiB; each call is checked in ``torch.cuda.memory_stats()`` to have made
   exactly one driver call. A line fitted per call gives the fixed cost and
   the cost per GiB.
2. the free's synchronization -- ``empty_cache`` while a 50 ms kernel runs:
   cudaFree waits for the device.
3. the retry path -- live memory fills the device but for 1 GiB; C GiB sit in
   the cache as 256 MiB segments; an allocation larger than a segment and than
   what the driver has free fails its cudaMalloc, releases the cache (one
   cudaFree a segment) and retries. Checked: one retry, C/256 MiB frees and one
   cudaMalloc (or one OOM, for a request the release cannot satisfy).
4. idle from retries -- a decode-like loop (one step: weight-streaming
   matmuls then the token read back, as an engine without CUDA graphs does)
   runs for 4 s at each rate of retries a second; per rate, the fraction of
   wall time the device ran the steps' kernels (CUDA events) and NVML's
   utilization, sampled every 100 ms.
5. the cost model -- the measured figures beside ``CostModel``'s.

A deadline (default 300 s) skips what is left; results are printed as they
come and written, after every row, to ``$OUT/alloc_gpu.json`` when OUT is set
(or to ``--json PATH``). Exit code 0, or 1 when a measurement did not take the
path it claims (the check says which).

    python bench/alloc_gpu.py [--deadline-s 300] [--json PATH]
    python bench/alloc_gpu.py --cpu-selftest   # the script's own arithmetic, no GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_gpu import Report, engine_package, log  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
SIZES_MIB = (2, 64, 256, 1024, 4096, 16384)
REPEATS = 5
SEGMENT_BYTES = 256 * MIB  # the field report's first KV region
DRIVER_FREE_BYTES = 1 * GIB  # what the driver keeps free while the cache holds C GiB
CACHED_GIB = (0.5, 2, 8)
LOOP_S = 4.0
RETRY_RATES = (0, 5, 10, 20, 40)
NVML_PERIOD_S = 0.1


# -- arithmetic (checked by --cpu-selftest) ------------------------------------------------
def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of ys against xs."""
    n = len(xs)
    if n < 2:
        raise ValueError("a line needs two points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a line needs two distinct x values")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def stat_delta(before: dict, after: dict, keys: tuple[str, ...]) -> dict[str, int]:
    """How much each counter of ``torch.cuda.memory_stats()`` moved."""
    return {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in keys}


def path_taken(delta: dict[str, int], want: dict[str, int]) -> str | None:
    """None when the counters moved exactly as ``want`` says; else what differs, in words."""
    wrong = [f"{k} {delta.get(k, 0):+d} (expected {v:+d})" for k, v in want.items() if delta.get(k, 0) != v]
    return "; ".join(wrong) or None


def derive_costs(malloc_rows: list[dict], free_rows: list[dict], retry_rows: list[dict]) -> dict[str, float]:
    """CostModel's allocator fields from the measured rows (seconds, seconds per GiB).

    ``alloc_retry_s`` is what a retry costs beyond the frees and the malloc it makes: the failed
    cudaMalloc, the event synchronization and the walk over the cache.
    """
    out: dict[str, float] = {}
    if len(malloc_rows) >= 2:
        out["cuda_malloc_s"], out["cuda_malloc_s_per_gib"] = fit_line(
            [r["bytes"] / GIB for r in malloc_rows], [r["median_s"] for r in malloc_rows])
    if len(free_rows) >= 2:
        out["cuda_free_s"], out["cuda_free_s_per_gib"] = fit_line(
            [r["bytes"] / GIB for r in free_rows], [r["median_s"] for r in free_rows])
    ok = [r for r in retry_rows if r.get("outcome") == "retried"]
    if ok and {"cuda_malloc_s", "cuda_free_s"} <= out.keys():
        extra = []
        for r in ok:
            frees = r["segments"] * out["cuda_free_s"] + r["cached_bytes"] / GIB * out["cuda_free_s_per_gib"]
            malloc = out["cuda_malloc_s"] + r["request_bytes"] / GIB * out["cuda_malloc_s_per_gib"]
            extra.append(r["median_s"] - frees - malloc)
        out["alloc_retry_s"] = statistics.median(extra)
    return out


def busy_fraction(step_gpu_s: list[float], wall_s: float) -> float:
    """Share of the wall time the device spent in the steps' kernels."""
    return min(1.0, sum(step_gpu_s) / wall_s) if wall_s > 0 else 0.0


# -- GPU sections ----------------------------------------------------------------------------
class Nvml:
    """NVML utilization of one device, sampled in a thread; absent NVML gives no samples."""

    def __init__(self, index: int):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # noqa: BLE001 -- no NVML: the events still measure
            self._nvml = None

    def __enter__(self):
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(NVML_PERIOD_S):
            self.samples.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def driver_calls(report: Report, torch, dev, deadline: float) -> tuple[list[dict], list[dict], bool]:
    keys = ("num_device_alloc", "num_device_free")
    mallocs, frees, ok = [], [], True
    for mib in SIZES_MIB:
        size = mib * MIB
        if time.monotonic() > deadline:
            log("driver calls: deadline, the larger sizes are skipped")
            break
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if torch.cuda.mem_get_info(dev)[0] < size + GIB:
            log(f"driver calls: {mib} MiB does not fit beside 1 GiB of headroom; skipped")
            continue
        m_s, f_s, bad, segment = [], [], None, size
        for _ in range(REPEATS):
            s0 = torch.cuda.memory_stats(dev)
            t0 = time.perf_counter()
            x = torch.empty(size, dtype=torch.uint8, device=dev)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            del x
            s1 = torch.cuda.memory_stats(dev)
            # The segment the driver call made: below 10 MiB torch rounds a request up to a 20 MiB one.
            segment = int(s1["reserved_bytes.all.current"]) - int(s0["reserved_bytes.all.current"])
            t2 = time.perf_counter()
            torch.cuda.empty_cache()
            t3 = time.perf_counter()
            s2 = torch.cuda.memory_stats(dev)
            bad = (path_taken(stat_delta(s0, s1, keys), {"num_device_alloc": 1, "num_device_free": 0})
                   or path_taken(stat_delta(s1, s2, keys), {"num_device_alloc": 0, "num_device_free": 1}))
            if bad:
                break
            m_s.append(t1 - t0)
            f_s.append(t3 - t2)
        if bad:
            ok = False
            report.add("driver_calls", {"bytes": size, "invalid": bad})
            log(f"driver calls: {mib} MiB did not make exactly one cudaMalloc and one cudaFree: {bad}")
            continue
        m = {"bytes": segment, "median_s": statistics.median(m_s)}
        f = {"bytes": segment, "median_s": statistics.median(f_s)}
        mallocs.append(m)
        frees.append(f)
        report.add("driver_calls", {"request_bytes": size, "bytes": segment, "malloc_s": m["median_s"],
                                    "free_s": f["median_s"]})
        log(f"driver calls: {mib:6d} MiB ({segment / MIB:.0f} MiB segment)  cudaMalloc {m['median_s'] * 1e3:8.3f} ms  "
            f"cudaFree {f['median_s'] * 1e3:8.3f} ms  (median of {REPEATS})")
    return mallocs, frees, ok


def free_waits_for_the_device(report: Report, torch, dev) -> None:
    x = torch.empty(64 * MIB, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    kernel_s = time.perf_counter() - t0
    cycles = max(1, int(1_000_000 * 0.050 / kernel_s))  # a ~50 ms kernel
    torch.cuda._sleep(cycles)
    del x
    t0 = time.perf_counter()
    torch.cuda.empty_cache()
    waited = time.perf_counter() - t0
    torch.cuda.synchronize()
    report.add("free_sync", {"kernel_s": 0.050, "empty_cache_s": waited})
    log(f"the free's synchronization: empty_cache behind a ~50 ms kernel took {waited * 1e3:.1f} ms")


class Filled:
    """The device filled with live tensors but for ``DRIVER_FREE_BYTES`` plus ``room`` bytes."""

    def __init__(self, torch, dev, room: int):
        self.torch, self.dev, self.live = torch, dev, []
        torch.cuda.empty_cache()
        target = room + DRIVER_FREE_BYTES
        for chunk in (GIB, 64 * MIB):
            while torch.cuda.mem_get_info(dev)[0] - target > chunk:
                self.live.append(torch.empty(chunk, dtype=torch.uint8, device=dev))

    def cache(self, nbytes: int) -> int:
        """Put ``nbytes`` in the cache as free 256 MiB segments; returns how many."""
        n = max(1, round(nbytes / SEGMENT_BYTES))
        held = [self.torch.empty(SEGMENT_BYTES, dtype=self.torch.uint8, device=self.dev) for _ in range(n)]
        del held
        return n

    def close(self) -> None:
        self.live.clear()
        self.torch.cuda.empty_cache()


def retry_path(report: Report, torch, dev, deadline: float) -> tuple[list[dict], bool]:
    keys = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")
    rows, ok = [], True
    for gib in CACHED_GIB:
        if time.monotonic() > deadline:
            log("retry path: deadline, the larger caches are skipped")
            break
        cached = int(gib * GIB)
        for outcome in ("retried", "oom"):
            times, bad, n = [], None, 0
            filled = Filled(torch, dev, cached)
            try:
                for _ in range(REPEATS):
                    n = filled.cache(cached)
                    free_now = torch.cuda.mem_get_info(dev)[0]
                    request = free_now + SEGMENT_BYTES if outcome == "retried" else free_now + n * SEGMENT_BYTES + GIB
                    torch.cuda.synchronize()
                    s0 = torch.cuda.memory_stats(dev)
                    t0 = time.perf_counter()
                    try:
                        y = torch.empty(request, dtype=torch.uint8, device=dev)
                    except torch.cuda.OutOfMemoryError:
                        y = None
                    took = time.perf_counter() - t0
                    s1 = torch.cuda.memory_stats(dev)
                    want = ({"num_alloc_retries": 1, "num_ooms": 0, "num_device_alloc": 1, "num_device_free": n}
                            if outcome == "retried" else
                            {"num_alloc_retries": 1, "num_ooms": 1, "num_device_alloc": 0, "num_device_free": n})
                    bad = path_taken(stat_delta(s0, s1, keys), want)
                    del y
                    torch.cuda.empty_cache()
                    if bad:
                        break
                    times.append(took)
            finally:
                filled.close()
            if bad:
                ok = False
                report.add("retry_path", {"cached_bytes": cached, "outcome": outcome, "invalid": bad})
                log(f"retry path: {gib} GiB cached, {outcome}: the allocator did not take that path: {bad}")
                continue
            row = {"cached_bytes": n * SEGMENT_BYTES, "segments": n, "outcome": outcome,
                   "request_bytes": request, "median_s": statistics.median(times)}
            rows.append(row)
            report.add("retry_path", row)
            log(f"retry path: {n * SEGMENT_BYTES / GIB:5.1f} GiB cached in {n:3d} segments, {outcome:7s}: "
                f"{row['median_s'] * 1e3:8.2f} ms (median of {REPEATS})")
    return rows, ok


def idle_from_retries(report: Report, torch, dev, deadline: float, index: int) -> None:
    # One step streams 14 GiB of weights (28 reads of a 512 MiB matrix, larger than any L2), as a
    # 7B model's decode step reads its 14 GB: a few milliseconds of kernels on an H100.
    hidden = 16384
    w = torch.randn(hidden, hidden, dtype=torch.bfloat16, device=dev) / hidden ** 0.5
    x = torch.randn(64, hidden, dtype=torch.bfloat16, device=dev)
    layers = 28
    cached = 2 * GIB
    filled = Filled(torch, dev, cached + GIB)
    try:
        for rate in RETRY_RATES:
            if time.monotonic() + LOOP_S > deadline:
                log("idle from retries: deadline, the higher rates are skipped")
                break
            retries0 = torch.cuda.memory_stats(dev)["num_alloc_retries"]
            step_gpu, done, next_retry = [], 0, 0.0
            with Nvml(index) as nvml:
                t0 = time.perf_counter()
                while (now := time.perf_counter()) - t0 < LOOP_S:
                    if rate and now - t0 >= next_retry:
                        filled.cache(cached)
                        y = torch.empty(torch.cuda.mem_get_info(dev)[0] + SEGMENT_BYTES, dtype=torch.uint8,
                                        device=dev)
                        del y
                        torch.cuda.empty_cache()
                        next_retry += 1.0 / rate
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    h = x
                    for _ in range(layers):
                        h = h @ w
                    b.record()
                    h[0, 0].item()  # the sampled token comes back to the host
                    step_gpu.append(a.elapsed_time(b) / 1e3)
                    done += 1
                wall = time.perf_counter() - t0
            retries = torch.cuda.memory_stats(dev)["num_alloc_retries"] - retries0
            row = {"retries_per_s_asked": rate, "retries": retries, "steps": done, "wall_s": wall,
                   "step_gpu_median_s": statistics.median(step_gpu),
                   "busy_by_events": busy_fraction(step_gpu, wall),
                   "nvml_util_mean": statistics.mean(nvml.samples) if nvml.samples else None,
                   "nvml_util_min": min(nvml.samples) if nvml.samples else None}
            report.add("idle_from_retries", row)
            nv = (f"NVML mean {row['nvml_util_mean']:.0%} min {row['nvml_util_min']:.0%}"
                  if nvml.samples else "no NVML")
            log(f"idle from retries: {retries / wall:5.1f} retries/s  {done / wall:6.1f} steps/s  "
                f"busy {row['busy_by_events']:.0%} (events)  {nv}")
    finally:
        filled.close()


def compare(report: Report, measured: dict[str, float]) -> None:
    try:
        engine_package()
        from gpudiag.reference_engine.sim.sim_gpu import CostModel
        model = CostModel()
    except Exception as exc:  # noqa: BLE001 -- print the measured side alone
        log(f"cost model: not importable ({type(exc).__name__}: {exc}); the measured figures alone")
        model = None
    rows = []
    for key, value in measured.items():
        was = getattr(model, key, None) if model is not None else None
        rows.append({"field": key, "measured": value, "cost_model": was})
        log(f"cost model: {key:22s} measured {value * 1e3:9.3f} ms   "
            f"CostModel {'-' if was is None else f'{was * 1e3:9.3f} ms'}")
    report.set("cost_model", rows)


def selftest() -> int:
    """The arithmetic, on figures whose answer is known."""
    b, m = fit_line([0.5, 1, 2, 4], [0.2e-3 + 0.5e-3 * x for x in (0.5, 1, 2, 4)])
    assert abs(b - 0.2e-3) < 1e-12 and abs(m - 0.5e-3) < 1e-12, (b, m)
    assert path_taken({"a": 1, "b": 0}, {"a": 1, "b": 0}) is None
    assert path_taken({"a": 0}, {"a": 1}) == "a +0 (expected +1)"
    assert stat_delta({"a": 1}, {"a": 4, "b": 2}, ("a", "b")) == {"a": 3, "b": 2}
    mallocs = [{"bytes": g * GIB, "median_s": 0.2e-3 + 0.5e-3 * g} for g in (1, 4)]
    frees = [{"bytes": g * GIB, "median_s": 0.5e-3 + 1.0e-3 * g} for g in (1, 4)]
    retry = [{"outcome": "retried", "segments": 8, "cached_bytes": 2 * GIB, "request_bytes": GIB,
              "median_s": 2e-3 + 8 * 0.5e-3 + 2 * 1e-3 + 0.2e-3 + 0.5e-3}]
    d = derive_costs(mallocs, frees, retry + [{"outcome": "oom", "median_s": 9.0}])
    assert abs(d["alloc_retry_s"] - 2e-3) < 1e-12, d
    assert abs(d["cuda_free_s_per_gib"] - 1e-3) < 1e-12, d
    assert busy_fraction([0.3, 0.3], 1.0) == 0.6 and busy_fraction([2.0], 1.0) == 1.0
    print("alloc_gpu: self-test passed", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deadline-s", type=float, default=300.0,
                    help="skip what is left after this many seconds (default 300)")
    ap.add_argument("--json", default=None, help="where to write results (default $OUT/alloc_gpu.json)")
    ap.add_argument("--cpu-selftest", action="store_true", help="check the script's arithmetic, no GPU")
    args = ap.parse_args(argv)
    if args.cpu_selftest:
        return selftest()
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        print(f"alloc_gpu: PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']} changes the allocator "
              f"this measures; unset it", file=sys.stderr, flush=True)
        return 2
    try:
        import torch
    except ImportError:
        print("alloc_gpu: torch is not installed; nothing to benchmark", flush=True)
        return 0
    if not torch.cuda.is_available():
        print("alloc_gpu: needs a CUDA GPU (torch.cuda.is_available() is False); nothing to benchmark", flush=True)
        return 0
    out_dir = os.environ.get("OUT")
    path = args.json or (os.path.join(out_dir, "alloc_gpu.json") if out_dir else None)
    report = Report(path)
    deadline = time.monotonic() + args.deadline_s
    dev, ok = torch.device("cuda", 0), True
    mallocs, frees, retries = [], [], []
    try:
        name = torch.cuda.get_device_name(dev)
        report.set("device", {"name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
                              "memory_bytes": torch.cuda.mem_get_info(dev)[1],
                              "allocator": torch.cuda.get_allocator_backend()})
        log(f"device {name}; torch {torch.__version__}, CUDA {torch.version.cuda}")
        torch.empty(1, device=dev)  # the context, before anything is timed
        for title, fn in (
                ("driver calls", lambda: driver_calls(report, torch, dev, deadline)),
                ("free sync", lambda: free_waits_for_the_device(report, torch, dev)),
                ("retry path", lambda: retry_path(report, torch, dev, deadline)),
                ("idle from retries", lambda: idle_from_retries(report, torch, dev, deadline, 0))):
            try:
                got = fn()
            except Exception as exc:  # noqa: BLE001 -- say it, keep the other sections
                report.error(title, exc)
                ok = False
                torch.cuda.empty_cache()
                continue
            if title == "driver calls":
                mallocs, frees, good = got
                ok &= good
            elif title == "retry path":
                retries, good = got
                ok &= good
        compare(report, derive_costs(mallocs, frees, retries))
    except Exception as exc:  # noqa: BLE001 -- whatever happens, say it and keep what was written
        report.error("setup", exc)
        traceback.print_exc()
        ok = False
    report.flush()
    log(f"done: {len(report.doc['errors'])} error(s); results {'in ' + path if path else 'printed only'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
