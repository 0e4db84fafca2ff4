"""The InferenceX runs of a real vLLM, turned back into the series vLLM exported, for a real Prometheus.

../shared/data/real/series/inferencex holds 72 runs of vLLM V1 on B200 (MANIFEST.md): the benchmark
scraped /metrics every second and kept one CSV row per scrape under its own column names. This
module writes each run back as the vLLM V1 series it was read from (names, types and labels of
vLLM's ``vllm/v1/metrics/loggers.py``: ``model_name`` and ``engine`` on every series,
``finished_reason`` on ``vllm:request_success``), in OpenMetrics text with timestamps, for
``promtool tsdb create-blocks-from openmetrics``.

Each run becomes one scrape target: ``instance="<run's node name>:8888"``, ``job="vllm"``, so
``gpudiag investigate --prometheus URL --node NAME`` selects one run. The runs are moved in time to
start together, recently (``t0``): promtool parses its input once per two-hour block, and the
originals spread over months; a run keeps its own spacing of samples and its gaps.

What is not written, and why:

* ``cpu_kv_cache_usage_pct``: the benchmark read vLLM V0's ``vllm:cpu_cache_usage_perc``, which
  vLLM V1 does not export; the column is 0 throughout;
* ``kv_offload_*``, ``prompt_tokens_local_*``, ``prefill_kv_computed_tokens_*``: other versions'
  offload and prompt-source series, under names the CSV does not keep;
* ``interval_*``: the benchmark's own per-interval arithmetic, not a scrape.

``request_success_total`` is the sum over finish reasons (the scraper added them up); it is
written as one series with ``finished_reason="stop"``.
"""

from __future__ import annotations

import csv
import gzip
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

REPO = Path(__file__).resolve().parents[1]
# GPUDIAG_REAL_DATA points at the real data where the checkout has no ../shared beside it.
REAL = Path(os.environ.get("GPUDIAG_REAL_DATA", REPO / ".." / "shared" / "data" / "real"))
INFERENCEX = REAL / "series" / "inferencex"
PORT = 8888  # the benchmark's `vllm serve --port`
ENGINE = "0"  # one engine core per server in every run
MODELS = {"dsr1": "nvidia/DeepSeek-R1-0528-FP4", "llama": "nvidia/Llama-3.3-70B-Instruct-FP4"}

# CSV column -> (vLLM V1 family, OpenMetrics type, scale to the exported unit).
GAUGES = {
    "kv_cache_usage_pct": ("vllm:kv_cache_usage_perc", 0.01),  # the CSV holds percent; vLLM exports 0..1
    "num_requests_running": ("vllm:num_requests_running", 1.0),
    "num_requests_waiting": ("vllm:num_requests_waiting", 1.0),
}
COUNTERS = {
    "num_preemptions_total": "vllm:num_preemptions",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    # The benchmark's "cpu" prefix cache is vLLM's external (KV connector) one.
    "cpu_prefix_cache_hits": "vllm:external_prefix_cache_hits",
    "cpu_prefix_cache_queries": "vllm:external_prefix_cache_queries",
    "prompt_tokens_total": "vllm:prompt_tokens",
    "generation_tokens_total": "vllm:generation_tokens",
    "request_success_total": "vllm:request_success",
}
EXTRA_LABELS = {"vllm:request_success": 'finished_reason="stop"'}
BLOCK_SIZE = 16  # vLLM's default; no sweep command sets --block-size

# The KV pool each sweep run's vLLM logged at start ("GPU KV cache size: N tokens"), from the run's
# server log in SemiAnalysisAI/InferenceX (experimental/multiturn/vllm_benchmark/results/
# sweep_results_20260204_062339/<run>/server.log, tp2 runs: server_attempt1.log; commit 2582608b).
# The scrapes do not keep vllm:cache_config_info, which carries the same figure as num_gpu_blocks x
# block_size. tp2_bs256_offloadoff and tp2_bs512_offloadon are absent: their logs hold the lines
# of an engine that failed to start and not those of the engine that served.
LOGGED_KV_TOKENS = {
    "tp1_bs16_offloadoff": 782_160, "tp1_bs16_offloadon": 782_160, "tp1_bs32_offloadoff": 782_160,
    "tp1_bs32_offloadon": 782_160, "tp1_bs64_offloadoff": 782_176, "tp1_bs64_offloadon": 782_176,
    "tp1_bs128_offloadoff": 782_160, "tp1_bs128_offloadon": 782_160, "tp1_bs256_offloadoff": 780_992,
    "tp1_bs256_offloadon": 780_992, "tp1_bs512_offloadoff": 773_312, "tp1_bs512_offloadon": 773_312,
    "tp2_bs16_offloadoff": 1_819_408, "tp2_bs16_offloadon": 1_811_872, "tp2_bs32_offloadoff": 1_819_408,
    "tp2_bs32_offloadon": 1_819_408, "tp2_bs64_offloadoff": 1_817_968, "tp2_bs64_offloadon": 1_817_968,
    "tp2_bs128_offloadoff": 1_818_176, "tp2_bs128_offloadon": 1_818_176, "tp2_bs256_offloadon": 1_809_120,
    "tp2_bs512_offloadoff": 1_795_104,
}


@dataclass(frozen=True)
class Run:
    """One run of index.csv: what the benchmark measured, and where its scrape rows are."""

    name: str  # index.csv's `run`
    node: str  # the scrape target's host here: short and unique (tp1_bs512_offloadon)
    path: Path
    start_unix: float
    duration_s: float
    preemptions: int
    kv_max_ratio: float
    waiting_max: int
    command: str  # the `vllm serve` command line, when the benchmark kept it

    @property
    def model(self) -> str:
        """The served model (the runs whose command line was not kept name it in the run's name)."""
        m = re.search(r"vllm serve (\S+)", self.command)
        if m:
            return m.group(1)
        return MODELS["dsr1"] if "_dsr1_" in self.name else MODELS["llama"]


def node_name(run: str) -> str:
    """A run's short name: the sweep's ``tp1_bs512_offloadon``; ``dsr1_tp8_bs64_offloadoff_slurm_2`` for
    the agentic runs, whose configuration repeats on other machines (the suffix says which)."""
    if "__" in run and run.startswith("sweep_results"):
        return run.split("__", 1)[1]
    m = re.search(r"agentic_(dsr1_tp\d+_bs\d+_offload(?:on|off))_.*_b200-(?:dgxc-)?([a-z]+_\d+)$", run)
    if not m:
        raise ValueError(f"unexpected run name {run!r}")
    return f"{m.group(1)}_{m.group(2)}"


def runs() -> list[Run]:
    """Every run of index.csv, in its order."""
    out = []
    with open(INFERENCEX / "index.csv", newline="") as fh:
        for row in csv.DictReader(fh):
            out.append(Run(row["run"], node_name(row["run"]), INFERENCEX / f"{row['run']}.csv.gz",
                           float(row["start_unix"]), float(row["duration_s"]), int(row["preemptions"]),
                           float(row["kv_max_pct"]) / 100.0, int(row["waiting_max"]), row["vllm_command"]))
    nodes = [r.node for r in out]
    assert len(set(nodes)) == len(nodes), "two runs share a short name"
    return out


def rows(run: Run) -> list[dict[str, str]]:
    """The run's scrape rows, as the CSV holds them."""
    with gzip.open(run.path, "rt", newline="") as fh:
        return list(csv.DictReader(fh))


def _labels(run: Run, family: str) -> str:
    out = f'instance="{run.node}:{PORT}",job="vllm",model_name="{run.model}",engine="{ENGINE}"'
    extra = EXTRA_LABELS.get(family)
    return f"{out},{extra}" if extra else out


def _samples(run: Run, data: list[dict[str, str]], t0: float, column: str, name: str,
             scale: float) -> Iterator[str]:
    labels = _labels(run, name.removesuffix("_total"))
    first = float(data[0]["timestamp_sec"])
    for r in data:
        at = t0 + float(r["timestamp_sec"]) - first
        yield f"{name}{{{labels}}} {float(r[column]) * scale:g} {at:.3f}\n"


def write_openmetrics(chosen: list[Run], out: TextIO, t0: float, *,
                      cache_config: bool = False) -> dict[str, tuple[float, float]]:
    """The runs' series as OpenMetrics text with timestamps, every run moved to start at ``t0``;
    returns each run's (first, last) scrape time on that clock, by node name.

    OpenMetrics keeps a family's samples together: each family is written once, with every
    run's series in it, each series in time order. ``cache_config`` adds vLLM's
    ``vllm:cache_config_info`` at every scrape, its pool the one the run logged
    (:data:`LOGGED_KV_TOKENS`; runs without a logged pool get none).
    """
    data = {r.node: rows(r) for r in chosen}
    spans = {node: (t0, t0 + float(d[-1]["timestamp_sec"]) - float(d[0]["timestamp_sec"]))
             for node, d in data.items()}
    if cache_config:
        out.write("# TYPE vllm:cache_config_info gauge\n")
        for r in chosen:
            if r.node not in LOGGED_KV_TOKENS:
                continue
            labels = (f'{_labels(r, "vllm:cache_config_info")},block_size="{BLOCK_SIZE}",'
                      f'num_gpu_blocks="{LOGGED_KV_TOKENS[r.node] // BLOCK_SIZE}"')
            first = float(data[r.node][0]["timestamp_sec"])
            out.writelines(f"vllm:cache_config_info{{{labels}}} 1 {t0 + float(x['timestamp_sec']) - first:.3f}\n"
                           for x in data[r.node])
    for column, (family, scale) in GAUGES.items():
        out.write(f"# TYPE {family} gauge\n")
        for r in chosen:
            out.writelines(_samples(r, data[r.node], t0, column, family, scale))
    for column, family in COUNTERS.items():
        out.write(f"# TYPE {family} counter\n")
        for r in chosen:
            out.writelines(_samples(r, data[r.node], t0, column, family + "_total", 1.0))
    out.write("# EOF\n")
    return spans
