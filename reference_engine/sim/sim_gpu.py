"""The simulated GPU: memory through the caching-allocator model, time through a roofline.

Nothing here computes: an engine step is charged the time a real GPU would
need for it, from bytes moved over HBM and FLOPs at peak (the roofline), plus
the host-side work around it. GPU utilization is the busy fraction of each
sample interval, as NVML defines utilization.gpu (the fraction of time one or
more kernels were executing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gpudiag.errors import GpudiagError
from gpudiag.reference_engine.core.allocator import CachingAllocator, DeviceMemory
from gpudiag.reference_engine.model.model_config import PRESETS, ModelConfig
from gpudiag.reference_engine.sim.gpu_specs import GIB, GPUSpec

MIB = 1024**2


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know about a model."""

    name: str
    params: float
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    kv_dtype_bytes: int = 2  # 1 for an fp8 KV cache (vLLM's kv_cache_dtype=fp8)

    @property
    def weight_bytes(self) -> int:
        return int(self.params * self.dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer and KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes


def shape_of(cfg: ModelConfig, kv_dtype_bytes: int | None = None, name: str | None = None) -> ModelShape:
    """The cost model's view of a model configuration (one source of model shapes: model_config.PRESETS)."""
    return ModelShape(name or cfg.name, float(cfg.param_count()), cfg.num_layers, cfg.hidden_size,
                      cfg.num_kv_heads, cfg.head_dim, cfg.dtype_bytes,
                      cfg.dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes)


MODELS = {
    # Llama-2-7B: 32 KV heads of 128 (no GQA): 512 KiB of KV per token in fp16.
    "llama-7b": shape_of(PRESETS["llama-7b"]),
    # Mistral-7B: GQA with 8 KV heads: 128 KiB per token.
    "mistral-7b": shape_of(PRESETS["mistral-7b"]),
    # Mistral-7B with an fp8 KV cache (vLLM's kv_cache_dtype=fp8): 64 KiB per token.
    "mistral-7b-kv8": shape_of(PRESETS["mistral-7b"], kv_dtype_bytes=1, name="mistral-7b-kv8"),
    # Mistral-7B with int8 weights (W8A16: GPTQ/AWQ 8-bit, LLM.int8): 7.2 GB of weights, the
    # "8 GB model on a 16 GB card" of SCENARIOS.md §3; decode reads half the bytes.
    "mistral-7b-w8": replace(shape_of(PRESETS["mistral-7b"], name="mistral-7b-w8"), dtype_bytes=1),
    # Llama-3.3-70B-Instruct in bf16, bf16 KV: 141 GB of weights, 320 KiB of KV per token.
    "llama-3.3-70b": shape_of(PRESETS["llama-3.3-70b"]),
    # nvidia/Llama-3.3-70B-Instruct-FP4 (hf_quant_config.json: quant_algo NVFP4, group_size 16,
    # kv_cache_quant_algo FP8, exclude_modules lm_head): the 68.45 B linear-layer weights hold 4 bits
    # plus one FP8 scale per 16 (0.5625 B each), the embedding and LM head (2.10 B) stay bf16:
    # 42.7 GB of weights, 0.605 B a parameter on average; 160 KiB of fp8 KV per token.
    "llama-3.3-70b-fp4": replace(shape_of(PRESETS["llama-3.3-70b"], kv_dtype_bytes=1, name="llama-3.3-70b-fp4"),
                                 dtype_bytes=(68.45 * 0.5625 + 2.10 * 2) / 70.55),
}


@dataclass
class CostModel:
    """Time of engine work on a GPU and on the host.

    GPU figures are fractions of the datasheet peak that a serving engine
    reaches; host figures are those of a Python engine loop (nano-vllm /
    vLLM V0 class) on a server CPU.
    """

    # Decode is bandwidth-bound; good kernels reach ~80 % of HBM peak.
    bandwidth_efficiency: float = 0.8
    # Prefill GEMMs reach ~60 % of tensor-core peak at serving batch sizes.
    flops_efficiency: float = 0.6
    # ~10 kernel launches per layer at ~5 µs each, not hidden without CUDA graphs.
    launch_overhead_s_per_layer: float = 50e-6
    # Python scheduling, sampling and detokenization per engine step.
    host_step_s: float = 6.0e-3
    host_per_seq_s: float = 20e-6
    # Per-request host work outside the step loop (tokenize, HTTP, queueing).
    host_per_request_s: float = 1.0e-3
    # cudaMalloc maps pages (~0.5 ms per GiB on A100-class parts) on top of a fixed cost.
    cuda_malloc_s: float = 0.2e-3
    cuda_malloc_s_per_gib: float = 0.5e-3
    # cudaFree implicitly synchronizes the device and unmaps pages.
    cuda_free_s: float = 0.5e-3
    cuda_free_s_per_gib: float = 1.0e-3
    # An allocation retry synchronizes and walks every cached segment.
    alloc_retry_s: float = 2.0e-3
    # Evicting a request: victim selection, freeing, re-queueing, block-table/region bookkeeping.
    eviction_host_s: float = 1.5e-3
    # Copies from pinned host memory reach ~80 % of the PCIe link (DMA and protocol overhead).
    host_link_efficiency: float = 0.8
    # Request preprocessing before scheduling (tokenize, pad, feature transforms): CPU time of one
    # core per request and per prompt token. Zero: the engine receives requests ready to schedule.
    preprocess_s: float = 0.0
    preprocess_s_per_token: float = 0.0
    # What one thread block on one SM sustains (A100: 32 B/clk of loads, 1024 BF16 FMA/clk of tensor
    # cores): a kernel launched with too few blocks runs at that many SMs' worth of the device.
    sm_bytes_per_clock: float = 32.0
    sm_flops_per_clock: float = 2048.0

    def preprocess_cost_s(self, prompt_tokens: int) -> float:
        """CPU time to preprocess one request of ``prompt_tokens`` tokens."""
        return self.preprocess_s + self.preprocess_s_per_token * prompt_tokens

    def kernel_s(self, spec: GPUSpec, nbytes: float, flops: float, blocks: int | None = None) -> float:
        """Roofline time of one kernel; with ``blocks``, capped at what that many SMs' worth can do."""
        bw = spec.hbm_bandwidth_bytes_per_s * self.bandwidth_efficiency
        peak = spec.peak_bf16_flops * self.flops_efficiency
        if blocks is not None:
            bw = min(bw, blocks * self.sm_bytes_per_clock * spec.sm_clock_max_hz)
            peak = min(peak, blocks * self.sm_flops_per_clock * spec.sm_clock_max_hz)
        return max(nbytes / bw, flops / peak)

    def decode_gpu_s(self, spec: GPUSpec, model: ModelShape, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` sequences holding ``context_tokens`` tokens of KV in all."""
        bytes_moved = model.weight_bytes + context_tokens * model.kv_bytes_per_token
        t_mem = bytes_moved / (spec.hbm_bandwidth_bytes_per_s * self.bandwidth_efficiency)
        t_flop = 2.0 * model.params * batch / (spec.peak_bf16_flops * self.flops_efficiency)
        return max(t_mem, t_flop) + self.launch_overhead_s_per_layer * model.num_layers

    def prefill_gpu_s(self, spec: GPUSpec, model: ModelShape, token_counts: list[int],
                      cached_counts: list[int] | None = None) -> float:
        """One prefill step over sequences of the given lengths (recompute included).

        ``cached_counts``: tokens ahead of each sequence's computed ones whose KV
        came from the prefix cache; the new tokens attend to them (and read them).
        """
        tokens = sum(token_counts)
        cached = cached_counts or [0] * len(token_counts)
        # Linear layers 2*P FLOPs per token; causal attention ~2*L*d*n^2 per sequence
        # (n new tokens after c cached ones: 2*L*d*(n^2 + 2*n*c)).
        flops = 2.0 * model.params * tokens + sum(
            2.0 * model.num_layers * model.hidden_size * n * (n + 2 * c) for n, c in zip(token_counts, cached))
        t_flop = flops / (spec.peak_bf16_flops * self.flops_efficiency)
        bytes_moved = model.weight_bytes + (tokens + sum(cached)) * model.kv_bytes_per_token
        t_mem = bytes_moved / (spec.hbm_bandwidth_bytes_per_s * self.bandwidth_efficiency)
        return max(t_flop, t_mem) + self.launch_overhead_s_per_layer * model.num_layers

    def copy_gpu_s(self, spec: GPUSpec, nbytes: int) -> float:
        """A device-to-device copy reads and writes every byte."""
        return 2.0 * nbytes / (spec.hbm_bandwidth_bytes_per_s * self.bandwidth_efficiency)

    def host_load_s(self, spec: GPUSpec, nbytes: int) -> float:
        """Loading ``nbytes`` of KV from host memory to the device over the host link."""
        return nbytes / (spec.host_link_bytes_per_s * self.host_link_efficiency)

    def host_step_cost_s(self, batch: int) -> float:
        return self.host_step_s + self.host_per_seq_s * batch

    def allocator_host_s(self, mallocs: int, malloc_bytes: int, frees: int, free_bytes: int, retries: int) -> float:
        """Host time of the driver calls the caching allocator made."""
        return (mallocs * self.cuda_malloc_s + malloc_bytes / GIB * self.cuda_malloc_s_per_gib
                + frees * self.cuda_free_s + free_bytes / GIB * self.cuda_free_s_per_gib
                + retries * self.alloc_retry_s)


class LimitedDeviceMemory(DeviceMemory):
    """HBM with a per-owner cap: torch.cuda.set_per_process_memory_fraction for the engine.

    A cap covers its owner and the owners joined to it: torch applies the
    fraction to every pool of the process, private (CUDA-graph) pools included.
    """

    def __init__(self, total_bytes: int):
        super().__init__(total_bytes)
        self.limits: dict[str, int] = {}
        self._joined: dict[str, str] = {}  # owner -> the owner whose cap it shares

    def join_cap(self, owner: str, capped_owner: str) -> None:
        """Count ``owner``'s memory against ``capped_owner``'s cap."""
        self._joined[owner] = capped_owner

    def reserve(self, nbytes: int, owner: str) -> bool:
        key = self._joined.get(owner, owner)
        limit = self.limits.get(key)
        if limit is not None:
            held = self.used_bytes(key) + sum(self.used_bytes(o) for o, k in self._joined.items() if k == key)
            if held + nbytes > limit:
                return False
        return super().reserve(nbytes, owner)


class BusyTimeline:
    """Per-second accounting of GPU-busy and host-busy time on the virtual clock."""

    def __init__(self):
        self.gpu: list[float] = []
        self.host: list[float] = []

    def _grow(self, second: int) -> None:
        while len(self.gpu) <= second:
            self.gpu.append(0.0)
            self.host.append(0.0)

    def add(self, t0: float, t1: float, gpu_fraction: float) -> None:
        """Charge [t0, t1) with ``gpu_fraction`` of it GPU-busy and the rest host-busy."""
        if t1 <= t0:
            return
        s = int(t0)
        last = int(math.ceil(t1)) - 1
        self._grow(last)
        t = t0
        while s <= last:
            end = min(t1, s + 1.0)
            span = end - t
            if span > 0:
                self.gpu[s] += span * gpu_fraction
                self.host[s] += span * (1.0 - gpu_fraction)
            t = end
            s += 1

    def second(self, s: int) -> tuple[float, float]:
        """(GPU-busy, host-busy) seconds within second ``s``."""
        if s < len(self.gpu):
            return min(1.0, self.gpu[s]), min(1.0, self.host[s])
        return 0.0, 0.0


@dataclass
class DeviceLayout:
    """Where the device memory goes before any KV is stored."""

    cuda_context_bytes: int = 512 * MIB  # the driver's context, charged to the process
    memory_fraction: float = 0.75  # of the device the engine may use (torch per-process fraction)
    activation_bytes: int = 2 * GIB  # workspace for activations, allocated once
    # vLLM's gpu_memory_utilization: weights, activations and the KV pool are sized to this share
    # of the device, and the rest stays free for whatever else the process allocates. None: the
    # KV pool may take all memory under the cap.
    gpu_memory_utilization: float | None = None


class SimGPU:
    """One simulated GPU: HBM shared by owners, the engine's caching allocator, a cost model."""

    ENGINE = "engine"

    def __init__(self, spec: GPUSpec, model: ModelShape, layout: DeviceLayout | None = None,
                 cost: CostModel | None = None, *, max_split_size_bytes: int | None = None,
                 expandable_segments: bool = False, other_tenant_bytes: int = 0):
        self.spec = spec
        self.model = model
        self.layout = layout or DeviceLayout()
        self.cost = cost or CostModel()
        self.memory = LimitedDeviceMemory(spec.memory_bytes)
        if other_tenant_bytes and not self.memory.reserve(other_tenant_bytes, "cotenant"):
            raise GpudiagError("the co-tenant's memory does not fit the device")
        if not 0.0 < self.layout.memory_fraction <= 1.0:
            raise GpudiagError(f"memory fraction must be in (0, 1], got {self.layout.memory_fraction}")
        util = self.layout.gpu_memory_utilization
        if util is not None and not 0.0 < util <= 1.0:
            raise GpudiagError(f"gpu_memory_utilization must be in (0, 1], got {util}")
        engine_limit = int(spec.memory_bytes * self.layout.memory_fraction)
        self.memory.limits[self.ENGINE] = engine_limit
        if not self.memory.reserve(self.layout.cuda_context_bytes, self.ENGINE + ":context"):
            raise GpudiagError("the CUDA context does not fit the device")
        self.allocator = CachingAllocator(self.memory, self.ENGINE, max_split_size_bytes=max_split_size_bytes,
                                          expandable_segments=expandable_segments)
        need = model.weight_bytes + self.layout.activation_bytes
        if need > min(engine_limit, self.memory.free_bytes()):
            raise GpudiagError(
                f"the workload cannot fit: {model.name} weights ({model.weight_bytes / GIB:.1f} GiB) plus "
                f"activations need {need / GIB:.1f} GiB but {spec.name} gives the engine "
                f"{min(engine_limit, self.memory.free_bytes()) / GIB:.1f} GiB")
        self.weights_addr = self.allocator.malloc(model.weight_bytes)
        self.activations_addr = self.allocator.malloc(self.layout.activation_bytes)
        self.busy = BusyTimeline()
        self._last_stats = self.allocator.stats()

    def _kv_budget_bytes(self) -> int:
        """What the engine's own memory may reach: its cap, or less under gpu_memory_utilization."""
        budget = self.memory.limits[self.ENGINE]
        if self.layout.gpu_memory_utilization is not None:
            budget = min(budget, int(self.spec.memory_bytes * self.layout.gpu_memory_utilization))
        return budget

    @property
    def kv_capacity_bytes(self) -> int:
        """Device memory left for KV under the engine's cap."""
        return max(0, min(self._kv_budget_bytes() - self.memory.used_bytes(self.ENGINE),
                          self.memory.free_bytes()))

    @property
    def kv_nominal_bytes(self) -> int:
        """KV capacity on this device with no other tenant: the engine's cap less its own holdings."""
        return max(0, self._kv_budget_bytes() - self.memory.used_bytes(self.ENGINE))

    def driver_bytes(self) -> int:
        """Black: what the driver charges the engine process: its segments, its context, and every other
        owner named after it (private pools, memory allocated outside PyTorch)."""
        prefix = self.ENGINE + ":"
        return sum(n for owner, n in self.memory.owners().items() if owner == self.ENGINE or owner.startswith(prefix))

    def allocator_host_time_since_last(self) -> tuple[float, int]:
        """Host time of allocator driver calls since the last call, and the retries among them."""
        s = self.allocator.stats()
        last = self._last_stats
        self._last_stats = s
        retries = s.num_alloc_retries - last.num_alloc_retries
        t = self.cost.allocator_host_s(
            s.num_device_mallocs - last.num_device_mallocs, s.device_malloc_bytes - last.device_malloc_bytes,
            s.num_device_frees - last.num_device_frees, s.device_free_bytes - last.device_free_bytes, retries)
        return t, retries
