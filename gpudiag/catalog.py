"""The metric catalog: the single place where metric names are spelled.

Every frame column, Prometheus series, OTLP instrument, dashboard query and
alert rule takes its name from here. A frame column is the metric's ``column``
(for example ``gpu_utilization_ratio``); the exported name is ``name``
(``gpudiag_gpu_utilization_ratio``, or ``vllm:num_requests_running`` for the
metrics a serving engine exports in vLLM's dialect).

Code refers to columns through ``M``: ``M.gpu_utilization_ratio`` is the
string ``"gpu_utilization_ratio"``, and a misspelt attribute fails at once.

Units are SI base units (bytes, seconds, ratio 0..1, celsius, watts, hertz)
and appear at the end of the name, before ``_total`` for counters, as
Prometheus naming asks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

PREFIX = "gpudiag_"
VLLM_PREFIX = "vllm:"

GAUGE, COUNTER, HISTOGRAM, INFO = "gauge", "counter", "histogram", "info"

GPU_LABELS = ("node", "gpu", "uuid")
# pod, namespace, container: where the process runs on Kubernetes (gpudiag.probes.kube), the names
# dcgm-exporter gives the same labels; empty (absent to Prometheus) elsewhere.
POD_LABELS = ("pod", "namespace", "container")
# gpu_instance, compute_instance: the MIG instance the process runs in (NVML's IDs); empty without MIG.
MIG_LABELS = ("gpu_instance", "compute_instance")
PROCESS_LABELS = ("node", "gpu", "uuid", "pid", "process") + MIG_LABELS + POD_LABELS
ENGINE_LABELS = ("node", "gpu", "engine")

# Context-length buckets (label ``context_bucket``) of gpudiag's per-request latency
# histograms, in tokens of prompt plus output: the KV a request held when it finished,
# which is what its decode steps read and what fragments a KV pool. Prompt length alone
# would put the storm's long generations (prompt ~1.5k, output ~3k tokens) in one bucket
# with chat turns (prompts up to 2k). Edges a factor 4 apart from 512 to 32k tokens keep
# the label to five values (each times 24 latency buckets per engine): chat turns land in
# the lowest two, long generations and RAG prompts in <=8k, long-context work above.
CONTEXT_BUCKET_EDGES_TOKENS = (512, 2048, 8192, 32768)


def _tokens_text(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


CONTEXT_BUCKETS = tuple(f"<={_tokens_text(e)}" for e in CONTEXT_BUCKET_EDGES_TOKENS) + (
    f">{_tokens_text(CONTEXT_BUCKET_EDGES_TOKENS[-1])}",)


def context_bucket(tokens) -> str | None:
    """The ``context_bucket`` label value of a request of ``tokens`` (prompt + output); None when unknown."""
    if not isinstance(tokens, (int, float)) or isinstance(tokens, bool) or tokens != tokens or tokens < 0:
        return None
    for edge, label in zip(CONTEXT_BUCKET_EDGES_TOKENS, CONTEXT_BUCKETS):
        if tokens <= edge:
            return label
    return CONTEXT_BUCKETS[-1]


def token_count(v) -> float | None:
    """A request's token count as a float (an int no float holds: +-inf); None for what is no number (a bool)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def request_context_bucket(row) -> str | None:
    """A request row's ``context_bucket``: its own, else from its prompt and output tokens (None if unknown)."""
    given = row.get("context_bucket")
    if isinstance(given, str) and given:
        return given
    prompt, output = token_count(row.get("prompt_tokens")), token_count(row.get("output_tokens"))
    if prompt is None or output is None:
        return None
    return context_bucket(prompt + output)  # NaN or negative: None


@dataclass(frozen=True)
class Metric:
    """One metric: what it is called, what it measures and in which unit."""

    column: str
    type: str
    unit: str
    help: str
    labels: tuple[str, ...]
    entity: str  # gpu | process | engine | request | node | agent | cuda_api | finding
    dialect: str = "gpudiag"  # gpudiag | vllm

    @property
    def name(self) -> str:
        """The exported name (Prometheus/OTLP)."""
        if self.dialect == "vllm":
            return VLLM_PREFIX + self.column
        return PREFIX + self.column


def _m(column, type_, unit, help_, labels, entity, dialect="gpudiag") -> Metric:
    return Metric(column, type_, unit, help_, tuple(labels), entity, dialect)


_G, _P, _E = GPU_LABELS, PROCESS_LABELS, ENGINE_LABELS

METRICS: tuple[Metric, ...] = (
    # --- GPU (NVML or the simulated GPU) ---------------------------------
    _m("gpu_utilization_ratio", GAUGE, "ratio",
       "Fraction of the sample period during which one or more kernels ran (NVML utilization.gpu).", _G, "gpu"),
    _m("gpu_memory_utilization_ratio", GAUGE, "ratio",
       "Fraction of the sample period during which device memory was read or written.", _G, "gpu"),
    _m("gpu_memory_used_bytes", GAUGE, "bytes", "Device memory in use, all processes and the driver.", _G, "gpu"),
    _m("gpu_memory_total_bytes", GAUGE, "bytes", "Device memory capacity.", _G, "gpu"),
    _m("gpu_memory_reserved_bytes", GAUGE, "bytes", "Device memory reserved by the driver and firmware.", _G, "gpu"),
    _m("gpu_sm_clock_hertz", GAUGE, "hertz", "Current SM clock.", _G, "gpu"),
    _m("gpu_sm_clock_max_hertz", GAUGE, "hertz", "Maximum SM clock.", _G, "gpu"),
    _m("gpu_memory_clock_hertz", GAUGE, "hertz", "Current memory clock.", _G, "gpu"),
    _m("gpu_memory_clock_max_hertz", GAUGE, "hertz", "Maximum memory clock.", _G, "gpu"),
    _m("gpu_power_watts", GAUGE, "watts", "Power draw.", _G, "gpu"),
    _m("gpu_power_limit_watts", GAUGE, "watts", "Enforced power limit.", _G, "gpu"),
    _m("gpu_temperature_celsius", GAUGE, "celsius", "GPU core temperature.", _G, "gpu"),
    _m("gpu_memory_temperature_celsius", GAUGE, "celsius", "HBM temperature.", _G, "gpu"),
    _m("gpu_fan_speed_ratio", GAUGE, "ratio", "Fan speed as a fraction of its maximum.", _G, "gpu"),
    _m("gpu_pcie_tx_bytes_per_second", GAUGE, "bytes_per_second", "PCIe transmit throughput.", _G, "gpu"),
    _m("gpu_pcie_rx_bytes_per_second", GAUGE, "bytes_per_second", "PCIe receive throughput.", _G, "gpu"),
    _m("gpu_pcie_replay_total", COUNTER, "", "PCIe replay counter.", _G, "gpu"),
    _m("gpu_nvlink_errors_total", COUNTER, "", "NVLink error counters by kind.", _G + ("kind",), "gpu"),
    _m("gpu_ecc_errors_total", COUNTER, "", "ECC error counts.", _G + ("scope", "kind"), "gpu"),
    _m("gpu_retired_pages_total", COUNTER, "", "Retired memory pages.", _G + ("cause",), "gpu"),
    _m("gpu_remapped_rows_total", COUNTER, "", "Remapped HBM rows.", _G + ("kind",), "gpu"),
    _m("gpu_clock_throttle_active", GAUGE, "", "1 while the named clock throttle reason is active.",
       _G + ("reason",), "gpu"),
    _m("gpu_performance_state", GAUGE, "", "Performance state (0 = P0, maximum performance).", _G, "gpu"),
    _m("gpu_xid_errors_total", COUNTER, "", "XID error events by XID code.", _G + ("xid",), "gpu"),
    _m("gpu_mig_memory_used_bytes", GAUGE, "bytes", "Device memory in use in one MIG device (GPU and compute "
       "instance).", _G + MIG_LABELS, "gpu"),
    _m("gpu_mig_memory_total_bytes", GAUGE, "bytes", "Device memory of one MIG device (its GPU instance's share).",
       _G + MIG_LABELS, "gpu"),
    _m("gpu_lost", GAUGE, "", "1 when NVML reports the GPU as lost (fallen off the bus).", _G, "gpu"),
    _m("gpu_info", INFO, "", "Static GPU facts; metrics are unreliable where mig_mode or virtualization is set.",
       _G + ("name", "pci_bus_id", "driver_version", "cuda_driver_version", "mig_mode", "virtualization_mode"), "gpu"),
    # --- Process on a GPU: the three colours and host view ---------------
    _m("process_gpu_memory_bytes", GAUGE, "bytes",
       "Black: device memory the driver charges to the process (NVML per-process used memory).", _P, "process"),
    _m("process_torch_allocated_bytes", GAUGE, "bytes",
       "White: bytes held by live tensors (torch.cuda.memory_allocated).", _P, "process"),
    _m("process_torch_reserved_bytes", GAUGE, "bytes",
       "Grey: bytes the caching allocator holds (torch.cuda.memory_reserved).", _P, "process"),
    _m("process_torch_active_bytes", GAUGE, "bytes", "Bytes in active blocks of the caching allocator.", _P, "process"),
    _m("process_torch_inactive_split_bytes", GAUGE, "bytes",
       "Free bytes inside split segments of the caching allocator (unreleasable holes).", _P, "process"),
    _m("process_torch_requested_bytes", GAUGE, "bytes", "Bytes callers asked for, before rounding.", _P, "process"),
    _m("process_torch_largest_free_block_bytes", GAUGE, "bytes",
       "Largest free block in the caching allocator's segments.", _P, "process"),
    _m("process_torch_segments", GAUGE, "", "Segments (cudaMalloc'd regions) held by the caching allocator.",
       _P, "process"),
    _m("process_torch_alloc_retries_total", COUNTER, "",
       "Allocations that failed, freed cached blocks and retried.", _P, "process"),
    _m("process_torch_ooms_total", COUNTER, "", "Allocations that failed after the retry (out of memory).",
       _P, "process"),
    _m("process_reserved_minus_allocated_bytes", GAUGE, "bytes",
       "Grey minus white: memory the caching allocator holds that no tensor uses.", _P, "process"),
    _m("process_driver_minus_reserved_bytes", GAUGE, "bytes",
       "Black minus grey: driver-charged memory outside the caching allocator (context, libraries, raw cudaMalloc).",
       _P, "process"),
    _m("process_torch_allocated_growth_bytes_per_second", GAUGE, "bytes_per_second",
       "Trend of the white layer: least-squares slope of allocated bytes over the tracker's window.", _P, "process"),
    _m("process_torch_reserved_growth_bytes_per_second", GAUGE, "bytes_per_second",
       "Trend of the grey layer: least-squares slope of reserved bytes over the tracker's window.", _P, "process"),
    _m("process_gpu_memory_growth_bytes_per_second", GAUGE, "bytes_per_second",
       "Trend of the black layer: least-squares slope of driver-charged bytes over the tracker's window.",
       _P, "process"),
    _m("process_cpu_utilization_ratio", GAUGE, "ratio", "Process CPU time per wall second (1.0 = one core).",
       _P, "process"),
    _m("process_thread_cpu_max_ratio", GAUGE, "ratio", "CPU time per wall second of the busiest thread.",
       _P, "process"),
    _m("process_resident_memory_bytes", GAUGE, "bytes", "Resident set size.", _P, "process"),
    _m("process_context_switches_total", COUNTER, "", "Context switches by kind.", _P + ("kind",), "process"),
    # --- Serving engine, vLLM dialect --------------------------------------
    _m("num_requests_running", GAUGE, "", "Requests in the running batch.", _E, "engine", "vllm"),
    _m("num_requests_waiting", GAUGE, "", "Requests waiting to be scheduled.", _E, "engine", "vllm"),
    _m("kv_cache_usage_perc", GAUGE, "ratio", "KV-cache usage, 0..1 (vLLM's name keeps 'perc').", _E, "engine", "vllm"),
    _m("num_preemptions_total", COUNTER, "", "Preemptions (KV evicted, request re-queued).", _E, "engine", "vllm"),
    _m("prompt_tokens_total", COUNTER, "", "Prefill tokens processed.", _E, "engine", "vllm"),
    _m("generation_tokens_total", COUNTER, "", "Tokens generated.", _E, "engine", "vllm"),
    _m("prefix_cache_queries_total", COUNTER, "", "Prompt tokens looked up in the prefix cache.", _E, "engine", "vllm"),
    _m("prefix_cache_hits_total", COUNTER, "", "Prompt tokens found in the prefix cache.", _E, "engine", "vllm"),
    # vLLM V1 exports these two always; they move only when a KV connector (CPU offload, a shared
    # cache) answers lookups, so their increase is what shows that KV offload is on.
    _m("external_prefix_cache_queries_total", COUNTER, "",
       "Prompt tokens looked up through the KV connector (offloaded or shared KV).", _E, "engine", "vllm"),
    _m("external_prefix_cache_hits_total", COUNTER, "",
       "Prompt tokens the KV connector had (loaded back instead of prefilled).", _E, "engine", "vllm"),
    _m("request_success_total", COUNTER, "", "Requests finished, by finish reason (stop, length, abort, ...).",
       _E + ("finished_reason",), "engine", "vllm"),
    _m("time_to_first_token_seconds", HISTOGRAM, "seconds", "Time to first token.", _E, "request", "vllm"),
    _m("inter_token_latency_seconds", HISTOGRAM, "seconds",
       "Time per output token after the first (per request: (e2e - ttft) / (output tokens - 1)).",
          _E, "request", "vllm"),
    _m("e2e_request_latency_seconds", HISTOGRAM, "seconds", "End-to-end request latency.", _E, "request", "vllm"),
    _m("request_queue_time_seconds", HISTOGRAM, "seconds", "Time a request waited before its first prefill.",
       _E, "request", "vllm"),
    _m("request_prefill_time_seconds", HISTOGRAM, "seconds",
       "Time from a request's first scheduling to its first token (its prefill); TTFT is queue time plus this.",
       _E, "request", "vllm"),
    _m("request_decode_time_seconds", HISTOGRAM, "seconds",
       "Time from a request's first token to its last (its decode phase).", _E, "request", "vllm"),
    # vLLM V1's sampled KV residency histograms (--kv-cache-metrics): how long a cached block lived,
    # sat idle before it was evicted, and how long passed between two uses of it.
    _m("kv_block_lifetime_seconds", HISTOGRAM, "seconds",
       "KV cache block lifetime from allocation to eviction (sampled).", _E, "request", "vllm"),
    _m("kv_block_idle_before_evict_seconds", HISTOGRAM, "seconds",
       "Idle time of a KV cache block before its eviction (sampled).", _E, "request", "vllm"),
    _m("kv_block_reuse_gap_seconds", HISTOGRAM, "seconds",
       "Time between consecutive uses of a KV cache block (sampled).", _E, "request", "vllm"),
    # --- Requests by context length, gpudiag's own (vLLM's histograms carry no such label) ---
    _m("request_time_to_first_token_seconds", HISTOGRAM, "seconds",
       "Time to first token by context_bucket (prompt + output tokens of the request).",
       _E + ("context_bucket",), "request"),
    _m("request_inter_token_latency_seconds", HISTOGRAM, "seconds",
       "Time per output token after the first, by context_bucket (prompt + output tokens of the request).",
       _E + ("context_bucket",), "request"),
    _m("request_e2e_latency_seconds", HISTOGRAM, "seconds",
       "End-to-end request latency by context_bucket (prompt + output tokens of the request).",
       _E + ("context_bucket",), "request"),
    # --- Serving engine, gpudiag's own --------------------------------------
    _m("engine_batch_size", GAUGE, "", "Sequences in the last engine step.", _E, "engine"),
    _m("engine_kv_evictions_total", COUNTER, "", "KV evictions (a request's KV freed to make room).", _E, "engine"),
    _m("engine_recomputed_tokens_total", COUNTER, "", "Tokens prefilled again after an eviction.", _E, "engine"),
    _m("engine_kv_alloc_failures_total", COUNTER, "", "KV allocations that failed.", _E, "engine"),
    _m("engine_kv_failed_request_bytes", GAUGE, "bytes",
       "Largest KV allocation that failed in the last interval (0 when none failed).", _E, "engine"),
    _m("engine_kv_capacity_bytes", GAUGE, "bytes", "KV capacity the engine can use.", _E, "engine"),
    _m("engine_kv_capacity_tokens", GAUGE, "",
       "Tokens the engine's KV pool holds at most (blocks times tokens per block).", _E, "engine"),
    _m("engine_kv_used_tokens", GAUGE, "", "Tokens held in the engine's KV pool.", _E, "engine"),
    _m("engine_kv_capacity_nominal_bytes", GAUGE, "bytes",
       "KV capacity the engine would have on the device alone (no other process holding memory).", _E, "engine"),
    _m("engine_kv_used_bytes", GAUGE, "bytes", "KV bytes holding tokens.", _E, "engine"),
    _m("engine_kv_reserved_bytes", GAUGE, "bytes", "KV bytes allocated to requests (used plus internal slack).",
       _E, "engine"),
    _m("engine_requests_finished_total", COUNTER, "", "Requests completed.", _E, "engine"),
    _m("engine_requests_arrived_total", COUNTER, "", "Requests received.", _E, "engine"),
    _m("engine_requests_rejected_total", COUNTER, "", "Requests refused by admission control (HTTP 429).",
       _E, "engine"),
    _m("engine_requests_timed_out_total", COUNTER, "",
       "Requests whose client gave up (timeout) before the last token; the engine aborted them, queued or running.",
       _E, "engine"),
    _m("engine_requests_failed_total", COUNTER, "",
       "Requests that ended in an error (CUDA out of memory) instead of their last token.", _E, "engine"),
    _m("engine_restarts_total", COUNTER, "",
       "Restarts of the engine process (failed liveness probes, crashes), as its supervisor counts them.",
       _E, "engine"),
    _m("engine_prefix_cache_evictions_total", COUNTER, "",
       "Cached KV blocks nobody was using, dropped from the prefix cache to make room.", _E, "engine"),
    _m("engine_prefix_cache_recomputed_tokens_total", COUNTER, "",
       "Prompt tokens prefilled again because the prefix cache had held their KV and evicted it.", _E, "engine"),
    _m("engine_kv_logical_bytes", GAUGE, "bytes",
       "KV bytes the running requests address, a shared prefix block counted once per request using it "
       "(their KV demand without prefix sharing).", _E, "engine"),
    _m("engine_serving_state", GAUGE, "", "Serving state as a label set to 1.", _E + ("state",), "engine"),
    _m("engine_model_info", INFO, "", "The served model.", _E + ("model", "fingerprint"), "engine"),
    _m("engine_preprocess_backlog_requests", GAUGE, "",
       "Requests received and waiting for preprocessing (tokenize, pad, feature transforms); not yet in the "
       "engine's queue.", _E, "engine"),
    _m("engine_prefetch_queue_requests", GAUGE, "",
       "Preprocessed requests in the bounded prefetch queue, ready for the engine.", _E, "engine"),
    _m("engine_prefetch_queue_capacity_requests", GAUGE, "", "Requests the prefetch queue holds at most.",
       _E, "engine"),
    _m("engine_preprocess_workers_busy_ratio", GAUGE, "ratio",
       "Share of the interval the preprocessing workers spent preprocessing (mean over workers).", _E, "engine"),
    _m("engine_preprocess_workers_blocked_ratio", GAUGE, "ratio",
       "Share of the interval the preprocessing workers held a finished request because the prefetch queue was "
       "full (backpressure; mean over workers).", _E, "engine"),
    # --- Node (host) ----------------------------------------------------------
    _m("node_cpu_utilization_ratio", GAUGE, "ratio", "Node CPU busy fraction, all cores.", ("node",), "node"),
    _m("node_load1", GAUGE, "", "1-minute load average.", ("node",), "node"),
    _m("node_memory_used_bytes", GAUGE, "bytes", "Host memory in use.", ("node",), "node"),
    _m("node_memory_total_bytes", GAUGE, "bytes", "Host memory capacity.", ("node",), "node"),
    _m("node_swap_used_bytes", GAUGE, "bytes", "Swap in use.", ("node",), "node"),
    # --- CUDA API (eBPF) -------------------------------------------------------
    _m("cuda_api_calls_total", COUNTER, "", "CUDA runtime/driver API calls.", ("node", "pid", "process", "api"),
       "cuda_api"),
    _m("cuda_api_errors_total", COUNTER, "", "CUDA API calls that returned an error, by code.",
       ("node", "pid", "process", "api", "code"), "cuda_api"),
    _m("cuda_api_bytes_total", COUNTER, "bytes", "Bytes allocated, freed or copied by CUDA API calls.",
       ("node", "pid", "process", "api"), "cuda_api"),
    _m("cuda_api_latency_seconds", HISTOGRAM, "seconds", "CUDA API call latency (log2 buckets).",
       ("node", "pid", "process", "api"), "cuda_api"),
    _m("cuda_outstanding_allocation_bytes", GAUGE, "bytes", "Device allocations not yet freed, seen by eBPF.",
       ("node", "pid", "process"), "cuda_api"),
    _m("cuda_kernel_launches_total", COUNTER, "", "Kernel launches.", ("node", "pid", "process"), "cuda_api"),
    _m("cuda_degenerate_launches_total", COUNTER, "", "Kernel launches with grid (1,1,1).",
       ("node", "pid", "process"), "cuda_api"),
    _m("cuda_function_launches_total", COUNTER, "", "Kernel launches of one kernel function.",
       ("node", "pid", "process", "function"), "cuda_api"),
    _m("cuda_function_grid_blocks", GAUGE, "",
       "Thread blocks per launch (grid x*y*z) of one kernel function's launches in the last interval (median).",
       ("node", "pid", "process", "function"), "cuda_api"),
    _m("cuda_function_duration_seconds", GAUGE, "seconds",
       "Mean GPU time per launch of one kernel function in the last interval (CUPTI/Kineto or the simulated GPU).",
       ("node", "pid", "process", "function"), "cuda_api"),
    _m("host_offcpu_seconds_total", COUNTER, "seconds", "Off-CPU time of a GPU process's threads (sched_switch).",
       ("node", "pid", "process"), "cuda_api"),
    _m("host_runqueue_wait_seconds_total", COUNTER, "seconds",
       "Time a GPU process's threads were runnable but not running (preempted; CPU starvation).",
       ("node", "pid", "process"), "cuda_api"),
    _m("host_oom_kills_total", COUNTER, "", "Host OOM kills seen.", ("node",), "node"),
    # --- Recorded artifacts: profiler (Kineto) traces, allocator snapshots --------
    _m("trace_device_idle_ratio", GAUGE, "ratio",
       "Fraction of a traced span with no activity on any stream of the device (HTA idle time per rank).", _P,
       "process"),
    _m("trace_stream_idle_ratio", GAUGE, "ratio",
       "Fraction of a CUDA stream's traced span with no GPU activity (HTA idle time).", _P + ("stream",), "process"),
    _m("trace_stream_host_wait_ratio", GAUGE, "ratio",
       "Share of a stream's idle time in which the host had not yet launched the next operation (HTA host wait).",
       _P + ("stream",), "process"),
    _m("trace_stream_queue_empty_ratio", GAUGE, "ratio",
       "Fraction of a stream's traced span with no launched operation waiting to start.", _P + ("stream",), "process"),
    _m("trace_kernel_launch_delay_seconds", GAUGE, "seconds",
       "Median time from the start of a launch call onto an idle stream to the start of its device activity "
       "(HTA's kernel launch delay).", _P + ("stream",), "process"),
    _m("process_torch_external_fragmentation_ratio", GAUGE, "ratio",
       "1 - largest free block / free bytes in the caching allocator's segments.", _P, "process"),
    # --- Findings and the agent itself ------------------------------------------
    _m("finding_active", GAUGE, "", "1 while a finding is open (pod and namespace: whose process it is about).",
       ("node", "kind", "severity", "gpu", "pod", "namespace"), "finding"),
    _m("agent_tick_seconds", GAUGE, "seconds", "Duration of the last collection tick by probe.", ("node", "probe"),
       "agent"),
    _m("agent_probe_errors_total", COUNTER, "", "Probe errors by probe and kind.", ("node", "probe", "kind"), "agent"),
    _m("agent_dropped_events_total", COUNTER, "", "Events dropped (buffers full).", ("node", "probe"), "agent"),
    _m("agent_store_write_seconds", GAUGE, "seconds", "Duration of the last store flush.", ("node",), "agent"),
    _m("agent_store_bytes", GAUGE, "bytes", "Bytes the timeline store's database uses (retention keeps it under "
       "its max_bytes).", ("node",), "agent"),
    _m("agent_otlp_push_errors_total", COUNTER, "", "OTLP metric pushes the collector did not accept.", ("node",),
       "agent"),
    _m("agent_store_errors_total", COUNTER, "",
       "Store failures by kind: writes (disk full, read-only, ...) and fresh chunks found damaged at a seal.",
       ("node", "kind"), "agent"),
    _m("agent_cpu_utilization_ratio", GAUGE, "ratio", "Agent CPU time per wall second.", ("node",), "agent"),
    _m("agent_resident_memory_bytes", GAUGE, "bytes", "Agent resident set size.", ("node",), "agent"),
    _m("agent_probe_available", GAUGE, "", "1 when the probe runs, 0 when it is unavailable (see the agent log).",
       ("node", "probe"), "agent"),
    _m("agent_analysis_seconds", GAUGE, "seconds", "Duration of the last streaming analysis over the window.",
       ("node",), "agent"),
    _m("agent_findings_opened_total", COUNTER, "", "Findings the streaming analyzers opened, by kind.",
       ("node", "kind"), "agent"),
    _m("agent_sim_seconds", GAUGE, "seconds", "Simulated time the --sim engine has reached.", ("node",), "agent"),
)

CATALOG: dict[str, Metric] = {m.column: m for m in METRICS}
BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}
if len(CATALOG) != len(METRICS):  # pragma: no cover - guards the table above
    raise RuntimeError("duplicate column in the metric catalog")


class _Columns(SimpleNamespace):
    def __getattr__(self, item):  # only reached for names that do not exist
        raise AttributeError(f"{item!r} is not in the metric catalog (gpudiag/catalog.py)")


M = _Columns(**{m.column: m.column for m in METRICS})

# The engine's per-request latency (a request row's vLLM-dialect column) -> gpudiag's histogram
# of the same observation by context_bucket. The exporters observe both from one request row.
BY_CONTEXT: dict[str, str] = {
    M.time_to_first_token_seconds: M.request_time_to_first_token_seconds,
    M.inter_token_latency_seconds: M.request_inter_token_latency_seconds,
    M.e2e_request_latency_seconds: M.request_e2e_latency_seconds,
}


# Recording rules (dashboards/engine_rules.py) normalise every serving engine's dialect into these
# names: the prefix, then the catalog column (``gpudiag:num_requests_waiting``), with a ``dialect``
# label naming the engine's. Alerts and dashboards that read them serve vLLM, SGLang... alike.
NORMALISED_PREFIX = "gpudiag:"


def normalised(column: str) -> str:
    """The recorded name of an engine-vocabulary column (``gpudiag:<column>``)."""
    return NORMALISED_PREFIX + get(column).column


def get(column: str) -> Metric:
    """The catalog entry for a frame column; KeyError names the column."""
    try:
        return CATALOG[column]
    except KeyError:
        raise KeyError(f"{column!r} is not in the metric catalog") from None


def by_entity(entity: str) -> list[Metric]:
    """Metrics of one entity kind, in catalog order."""
    return [m for m in METRICS if m.entity == entity]
