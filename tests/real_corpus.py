"""The real corpus: where it lives, what each artifact is, and the verdict each deserves.

``../shared/data/real`` (beside the repository) holds artifacts and telemetry that real
machines recorded and nobody here produced (its MANIFEST.md says where each comes from and
the facts known of it). This module is the one place that names them for the tests and for
``bench/bench_verdicts.py``:

- the paths, and a skip reason when the folder is absent;
- :data:`EXPECTED`: per artifact, the findings a careful senior engineer would raise (kind
  and lowest severity) -- everything else must stay below warning;
- the reference figures MANIFEST.md gives (HTA's idle / compute / non-compute of each trace,
  each snapshot's reserved / allocated / largest free / releasable);
- :func:`inferencex_expect`: the verdict each InferenceX vLLM run deserves (``real_vllm``
  turns the runs back into vLLM's series).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REAL = REPO.parent / "shared" / "data" / "real"
MIB = 1 << 20


def real(*parts: str) -> Path:
    """A path under the real corpus (it may not exist: see :func:`missing`)."""
    return REAL.joinpath(*parts)


def missing(*parts: str) -> str | None:
    """Why a test of this part of the corpus must skip, or None when it is there."""
    p = real(*parts)
    if not p.exists():
        return f"the real corpus is not at {p} (../shared/data/real beside the checkout)"
    return None


@dataclass(frozen=True)
class Expect:
    """The verdict an artifact deserves: these kinds at least at these severities, nothing
    else at warning or above. ``why`` is the reason, as a senior engineer would give it."""

    why: str
    required: dict[str, str] = field(default_factory=dict)  # kind -> lowest severity (warning | critical)


CALM = Expect("nothing harmful in it")

# ---- Kineto traces (HTA's test data). Reference figures: HTA 0.6.1, % of the trace span.
HTA_FIGURES: dict[str, tuple[float, float, float]] = {
    "critical_path_cuda_event_sync_event_sync_trace.json.gz": (78.71, 18.63, 2.66),
    "critical_path_cuda_event_sync_multi_stream_event_sync_trace.json.gz": (98.08, 1.89, 0.03),
    "nccl_parser_config_nccl_data.json.gz": (77.78, 17.26, 4.97),
    "nccl_data_ncclDevKernel.json.gz": (77.78, 17.26, 4.97),
    "mtia_inference_trace_mtia_inference_rank_0.json.gz": (4.34, 86.17, 9.49),
    "triton_example_triton_example.json.gz": (0.0, 100.0, 0.0),
    "amd_trace_mi250_minitoy_train_ROCm6_2_kineto.json.gz": (98.53, 1.08, 0.39),
    "trace_diff_test_test.json.gz": (7.47, 68.31, 24.23),
    "trace_filter_sampled_rank-1.json.gz": (54.72, 22.57, 22.72),
    "df_index_resolver_df_index_resolver.json.gz": (46.08, 35.55, 18.37),
    "trace_file_list_inference_rank_1.json.gz": (98.16, 1.84, 0.0),
}
NO_GPU_TRACE = "cpu_only_rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"

# ---- Memory snapshots: MANIFEST's figures recomputed from the pickles, in MiB as MANIFEST
# writes them (reserved, allocated, largest free, releasable); a figure matches when ours,
# rounded to as many decimals, reads the same.
SNAPSHOT_MANIFEST: dict[str, tuple[str, str, str, str]] = {
    "real_snapshot_cnn.pickle": ("128", "46.5", "20", "46"),
    "Wedsonlin_medium_1024_training_memory_snapshot.pickle": ("24012", "6556", "256", "11046"),
    "Wedsonlin_medium_128_inference_memory_snapshot.pickle": ("1682", "1624", "20", "44"),
    "kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle": ("58280", "52332", "100", "5782"),
    "cranberrii_ftcourse.pickle": ("6172", "2191", "124", "2440"),
    "Constructor-Sun.pickle": ("109318", "27398", "26220", "59640"),
}
SNAPSHOT_WITH_OOM = "Constructor-Sun.pickle"


def as_manifest_rounds(value_bytes: float, written: str) -> float:
    """``value_bytes`` in MiB, rounded to as many decimals as MANIFEST wrote ``written``."""
    decimals = len(written.split(".")[1]) if "." in written else 0
    return round(value_bytes / MIB, decimals)


# The OOM of Constructor-Sun.pickle, replayed from its device trace up to the oom event.
OOM_REQUEST_MIB, OOM_POOL_FREE_MIB, OOM_DEVICE_FREE_MIB = 5063, 133, 91

# ---- InferenceX: 72 runs of a real vLLM V1 on B200 (tests/real_vllm.py writes them back as
# vLLM's series). Preemptions per run at which a run is a storm: hundreds in a quarter of an
# hour with the KV cache pinned full is the engine thrashing; a handful in half an hour is its
# capacity edge.
STORM_PREEMPTIONS = 50


def inferencex_expect(run) -> Expect:
    """The verdict a run of ``real_vllm.runs()`` deserves: hundreds of preemptions at a full KV
    cache are a storm (demand over capacity: vLLM is paged); a handful, or none, are calm."""
    if run.preemptions >= STORM_PREEMPTIONS:
        return Expect(f"{run.preemptions} preemptions at a KV cache {run.kv_max_ratio:.0%} full, "
                      f"{run.waiting_max} waiting", {"kv_eviction_storm": "warning"})
    return Expect(f"{run.preemptions} preemptions in {run.duration_s:.0f} s: not a storm")


# ---- The verdict each artifact deserves.
_TOO_LITTLE = "a handful of kernels in milliseconds: too little to judge a host-bound loop"
TRACE_EXPECT: dict[str, Expect] = {
    "critical_path_cuda_event_sync_event_sync_trace.json.gz": Expect(_TOO_LITTLE),
    "critical_path_cuda_event_sync_multi_stream_event_sync_trace.json.gz": Expect(_TOO_LITTLE),
    "trace_file_list_inference_rank_1.json.gz": Expect(_TOO_LITTLE),
    "amd_trace_mi250_minitoy_train_ROCm6_2_kineto.json.gz": Expect(_TOO_LITTLE + " (16 kernels in 9 ms)"),
    "nccl_parser_config_nccl_data.json.gz": Expect(
        "training rank: the device idles 78 % of three steps, its compute stream's idle is host wait",
        {"cpu_starved_gpu": "warning"}),
    "nccl_data_ncclDevKernel.json.gz": Expect(
        "the same rank with NCCL >= 2.19 kernel names: the same verdict", {"cpu_starved_gpu": "warning"}),
    "df_index_resolver_df_index_resolver.json.gz": Expect(
        "training rank: the device idles 46 % of five steps and 90 % of the compute stream's idle is host wait",
        {"cpu_starved_gpu": "warning"}),
    "mtia_inference_trace_mtia_inference_rank_0.json.gz": Expect("the MTIA device is 96 % busy"),
    "triton_example_triton_example.json.gz": Expect("the device is busy for the whole (tiny) span"),
    "trace_diff_test_test.json.gz": Expect("training step, device 92 % busy"),
    "trace_filter_sampled_rank-1.json.gz": Expect(
        "the compute stream's idle is mostly not host wait (36 %): not a CPU-starved device"),
}

SNAPSHOT_EXPECT: dict[str, Expect] = {
    "real_snapshot_cnn.pickle": Expect("a 128 MiB process with free memory and no failed allocation"),
    "Wedsonlin_medium_1024_training_memory_snapshot.pickle": Expect(
        "free memory is mostly whole segments empty_cache would release; no failed allocation"),
    "Wedsonlin_medium_128_inference_memory_snapshot.pickle": Expect("no failed allocation"),
    "kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle": Expect("no failed allocation"),
    "cranberrii_ftcourse.pickle": Expect("no failed allocation"),
    "Constructor-Sun.pickle": Expect(
        "a capacity OOM: 5063 MiB asked with 133 MiB free in the pool and 91 MiB on the device",
        {"oom_forecast": "critical"}),
}

_HEALTHY_LOG = "a healthy single-job run, mostly idle or training"
FILE_EXPECT: dict[tuple[str, ...], Expect] = {
    ("series", "nvidia-smi", "akrammoustafa__V100S__gpu_usage_a.log"): Expect(_HEALTHY_LOG),
    ("series", "nvidia-smi", "beam11221_plato__gpu_log.csv"): Expect(_HEALTHY_LOG),
    ("series", "nvidia-smi", "eobo0530_vlm_optimization__RTX4090__gpu_log.csv"): Expect(_HEALTHY_LOG),
    ("series", "nvidia-smi", "singroup_ters_gen__A100__bash_gpu_usage__INTERLEAVED_CORRUPT.log"): Expect(
        _HEALTHY_LOG + "; interleaved lines are skipped and counted"),
    ("series", "nvidia-smi", "singroup_ters_gen__H200__gpu_usage.log"): Expect(_HEALTHY_LOG),
    ("series", "nvidia-smi", "xypp3_gpu_glasses__8x80GB__nvidia_smi.csv"): Expect(_HEALTHY_LOG),
    ("series", "dcgm", "dcgm_metrics_20250718_134233.csv"): Expect("a cross-section of 247 healthy H100s"),
    ("series", "incidents", "qhy991_grpo__gpu_monitor__OOM.log.gz"): Expect(
        "training OOMed on a GPU another process held (78.54 of 79.15 GiB): a co-tenant, and harm done",
        {"gpu_cotenant": "critical"}),
}


def check_corpus() -> None:
    """Raise AssertionError naming what is missing when the corpus is not the one MANIFEST
    describes (a benchmark must not print figures over the wrong input)."""
    problems = []
    for name in list(HTA_FIGURES) + [NO_GPU_TRACE]:
        if not real("traces", name).is_file():
            problems.append(f"traces/{name}")
    for name in SNAPSHOT_MANIFEST:
        if not real("snapshots", name).is_file():
            problems.append(f"snapshots/{name}")
    for parts in FILE_EXPECT:
        if not real(*parts).is_file():
            problems.append("/".join(parts))
    import real_vllm

    runs = real_vllm.runs() if (real_vllm.INFERENCEX / "index.csv").is_file() else []
    if len(runs) != 72:
        problems.append(f"inferencex: {len(runs)} runs, not 72")
    problems += [f"inferencex/{r.path.name}" for r in runs if not r.path.is_file()]
    if problems:
        raise AssertionError("the real corpus lacks " + ", ".join(problems[:8]))
