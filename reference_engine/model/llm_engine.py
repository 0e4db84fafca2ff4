"""The reference engine on real tensors: requests in, greedy tokens out, one step at a time.

The Sequence, the Scheduler and the KV managers are the simulated engine's
(:mod:`.engine`); what differs is who computes a step and where memory comes
from:

* ``cpu``: the model runs in torch on the host (:class:`~.model_runner.ModelRunner`).
  Device memory is accounted by the simulated GPU's caching-allocator model
  (:class:`~.sim_gpu.SimGPU`, sized for the model and a KV budget), so a
  scenario's memory behaves as it does on ``sim`` while K/V are real tensors.
* ``cuda``: the model and the KV managers' buffers live on the GPU, memory
  comes from the real caching allocator; white and grey from
  ``torch.cuda.memory_allocated``/``memory_reserved``, black from NVML.
* ``sim``: no tensors; steps are charged the cost model's GPU time, paced to
  the wall clock (:class:`~.model_runner.SimRunner`), which lets a server
  behave like a 7B model on an A100 on a laptop.

A step is a prefill of newly admitted (or recomputed) sequences or a decode
over the running batch, exactly as the scheduler decides; every sequence
that got a token is returned. Time is the wall clock (``time.monotonic``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.frames import Frame
from gpudiag.reference_engine.core.allocator import get_allocation_size, round_size
from gpudiag.reference_engine.core.kv_manager import KVConfig, make_kv_manager
from gpudiag.reference_engine.core.scheduler import Scheduler, SchedulerConfig, StepStats
from gpudiag.reference_engine.core.sequence import TIERS, Sequence, Status
from gpudiag.reference_engine.model.model_config import ModelConfig, load_model_config
from gpudiag.reference_engine.model.tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from gpudiag.reference_engine.sim.engine import engine_metrics
from gpudiag.reference_engine.sim.gpu_specs import spec as gpu_spec
from gpudiag.reference_engine.sim.sim_gpu import CostModel, DeviceLayout, SimGPU, shape_of

MIB = 1024**2
DEVICES = ("cpu", "cuda", "sim")
ENGINE_NAME = "gpudiag-engine"
DEFAULT_MODEL = {"cpu": "tiny", "cuda": "small", "sim": "llama-7b"}
# The KV budget on the cpu device: the host holds it as real tensors, so it is
# sized like a small GPU's pool, not like an A100's 45 GB.
CPU_KV_BYTES = 64 * MIB
# cpu: a contiguous region starts with room for this many tokens (the sim's 256 MB
# would be half a million tokens of the tiny model).
CPU_INITIAL_REGION_TOKENS = 256
# cuda: activations of one step of max_num_batched_tokens, kept out of the KV budget.
CUDA_ACTIVATION_HEADROOM_BYTES = 512 * MIB


@dataclass
class LLMEngineConfig:
    """Device, model, KV and scheduler of one real-tensor engine."""

    device: str = "cpu"  # cpu | cuda | sim
    model: str | None = None  # preset or JSON config; None: DEFAULT_MODEL[device]
    checkpoint: str | None = None  # safetensors file or directory; None: weights drawn from ``seed``
    seed: int = 0
    kv: KVConfig | None = None  # None: paged, 16-token blocks (contiguous regions sized for the device)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    gpu: str = "A100-80GB"  # sim: the simulated device; cpu: its speed figures (memory is sized below)
    kv_capacity_bytes: int | None = None  # cap on the KV pool; cpu default CPU_KV_BYTES
    max_model_len: int | None = None  # tokens per request; None: the model's max_position
    backend: str = "auto"  # kernel backend (see kernels/dispatch.py)
    sim_speed: float | None = 1.0  # sim: simulated seconds per wall second; None: no pacing
    cuda_memory_fraction: float = 0.9  # cuda: share of the device the engine may hold
    cpu_threads: int | None = None  # cpu: torch intra-op threads (None: torch's choice)
    cost: CostModel = field(default_factory=CostModel)

    def validate(self) -> None:
        """Raise GpudiagError on a configuration no engine could run with."""
        if self.device not in DEVICES:
            raise GpudiagError(f"unknown device {self.device!r}; choose one of {', '.join(DEVICES)}")
        gpu_spec(self.gpu)
        self.scheduler.validate()
        if self.kv is not None:
            self.kv.validate()
        if self.kv_capacity_bytes is not None and self.kv_capacity_bytes <= 0:
            raise GpudiagError("kv_capacity_bytes must be positive")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise GpudiagError("max_model_len must be positive")
        if self.sim_speed is not None and not (0 < self.sim_speed < math.inf):  # None: no pacing
            raise GpudiagError(f"sim_speed must be a positive number, got {self.sim_speed:g}")
        if not 0.0 < self.cuda_memory_fraction <= 1.0:
            raise GpudiagError("cuda_memory_fraction must be in (0, 1]")
        if self.cpu_threads is not None and self.cpu_threads <= 0:
            raise GpudiagError(f"cpu_threads must be positive, got {self.cpu_threads}")


@dataclass(eq=False)
class GenerationSequence(Sequence):
    """A request with its tokens: ``token_ids`` is the prompt followed by the output so far."""

    token_ids: list[int] = field(default_factory=list)
    stop_at_eos: bool = True
    finish_reason: str | None = None  # length | eos | kv_capacity | abort
    token_times: list[float] = field(default_factory=list)  # when each output token was produced

    @property
    def output_ids(self) -> list[int]:
        """The generated tokens."""
        return self.token_ids[self.prompt_tokens:]


class EngineObserver:
    """Hooks a tracer implements; the engine calls them only when one is set (no cost otherwise)."""

    def on_step(self, kind: str, seqs: list[GenerationSequence], t0: float, t1: float) -> None:
        """A prefill or decode step over ``seqs`` ran from ``t0`` to ``t1`` (engine clock)."""

    def on_preempt(self, seq: GenerationSequence, t: float) -> None:
        """``seq``'s KV was evicted; it waits to be recomputed."""

    def on_finish(self, seq: GenerationSequence) -> None:
        """``seq`` produced its last token (or could never be admitted)."""


class LLMEngine:
    """The reference engine computing real tokens (cpu, cuda) or charging a cost model (sim)."""

    def __init__(self, cfg: LLMEngineConfig | None = None, *, clock: Callable[[], float] = time.monotonic,
                 on_logits=None, node: str = "localhost", gpu_index: int = 0):
        cfg = cfg or LLMEngineConfig()
        cfg.validate()
        self.cfg = cfg
        self.clock = clock
        self.node = node
        self.gpu_index = gpu_index
        self.model_config: ModelConfig = load_model_config(cfg.model or DEFAULT_MODEL[cfg.device])
        self.model = None
        self.sim_gpu: SimGPU | None = None
        self._nvml = None
        self.tokenizer = ByteTokenizer()
        if cfg.device == "cuda":
            self._build_cuda(on_logits)
        else:
            self._build_simulated(on_logits)
        self.sched = Scheduler(cfg.scheduler, self.kv)
        mc = self.model_config
        self.max_model_len = min(cfg.max_model_len or mc.max_position, mc.max_position)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.arrived_total = 0
        self.finished_total = 0
        self.failed_total = 0
        self.last_batch = 0
        self.steps_total = {"prefill": 0, "decode": 0}
        self.observer: EngineObserver | None = None
        self._next_id = 0
        self._request_rows: list[dict] = []
        self.stats = self.allocator.stats()  # refreshed after every step; read by other threads

    # -- construction ------------------------------------------------------------------------
    def _kv_config(self, initial_tokens: int) -> KVConfig:
        if self.cfg.kv is not None:
            return self.cfg.kv
        bpt = self.model_config.kv_bytes_per_token()
        return KVConfig(strategy="paged", block_size=16, initial_bytes=initial_tokens * bpt,
                        chunk_bytes=initial_tokens * bpt, max_model_len=self.model_config.max_position)

    def _build_simulated(self, on_logits) -> None:
        from gpudiag.reference_engine.model.model_runner import (
            HostBackedAllocator,
            ModelRunner,
            SimRunner,
            make_tensor_kv_manager,
        )

        cfg, mc = self.cfg, self.model_config
        shape = shape_of(mc)
        spec = gpu_spec(cfg.gpu)
        if cfg.device == "cpu":
            import psutil

            # The cpu device holds the KV pool in host memory, as cuda checks the device's free memory.
            available = psutil.virtual_memory().available
            if cfg.kv_capacity_bytes is not None and cfg.kv_capacity_bytes > available:
                raise GpudiagError(f"device cpu: a KV cache of {cfg.kv_capacity_bytes / MIB:.0f} MiB is more than "
                                   f"this host's available memory ({available / MIB:.0f} MiB); lower the KV capacity")
            layout = DeviceLayout(cuda_context_bytes=512 * MIB, memory_fraction=1.0, activation_bytes=64 * MIB)
            # Each of weights, activations and the KV pool is one block of the allocator
            # model: the device holds the segments the allocator would cudaMalloc for them.
            memory = layout.cuda_context_bytes + sum(
                get_allocation_size(round_size(n))
                for n in (shape.weight_bytes, layout.activation_bytes, cfg.kv_capacity_bytes or CPU_KV_BYTES))
            spec = dataclasses.replace(spec, memory_bytes=memory)
        else:
            layout = DeviceLayout()
        self.sim_gpu = SimGPU(spec, shape, layout, cfg.cost)
        self.uuid = f"GPU-sim-{self.gpu_index:02d}-{cfg.device}"
        capacity = self.sim_gpu.kv_capacity_bytes
        if cfg.kv_capacity_bytes is not None:
            capacity = min(capacity, cfg.kv_capacity_bytes)
        # No other tenant shares a simulated device: nominal is what the engine gets.
        self._kv_nominal_bytes = capacity
        if cfg.device == "cpu":
            import torch

            from gpudiag.reference_engine.model.model import build_model

            if cfg.cpu_threads:
                torch.set_num_threads(cfg.cpu_threads)
            self.allocator = HostBackedAllocator(self.sim_gpu.allocator)
            self.model = build_model(mc, seed=cfg.seed, device="cpu", checkpoint=cfg.checkpoint)
            self.kv = make_tensor_kv_manager(self._kv_config(CPU_INITIAL_REGION_TOKENS), self.allocator, capacity,
                                             mc, self.model.dtype)
            self.runner = ModelRunner(self.model, self.kv, cfg.backend, on_logits)
        else:
            self.allocator = self.sim_gpu.allocator
            kv_cfg = self.cfg.kv or KVConfig()
            self.kv = make_kv_manager(kv_cfg, self.allocator, shape.kv_bytes_per_token, capacity)
            self.runner = SimRunner(self.sim_gpu, cfg.cost, self.kv, cfg.sim_speed)

    def _build_cuda(self, on_logits) -> None:
        import torch

        from gpudiag.reference_engine.model.model import build_model
        from gpudiag.reference_engine.model.model_runner import ModelRunner, TorchCudaAllocator, make_tensor_kv_manager

        if not torch.cuda.is_available():
            raise GpudiagError(f"device cuda: torch {torch.__version__} sees no CUDA device; "
                               "use --device cpu (real tensors on the host) or --device sim")
        cfg, mc = self.cfg, self.model_config
        dev = torch.device("cuda", self.gpu_index)
        torch.cuda.set_device(dev)
        self.model = build_model(mc, seed=cfg.seed, device=dev, checkpoint=cfg.checkpoint)
        self.allocator = TorchCudaAllocator(dev)
        free, total = torch.cuda.mem_get_info(dev)
        capacity = int(total * cfg.cuda_memory_fraction) - (total - free) - CUDA_ACTIVATION_HEADROOM_BYTES
        if cfg.kv_capacity_bytes is not None:
            capacity = min(capacity, cfg.kv_capacity_bytes)
        self._kv_nominal_bytes = capacity
        if capacity <= 0:
            raise GpudiagError(f"device cuda: no memory left for the KV cache after the weights "
                               f"({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB); "
                               "raise cuda_memory_fraction or use a smaller model")
        self.kv = make_tensor_kv_manager(self._kv_config(4096), self.allocator, capacity, mc, self.model.dtype)
        self.runner = ModelRunner(self.model, self.kv, cfg.backend, on_logits)
        props = torch.cuda.get_device_properties(dev)
        uuid = getattr(props, "uuid", None)
        self.uuid = (str(uuid) if str(uuid).startswith("GPU-") else f"GPU-{uuid}") if uuid else None

    # -- requests ------------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], max_tokens: int) -> None:
        """Raise GpudiagError when a request could never run on this engine (too long, bad ids)."""
        if not prompt_ids:
            raise GpudiagError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise GpudiagError(f"prompt token ids must be in [0, {vocab})")
        if max_tokens <= 0:
            raise GpudiagError(f"max_tokens must be positive, got {max_tokens}")
        total = len(prompt_ids) + max_tokens
        if total > self.max_model_len:
            raise GpudiagError(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                               f"context of {self.max_model_len} tokens")
        if self.kv.estimate_bytes(total + 1) > self.kv.capacity_bytes:
            raise GpudiagError(f"a request of {total} tokens needs more KV memory than the engine has "
                               f"({self.kv.capacity_bytes} bytes)")

    def add_request(self, prompt_ids: list[int], max_tokens: int, tier: int = 1, *, stop_at_eos: bool = True,
                    kind: str = "api") -> GenerationSequence:
        """Queue a request; returns its sequence (GpudiagError when it could never run)."""
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_request(prompt_ids, max_tokens)
        if not 0 <= tier < len(TIERS):
            raise GpudiagError(f"tier must be in [0, {len(TIERS)}), got {tier}")
        # Prefix caching names blocks by content: each prompt token is its own piece.
        seq = GenerationSequence(self._next_id, self.clock(), len(prompt_ids), max_tokens, tier, kind,
                                 content=tuple((t, 1) for t in prompt_ids), token_ids=prompt_ids,
                                 stop_at_eos=stop_at_eos)
        self._next_id += 1
        self.arrived_total += 1
        self.sched.add(seq)
        return seq

    def add_text(self, prompt: str, max_tokens: int, tier: int = 1, **kw) -> GenerationSequence:
        """Queue a text prompt (byte tokens after BOS)."""
        return self.add_request(self.tokenizer.encode(prompt), max_tokens, tier, **kw)

    @property
    def has_unfinished(self) -> bool:
        """True while some request waits or runs."""
        return self.sched.has_work

    def preempt(self, seq: GenerationSequence) -> None:
        """Evict a running sequence's KV now (it is recomputed when readmitted): fault injection and tests."""
        if seq.status is not Status.RUNNING:
            raise GpudiagError(f"request {seq.seq_id} is not running")
        self.sched.preempt(seq)
        if self.observer is not None:
            self.observer.on_preempt(seq, self.clock())

    def warm_up(self) -> None:
        """One short request through prefill and decode (first-use costs: kernels, allocator), then zero the counters.

        The serving state is WARMING until this returns.
        """
        self.generate([[BOS_ID, 1, 2, 3]], max_tokens=2)
        self.prompt_tokens_total = self.generation_tokens_total = 0
        self.arrived_total = self.finished_total = self.failed_total = self.last_batch = 0
        self.steps_total = {"prefill": 0, "decode": 0}
        self.sched.stats = StepStats()
        self._request_rows = []

    def abort(self, seq: GenerationSequence) -> None:
        """Drop a waiting or running request whose client went away; its KV is released, no result kept."""
        if seq.status not in (Status.WAITING, Status.RUNNING):
            return
        now = self.clock()
        self.sched.abort(seq, now)
        seq.finish_reason = "abort"
        seq.finish_s = now
        if self.observer is not None:
            self.observer.on_finish(seq)

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[GenerationSequence]:
        """Run one prefill or decode step; the sequences that got a token (finished ones included).

        A request that cannot get KV memory even with nothing else running is
        given up (``finish_reason`` ``kv_capacity``, no token) and returned alone.
        """
        t0 = self.clock()
        batch = self.sched.schedule_prefill(t0) if self.sched.can_admit() else []
        if not batch and not self.sched.running and self.sched.waiting:
            # Nothing runs, so nothing will be freed: past failures say nothing about an empty pool.
            self.sched.retry_admission()
            batch = self.sched.schedule_prefill(t0)
            if not batch:
                seq = self.sched.waiting.popleft()
                self._fail(seq, t0)
                return [seq]
        if batch:
            self.prompt_tokens_total += self.runner.prefill_token_count(batch)
            tokens = self.runner.prefill(batch)
            kind = "prefill"
        else:
            before = self.sched.stats.evictions
            running = list(self.sched.running)
            batch = list(self.sched.prepare_decode(t0))
            if self.observer is not None and self.sched.stats.evictions != before:
                for s in running:
                    if s.status is Status.WAITING:
                        self.observer.on_preempt(s, t0)
            if not batch:
                return []
            tokens = self.runner.decode(batch)
            self.kv.advance(batch, 1)
            kind = "decode"
        t1 = self.clock()
        self.steps_total[kind] += 1
        self.last_batch = len(batch)
        for seq, tok in zip(batch, tokens):
            self._append(seq, tok, t1)
        if self.observer is not None:
            self.observer.on_step(kind, batch, t0, t1)
        for seq in batch:
            reason = self._finish_reason(seq)
            if reason:
                seq.finish_reason = reason
                self.sched.finish(seq, t1)
                self.finished_total += 1
                self._request_rows.append(self._request_row(seq))
                if self.observer is not None:
                    self.observer.on_finish(seq)
        self.stats = self.allocator.stats()
        return batch

    def _append(self, seq: GenerationSequence, token: int, t: float) -> None:
        seq.token_ids.append(int(token))
        seq.generated += 1
        seq.token_times.append(t)
        self.generation_tokens_total += 1
        if seq.first_token_s is None:
            seq.first_token_s = t

    def _finish_reason(self, seq: GenerationSequence) -> str | None:
        if seq.stop_at_eos and seq.token_ids[-1] == EOS_ID:
            return "eos"
        if seq.remaining <= 0 or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _fail(self, seq: GenerationSequence, t: float) -> None:
        seq.status = Status.FAILED
        seq.finish_reason = "kv_capacity"
        seq.finish_s = t
        self.failed_total += 1
        if self.observer is not None:
            self.observer.on_finish(seq)

    def generate(self, prompts: Iterable[list[int]], max_tokens: int, tier: int = 1,
                 stop_at_eos: bool = False) -> list[GenerationSequence]:
        """Run prompts (token ids) to completion; their sequences, in the prompts' order."""
        seqs = [self.add_request(p, max_tokens, tier, stop_at_eos=stop_at_eos) for p in prompts]
        while self.has_unfinished:
            self.step()
        return seqs

    # -- what the engine publishes --------------------------------------------------------------
    def labels(self) -> dict:
        """The engine's labels (node, gpu, engine)."""
        return {"node": self.node, "gpu": self.gpu_index, "engine": ENGINE_NAME}

    def fingerprint(self) -> str:
        """SHA-256 of the served weights (sim: of the model config's name; there are no weights)."""
        if self.model is not None:
            return self.model.fingerprint().sha256
        import hashlib

        return hashlib.sha256(f"sim:{self.model_config.name}".encode()).hexdigest()

    def engine_row(self) -> dict:
        """The engine's figures in catalog columns (vLLM's dialect and gpudiag's own)."""
        return {**self.labels(), **engine_metrics(
            self.sched, self.kv, prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total, last_batch=self.last_batch,
            kv_nominal_bytes=self._kv_nominal_bytes, finished_total=self.finished_total,
            arrived_total=self.arrived_total)}

    def driver_bytes(self) -> int | None:
        """Black: device memory the driver charges this process (sim/cpu: the model's; cuda: NVML's)."""
        if self.sim_gpu is not None:
            return self.sim_gpu.driver_bytes()
        try:
            import pynvml

            if self._nvml is None:
                pynvml.nvmlInit()
                self._nvml = pynvml.nvmlDeviceGetHandleByUUID(self.uuid) if self.uuid else \
                    pynvml.nvmlDeviceGetHandleByIndex(self.gpu_index)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(self._nvml):
                if p.pid == os.getpid():
                    return int(p.usedGpuMemory)
        except Exception:  # noqa: BLE001 - no NVML (a container without the library): black is missing, not 0
            return None
        return None

    def process_row(self) -> dict:
        """The three colours and the allocator's figures of the serving process, in catalog columns."""
        a = self.stats
        row = {**self.labels(), "uuid": self.uuid, "pid": os.getpid(), "process": ENGINE_NAME,
               M.process_torch_allocated_bytes: a.allocated_bytes,
               M.process_torch_reserved_bytes: a.reserved_bytes,
               M.process_torch_active_bytes: a.active_bytes,
               M.process_torch_inactive_split_bytes: a.inactive_split_bytes,
               M.process_torch_requested_bytes: a.requested_bytes,
               M.process_torch_segments: a.segment_count,
               M.process_torch_alloc_retries_total: a.num_alloc_retries,
               M.process_torch_ooms_total: a.num_ooms,
               M.process_reserved_minus_allocated_bytes: a.reserved_bytes - a.allocated_bytes}
        if self.sim_gpu is not None:  # torch keeps no largest-free-block figure
            row[M.process_torch_largest_free_block_bytes] = a.largest_free_block_bytes
        black = self.driver_bytes()
        if black is not None:
            row[M.process_gpu_memory_bytes] = black
            row[M.process_driver_minus_reserved_bytes] = black - a.reserved_bytes
        return row

    def reporter_entries(self) -> list[dict]:
        """Device entries for ``instrument(stats_source=...)``: the allocator's white and grey, as torch reports."""
        from gpudiag.probes.torch_reporter import REPORTED_COLUMNS

        row = self.process_row()
        entry = {"device": self.gpu_index, "gpu": self.gpu_index, "uuid": self.uuid}
        entry.update({c: row[c] for c in REPORTED_COLUMNS if c in row})
        return [entry]

    def _request_row(self, seq: GenerationSequence) -> dict:
        return {**self.labels(), "request_id": seq.seq_id, "kind": seq.kind, "tier": TIERS[seq.tier],
                "arrival_s": seq.arrival_s, "finish_s": seq.finish_s, "prompt_tokens": seq.prompt_tokens,
                "output_tokens": seq.generated, "preemptions": seq.preemptions, **seq.latencies()}

    def take_request_rows(self) -> list[dict]:
        """Rows of the requests finished since the last call (each row is handed out once)."""
        rows, self._request_rows = self._request_rows, []
        return rows

    def frames(self, t: float | None = None) -> list[Frame]:
        """Engine, process and request frames of now (request rows: those finished since the last call)."""
        t = time.time() if t is None else t
        out = [Frame("engine", t, [self.engine_row()]), Frame("process", t, [self.process_row()])]
        rows = self.take_request_rows()
        if rows:
            out.append(Frame("request", t, rows))
        return out
