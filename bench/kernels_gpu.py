"""Benchmark: the Triton paged-decode kernel against torch SDPA, as a fraction of HBM peak.

Runs on a CUDA GPU, once, unattended; on a machine without one it says so
and exits 0. Sections, each guarded so one failure never loses the rest:

1. correctness -- the compiled kernels (decode with and without split-KV,
   prefill, reshape-and-cache, RMSNorm; fp32/fp16/bf16; GQA 1/4/8) and the
   tiny model's paged forward against the torch references, on the GPU. The
   CPU tests can only run these kernels in Triton's interpreter.
2. copy bandwidth -- a device-to-device copy, the practical ceiling.
3. decode grid -- batch x context (Mistral-7B attention shapes: 32 query
   heads, 8 KV heads of 128, bf16, blocks of 16 scattered over the pool):
   the paged kernel vs ``F.scaled_dot_product_attention`` over an equivalent
   contiguous cache, time (median, L2 flushed between runs), achieved
   bandwidth (K/V + q + out bytes / time) as a fraction of the datasheet peak
   and of the measured copy bandwidth, and the kernels' outputs compared.
   Cells whose caches do not fit in memory are pruned; a cell whose two outputs
   disagree beyond bf16's tolerance gets no figure, and fails the run (exit 1).
4. cut-over -- host-inclusive time per call (calls issued back to back, as
   an engine without CUDA graphs does) of the Triton kernels vs the torch
   path at small sizes: the figures behind the constants in
   ``reference_engine/model/kernels/dispatch.py`` (RMSNORM_TRITON_MIN_ELEMENTS:
   the "rmsnorm cut-over" table).

A deadline (default 420 s) skips what is left; results are printed as they
come (flushed) and written, after every cell, to ``$OUT/kernels_gpu.json``
when OUT is set (or to ``--json PATH``). Exit code 0, or 1 when a
correctness check failed.

    python bench/kernels_gpu.py [--deadline-s 420] [--quick] [--json PATH]
    TRITON_INTERPRET=1 python bench/kernels_gpu.py --cpu-selftest   # the script's own check, no GPU
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

START_S = time.monotonic()

# Datasheet HBM bandwidth of GPUs not in reference_engine/sim/gpu_specs.py, matched
# on the CUDA device name (NVIDIA datasheets: H100 PCIe 2.0 TB/s, H100 NVL
# 3.9 TB/s, H200 NVL 4.8 TB/s, A100 80GB PCIe 1.935 TB/s, B200 8 TB/s, L40S
# 864 GB/s, A10 600 GB/s, V100 SXM2 900 GB/s, RTX 4090 1008 GB/s).
EXTRA_PEAK_BYTES_PER_S = [
    (("H200",), 4.8e12),
    (("H100", "PCIe"), 2.0e12),
    (("H100", "NVL"), 3.9e12),
    (("H100",), 3.35e12),
    (("A100", "80GB", "PCIe"), 1.935e12),
    (("A100", "80GB"), 2.039e12),
    (("A100",), 1.555e12),
    (("B200",), 8.0e12),
    (("L40S",), 864e9),
    (("L4",), 300e9),
    (("A10",), 600e9),
    (("V100",), 900e9),
    (("RTX 4090",), 1008e9),
]


def log(msg: str = "") -> None:
    """Print one progress line at once (the run is watched only through its output)."""
    print(f"[{time.monotonic() - START_S:6.1f}s] {msg}", flush=True)


def engine_package() -> None:
    """Make ``gpudiag.reference_engine`` importable: installed, or else from this checkout."""
    try:
        import gpudiag.reference_engine  # noqa: F401
    except ImportError:
        root = Path(__file__).resolve().parents[1]
        sys.path.insert(0, str(root))  # the core package gpudiag/ lives at the top of the checkout
        import gpudiag

        spec = importlib.util.spec_from_file_location(
            "gpudiag.reference_engine", root / "reference_engine" / "__init__.py",
            submodule_search_locations=[str(root / "reference_engine")])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules["gpudiag.reference_engine"] = pkg
        spec.loader.exec_module(pkg)
        gpudiag.reference_engine = pkg


def import_engine():
    """The engine's modules, from the installed package or, failing that, from this checkout."""
    engine_package()
    from gpudiag.reference_engine.model.kernels import paged_attention, prefill_attention, rmsnorm
    from gpudiag.reference_engine.sim import gpu_specs

    return paged_attention, prefill_attention, rmsnorm, gpu_specs


def peak_bandwidth(device_name: str, gpu_specs) -> float | None:
    """Datasheet HBM bytes/s of the device, or None when the name is not known."""
    for s in gpu_specs.SPECS.values():
        if s.name == device_name:
            return s.hbm_bandwidth_bytes_per_s
    for words, bw in EXTRA_PEAK_BYTES_PER_S:
        if all(w in device_name for w in words):
            return bw
    return None


class Report:
    """Results so far; written to JSON after every addition so a killed run keeps them."""

    def __init__(self, path: str | None):
        self.path = path
        self.doc: dict = {"sections": {}, "errors": []}

    def set(self, key, value) -> None:
        self.doc[key] = value
        self.flush()

    def add(self, section: str, row: dict) -> None:
        self.doc["sections"].setdefault(section, []).append(row)
        self.flush()

    def error(self, where: str, exc: BaseException) -> None:
        line = f"{where}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        self.doc["errors"].append(line)
        log(f"ERROR {line}")
        self.flush()

    def flush(self) -> None:
        if not self.path:
            return
        self.doc["elapsed_s"] = round(time.monotonic() - START_S, 1)
        tmp = self.path + ".partial"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1, default=str)
        os.replace(tmp, self.path)


def context_lost(exc: BaseException) -> bool:
    """Whether a CUDA error poisoned the context (every later call would fail too)."""
    text = str(exc).lower()
    return any(s in text for s in ("illegal memory access", "device-side assert", "unspecified launch failure",
                                   "misaligned address", "illegal instruction"))


class Timer:
    """GPU time (median, L2 flushed) and host-inclusive time per call."""

    def __init__(self, device, host_calls: int = 200):
        import torch

        self.torch = torch
        self.device = device
        self.cuda = device.type == "cuda"
        self.host_calls = host_calls

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def gpu_s(self, fn, rep_ms: int = 100) -> float:
        """Median seconds per call; on CUDA triton.testing.do_bench (flushes L2 before each run)."""
        if self.cuda:
            import triton.testing

            return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e-3
        return self.host_s(fn, calls=3, repeats=3)

    def host_s(self, fn, calls: int | None = None, repeats: int = 5) -> float:
        """Median over ``repeats`` of (wall time of ``calls`` back-to-back calls + sync) / calls."""
        calls = calls or self.host_calls
        for _ in range(3):
            fn()
        self.sync()
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            self.sync()
            runs.append((time.perf_counter() - t0) / calls)
        return statistics.median(runs)


def _layout(torch, context_lens, block_size, device, gen_seed=0):
    """Block tables over a shuffled pool, one table row per sequence, padded with 0."""
    g = torch.Generator().manual_seed(gen_seed)
    blocks = [math.ceil(c / block_size) for c in context_lens]
    perm = torch.randperm(sum(blocks), generator=g)
    width = max(blocks)
    bt = torch.zeros(len(context_lens), width, dtype=torch.int32)
    i = 0
    for s, n in enumerate(blocks):
        bt[s, :n] = perm[i:i + n]
        i += n
    return bt.to(device), sum(blocks)


# --- 1. correctness ---------------------------------------------------------------

TOLERANCE = {"float32": (2e-5, 2e-5), "float16": (2e-3, 2e-3), "bfloat16": (1e-2, 1.6e-2)}


def correctness(report: Report, mods, device, quick: bool, small: bool = False,
                budget_s: float = math.inf) -> bool:
    """Compiled kernels vs torch references on the device; returns whether all passed.

    ``small`` shrinks every shape (for the interpreter self-test). Checks not
    started within ``budget_s`` of the start (JIT compiles dominate) are skipped.
    """
    import torch

    pa, pf, rn, _ = mods
    ok = True
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    gqas = (1, 4) if quick else (1, 4, 8)
    d = 32 if small else 128
    decode_ctx = [1, 37, 100] if small else [1, 37, 300, 2000]
    long_prompt = 100 if small else 1000
    hidden = 256 if small else 4096

    def check(name, got, want, dtype):
        nonlocal ok
        atol, rtol = TOLERANCE[str(dtype).split(".")[1]]
        err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
        passed = bool(torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol))
        ok &= passed
        report.add("correctness", {"check": name, "max_abs_err": err, "passed": passed})
        log(f"  {'ok  ' if passed else 'FAIL'} {name}: max|err| {err:.3g}")

    for dtype in dtypes:
        dn = str(dtype).split(".")[1]
        if time.monotonic() - START_S > budget_s:
            report.add("correctness", {"check": f"{dn} checks", "skipped": "time budget"})
            log(f"  skipped the {dn} checks: time budget spent")
            continue
        for gqa in gqas:
            for bs in (16, 32):
                where = f"decode {dn} gqa{gqa} block{bs}"
                try:
                    g = torch.Generator(device="cpu").manual_seed(gqa * 10 + bs)
                    kvh = 2
                    ctx = decode_ctx
                    bt, nb = _layout(torch, ctx, bs, device, gqa)
                    k = torch.randn(nb, bs, kvh, d, generator=g).to(device, dtype)
                    v = torch.randn(nb, bs, kvh, d, generator=g).to(device, dtype)
                    q = torch.randn(len(ctx), kvh * gqa, d, generator=g).to(device, dtype)
                    cl = torch.tensor(ctx, dtype=torch.int32, device=device)
                    ref = pa.paged_decode_attention_reference(q, k, v, bt, cl, d ** -0.5)
                    for splits in (None, 1, 5):
                        out = pa.paged_decode_attention_triton(q, k, v, bt, cl, d ** -0.5, num_splits=splits)
                        check(f"{where} splits={splits or 'auto'}", out, ref, dtype)
                except Exception as exc:  # noqa: BLE001 -- one failed check must not stop the run
                    ok = False
                    report.error(where, exc)
                    if context_lost(exc):
                        return False
            where = f"prefill {dn} gqa{gqa}"
            try:
                g = torch.Generator(device="cpu").manual_seed(gqa)
                bs, kvh = 16, 2
                seqs = [(5, 5), (37, 13), (32, 32), (20, 1), (long_prompt, long_prompt)]
                ctx = [c for c, _ in seqs]
                bt, nb = _layout(torch, ctx, bs, device, gqa)
                k = torch.randn(nb, bs, kvh, d, generator=g).to(device, dtype)
                v = torch.randn(nb, bs, kvh, d, generator=g).to(device, dtype)
                ql = [n for _, n in seqs]
                cu = torch.tensor([0] + torch.tensor(ql).cumsum(0).tolist(), dtype=torch.int32, device=device)
                q = torch.randn(sum(ql), kvh * gqa, d, generator=g).to(device, dtype)
                cl = torch.tensor(ctx, dtype=torch.int32, device=device)
                ref = pf.prefill_attention_reference(q, k, v, bt, cl, cu, d ** -0.5)
                check(where, pf.prefill_attention_triton(q, k, v, bt, cl, cu, d ** -0.5), ref, dtype)
            except Exception as exc:  # noqa: BLE001
                ok = False
                report.error(where, exc)
                if context_lost(exc):
                    return False
        where = f"reshape_and_cache + rmsnorm {dn}"
        try:
            g = torch.Generator(device="cpu").manual_seed(1)
            key = torch.randn(50, 8, d, generator=g).to(device, dtype)
            val = torch.randn(50, 8, d, generator=g).to(device, dtype)
            slots = torch.randperm(64 * 16, generator=g)[:50].to(device)
            slots[7] = -1
            k1 = torch.zeros(64, 16, 8, d, dtype=dtype, device=device)
            v1, k2, v2 = k1.clone(), k1.clone(), k1.clone()
            pf.reshape_and_cache_reference(key, val, k1, v1, slots)
            pf.reshape_and_cache_triton(key, val, k2, v2, slots)
            passed = bool(torch.equal(k1, k2) and torch.equal(v1, v2))
            ok &= passed
            report.add("correctness", {"check": f"reshape_and_cache {dn}", "max_abs_err": 0.0 if passed else None,
                                       "passed": passed})
            log(f"  {'ok  ' if passed else 'FAIL'} reshape_and_cache {dn}: exact")
            x = torch.randn(33, hidden, generator=g).to(device, dtype)
            r = torch.randn(33, hidden, generator=g).to(device, dtype)
            w = torch.randn(hidden, generator=g).to(device, dtype)
            check(f"rmsnorm {dn}", rn.rms_norm_triton(x, w, 1e-5), rn.rms_norm_reference(x, w, 1e-5), dtype)
            o1, r1 = rn.rms_norm_triton(x, w, 1e-5, r)
            o2, r2 = rn.rms_norm_reference(x, w, 1e-5, r)
            check(f"rmsnorm+residual {dn}", o1, o2, dtype)
            check(f"residual sum {dn}", r1, r2, dtype)
        except Exception as exc:  # noqa: BLE001
            ok = False
            report.error(where, exc)
            if context_lost(exc):
                return False
    try:
        ok &= model_check(report, device)
    except Exception as exc:  # noqa: BLE001
        ok = False
        report.error("model paged forward", exc)
    return ok


def model_check(report: Report, device) -> bool:
    """The tiny model's paged forward through the Triton kernels vs the torch path, on the device."""
    import torch

    from gpudiag.reference_engine.model.model import allocate_kv_cache, build_model
    from gpudiag.reference_engine.model.model_config import ModelConfig

    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg, seed=3, device=device)
    bs = 16
    lens = [40, 7, 100]
    bt, nb = _layout(torch, [n + 4 for n in lens], bs, device, 9)
    tables = bt.tolist()

    def slot(s, p):
        return tables[s][p // bs] * bs + p % bs

    caches = {b: allocate_kv_cache(cfg, nb, bs, device=device) for b in ("torch", "triton")}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (sum(lens),), generator=g).to(device)
    pos = torch.cat([torch.arange(n) for n in lens]).to(device)
    slots = torch.tensor([slot(s, p) for s, n in enumerate(lens) for p in range(n)], device=device)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    ctx = list(lens)
    outs = {b: [model.forward_paged(ids, pos, caches[b], bt, torch.tensor(ctx, dtype=torch.int32, device=device),
                                    slots, True, cu_seqlens_q=cu, backend=b)] for b in caches}
    tok = outs["torch"][0].argmax(-1)
    for _ in range(3):
        pos = torch.tensor(ctx, device=device)
        slots = torch.tensor([slot(s, ctx[s]) for s in range(len(ctx))], device=device)
        ctx = [c + 1 for c in ctx]
        for b, cache in caches.items():
            outs[b].append(model.forward_paged(tok, pos, cache, bt,
                                               torch.tensor(ctx, dtype=torch.int32, device=device),
                                               slots, False, backend=b))
        tok = outs["torch"][-1].argmax(-1)
    err = max((a - b).abs().max().item() for a, b in zip(outs["torch"], outs["triton"]))
    same = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(outs["torch"], outs["triton"]))
    passed = same and err < 1e-4
    report.add("correctness", {"check": "tiny model paged forward triton vs torch (fp32)", "max_abs_err": err,
                               "passed": passed, "same_greedy_tokens": same})
    log(f"  {'ok  ' if passed else 'FAIL'} tiny model paged forward: max|logit err| {err:.3g}, same greedy {same}")
    return passed


# --- 2. copy bandwidth -------------------------------------------------------------

def copy_bandwidth(report: Report, timer: Timer, device) -> float | None:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    import torch

    n = (2 << 30) if device.type == "cuda" else (64 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    t = timer.gpu_s(lambda: b.copy_(a))
    bw = 2 * n / t
    report.set("copy_bandwidth_bytes_per_s", bw)
    log(f"device-to-device copy: {bw / 1e12:.2f} TB/s")
    return bw


# --- 3. decode grid ----------------------------------------------------------------

def decode_grid(report: Report, timer: Timer, pa, device, peak: float | None, copy_bw: float | None,
                batches, contexts, deadline_s: float, heads=32, kv_heads=8, head_dim=128, block_size=16) -> None:
    """Paged Triton decode vs SDPA on a contiguous cache over the batch x context grid."""
    import torch

    kv_bytes_per_token = 2 * kv_heads * head_dim * 2  # bf16 K and V
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 4 << 30
    # Paged cache, contiguous copy and the transient gather that builds it: ~3x the KV.
    budget = 0.8 * free / 3.2
    header = (f"{'batch':>5} {'context':>7} {'splits':>6} | {'triton us':>10} {'TB/s':>6} {'%peak':>6} "
              f"{'%copy':>6} | {'sdpa us':>10} {'TB/s':>6} {'%peak':>6} | {'sdpa/tri':>8} {'max|diff|':>9}")
    log("decode grid: Mistral-7B attention (32 q heads, 8 KV heads x 128, bf16, blocks of 16)")
    log(header)
    for b in batches:
        for ctx in contexts:
            cell = {"batch": b, "context": ctx, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                     "block_size": block_size, "dtype": "bfloat16"}
            kv_bytes = b * ctx * kv_bytes_per_token
            if kv_bytes > budget:
                cell["skipped"] = f"KV {kv_bytes / 2**30:.1f} GiB over the {budget / 2**30:.1f} GiB budget"
                report.add("decode_grid", cell)
                continue
            if time.monotonic() - START_S > deadline_s:
                cell["skipped"] = "deadline"
                report.add("decode_grid", cell)
                continue
            try:
                _decode_cell(cell, timer, pa, device, peak, copy_bw, b, ctx, heads, kv_heads, head_dim,
                             block_size, kv_bytes)
                report.add("decode_grid", cell)
            except Exception as exc:  # noqa: BLE001
                cell["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                report.add("decode_grid", cell)
                report.error(f"decode grid batch={b} context={ctx}", exc)
                if context_lost(exc):
                    return
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()


def _time_paged_decode(timer: Timer, pa, q, k, v, bt, cl, scale, ctx):
    def run():
        return pa.paged_decode_attention_triton(q, k, v, bt, cl, scale, max_context_len=ctx)

    return run(), timer.gpu_s(run)


def _decode_cell(cell: dict, timer: Timer, pa, device, peak, copy_bw, b, ctx, heads, kv_heads, head_dim,
                 block_size, kv_bytes) -> None:
    """One grid cell, filled into ``cell``; its tensors die when it returns."""
    import torch
    import torch.nn.functional as F

    dtype, esize = torch.bfloat16, 2
    scale = head_dim ** -0.5
    bt, nb = _layout(torch, [ctx] * b, block_size, device, b + ctx)
    k = torch.randn(nb, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn(nb, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    q = torch.randn(b, heads, head_dim, device=device, dtype=dtype)
    cl = torch.full((b,), ctx, dtype=torch.int32, device=device)
    splits = pa.choose_num_splits(b, kv_heads, ctx, pa.device_sm_count(device))

    out_tri, t_tri = _time_paged_decode(timer, pa, q, k, v, bt, cl, scale, ctx)
    moved = kv_bytes + 2 * b * heads * head_dim * esize
    cell.update(num_splits=splits, triton_s=t_tri, triton_bytes_per_s=moved / t_tri)
    # The same K/V laid out contiguously, [B, KVH, ctx, D], as SDPA wants it.
    kc = k[bt.long()].reshape(b, -1, kv_heads, head_dim)[:, :ctx].transpose(1, 2).contiguous()
    vc = v[bt.long()].reshape(b, -1, kv_heads, head_dim)[:, :ctx].transpose(1, 2).contiguous()
    del k, v
    q4 = q[:, :, None, :]
    kw = {"enable_gqa": True}
    try:
        out_sdpa = F.scaled_dot_product_attention(q4, kc, vc, scale=scale, **kw)
        cell["sdpa_variant"] = "enable_gqa"
    except Exception as exc:  # noqa: BLE001 -- a torch or backend without GQA: expand K/V instead
        cell["sdpa_variant"] = f"K/V expanded to {heads} heads ({type(exc).__name__})"
        kc = kc.repeat_interleave(heads // kv_heads, dim=1)
        vc = vc.repeat_interleave(heads // kv_heads, dim=1)
        kw = {}
        out_sdpa = F.scaled_dot_product_attention(q4, kc, vc, scale=scale)

    def sdpa():
        return F.scaled_dot_product_attention(q4, kc, vc, scale=scale, **kw)

    # The cell's input: both kernels computed the same attention. A cell where they disagree
    # beyond bf16's tolerance times something else, and gets no figure.
    diff = (out_tri.float() - out_sdpa[:, :, 0].float()).abs().max().item()
    atol, rtol = TOLERANCE["bfloat16"]
    if not torch.allclose(out_tri.float(), out_sdpa[:, :, 0].float(), atol=atol, rtol=rtol):
        for key in ("triton_s", "triton_bytes_per_s"):
            cell.pop(key, None)
        cell.update(max_abs_diff=diff, invalid=f"paged decode and SDPA disagree: max|diff| {diff:.3g} "
                    f"over the bf16 tolerance (atol {atol:g}, rtol {rtol:g})")
        log(f"{b:>5} {ctx:>7} {splits:>6} | FAIL: {cell['invalid']}; no figure")
        return
    t_sdpa = timer.gpu_s(sdpa)
    cell.update(sdpa_s=t_sdpa, sdpa_bytes_per_s=moved / t_sdpa, max_abs_diff=diff, sdpa_over_triton=t_sdpa / t_tri)
    if peak:
        cell.update(triton_peak_fraction=moved / t_tri / peak, sdpa_peak_fraction=moved / t_sdpa / peak)
    if copy_bw:
        cell["triton_copy_fraction"] = moved / t_tri / copy_bw

    def pct(x):
        return f"{100 * x:5.1f}%" if x is not None else "   n/a"

    log(f"{b:>5} {ctx:>7} {splits:>6} | {t_tri * 1e6:>10.1f} {moved / t_tri / 1e12:>6.2f} "
        f"{pct(cell.get('triton_peak_fraction'))} {pct(cell.get('triton_copy_fraction'))} | "
        f"{t_sdpa * 1e6:>10.1f} {moved / t_sdpa / 1e12:>6.2f} {pct(cell.get('sdpa_peak_fraction'))} | "
        f"{t_sdpa / t_tri:>8.2f} {diff:>9.2g}")


# --- 4. cut-over -------------------------------------------------------------------

def cutover(report: Report, timer: Timer, mods, device, deadline_s: float, quick: bool,
            small: bool = False) -> None:
    """Host-inclusive time per call: Triton vs the torch path at small sizes."""

    pa, _, rn, _ = mods
    hidden = 256 if small else 4096
    if small:
        row_counts, decode_batches, decode_contexts = (1, 8), (1,), (16,)
    elif quick:
        row_counts, decode_batches, decode_contexts = (1, 64, 1024, 8192), (1, 16), (16, 256)
    else:
        row_counts = (1, 8, 64, 256, 512, 1024, 2048, 4096, 16384)
        decode_batches, decode_contexts = (1, 4, 16), (16, 64, 256, 1024)
    log(f"rmsnorm cut-over (bf16, hidden {hidden}; host-inclusive us per call)")
    log(f"{'rows':>6} {'elements':>9} | {'triton':>8} {'torch':>8} | {'triton+res':>10} {'torch+res':>9}")
    crossing = None
    for rows in row_counts:
        if time.monotonic() - START_S > deadline_s:
            report.add("rmsnorm_cutover", {"rows": rows, "skipped": "deadline"})
            continue
        try:
            row = _rmsnorm_row(timer, rn, rows, hidden, device)
            if crossing is None and row["triton_residual_s"] < row["torch_residual_s"]:
                crossing = rows * hidden
            report.add("rmsnorm_cutover", row)
            log(f"{rows:>6} {rows * hidden:>9} | {row['triton_s'] * 1e6:>8.1f} {row['torch_s'] * 1e6:>8.1f} | "
                f"{row['triton_residual_s'] * 1e6:>10.1f} {row['torch_residual_s'] * 1e6:>9.1f}")
        except Exception as exc:  # noqa: BLE001
            report.error(f"rmsnorm cut-over rows={rows}", exc)
            if context_lost(exc):
                return
    report.set("rmsnorm_cutover_min_elements", crossing)
    log(f"rmsnorm (with residual): Triton first faster at {crossing} elements "
        "(RMSNORM_TRITON_MIN_ELEMENTS in dispatch.py)")

    log("decode cut-over (bf16, GQA 4, head_dim 128, blocks of 16; host-inclusive us per call)")
    log(f"{'batch':>5} {'context':>7} | {'triton':>8} {'torch path':>10}")
    for b in decode_batches:
        for ctx in decode_contexts:
            if time.monotonic() - START_S > deadline_s:
                report.add("decode_cutover", {"batch": b, "context": ctx, "skipped": "deadline"})
                continue
            try:
                row = _decode_cutover_row(timer, pa, b, ctx, device, small)
                report.add("decode_cutover", row)
                log(f"{b:>5} {ctx:>7} | {row['triton_s'] * 1e6:>8.1f} {row['torch_s'] * 1e6:>10.1f}")
            except Exception as exc:  # noqa: BLE001
                report.error(f"decode cut-over batch={b} context={ctx}", exc)
                if context_lost(exc):
                    return


def _rmsnorm_row(timer: Timer, rn, rows: int, hidden: int, device) -> dict:
    import torch
    import torch.nn.functional as F

    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(hidden, device=device, dtype=torch.bfloat16)

    def torch_res():
        s = x + r
        return F.rms_norm(s, (hidden,), w, 1e-5), s

    return {"rows": rows, "elements": rows * hidden,
            "triton_s": timer.host_s(lambda: rn.rms_norm_triton(x, w, 1e-5)),
            "torch_s": timer.host_s(lambda: F.rms_norm(x, (hidden,), w, 1e-5)),
            "triton_residual_s": timer.host_s(lambda: rn.rms_norm_triton(x, w, 1e-5, r)),
            "torch_residual_s": timer.host_s(torch_res)}


def _decode_cutover_row(timer: Timer, pa, b: int, ctx: int, device, small: bool) -> dict:
    import torch

    bt, nb = _layout(torch, [ctx] * b, 16, device, 1)
    kvh, d = (1, 16) if small else (8, 128)
    k = torch.randn(nb, 16, kvh, d, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(b, 4 * kvh, d, device=device, dtype=torch.bfloat16)
    cl = torch.full((b,), ctx, dtype=torch.int32, device=device)
    scale = d ** -0.5
    return {"batch": b, "context": ctx,
            "triton_s": timer.host_s(lambda: pa.paged_decode_attention_triton(q, k, v, bt, cl, scale,
                                                                              max_context_len=ctx)),
            "torch_s": timer.host_s(lambda: pa.paged_decode_attention_reference(q, k, v, bt, cl, scale))}


def main(argv: list[str] | None = None) -> int:
    """Run the sections; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deadline-s", type=float, default=420.0,
                    help="skip what is left after this many seconds (default 420)")
    ap.add_argument("--quick", action="store_true", help="a smaller grid")
    ap.add_argument("--json", default=None, help="where to write results (default $OUT/kernels_gpu.json)")
    ap.add_argument("--cpu-selftest", action="store_true",
                    help="run every section on the CPU with tiny shapes (needs TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("kernels_gpu: torch is not installed; nothing to benchmark", flush=True)
        return 0
    if args.cpu_selftest:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("kernels_gpu: --cpu-selftest needs TRITON_INTERPRET=1", flush=True)
            return 2
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("kernels_gpu: needs a CUDA GPU (torch.cuda.is_available() is False); nothing to benchmark",
              flush=True)
        return 0
    else:
        device = torch.device("cuda", 0)
    out_dir = os.environ.get("OUT")
    path = args.json or (os.path.join(out_dir, "kernels_gpu.json") if out_dir else None)
    report = Report(path)
    ok = True
    try:
        mods = import_engine()
        import triton

        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter self-test)"
        peak = peak_bandwidth(name, mods[3])
        report.set("device", {
            "name": name, "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "sm_count": mods[0].device_sm_count(device),
            "peak_hbm_bytes_per_s": peak})
        log(f"device {name}; torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}; "
            f"datasheet HBM peak {peak / 1e12:.2f} TB/s" if peak else f"device {name}: peak bandwidth unknown")
        timer = Timer(device, host_calls=2 if args.cpu_selftest else 200)

        log("1. correctness of the compiled kernels")
        try:
            ok = correctness(report, mods, device, quick=args.quick or args.cpu_selftest, small=args.cpu_selftest,
                             budget_s=0.4 * args.deadline_s)
        except Exception as exc:  # noqa: BLE001
            ok = False
            report.error("correctness", exc)
        log(f"correctness: {'all passed' if ok else 'FAILURES (see above)'}")

        copy_bw = None
        try:
            copy_bw = copy_bandwidth(report, timer, device)
        except Exception as exc:  # noqa: BLE001
            report.error("copy bandwidth", exc)

        if args.cpu_selftest:
            batches, contexts = (1, 2), (32, 64)
        elif args.quick:
            batches, contexts = (1, 16, 256), (512, 4096, 32768)
        else:
            batches, contexts = (1, 4, 16, 64, 256), (512, 2048, 8192, 16384, 32768)
        hd = {"heads": 4, "kv_heads": 1, "head_dim": 16} if args.cpu_selftest else {}
        try:
            decode_grid(report, timer, mods[0], device, peak, copy_bw, batches, contexts, args.deadline_s, **hd)
        except Exception as exc:  # noqa: BLE001
            report.error("decode grid", exc)
        invalid = [c for c in report.doc["sections"].get("decode_grid", []) if c.get("invalid")]
        timed = [c for c in report.doc["sections"].get("decode_grid", []) if "sdpa_s" in c]
        if invalid or not timed:
            ok = False
            log(f"decode grid: {len(invalid)} cell(s) whose outputs disagree, {len(timed)} timed: its figures "
                f"do not stand")

        try:
            cutover(report, timer, mods, device, args.deadline_s + 60, args.quick, small=args.cpu_selftest)
        except Exception as exc:  # noqa: BLE001
            report.error("cut-over", exc)
    except Exception as exc:  # noqa: BLE001 -- whatever happens, say it and keep what was written
        report.error("setup", exc)
        traceback.print_exc()
        ok = False
    report.flush()
    errors = report.doc["errors"]
    log(f"done: {len(errors)} error(s); results {'in ' + path if path else 'printed only'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
