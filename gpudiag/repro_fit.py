"""A window of real telemetry as a scenario of the simulator: ``gpudiag repro --from-store/--from-prometheus/--file``.

:func:`fit` reads what a window shows about one serving engine and makes a
:class:`FittedScenario` of it:

- the GPU, from NVML's name (or ``--gpu``), and the tensor-parallel degree, from the serve command;
- the model, from the engine's model name (or ``--model``) against the known presets;
- the KV pool: block size and the share of the device vLLM gives it (``--gpu-memory-utilization``);
- the knobs the serve command shows (``--max-num-seqs``, ``--max-num-batched-tokens``,
  prefix caching, chunked prefill, KV offload), vLLM V1's defaults where it shows none;
- arrivals over time, one rate a minute: from request rows where the window has them, else from the
  engine's counters (requests finished plus the change of those running and waiting);
- prompt and output lengths: from request rows (a log-normal fit), else the means of the engine's
  prompt and generation token counters over five-minute spans, with the spread assumed (and said so);
- the prompt tokens the window's prefix cache served (its hits over its lookups, a share a minute):
  the twin does not prefill that share of a request's prompt when it is first admitted. A
  conversation's next turn repeats the turns before it; while the cache has room the window serves
  most of it from there, and at a full cache almost none.

What the simulator cannot describe it refuses, naming what is missing (:class:`NotDescribable`):
no GPU name, an unknown or mixture-of-experts model, no token counts, no engine series.

:func:`fidelity` sets the simulated run beside the observed window: KV usage, requests running and
waiting, preemptions, token throughput, GPU utilization and latency percentiles where observed.
The fitted scenario is written and read back as TOML (:func:`save`, :func:`load`).
"""

from __future__ import annotations

import copy
import math
import re
import shlex
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import tomllib

from gpudiag.analyzers.common import counter_increase, labelled_total
from gpudiag.catalog import M
from gpudiag.errors import GpudiagError
from gpudiag.frames import Window
from gpudiag.reference_engine.core.allocator import K_ROUND_LARGE
from gpudiag.reference_engine.core.kv_manager import KVConfig
from gpudiag.reference_engine.core.scheduler import SchedulerConfig
from gpudiag.reference_engine.core.sequence import Sequence
from gpudiag.reference_engine.scenarios import Fix, Scenario
from gpudiag.reference_engine.scenarios.workload import MAX_REQUESTS, LengthDist, Phase, RequestClass, Workload
from gpudiag.reference_engine.sim import gpu_specs
from gpudiag.reference_engine.sim.engine import EngineConfig
from gpudiag.reference_engine.sim.sim_gpu import MODELS, DeviceLayout
from gpudiag.units import fmt_bytes

# The CUDA context each GPU's process holds before it allocates, as the simulator charges it.
CUDA_CONTEXT_BYTES = DeviceLayout.cuda_context_bytes

GIB = 1024**3

# Arrival rate: one figure a minute. Lengths from counters: one mean per five minutes (a minute's
# finished requests are too few, at tens a minute, for their token mean to be more than noise).
ARRIVAL_BIN_S = 60.0
LENGTH_BIN_S = 300.0
# Counters give a mean per span and nothing of the spread: the log-normal's sigma is assumed, as wide
# as the chat mixes of the canned scenarios (0.5-0.6), and the fitted file says it was assumed.
ASSUMED_SIGMA = 0.5
# A window's KV cache is full when usage reaches this (vLLM reports 99.9-100 % when it preempts).
KV_FULL_RATIO = 0.98
# Activation workspace vLLM's memory profile keeps out of the KV pool, when the window does not show
# the pool's size: the peak of a forward of max-num-batched-tokens on a 70B-class model plus the CUDA
# graphs' pool, about 4 GiB on vLLM V1 (its "Available KV cache memory" log line, less weights).
ACTIVATION_BYTES_ESTIMATE = 4 * GIB


class NotDescribable(GpudiagError):
    """The window shows something the simulator cannot describe, or lacks what a fit needs."""


# Model names as engines report them (Hugging Face ids) -> the cost model's presets.
MODEL_ALIASES = {
    "meta-llama/llama-3.3-70b-instruct": "llama-3.3-70b",
    "nvidia/llama-3.3-70b-instruct-fp4": "llama-3.3-70b-fp4",
    "meta-llama/llama-2-7b-hf": "llama-7b",
    "meta-llama/llama-2-7b-chat-hf": "llama-7b",
    "mistralai/mistral-7b-instruct-v0.2": "mistral-7b",
    "mistralai/mistral-7b-v0.1": "mistral-7b",
}
# Families whose experts the roofline (every parameter read every step) does not describe.
MOE_PATTERNS = ("deepseek-r1", "deepseek-v2", "deepseek-v3", "mixtral", "qwen3-235b", "qwen3-30b-a3b",
                "qwen2-57b-a14b", "dbrx", "gpt-oss", "kimi-k2", "llama-4")


@dataclass
class Knobs:
    """The engine settings a fit uses, each with where it came from."""

    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    tensor_parallel_size: int
    block_size: int
    prefix_caching: bool
    chunked_prefill: bool
    kv_offload: bool
    # --kv-offloading-size (given in GiB, all TP ranks together); 0: not given. Set, kv_offload is on.
    kv_offload_bytes: int = 0
    # Tokens the KV pool holds, where something states it (the engine's cache_config_info gauge,
    # --kv-cache-tokens, --num-gpu-blocks-override, --kv-cache-memory-bytes); 0: sized from memory
    # as vLLM sizes it, with an estimated activation workspace.
    kv_cache_tokens: int = 0
    # --kv-cache-memory-bytes (per GPU, as vLLM's CacheConfig takes it); 0: not given.
    kv_cache_memory_bytes: int = 0
    # --num-gpu-blocks-override; 0: not given.
    num_gpu_blocks_override: int = 0
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def pool_option(self) -> str | None:
        """The serve option that sets the KV pool's size outright, where one does: vLLM then ignores
        gpu-memory-utilization for the pool (--num-gpu-blocks-override replaces the profiled block count;
        --kv-cache-memory-bytes replaces the profile)."""
        if self.kv_cache_memory_bytes:
            return "--kv-cache-memory-bytes"
        if self.num_gpu_blocks_override:
            return "--num-gpu-blocks-override"
        return None


def parse_serve_args(text: str | None, device_bytes: int) -> Knobs:
    """The knobs of a ``vllm serve ...`` command line; vLLM V1's defaults where it names none.

    Defaults (vllm/engine/arg_utils.py, V1, OpenAI API server): on a device of 70 GiB or more,
    max-num-seqs 1024 and max-num-batched-tokens 8192 (256 and 2048 below); block size 16;
    gpu-memory-utilization 0.9; prefix caching on; chunked prefill always on.
    """
    big = device_bytes >= 70 * GIB
    k = Knobs(1024 if big else 256, 8192 if big else 2048, 0.9, 1, 16, True, True, False)
    src = {f: "vLLM V1 default" for f in ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
                                          "tensor_parallel_size", "block_size", "prefix_caching",
                                          "chunked_prefill", "kv_offload")}
    if not text:
        k.sources = src
        return k
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise GpudiagError(f"--serve-args: not a command line ({exc})") from None
    opts: dict[str, str | None] = {}
    i = 0
    while i < len(words):
        w = words[i]
        if w.startswith("--"):
            name, eq, val = w[2:].partition("=")
            name = name.replace("_", "-")
            if not eq and i + 1 < len(words) and not words[i + 1].startswith("--"):
                val = words[i + 1]
                i += 1
            opts[name] = val if (eq or val) else None
        i += 1

    def num(name: str, cast):
        try:
            return cast(opts[name])
        except (TypeError, ValueError):
            raise GpudiagError(f"--serve-args: --{name} needs a number, got {opts[name]!r}") from None

    for name, attr, cast in (("max-num-seqs", "max_num_seqs", int),
                             ("max-num-batched-tokens", "max_num_batched_tokens", int),
                             ("gpu-memory-utilization", "gpu_memory_utilization", float),
                             ("tensor-parallel-size", "tensor_parallel_size", int),
                             ("block-size", "block_size", int)):
        if name in opts:
            setattr(k, attr, num(name, cast))
            src[attr] = "serve command"
    if "tp" in opts:
        k.tensor_parallel_size = num("tp", int)
        src["tensor_parallel_size"] = "serve command"
    for on, off, attr in (("enable-prefix-caching", "no-enable-prefix-caching", "prefix_caching"),
                          ("enable-chunked-prefill", "no-enable-chunked-prefill", "chunked_prefill")):
        if on in opts:
            setattr(k, attr, True)
            src[attr] = "serve command"
        if off in opts:
            setattr(k, attr, False)
            src[attr] = "serve command"
    if any(n in opts for n in ("kv-offloading-backend", "kv-offloading-size", "kv-transfer-config")):
        k.kv_offload = True
        src["kv_offload"] = "serve command"
    def positive(name: str, cast, unit: str):
        v = num(name, cast)
        if not v > 0:
            raise GpudiagError(f"--serve-args: --{name} must be positive {unit}, got {opts[name]}")
        return v

    if "kv-offloading-size" in opts:
        k.kv_offload_bytes = int(positive("kv-offloading-size", float, "GiB") * GIB)
        src["kv_offload_bytes"] = "serve command"
    if "num-gpu-blocks-override" in opts:
        k.num_gpu_blocks_override = positive("num-gpu-blocks-override", int, "blocks")
        k.kv_cache_tokens = k.num_gpu_blocks_override * k.block_size
        src["kv_cache_tokens"] = "serve command (--num-gpu-blocks-override x block size)"
    if "kv-cache-memory-bytes" in opts:
        k.kv_cache_memory_bytes = positive("kv-cache-memory-bytes", int, "bytes")
        src["kv_cache_memory_bytes"] = "serve command"
    if "pipeline-parallel-size" in opts and opts["pipeline-parallel-size"] not in ("1", None):
        raise NotDescribable("the serve command runs pipeline parallel; the simulator describes one engine "
                             "on one GPU or a tensor-parallel group")
    if not (k.max_num_seqs > 0 and k.max_num_batched_tokens > 0 and k.tensor_parallel_size > 0
            and k.block_size > 0 and 0 < k.gpu_memory_utilization <= 1):
        raise GpudiagError("--serve-args: max-num-seqs, max-num-batched-tokens, tensor-parallel-size and "
                           "block-size must be positive, gpu-memory-utilization in (0, 1]")
    k.sources = src
    return k


def resolve_gpu(name: str) -> str:
    """The preset key of a GPU named by NVML (``NVIDIA B200``) or by preset (``B200``)."""
    if name in gpu_specs.SPECS:
        return name
    for key, s in gpu_specs.SPECS.items():
        if s.name.lower() == name.strip().lower():
            return key
    raise NotDescribable(f"GPU {name!r} has no preset in the simulator (known: "
                         f"{', '.join(s.name for s in gpu_specs.SPECS.values())})")


def resolve_model(name: str) -> str:
    """The cost-model preset of a served model name (Hugging Face id or preset)."""
    if name in MODELS:
        return name
    low = name.strip().lower()
    if any(p in low for p in MOE_PATTERNS):
        raise NotDescribable(f"model {name!r} is a mixture of experts: the simulator's cost model reads every "
                             f"weight every step and cannot describe its expert routing")
    if low in MODEL_ALIASES:
        return MODEL_ALIASES[low]
    raise NotDescribable(f"model {name!r} is not one the simulator knows (known: "
                         f"{', '.join(list(MODEL_ALIASES) + list(MODELS))})")


# Dense FP4 tensor-core FLOP/s of the GPUs that have FP4 tensor cores: a model with FP4 weights runs its
# GEMMs there. B200: HGX B200 datasheet, FP4 tensor 144 PFLOPS for eight GPUs with sparsity, 9 dense each.
FP4_TENSOR_FLOPS = {"B200": 9.0e15}


def group_gpu(key: str, tp: int, model_key: str = "") -> str:
    """The device the roofline charges: a tensor-parallel group of ``tp`` GPUs as one device (memory,
    bandwidth, host links and FLOP/s add up; the all-reduce between them is not charged), its GEMMs at the FP4
    tensor-core rate for a model with FP4 weights. Registered as ``KEY[-fp4][xTP]``."""
    fp4 = model_key.endswith("-fp4")
    if fp4 and key not in FP4_TENSOR_FLOPS:
        raise NotDescribable(f"{model_key} has FP4 weights, and {gpu_specs.SPECS[key].name} has no FP4 tensor "
                             f"cores the simulator knows of")
    if tp == 1 and not fp4:
        return key
    name = key + ("-fp4" if fp4 else "") + (f"x{tp}" if tp > 1 else "")
    s = gpu_specs.SPECS[key]
    flops = FP4_TENSOR_FLOPS[key] if fp4 else s.peak_bf16_flops
    gpu_specs.SPECS.setdefault(name, replace(
        s, name=f"{tp}x {s.name} (TP{tp})" if tp > 1 else s.name, memory_bytes=s.memory_bytes * tp,
        hbm_bandwidth_bytes_per_s=s.hbm_bandwidth_bytes_per_s * tp, peak_bf16_flops=flops * tp,
        host_link_bytes_per_s=s.host_link_bytes_per_s * tp,
        power_limit_w=s.power_limit_w * tp, idle_power_w=s.idle_power_w * tp))
    return name


# ---- what the window shows -----------------------------------------------------------------------

@dataclass
class Observed:
    """One engine's series of the window, on the window's clock from 0."""

    t: np.ndarray
    kv: np.ndarray
    running: np.ndarray
    waiting: np.ndarray
    preemptions: np.ndarray
    prompt_tokens: np.ndarray
    generation_tokens: np.ndarray
    finished: np.ndarray
    prefix_hits: np.ndarray
    prefix_queries: np.ndarray
    # The KV connector's lookups and hits (vllm:external_prefix_cache_*); NaN where the window has none.
    external_hits: np.ndarray
    external_queries: np.ndarray
    gpu_util: np.ndarray | None
    requests: pd.DataFrame  # request rows (arrival_s from 0), empty without
    # Tokens the engine says its KV pool holds (vLLM's cache_config_info, SGLang's max_total_num_tokens,
    # the agent's engine rows): the last figure of the window; 0 where it says nothing.
    kv_capacity_tokens: float = 0.0


def _col(df: pd.DataFrame, name: str) -> np.ndarray:
    if name not in df:
        return np.full(len(df), np.nan)
    v = df[name]
    if v.dtype == object:
        return labelled_total(v.to_numpy())
    return v.to_numpy(float)


def observe(window: Window) -> Observed:
    """The engine series of ``window`` (NotDescribable without one engine's series)."""
    eng = window.table("engine")
    if eng.empty or M.num_requests_running not in eng:
        raise NotDescribable("the window holds no serving-engine series (vLLM /metrics or the agent's engine "
                             "rows): there is no workload to fit")
    keys = [c for c in ("node", "engine") if c in eng]
    if keys:
        ids = eng[keys].astype(str).drop_duplicates()
        if len(ids) > 1:
            names = ", ".join("/".join(r) for r in ids.itertuples(index=False))
            raise GpudiagError(f"the window holds {len(ids)} engines ({names}); name one node with --node")
    eng = eng.sort_values("t")
    t0 = window.start_s
    gpu = window.table("gpu")
    util = gpu[M.gpu_utilization_ratio].to_numpy(float) if M.gpu_utilization_ratio in gpu else None
    req = window.table("request")
    if not req.empty and "arrival_s" in req:
        req = req.copy()
        arr = req["arrival_s"].to_numpy(float)
        if np.nanmin(arr) >= t0 - 1:  # absolute arrival times: put them on the window's clock
            req["arrival_s"] = arr - t0
    else:
        req = pd.DataFrame()
    return Observed(
        t=eng["t"].to_numpy(float) - t0,
        kv=_col(eng, M.kv_cache_usage_perc), running=_col(eng, M.num_requests_running),
        waiting=_col(eng, M.num_requests_waiting), preemptions=_col(eng, M.num_preemptions_total),
        prompt_tokens=_col(eng, M.prompt_tokens_total), generation_tokens=_col(eng, M.generation_tokens_total),
        finished=_col(eng, M.request_success_total) if M.request_success_total in eng
        else _col(eng, M.engine_requests_finished_total),
        prefix_hits=_col(eng, M.prefix_cache_hits_total), prefix_queries=_col(eng, M.prefix_cache_queries_total),
        external_hits=_col(eng, M.external_prefix_cache_hits_total),
        external_queries=_col(eng, M.external_prefix_cache_queries_total),
        gpu_util=util, requests=req, kv_capacity_tokens=_last_stated(eng, M.engine_kv_capacity_tokens))


def _last_stated(df: pd.DataFrame, column: str) -> float:
    """The last positive figure of a column, 0 where there is none."""
    if column not in df:
        return 0.0
    v = pd.to_numeric(df[column], errors="coerce").to_numpy(float)
    v = v[np.isfinite(v) & (v > 0)]
    return float(v[-1]) if v.size else 0.0


def _window_gpu_name(window: Window) -> str | None:
    gpu = window.table("gpu")
    if "name" in gpu:
        names = {str(n) for n in gpu["name"].dropna() if str(n)}
        if len(names) > 1:
            raise GpudiagError(f"the window holds GPUs of several models ({', '.join(sorted(names))}); "
                               f"name one node with --node")
        if names:
            return names.pop()
    return None


def _window_model_name(window: Window) -> str | None:
    eng = window.table("engine")
    for col in ("model_name", "model"):
        if col in eng:
            names = {str(n) for n in eng[col].dropna() if str(n) and str(n) != "nan"}
            if names:
                return sorted(names)[0]
    return None


# ---- the fitted scenario ---------------------------------------------------------------------------

@dataclass
class Bin:
    """One minute of the window: arrivals per second and the mean lengths of its requests."""

    start_s: float
    end_s: float
    qps: float
    prompt_mean: float
    output_mean: float
    # Share of the prompt tokens the window's prefix cache served (not prefilled) in this minute.
    reused_share: float = 0.0
    # Share of the prompt tokens a KV connector (vLLM's CPU offload, a shared store) loaded back instead of
    # prefilling in this minute: KV an earlier request left in that tier, a conversation's last turn.
    loaded_share: float = 0.0


@dataclass
class Fitted:
    """Everything a fit found: what to simulate, and what was observed to compare with."""

    source: str
    gpu: str  # preset key (a TP group: KEYxTP)
    gpu_name: str  # as NVML (or the user) named it
    model: str  # cost-model preset
    model_name: str  # as the engine (or the user) named it
    knobs: Knobs
    duration_s: float
    initial_requests: int
    bins: list[Bin]
    sigma_prompt: float
    sigma_output: float
    lengths_from: str  # "request rows" | "token counters"
    arrivals_from: str
    max_model_len: int
    activation_bytes: int
    speed_factor: float  # the engine's GPU work takes this many times the roofline's figure
    observed: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    # Closed loop: this many clients, each sending its next request when its last one ends (0: open loop).
    clients: int = 0

    @property
    def name(self) -> str:
        return f"fitted:{self.source}"

    @property
    def pool_bytes(self) -> float:
        """Bytes of KV pool the twin holds (as the simulated device sizes it, before any fix)."""
        return _kv_pool_bytes(self.gpu, self.model, self.knobs, self.activation_bytes)

    @property
    def pool_tokens(self) -> float:
        """Tokens of KV the twin's pool holds."""
        return self.pool_bytes / MODELS[self.model].kv_bytes_per_token


def fit(window: Window, *, gpu: str | None = None, model: str | None = None, serve_args: str | None = None,
        source: str = "window", kv_cache_tokens: int | None = None) -> Fitted:
    """The scenario ``window`` shows (NotDescribable naming what is missing or not covered)."""
    obs = observe(window)
    gpu_name = _window_gpu_name(window) or gpu
    if gpu_name is None:
        raise NotDescribable("the window names no GPU (no NVML rows): give the GPU with --gpu (NVML's name, "
                             f"or one of {', '.join(gpu_specs.SPECS)})")
    gpu_key = resolve_gpu(gpu_name)
    model_name = _window_model_name(window) or model
    if model_name is None:
        raise NotDescribable("the window names no served model: give it with --model (the Hugging Face id the "
                             "engine serves)")
    model_key = resolve_model(model_name)
    knobs = parse_serve_args(serve_args, gpu_specs.SPECS[gpu_key].memory_bytes)
    notes = []
    if knobs.chunked_prefill:
        notes.append("chunked prefill is on: the simulator prefills whole prompts, up to "
                     "max-num-batched-tokens a step")
    if knobs.kv_offload_bytes:
        notes.append(f"KV offload is on: the twin keeps a host KV tier of {knobs.kv_offload_bytes / GIB:g} GiB and "
                     "loads a preempted request's blocks back over PCIe instead of recomputing them; the blocks of "
                     "finished requests take room there too, and no later request reads them (the twin's requests "
                     "repeat no content)")
    elif knobs.kv_offload:
        notes.append("KV offload is on in the window, with no --kv-offloading-size in the serve command: the twin "
                     "has no host tier and recomputes what offload would load back")
    group = group_gpu(gpu_key, knobs.tensor_parallel_size, model_key)
    activation, pool_note = _size_pool(knobs, obs, group, model_key, kv_cache_tokens)
    capacity = _kv_capacity_tokens(group, model_key, knobs, activation)
    duration = float(window.end_s - window.start_s)
    if not duration > 0 or obs.t.size < 2:
        raise NotDescribable("the window holds fewer than two engine samples: nothing to fit")

    if not obs.requests.empty and {"prompt_tokens", "output_tokens"} <= set(obs.requests):
        bins, sp, so = _from_requests(obs.requests, duration)
        lengths_from = arrivals_from = "request rows"
        initial = 0
    else:
        if np.all(np.isnan(obs.prompt_tokens)) or np.all(np.isnan(obs.generation_tokens)):
            raise NotDescribable("the window has neither request rows nor the engine's prompt and generation "
                                 "token counters: the request lengths cannot be fitted")
        if np.all(np.isnan(obs.finished)):
            raise NotDescribable("the window has no finished-requests counter (vllm:request_success): "
                                 "arrivals cannot be told from completions")
        bins, initial = _from_counters(obs, duration)
        sp = ASSUMED_SIGMA
        so, how = _output_spread(obs, bins, capacity)
        lengths_from = arrivals_from = "engine counters"
        notes.append(f"lengths from token counters: their means per {LENGTH_BIN_S:g} s; prompt spread assumed "
                     f"(log-normal sigma {ASSUMED_SIGMA}); output spread {how}")
    reuse_note = _fit_reuse(obs, bins)
    if reuse_note:
        notes.append(reuse_note)
    clients = _closed_loop_clients(obs)
    if clients:
        notes.append(f"closed loop: {clients} requests in the engine (running plus waiting) through the window, "
                     f"whatever the rate; the twin replays {clients} clients that each send their next request when "
                     f"the last one ends, the lengths drawn minute by minute as fitted")
    held = np.mean([b.prompt_mean + b.output_mean / 2 for b in bins])  # a preempted request's KV, on average
    if knobs.kv_offload_bytes:
        held = 0.0  # the twin's host tier loads a preempted request's KV back: no recompute to calibrate on
    speed, speed_note = _speed_factor(obs, duration, group, model_key, capacity, held)
    notes.append(speed_note)
    if not bins or sum(b.qps * (b.end_s - b.start_s) for b in bins) + initial < 1:
        raise NotDescribable("no request arrived or finished in the window: there is no workload to fit")
    return Fitted(
        source=source, gpu=group, gpu_name=gpu_name, model=model_key, model_name=model_name, knobs=knobs,
        duration_s=duration, initial_requests=initial, bins=bins, sigma_prompt=sp, sigma_output=so,
        lengths_from=lengths_from, arrivals_from=arrivals_from,
        max_model_len=_max_model_len(model_key), activation_bytes=activation, speed_factor=speed,
        clients=clients, observed=summarize_observed(obs, duration), notes=notes + [pool_note])


def _fit_reuse(obs: Observed, bins: list[Bin]) -> str | None:
    """Set each minute's shares of prompt tokens the window's caches served; a note, or None when the
    window shows no lookups.

    ``reused_share``: the GPU prefix cache's hits over its lookups in the minute (lookups also count
    re-admitted preempted requests' prompts). ``loaded_share``: a KV connector's hits over its lookups
    (vLLM's external prefix cache: CPU offload, a shared store; vLLM looks up there the prompt tokens
    the GPU cache did not hold, and counts each request's prompt once). The twin applies both to a
    request's first admission only: a preempted one is recomputed, or loaded from the twin's own host
    tier (``kv-offload``), which holds preempted requests' KV and nothing an earlier request left. The
    connector's loads cost the twin no step time: a connector that loads asynchronously lets the
    other requests step meanwhile, and a host-to-device copy is PCIe time, not GPU compute. It replays
    what the window's caches served, not what the twin's would: a fix that changes the caches' room
    changes how much is served in the real engine and not here.
    """
    served = []
    for attr, hits_s, queries_s, what in (
            ("reused_share", obs.prefix_hits, obs.prefix_queries, "from the GPU prefix cache"),
            ("loaded_share", obs.external_hits, obs.external_queries,
             "loaded back through the KV connector (CPU offload)")):
        if np.all(np.isnan(queries_s)) or np.all(np.isnan(hits_s)):
            continue
        for b in bins:
            q = _increase(obs.t, queries_s, b.start_s, b.end_s)
            hits = _increase(obs.t, hits_s, b.start_s, b.end_s)
            setattr(b, attr, min(1.0, max(0.0, hits / q)) if q > 0 else 0.0)
        served.append((what, [getattr(b, attr) for b in bins]))
    if not served:
        return None
    parts = [f"{min(x):.0%} to {max(x):.0%} {what}" for what, x in served if max(x) > 0]
    if not parts:
        return "prefix cache: no prompt token was served from it in the window; the twin prefills every prompt"
    return (f"prefix cache: of the prompt tokens looked up, minute by minute, {' and '.join(parts)}; the twin "
            f"does not prefill that share of a request's prompt at its first admission (it replays what the "
            f"window's caches served, not what its own would)")


# A window is a closed loop when the requests in the engine (running plus waiting) stay at one count:
# its 10th percentile within this share of its maximum, over at least this many requests. Clients that
# send their next request when the last ends (a load generator at a fixed concurrency) hold the count
# there while the arrival rate follows the engine's speed; an open stream's count rises and falls.
CLOSED_LOOP_SHARE = 0.95
CLOSED_LOOP_MIN_CLIENTS = 4


def _closed_loop_clients(obs: Observed) -> int:
    """The number of clients of a closed-loop window, 0 for an open one."""
    ins = (np.nan_to_num(obs.running) + np.nan_to_num(obs.waiting))
    if ins.size < 10:
        return 0
    top = float(np.max(ins))
    if top < CLOSED_LOOP_MIN_CLIENTS or np.percentile(ins, 10) < CLOSED_LOOP_SHARE * top:
        return 0
    return int(round(top))


def _room_bytes(group: str, model_key: str, knobs: Knobs) -> float:
    """What gpu-memory-utilization leaves for activations and KV beside the weights (the simulator, as
    vLLM, sizes the pool within that share; the CUDA contexts are charged outside it)."""
    return gpu_specs.SPECS[group].memory_bytes * knobs.gpu_memory_utilization - MODELS[model_key].weight_bytes


def _kv_pool_bytes(group: str, model_key: str, knobs: Knobs, activation_bytes: int) -> float:
    """Bytes of KV pool, as :func:`engine`'s layout sizes it on the simulated device."""
    return max(0.0, _room_bytes(group, model_key, knobs) - activation_bytes)


def _kv_capacity_tokens(group: str, model_key: str, knobs: Knobs, activation_bytes: int) -> float:
    """Tokens of KV the pool holds, as :func:`engine`'s layout sizes it on the simulated device."""
    return _kv_pool_bytes(group, model_key, knobs, activation_bytes) / MODELS[model_key].kv_bytes_per_token


def _size_pool(knobs: Knobs, obs: Observed, group: str, model_key: str,
               kv_cache_tokens: int | None) -> tuple[int, str]:
    """The activation workspace that gives the twin the window's KV pool, and a note saying from what.

    The pool is the tokens someone states (``--kv-cache-tokens``, the engine's own gauge, the serve
    command's --num-gpu-blocks-override or --kv-cache-memory-bytes, in that order), else vLLM's sizing
    with an estimated workspace. A stated pool larger than gpu-memory-utilization leaves beside the
    weights raises the share to hold it (vLLM ignores the share under --kv-cache-memory-bytes); one
    that the device cannot hold is refused. Sets ``knobs.kv_cache_tokens`` and its source.
    """
    shape = MODELS[model_key]
    dev = gpu_specs.SPECS[group].memory_bytes
    if kv_cache_tokens is not None:
        knobs.kv_cache_tokens, knobs.sources["kv_cache_tokens"] = int(kv_cache_tokens), "--kv-cache-tokens"
    elif obs.kv_capacity_tokens > 0:
        knobs.kv_cache_tokens = int(round(obs.kv_capacity_tokens))
        knobs.sources["kv_cache_tokens"] = ("the engine's own gauge (vLLM's cache_config_info, SGLang's "
                                            "max_total_num_tokens)")
    elif knobs.kv_cache_memory_bytes and not knobs.kv_cache_tokens:
        knobs.kv_cache_tokens = int(knobs.kv_cache_memory_bytes * knobs.tensor_parallel_size
                                    // shape.kv_bytes_per_token)
        knobs.sources["kv_cache_tokens"] = "serve command (--kv-cache-memory-bytes per GPU)"
    if not knobs.kv_cache_tokens:
        return ACTIVATION_BYTES_ESTIMATE, (
            f"KV pool sized as vLLM sizes it: {knobs.gpu_memory_utilization:g} of the device less "
            f"{shape.weight_bytes / GIB:.1f} GiB of weights and an estimated {ACTIVATION_BYTES_ESTIMATE / GIB:.0f} "
            f"GiB of activations (--kv-cache-tokens gives the pool vLLM logged: \"GPU KV cache size: N tokens\")")
    pool = knobs.kv_cache_tokens * shape.kv_bytes_per_token
    src = knobs.sources["kv_cache_tokens"]
    stated = (f"KV pool of {knobs.kv_cache_tokens:,} tokens ({fmt_bytes(pool)}) from {src}")
    # The caching allocator rounds the weights' and the workspace's segments up to K_ROUND_LARGE: the
    # workspace leaves that much slack twice, so the twin's pool is the stated one or a block more.
    activation = (_room_bytes(group, model_key, knobs) - pool) // K_ROUND_LARGE * K_ROUND_LARGE - 2 * K_ROUND_LARGE
    context = CUDA_CONTEXT_BYTES * knobs.tensor_parallel_size
    if activation >= 0 and shape.weight_bytes + activation + pool + context <= dev:
        return int(activation), f"{stated}; the rest of the device's {knobs.gpu_memory_utilization:g} share " \
                                f"beside {shape.weight_bytes / GIB:.1f} GiB of weights is workspace " \
                                f"({fmt_bytes(activation)})"
    share = (shape.weight_bytes + pool) / dev
    if shape.weight_bytes + pool + context > dev:
        raise NotDescribable(f"a KV pool of {knobs.kv_cache_tokens:,} tokens ({fmt_bytes(pool)}, from {src}) and "
                             f"{shape.weight_bytes / GIB:.1f} GiB of weights do not fit {fmt_bytes(dev)} of "
                             f"{group}: check --gpu, --model and the pool's figure")
    was = knobs.gpu_memory_utilization
    knobs.gpu_memory_utilization = round(math.ceil(share * 1e4) / 1e4, 4)
    knobs.sources["gpu_memory_utilization"] = f"raised from {was:g} to hold the stated KV pool"
    return 0, f"{stated}; it needs {knobs.gpu_memory_utilization:g} of the device beside the weights " \
              f"(gpu-memory-utilization {was:g} leaves less), so the twin takes that share"


# Output spread from KV occupancy: samples where the cache holds a fifth or more of its capacity, once
# the requests in the engine have turned over (as many have finished as are running: before that the
# running ones are young, their outputs short, and they say nothing of the spread); and the largest
# spread accepted (a heavier tail than this is a few huge outputs the mean does not describe).
# Full-cache samples count too: the relation is an identity of what the running requests hold, at a
# full cache as below it, and in a window that is mostly full the samples below it are a biased pick
# (the moments just after long requests finished, when the KV per running request is lowest).
OCCUPANCY_KV_MIN = 0.2
MAX_OUTPUT_SIGMA = 1.5


def _output_spread(obs: Observed, bins: list[Bin], capacity_tokens: float) -> tuple[float, str]:
    """The log-normal sigma of output lengths that makes the running requests hold the KV the window shows.

    A running request holds its prompt and the output so far; a long output holds its KV longer, so the
    KV per running request, weighted by time, is p + E[o^2] / (2 E[o]) = p + o * exp(sigma^2) / 2 for
    mean prompt p and log-normal outputs of mean o. Observed: usage * capacity / running.
    """
    done = np.nan_to_num(obs.finished - np.nanmin(obs.finished))
    turned = np.nonzero(done >= np.nan_to_num(obs.running))[0]
    after = obs.t >= (obs.t[turned[np.argmax(obs.t[turned] > 0)]] if turned.size else np.inf)
    sel = (obs.kv >= OCCUPANCY_KV_MIN) & (obs.running >= 1) & after
    full = f", {int((sel & (obs.kv >= KV_FULL_RATIO)).sum())} at a full cache"
    if not sel.any() or capacity_tokens <= 0:
        return ASSUMED_SIGMA, (f"assumed (log-normal sigma {ASSUMED_SIGMA}: after the requests turned over, the "
                               f"KV cache never held {OCCUPANCY_KV_MIN:.0%} of its capacity)")
    mids = np.array([(b.start_s + b.end_s) / 2 for b in bins])
    p = np.interp(obs.t[sel], mids, [b.prompt_mean for b in bins])
    o = np.interp(obs.t[sel], mids, [b.output_mean for b in bins])
    per_running = obs.kv[sel] * capacity_tokens / obs.running[sel]
    g = float(np.median(2.0 * (per_running - p) / o))
    sigma = math.sqrt(math.log(g)) if g > 1.0 else 0.0
    sigma = min(sigma, MAX_OUTPUT_SIGMA)
    return sigma, (f"log-normal sigma {sigma:.2f}, fitted so the running requests hold the KV the window shows "
                   f"({int(sel.sum())} samples{full})")


# Calibration of the engine's speed: one-minute spans in which requests ran throughout (the engine loop
# then steps back to back), at least this many of them.
SPEED_SPAN_S = 60.0
MIN_SPEED_SPANS = 3


def _speed_factor(obs: Observed, duration: float, group: str, model_key: str,
                  capacity_tokens: float, recompute_tokens: float) -> tuple[float, str]:
    """How many times the roofline's GPU time the window's engine took for the work it did.

    While requests run, a vLLM engine steps back to back; each step decodes one token of every running
    request and prefills some prompt tokens. A minute with generation rate G, prompt rate P, R running
    and KV usage U did G/R decode steps over U * capacity tokens of context and P prompt tokens: the
    roofline (CostModel, the twin's own) charges those a GPU time g and host time h; the engine took
    the whole minute, so the factor is (1 - h) / g (median over the minutes). 1 without such minutes.

    The prompt work is the prompt tokens less those the window's prefix cache served or its KV
    connector loaded (the twin skips the same shares, :func:`_fit_reuse`), plus a recompute of
    ``recompute_tokens`` per preemption (vLLM V1's prompt counter leaves recompute out). The factor
    then makes the twin spend the window's time on the window's load.
    """
    from gpudiag.reference_engine.sim.sim_gpu import CostModel

    cost, spec, model = CostModel(), gpu_specs.SPECS[group], MODELS[model_key]
    factors = []
    for a in np.arange(0.0, duration - SPEED_SPAN_S + 1e-9, SPEED_SPAN_S):
        b = a + SPEED_SPAN_S
        sel = (obs.t >= a) & (obs.t <= b)
        if sel.sum() < 2 or np.nanmin(obs.running[sel]) < 1:
            continue
        g_rate = _increase(obs.t, obs.generation_tokens, a, b) / SPEED_SPAN_S
        # NaN samples are skipped; none at all: 0
        served = _increase(obs.t, obs.prefix_hits, a, b) + _increase(obs.t, obs.external_hits, a, b)
        p_rate = (max(0.0, _increase(obs.t, obs.prompt_tokens, a, b) - served)
                  + _increase(obs.t, obs.preemptions, a, b) * recompute_tokens) / SPEED_SPAN_S
        r = float(np.nanmean(obs.running[sel]))
        u = float(np.nanmean(obs.kv[sel]))
        if g_rate <= 0 or r < 1:
            continue
        steps = g_rate / r
        gpu = steps * cost.decode_gpu_s(spec, model, max(1, round(r)), int(u * capacity_tokens))
        gpu += cost.prefill_gpu_s(spec, model, [int(p_rate)]) if p_rate >= 1 else 0.0
        host = steps * cost.host_step_cost_s(max(1, round(r)))
        if gpu > 0 and host < 1:
            factors.append((1.0 - host) / gpu)
    if len(factors) < MIN_SPEED_SPANS:
        return 1.0, (f"engine speed: the roofline's as it is (fewer than {MIN_SPEED_SPANS} minutes with "
                     f"requests running throughout to calibrate it on)")
    k = float(np.median(factors))
    return k, (f"engine speed calibrated on {len(factors)} busy minutes: the window's engine took {k:.2f}x the "
               f"roofline's GPU time for its steps (spread {np.percentile(factors, 10):.2f}-"
               f"{np.percentile(factors, 90):.2f}x)")


def _max_model_len(model_key: str) -> int:
    from gpudiag.reference_engine.model.model_config import PRESETS

    base = re.sub(r"-(fp4|kv8|w8)$", "", model_key)
    return PRESETS[base].max_position if base in PRESETS else 8192


def _lognormal(x: np.ndarray) -> tuple[float, float]:
    x = x[np.isfinite(x) & (x > 0)]
    if x.size == 0:
        return 1.0, 0.0
    lx = np.log(x)
    return float(np.exp(lx.mean())), float(lx.std()) if x.size > 1 else 0.0


def _from_requests(req: pd.DataFrame, duration: float) -> tuple[list[Bin], float, float]:
    arr = req["arrival_s"].to_numpy(float)
    prompt, output = req["prompt_tokens"].to_numpy(float), req["output_tokens"].to_numpy(float)
    _, sp = _lognormal(prompt)
    _, so = _lognormal(output)
    bins = []
    for a in np.arange(0.0, duration, ARRIVAL_BIN_S):
        b = min(a + ARRIVAL_BIN_S, duration)
        sel = (arr >= a) & (arr < b)
        lo, hi = max(0.0, a - LENGTH_BIN_S / 2), min(duration, b + LENGTH_BIN_S / 2)
        around = (arr >= lo) & (arr < hi)
        pm = float(np.mean(prompt[around])) if around.any() else float(np.nanmean(prompt))
        om = float(np.mean(output[around])) if around.any() else float(np.nanmean(output))
        bins.append(Bin(float(a), float(b), float(sel.sum()) / (b - a), pm, om))
    return bins, sp, so


def _at(t: np.ndarray, v: np.ndarray, when: float) -> float:
    """The last sample of counter ``v`` at or before ``when`` (the first one before any)."""
    ok = ~np.isnan(v)
    tt, vv = t[ok], v[ok]
    if tt.size == 0:
        return float("nan")
    i = int(np.searchsorted(tt, when, side="right")) - 1
    return float(vv[max(i, 0)])


def _increase(t: np.ndarray, v: np.ndarray, a: float, b: float) -> float:
    sel = (t >= a) & (t <= b)
    prev = t < a
    vals = v[sel]
    if prev.any():
        vals = np.concatenate([v[prev][-1:], vals])
    return counter_increase(vals)


def _from_counters(obs: Observed, duration: float) -> tuple[list[Bin], int]:
    t = obs.t
    in_system = np.nan_to_num(obs.running) + np.nan_to_num(obs.waiting)
    initial = int(round(in_system[0]))
    edges = np.arange(0.0, duration, ARRIVAL_BIN_S)
    arrivals = []
    for a in edges:
        b = min(a + ARRIVAL_BIN_S, duration)
        done = _increase(t, obs.finished, a, b)
        change = _at(t, in_system, b) - _at(t, in_system, a)
        arrivals.append(max(0.0, done + change))
    # Clipping a negative minute adds requests; scale back to what the counters total.
    total = max(0.0, _increase(t, obs.finished, 0, duration) + in_system[-1] - in_system[0])
    s = sum(arrivals)
    if s > 0 and total > 0:
        arrivals = [x * total / s for x in arrivals]
    # Mean lengths per LENGTH_BIN_S: prompt tokens over requests that started (arrived), output tokens
    # over requests that finished; the whole window's mean where a span has too few.
    whole_p = _increase(t, obs.prompt_tokens, 0, duration) / max(1.0, total + initial)
    whole_o = _increase(t, obs.generation_tokens, 0, duration) / max(1.0, _increase(t, obs.finished, 0, duration))
    bins = []
    for a, n in zip(edges, arrivals):
        b = min(a + ARRIVAL_BIN_S, duration)
        lo = max(0.0, (a + b) / 2 - LENGTH_BIN_S / 2)
        hi = min(duration, lo + LENGTH_BIN_S)
        started = sum(x for e, x in zip(edges, arrivals) if lo <= e < hi)
        fin = _increase(t, obs.finished, lo, hi)
        pm = _increase(t, obs.prompt_tokens, lo, hi) / started if started >= 10 else whole_p
        om = _increase(t, obs.generation_tokens, lo, hi) / fin if fin >= 10 else whole_o
        bins.append(Bin(float(a), float(b), n / (b - a), max(1.0, pm), max(1.0, om)))
    return bins, initial


# ---- the scenario to run ---------------------------------------------------------------------------

class FittedWorkload(Workload):
    """The fitted arrivals: a Poisson process at each minute's rate, log-normal lengths of its means.

    Drawn a minute at a time, all of a minute's requests at once (a Poisson count, uniform times, the
    lengths as arrays): the same process as :class:`Workload`'s phases, without a draw per request.
    """

    def __init__(self, f: Fitted, replicas: int = 1):
        super().__init__(qps=max([b.qps for b in f.bins] + [1e-6]) / replicas, duration_s=f.duration_s,
                         phases=[Phase("window", 0.0, f.duration_s, (RequestClass("fitted", 1.0, LengthDist(1),
                                                                                   LengthDist(1)),))])
        self.fitted = f
        self.replicas = replicas
        # The engine releases a closed loop's requests one per finished request (SimEngine).
        self.clients = int(math.ceil(f.clients / replicas)) if f.clients else 0

    def validate(self) -> None:
        super().validate()
        asked = sum(b.qps * (b.end_s - b.start_s) for b in self.fitted.bins) / self.replicas
        if asked > MAX_REQUESTS:
            raise GpudiagError(f"the fitted window asks for {asked:.3g} requests; at most {MAX_REQUESTS:,} are "
                               f"simulated: fit a shorter window")

    def generate(self, seed: int) -> list[Sequence]:
        self.validate()
        f, rng = self.fitted, np.random.default_rng(seed)
        cap = f.max_model_len
        spans = [(0.0, min(1.0, f.duration_s), f.initial_requests, f.bins[0])] if f.initial_requests else []
        spans += [(b.start_s, b.end_s, None, b) for b in f.bins]
        seqs: list[Sequence] = []
        for lo, hi, count, b in spans:
            n = int(round(count / self.replicas)) if count is not None else \
                int(rng.poisson(b.qps * (hi - lo) / self.replicas))
            if n <= 0:
                continue
            at = np.sort(rng.uniform(lo, hi, n))
            prompt = _draw(rng, b.prompt_mean, f.sigma_prompt, n, cap)
            output = _draw(rng, b.output_mean, f.sigma_output, n, cap)
            seqs.extend(_request(float(t), int(p), int(o), b) for t, p, o in zip(at, prompt, output))
        seqs.sort(key=lambda s: s.arrival_s)
        if self.clients:
            seqs = self._closed(rng, seqs, cap)
        for i, s in enumerate(seqs):
            s.seq_id = i
        return seqs

    def _closed(self, rng, seqs: list[Sequence], cap: int) -> list[Sequence]:
        """The closed loop's requests: the clients' first ones at the start, the rest in the fitted order
        (their lengths those of the minute the window saw them in), with room for a twin that runs faster
        than the window (the last minute's lengths). The engine sets the arrival of each after the first
        ``clients`` when a request ends."""
        f, n = self.fitted, self.clients
        extra = max(n, len(seqs) // 2)
        b = f.bins[-1]
        seqs += [_request(math.inf, int(p), int(o), b) for p, o in
                 zip(_draw(rng, b.prompt_mean, f.sigma_prompt, extra, cap),
                     _draw(rng, b.output_mean, f.sigma_output, extra, cap))]
        for i, s in enumerate(seqs):
            s.arrival_s = float(rng.uniform(0.0, min(1.0, f.duration_s))) if i < n else math.inf
        head = sorted(seqs[:n], key=lambda s: s.arrival_s)
        return head + seqs[n:]


def _request(arrival_s: float, prompt: int, output: int, b: Bin) -> Sequence:
    """A request of minute ``b``: its lengths, and the share of its prompt the window's cache served."""
    seq = Sequence(0, arrival_s, prompt, output, 1, "fitted")
    seq.reused_tokens = int(min(1.0, b.reused_share + b.loaded_share) * prompt)
    return seq


def _draw(rng, mean: float, sigma: float, n: int, cap: int) -> np.ndarray:
    """``n`` log-normal token counts of mean ``mean`` (median mean / exp(sigma^2 / 2)), in [1, cap]."""
    median = max(1.0, mean / math.exp(sigma * sigma / 2))
    v = rng.lognormal(math.log(median), sigma, n) if sigma > 0 else np.full(n, median)
    return np.clip(np.round(v), 1, cap).astype(np.int64)


def workload(f: Fitted, replicas: int = 1) -> Workload:
    """The fitted arrivals and lengths; with ``replicas``, what one of that many replicas receives."""
    return FittedWorkload(f, replicas)


def engine(f: Fitted) -> EngineConfig:
    from gpudiag.reference_engine.sim.sim_gpu import CostModel

    k = f.knobs
    base = CostModel()
    return EngineConfig(
        cost=CostModel(bandwidth_efficiency=base.bandwidth_efficiency / f.speed_factor,
                       flops_efficiency=base.flops_efficiency / f.speed_factor),
        gpu=f.gpu, model=f.model,
        # The twin's requests repeat no content (a fit sees how many tokens the cache served, not which):
        # a prefix cache would hold only preempted requests' own blocks. Left off, the twin recomputes
        # them, as the windows of vLLM at a full cache show (their hit ratio falls to about 1 %); what the
        # window's cache served at first admission is replayed per request (``reused_tokens``).
        kv=KVConfig(strategy="paged", block_size=k.block_size, prefix_caching=False, max_model_len=f.max_model_len,
                    offload_bytes=k.kv_offload_bytes),
        # vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py, FCFS): a step schedules every running
        # request first, then waiting ones; when a running request cannot get a block it preempts the
        # last to join the batch (``self.running.pop()``); a step that preempted admits no waiting
        # request (``if not preempted_reqs``); the waiting queue stops at the first request it cannot
        # allocate (``if new_blocks is None: break``), nothing behind it is tried.
        scheduler=SchedulerConfig(max_num_seqs=k.max_num_seqs, max_num_batched_tokens=k.max_num_batched_tokens,
                                  policy="newest", admit_while_preempting=False, running_first=True,
                                  admission_lookahead=0),
        layout=DeviceLayout(memory_fraction=1.0, activation_bytes=f.activation_bytes,
                            cuda_context_bytes=CUDA_CONTEXT_BYTES * k.tensor_parallel_size,
                            gpu_memory_utilization=k.gpu_memory_utilization))


# Candidate fixes for a paged engine at capacity: NAME or NAME=VALUE.
FIXES = {
    "max-num-seqs": "cap the running batch at N sequences (fewer share the KV pool, fewer are preempted)",
    "max-num-batched-tokens": "cap the tokens of one step at N",
    "gpu-memory-utilization": "give the KV pool this share of the device (0..1)",
    "replicas": "serve the same traffic from N replicas (each gets 1/N of the arrivals)",
    "prefix-caching": "reuse the KV of repeated prompt prefixes",
    "kv-offload": "keep N GiB of KV in host memory and load preempted requests' KV back instead of recomputing",
}


@dataclass
class FittedScenario(Scenario):
    """A :class:`Scenario` from a fit; its fixes take parameters (``max-num-seqs=128``, ``replicas=2``)."""

    fitted: Fitted | None = None

    def build(self, fix: str | None = None) -> tuple[EngineConfig, Workload]:
        cfg = engine(self.fitted)
        replicas = 1
        if fix is not None:
            name, value = parse_fix(fix, self.fitted)
            if name == "replicas":
                replicas = int(value)
            else:
                cfg = copy.deepcopy(cfg)
                if name == "max-num-seqs":
                    cfg.scheduler.max_num_seqs = int(value)
                elif name == "max-num-batched-tokens":
                    cfg.scheduler.max_num_batched_tokens = int(value)
                elif name == "gpu-memory-utilization":
                    cfg.layout.gpu_memory_utilization = float(value)
                elif name == "kv-offload":
                    cfg.kv.offload_bytes = int(value * GIB)
        return cfg, workload(self.fitted, replicas)


# Fixes proposed from the fitted run's own findings (``--fix auto``, the default on a fitted window).
# A share of the device vLLM may give the pool beyond the window's, and the most it is raised to: 0.95
# leaves room for the CUDA context and the sampler's buffers, which vLLM's profile does not count.
GMU_STEP = 0.05
GMU_MAX = 0.95
STORM_KINDS = ("kv_eviction_storm",)
QUEUE_KINDS = ("queue_avalanche",)


@dataclass
class Candidate:
    """A fix the twin's findings propose, with the parameter and why."""

    fix: str
    reason: str


def candidate_fixes(f: Fitted, res) -> list[Candidate]:
    """The fixes the unfixed twin's findings propose, each with a parameter (gpudiag.repro.RunResult).

    For a paged engine at capacity that preempts (a KV-eviction-storm finding, or the twin's own
    regime): ``max-num-seqs=N``, N the number of requests the twin ran while its KV cache was full
    (the batch the pool holds; a cap there admits no request the pool must then preempt);
    ``replicas=2``; ``kv-offload=GiB`` (the device pool's size) where offload is off; a larger
    ``gpu-memory-utilization`` where the window's leaves room and no serve option sets the pool's size
    outright. A queue avalanche proposes ``replicas=2``. A calm twin proposes none.
    """
    kinds = {fd.kind for fd in res.findings}
    sim = summarize_run(res)
    storm = bool(kinds & set(STORM_KINDS)) or regime(sim, f.duration_s) == "preempting"
    out: list[Candidate] = []
    if storm:
        eng = res.window.table("engine")
        kv, running = _col(eng, M.kv_cache_usage_perc), _col(eng, M.num_requests_running)
        full = (kv >= KV_FULL_RATIO) & ~np.isnan(running)
        why = ("the KV-eviction-storm finding" if kinds & set(STORM_KINDS)
               else "the twin's preemptions at a full KV cache")
        if full.any():
            n = int(np.floor(np.median(running[full])))
            if 1 <= n < f.knobs.max_num_seqs:
                out.append(Candidate(f"max-num-seqs={n}", f"{why}: the twin ran {n} requests (median) while its KV "
                                     f"cache was full; a batch capped there fits the pool"))
        out.append(Candidate("replicas=2", f"{why}: half the traffic per replica halves the KV each pool holds"))
        if not f.knobs.kv_offload:
            gib = max(1, math.ceil(f.pool_bytes / GIB))
            out.append(Candidate(f"kv-offload={gib}", f"{why}: a preempted request's KV loaded back from host "
                                 f"memory instead of recomputed; {gib} GiB (the device pool's size) holds every "
                                 f"request the pool can preempt, and is host memory the node must have free"))
        gmu = f.knobs.gpu_memory_utilization
        if f.knobs.pool_option is None and gmu + 1e-9 < GMU_MAX:
            new = round(min(GMU_MAX, gmu + GMU_STEP), 2)
            out.append(Candidate(f"gpu-memory-utilization={new:g}", f"{why}: a larger share of the device for the "
                                 f"KV pool (from {gmu:g})"))
    if kinds & set(QUEUE_KINDS) and not any(c.fix == "replicas=2" for c in out):
        out.append(Candidate("replicas=2", "the queue-avalanche finding: the engine cannot keep up with arrivals"))
    return out


def parse_fix(text: str, f: Fitted) -> tuple[str, float]:
    """(name, value) of a fix given as NAME or NAME=VALUE (GpudiagError for one the twin cannot judge)."""
    name, _, value = text.strip().partition("=")
    if name not in FIXES:
        raise GpudiagError(f"unknown fix {name!r} for a fitted window; valid: "
                           f"{', '.join(k + ('' if k == 'prefix-caching' else '=N') for k in FIXES)}")
    if name == "kv-offload":
        if f.knobs.kv_offload:
            raise GpudiagError("kv-offload is already on in the window's engine")
        if not value:
            raise GpudiagError("fix kv-offload needs the host memory to give it: kv-offload=GiB (vLLM's "
                               "--kv-offloading-size)")
    if name == "prefix-caching":
        if f.knobs.prefix_caching:
            raise GpudiagError("prefix-caching is already on in the window's engine")
        raise NotDescribable("prefix-caching: the window does not show how much of the prompts repeat, so the "
                             "twin cannot judge what caching them would save")
    try:
        v = float(value)
    except ValueError:
        raise GpudiagError(f"fix {name} needs a value: {name}=N") from None
    if name == "gpu-memory-utilization":
        if not 0 < v <= 1:
            raise GpudiagError("gpu-memory-utilization must be in (0, 1]")
        if f.knobs.pool_option is not None:
            raise GpudiagError(f"the window's engine sizes its KV pool with {f.knobs.pool_option}, which vLLM "
                               f"takes instead of gpu-memory-utilization: that fix would not change the pool")
    elif name == "kv-offload":
        if not (v > 0 and math.isfinite(v)):
            raise GpudiagError(f"fix kv-offload needs a positive number of GiB, got {value}")
    elif not (v >= 1 and v == int(v)):
        raise GpudiagError(f"fix {name} needs a positive whole number, got {value}")
    return name, v


def scenario(f: Fitted) -> FittedScenario:
    fixes = {k: Fix(k, v, lambda cfg: None) for k, v in FIXES.items()}
    return FittedScenario(f.name, f"{f.model_name} on {f.gpu_name} x{f.knobs.tensor_parallel_size}, fitted from "
                          f"{f.source}", lambda: engine(f), lambda: workload(f),
                          [("window", 0.0, f.duration_s)], fixes, (), fitted=f)


# ---- fidelity --------------------------------------------------------------------------------------

def _stats(t, kv, running, waiting, preemptions, generation, prompt, finished, duration) -> dict[str, Any]:
    def agg(v, fn):
        v = v[~np.isnan(v)]
        return float(fn(v)) if v.size else None

    kvv = kv[~np.isnan(kv)]
    return {
        "kv_mean": agg(kv, np.mean), "kv_p95": agg(kv, lambda v: np.percentile(v, 95)), "kv_max": agg(kv, np.max),
        "kv_full_share": float(np.mean(kvv >= KV_FULL_RATIO)) if kvv.size else None,
        "running_mean": agg(running, np.mean), "running_max": agg(running, np.max),
        "waiting_mean": agg(waiting, np.mean), "waiting_max": agg(waiting, np.max),
        "preemptions": int(counter_increase(preemptions)),
        "generation_tokens_per_s": counter_increase(generation) / duration,
        "prompt_tokens_per_s": counter_increase(prompt) / duration,
        "finished": int(counter_increase(finished)),
    }


def _latency(req: pd.DataFrame) -> dict[str, float | None]:
    out = {}
    for key, col in (("ttft", M.time_to_first_token_seconds), ("tpot", M.inter_token_latency_seconds)):
        for q in (50, 99):
            v = req[col].to_numpy(float) if (not req.empty and col in req) else np.array([])
            v = v[np.isfinite(v)]
            out[f"{key}_p{q}_s"] = float(np.percentile(v, q)) if v.size else None
    return out


def summarize_observed(obs: Observed, duration: float) -> dict[str, Any]:
    d = _stats(obs.t, obs.kv, obs.running, obs.waiting, obs.preemptions, obs.generation_tokens,
               obs.prompt_tokens, obs.finished, duration)
    u = obs.gpu_util[~np.isnan(obs.gpu_util)] if obs.gpu_util is not None else np.array([])
    d["gpu_util_mean"] = float(u.mean()) if u.size else None
    d.update(_latency(obs.requests))
    q = counter_increase(obs.prefix_queries)
    d["prefix_hit_ratio"] = counter_increase(obs.prefix_hits) / q if q > 0 else None
    return d


def summarize_run(res) -> dict[str, Any]:
    """The same figures for a simulated run (gpudiag.repro.RunResult)."""
    w = res.window
    eng, gpu, req = w.table("engine"), w.table("gpu"), w.table("request")
    duration = w.end_s - w.start_s
    d = _stats(eng["t"].to_numpy(float), _col(eng, M.kv_cache_usage_perc), _col(eng, M.num_requests_running),
               _col(eng, M.num_requests_waiting), _col(eng, M.num_preemptions_total),
               _col(eng, M.generation_tokens_total), _col(eng, M.prompt_tokens_total),
               _col(eng, M.engine_requests_finished_total), duration)
    u = gpu[M.gpu_utilization_ratio].to_numpy(float) if M.gpu_utilization_ratio in gpu else np.array([])
    d["gpu_util_mean"] = float(u.mean()) if u.size else None
    d.update(_latency(req))
    q = counter_increase(_col(eng, M.prefix_cache_queries_total))
    d["prefix_hit_ratio"] = counter_increase(_col(eng, M.prefix_cache_hits_total)) / q if q > 0 else None
    d["unfinished"] = res.engine.unfinished()
    return d


def regime(d: dict[str, Any], duration_s: float) -> str:
    """``preempting`` (KV full and requests preempted), ``kv-full`` (full, none preempted) or ``calm``."""
    full = (d.get("kv_max") or 0.0) >= KV_FULL_RATIO
    if full and d["preemptions"] > 0:
        return "preempting"
    return "kv-full" if full else "calm"


FIDELITY_ROWS = (
    ("KV usage mean", "kv_mean", "ratio"), ("KV usage max", "kv_max", "ratio"),
    ("time at a full KV cache", "kv_full_share", "ratio"),
    ("running mean", "running_mean", "count"), ("running max", "running_max", "count"),
    ("waiting mean", "waiting_mean", "count"), ("waiting max", "waiting_max", "count"),
    ("preemptions", "preemptions", "count"), ("requests finished", "finished", "count"),
    ("generation tokens/s", "generation_tokens_per_s", "count"), ("prompt tokens/s", "prompt_tokens_per_s", "count"),
    ("prefix-cache hit ratio", "prefix_hit_ratio", "ratio"), ("GPU utilization mean", "gpu_util_mean", "ratio"),
    ("TTFT P50", "ttft_p50_s", "seconds"), ("TTFT P99", "ttft_p99_s", "seconds"),
    ("TPOT P50", "tpot_p50_s", "seconds"), ("TPOT P99", "tpot_p99_s", "seconds"),
)


def fidelity(observed: dict[str, Any], simulated: dict[str, Any], duration_s: float) -> dict[str, Any]:
    """Observed against simulated, figure by figure (rows where the window observed the figure), and
    whether the twin is in the window's regime."""
    rows = []
    for label, key, unit in FIDELITY_ROWS:
        o, s = observed.get(key), simulated.get(key)
        if o is None:
            continue
        ratio = (s / o) if (s is not None and o) else None
        rows.append({"signal": label, "key": key, "unit": unit, "observed": o, "simulated": s, "ratio": ratio})
    ro, rs = regime(observed, duration_s), regime(simulated, duration_s)
    return {"rows": rows, "observed_regime": ro, "simulated_regime": rs, "same_regime": ro == rs}


# ---- the scenario file -----------------------------------------------------------------------------

def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        return repr(float(v)) if math.isfinite(v) else "nan"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


FORMAT = "gpudiag-fitted-scenario/1"
# The [arrivals] rows, in Bin's order; the caches' shares may be missing from an older file.
CACHE_ROWS = ("reused_share", "loaded_share")
ARRIVAL_ROWS = ("start_s", "end_s", "qps", "prompt_mean", "output_mean") + CACHE_ROWS


def save(f: Fitted, path: str) -> None:
    """Write the fitted scenario as TOML: what to simulate, and what the window showed."""
    lines = [f"# A window of real telemetry fitted as a scenario: gpudiag repro {Path(path).name}",
             f'format = "{FORMAT}"']
    top = {k: getattr(f, k) for k in ("source", "gpu", "gpu_name", "model", "model_name", "duration_s",
                                      "initial_requests", "sigma_prompt", "sigma_output", "lengths_from",
                                      "arrivals_from", "max_model_len", "activation_bytes", "speed_factor",
                                      "clients")}
    lines += [f"{k} = {_toml_value(v)}" for k, v in top.items()]
    lines.append(f"notes = {_toml_value(f.notes)}")
    lines.append("\n[knobs]")
    kd = asdict(f.knobs)
    sources = kd.pop("sources")
    lines += [f"{k} = {_toml_value(v)}" for k, v in kd.items()]
    lines.append("\n[knobs.sources]")
    lines += [f"{k} = {_toml_value(v)}" for k, v in sources.items()]
    lines.append("\n[observed]")
    lines += [f"{k} = {_toml_value(v)}" for k, v in f.observed.items() if v is not None]
    lines.append("\n[arrivals]  # one row a minute: start, end (s), requests/s, mean prompt and output tokens, "
                 "shares of prompt tokens served from the window's prefix cache and loaded through its KV connector")
    for name in ARRIVAL_ROWS:
        lines.append(f"{name} = {_toml_value([round(getattr(b, name), 4) for b in f.bins])}")
    Path(path).write_text("\n".join(lines) + "\n")


def load(path: str) -> Fitted:
    """A fitted scenario written by :func:`save` (GpudiagError on a file that is not one)."""
    try:
        d = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise GpudiagError(f"cannot read {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise GpudiagError(f"{path}: not TOML ({exc})") from None
    if d.get("format") != FORMAT:
        raise GpudiagError(f"{path}: not a fitted scenario (format {d.get('format')!r}, expected {FORMAT!r})")
    try:
        kd = dict(d["knobs"])
        sources = kd.pop("sources", {})
        knobs = Knobs(**kd, sources=sources)
        a = d["arrivals"]
        # A fit saved before the caches' shares were fitted has no such rows: nothing was served.
        cols = [[float(x) for x in a.get(n, [0.0] * len(a["start_s"]) if n in CACHE_ROWS else a[n])]
                for n in ARRIVAL_ROWS]
        if len({len(c) for c in cols}) != 1:
            raise ValueError(f"the [arrivals] rows ({', '.join(ARRIVAL_ROWS)}) differ in length")
        bins = [Bin(*row) for row in zip(*cols)]
        model_key = resolve_model(d["model"])
        base_gpu = re.sub(r"(-fp4)?(x\d+)?$", "", d["gpu"])
        gpu = group_gpu(resolve_gpu(base_gpu), knobs.tensor_parallel_size, model_key)
        f = Fitted(source=d["source"], gpu=gpu, gpu_name=d["gpu_name"], model=model_key,
                   model_name=d["model_name"], knobs=knobs, duration_s=float(d["duration_s"]),
                   initial_requests=int(d["initial_requests"]), bins=bins, sigma_prompt=float(d["sigma_prompt"]),
                   sigma_output=float(d["sigma_output"]), lengths_from=d["lengths_from"],
                   arrivals_from=d["arrivals_from"], max_model_len=int(d["max_model_len"]),
                   activation_bytes=int(d["activation_bytes"]), speed_factor=float(d["speed_factor"]),
                   observed=dict(d.get("observed", {})), clients=int(d.get("clients", 0)),
                   notes=list(d.get("notes", [])))
    except (KeyError, TypeError, ValueError) as exc:
        raise GpudiagError(f"{path}: a fitted scenario with a missing or bad field ({exc})") from None
    if not bins or any(b.qps < 0 or b.end_s <= b.start_s for b in bins) or not f.duration_s > 0:
        raise GpudiagError(f"{path}: arrivals must be minutes of non-negative rates inside a positive duration")
    for name in CACHE_ROWS:
        if any(not 0.0 <= getattr(b, name) <= 1.0 for b in bins):
            raise GpudiagError(f"{path}: {name} must be a share of prompt tokens, from 0 to 1")
    for key in ("gpu_util_mean", "prefix_hit_ratio", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
        f.observed.setdefault(key, None)
    return f
