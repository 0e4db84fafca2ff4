"""Kernel launches of the simulated engine, as the eBPF launch probe and a Kineto trace would see them.

Each layer of a Llama-shaped model runs ten kernels per engine step (the
launch count behind ``CostModel.launch_overhead_s_per_layer``): two RMS
norms, four GEMMs (QKV, output, gate-up, down projections), rotary
embedding, the KV-cache write, attention and the SiLU-and-multiply. For
each, the step's shape gives the grid (thread blocks per launch) and the
roofline gives its time from the bytes it moves and the FLOPs it does.

A :class:`GridFault` is the upgrade bug of SCENARIOS.md §7: from
``from_s`` on, one kernel is launched with a fixed grid (1,1,1) instead of
the grid its shape calls for. Its work does not shrink, so one block on one
SM does it at one SM's bandwidth and FLOP rate (``CostModel.kernel_s`` with
``blocks``); the extra time lengthens every step that launches it.

:class:`LaunchLog` keeps, per second and kernel function, the launches, their
blocks and their GPU time, and yields ``cuda_api`` rows of two shapes: per
process (``cuda_kernel_launches_total``, ``cuda_degenerate_launches_total``,
as the eBPF probe gives them; like the probe, the single-block count includes
legitimate one-block launches, e.g. the norms of a one-sequence decode step)
and per function (cumulative launches, the interval's median blocks per
launch, mean GPU time per launch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.reference_engine.sim.gpu_specs import GPUSpec
from gpudiag.reference_engine.sim.sim_gpu import CostModel, ModelShape

ATTENTION = "flash_attn_fwd"
GEMM = "ampere_bf16_s16816gemm"
# Kernel function -> launches per layer per engine step.
KERNELS_PER_LAYER = {
    "rms_norm_kernel": 2,
    GEMM: 4,
    "rotary_embedding_kernel": 1,
    "reshape_and_cache_flash_kernel": 1,
    ATTENTION: 1,
    "act_and_mul_kernel": 1,
}
# GEMM tiles of 128x128 outputs; attention: one block per query head and 128 query tokens.
GEMM_TILE = 128
ATTENTION_QUERY_TILE = 128


@dataclass
class GridFault:
    """From ``from_s`` on, ``kernel`` is launched with grid ``grid`` whatever its shape."""

    kernel: str = ATTENTION
    grid: tuple[int, int, int] = (1, 1, 1)
    from_s: float = 0.0

    def validate(self) -> None:
        """Raise GpudiagError on a fault no engine could have."""
        if self.kernel not in KERNELS_PER_LAYER:
            raise GpudiagError(f"unknown kernel {self.kernel!r}; the engine launches: {', '.join(KERNELS_PER_LAYER)}")
        if len(self.grid) != 3 or any(int(g) < 1 for g in self.grid):
            raise GpudiagError(f"a grid is three positive dimensions, got {self.grid}")

    @property
    def blocks(self) -> int:
        return math.prod(int(g) for g in self.grid)


def step_kernels(model: ModelShape, token_counts: list[int], context_tokens: int, decode: bool):
    """Per kernel function: (blocks, bytes, FLOPs) of one launch in one layer of a step.

    ``token_counts``: the step's new tokens per sequence (1 each in decode);
    ``context_tokens``: KV tokens attention reads in all (decode).
    """
    tokens = sum(token_counts)
    d, heads = model.hidden_size, max(1, model.hidden_size // model.head_dim)
    layer_weight_bytes = model.weight_bytes / model.num_layers
    layer_params = model.params / model.num_layers
    act = tokens * d * model.dtype_bytes  # one activation tensor of the step
    kv_token = model.kv_bytes_per_token / model.num_layers
    gemm_blocks = math.ceil(tokens / GEMM_TILE) * math.ceil(d / GEMM_TILE)
    if decode:
        attn_blocks = len(token_counts) * heads
        attn_bytes = context_tokens * kv_token
        attn_flops = 4.0 * d * context_tokens
    else:
        attn_blocks = sum(math.ceil(n / ATTENTION_QUERY_TILE) for n in token_counts) * heads
        attn_bytes = tokens * kv_token + 2 * act
        attn_flops = sum(2.0 * d * n * n for n in token_counts)  # causal: half of 4*d*n^2
    return {
        "rms_norm_kernel": (tokens, 2 * act, 4.0 * tokens * d),
        GEMM: (gemm_blocks, layer_weight_bytes / 4 + 2 * act, 2.0 * layer_params * tokens / 4),
        "rotary_embedding_kernel": (tokens, 2 * act, 6.0 * tokens * d),
        "reshape_and_cache_flash_kernel": (tokens, 2 * tokens * kv_token, 0.0),
        ATTENTION: (attn_blocks, attn_bytes, attn_flops),
        "act_and_mul_kernel": (tokens, 6 * act, 8.0 * tokens * d),
    }


class LaunchLog:
    """Launches per second and kernel function; the fault's extra GPU time."""

    def __init__(self, spec: GPUSpec, model: ModelShape, cost: CostModel, fault: GridFault | None):
        if fault is not None:
            fault.validate()
        self.spec, self.model, self.cost, self.fault = spec, model, cost, fault
        self.launches_total: dict[str, int] = dict.fromkeys(KERNELS_PER_LAYER, 0)
        self.degenerate_total = 0
        # second -> function -> [launches, GPU seconds, {blocks: launches}]
        self._pending: dict[int, dict[str, list]] = {}

    def _faulty(self, t: float) -> bool:
        return self.fault is not None and t >= self.fault.from_s

    def fault_extra_s(self, t: float, token_counts: list[int], context_tokens: int, decode: bool) -> float:
        """GPU time the fault adds to one step starting at ``t`` (0 without it)."""
        if not self._faulty(t):
            return 0.0
        blocks, nbytes, flops = step_kernels(self.model, token_counts, context_tokens, decode)[self.fault.kernel]
        n = KERNELS_PER_LAYER[self.fault.kernel] * self.model.num_layers
        return n * (self.cost.kernel_s(self.spec, nbytes, flops, blocks=self.fault.blocks)
                    - self.cost.kernel_s(self.spec, nbytes, flops))

    def record(self, t: float, token_counts: list[int], context_tokens: int, decode: bool, steps: int = 1) -> float:
        """Log ``steps`` identical steps starting at ``t``; returns the GPU time the fault adds to them."""
        faulty = self._faulty(t)
        interval = self._pending.setdefault(math.floor(t), {})
        extra = 0.0
        for name, (blocks, nbytes, flops) in step_kernels(self.model, token_counts, context_tokens, decode).items():
            n = KERNELS_PER_LAYER[name] * self.model.num_layers * steps
            seconds = self.cost.kernel_s(self.spec, nbytes, flops)
            if faulty and name == self.fault.kernel:
                blocks = self.fault.blocks
                slow = self.cost.kernel_s(self.spec, nbytes, flops, blocks=blocks)
                extra += (slow - seconds) * n
                seconds = slow
            acc = interval.setdefault(name, [0, 0.0, {}])
            acc[0] += n
            acc[1] += seconds * n
            acc[2][blocks] = acc[2].get(blocks, 0) + n
            self.launches_total[name] += n
            if blocks == 1:
                self.degenerate_total += n
        return extra

    def rows(self, second: int, labels: dict) -> list[dict]:
        """cuda_api rows for second ``second`` (launches logged in it or before, not yet reported)."""
        merged: dict[str, list] = {}
        for s in [s for s in self._pending if s <= second]:
            for name, (n, secs, blocks) in self._pending.pop(s).items():
                acc = merged.setdefault(name, [0, 0.0, {}])
                acc[0] += n
                acc[1] += secs
                for b, k in blocks.items():
                    acc[2][b] = acc[2].get(b, 0) + k
        rows = [{**labels, M.cuda_kernel_launches_total: sum(self.launches_total.values()),
                 M.cuda_degenerate_launches_total: self.degenerate_total}]
        for name, (n, secs, blocks) in merged.items():
            rows.append({**labels, "function": name, M.cuda_function_launches_total: self.launches_total[name],
                         M.cuda_function_grid_blocks: _weighted_median(blocks),
                         M.cuda_function_duration_seconds: secs / n})
        return rows


def _weighted_median(counts: dict[int, int]) -> float:
    total = sum(counts.values())
    seen = 0
    for b in sorted(counts):
        seen += counts[b]
        if 2 * seen >= total:
            return float(b)
    return float("nan")
