"""Host and kernel incidents: a CPU-starved GPU, a kernel launched with a degenerate grid.

Registered into ``scenarios.SCENARIOS``; parameters live here and nowhere else.
"""

from __future__ import annotations

from gpudiag.reference_engine.core.kv_manager import KVConfig
from gpudiag.reference_engine.scenarios import Fix, Scenario
from gpudiag.reference_engine.scenarios.workload import LengthDist, Phase, RequestClass, Workload
from gpudiag.reference_engine.sim.engine import EngineConfig
from gpudiag.reference_engine.sim.gpu_specs import spec as gpu_spec
from gpudiag.reference_engine.sim.launches import ATTENTION, GridFault, step_kernels
from gpudiag.reference_engine.sim.preprocess import PreprocessConfig
from gpudiag.reference_engine.sim.sim_gpu import MODELS, CostModel, DeviceLayout

GIB = 1024**3

# --- cpu-starved (SCENARIOS.md §2) -----------------------------------------------
# Mistral-7B on an A100-40GB behind a Python front end whose preprocessing
# (tokenize, pad, a feature pipeline) costs ~0.7 s of one core per request
# and runs on the engine's one host thread, one request per decode step. The
# GPU needs ~70 ms per request, so the thread spends >90 % of its time
# preprocessing. Offered load: 5 QPS, about four times what the starved
# engine serves (~1.1/s) and well within what the GPU can.
STARVED_DURATION_S = 600.0
STARVED_RAMP_S = 120.0  # the batch fills up; "steady" is judged after it
STARVED_QPS = 5.0
STARVED_PREPROCESS_S = 0.6
STARVED_PREPROCESS_S_PER_TOKEN = 2e-4
# Eight workers preprocess ~12 requests/s, above the offered load with room to
# spare; a prefetch queue of 32 holds several seconds of the engine's intake.
STARVED_WORKERS = 8
STARVED_QUEUE_DEPTH = 32
_CHAT = RequestClass("chat", 1.0, LengthDist(400, 0.5, 32, 4000), LengthDist(200, 0.5, 16, 1000))


def _starved_engine() -> EngineConfig:
    return EngineConfig(
        gpu="A100-40GB", model="mistral-7b", kv=KVConfig(strategy="paged"),
        layout=DeviceLayout(memory_fraction=0.9, activation_bytes=2 * GIB),
        cost=CostModel(preprocess_s=STARVED_PREPROCESS_S, preprocess_s_per_token=STARVED_PREPROCESS_S_PER_TOKEN),
    )


def _starved_workload() -> Workload:
    return Workload(qps=STARVED_QPS, duration_s=STARVED_DURATION_S, phases=[
        Phase("ramp", 0.0, STARVED_RAMP_S, (_CHAT,)),
        Phase("steady", STARVED_RAMP_S, STARVED_DURATION_S, (_CHAT,)),
    ])


def _preprocess_workers(cfg: EngineConfig) -> None:
    cfg.preprocess = PreprocessConfig(workers=STARVED_WORKERS, queue_depth=STARVED_QUEUE_DEPTH)


STARVED_FIXES = {
    "preprocess-workers": Fix(
        "preprocess-workers",
        f"{STARVED_WORKERS} preprocessing worker processes fill a bounded prefetch queue of "
        f"{STARVED_QUEUE_DEPTH}; the engine thread only schedules and launches", _preprocess_workers),
}

# --- degenerate-grid (SCENARIOS.md §7) -------------------------------------------
# Mistral-7B chat serving on an A100-80GB at a load it carries easily. At
# UPGRADE_S a new build launches the attention kernel with grid (1,1,1):
# one block on one SM reads all the KV at one SM's bandwidth (~45 GB/s
# against ~1.6 TB/s), GRID_KERNEL_SLOWDOWN times as long for the same work,
# and every decode step waits for it. Steps slow down, batches grow, and each
# launch then reads more KV as well: the per-launch time the analyzer measures
# over a window grows past this figure, TPOT by less (attention is a part of a step).
GRID_DURATION_S = 1500.0
GRID_UPGRADE_S = 500.0
GRID_QPS = 2.0
_GRID_CHAT = RequestClass("chat", 1.0, LengthDist(250, 0.5, 16, 2000), LengthDist(200, 0.5, 16, 1000))


def _grid_engine() -> EngineConfig:
    return EngineConfig(
        gpu="A100-80GB", model="mistral-7b", kv=KVConfig(strategy="paged"),
        layout=DeviceLayout(memory_fraction=0.9, activation_bytes=4 * GIB),
        kernel_launch_rows=True,
        grid_fault=GridFault(kernel=ATTENTION, grid=(1, 1, 1), from_s=GRID_UPGRADE_S),
    )


def _grid_kernel_slowdown() -> float:
    """How many times as long one decode attention launch takes with the fault's grid as with the grid its
    shape calls for, doing the same work (one chat request of median length): the cost model's figure for
    this scenario's GPU and model."""
    cfg = _grid_engine()
    context = _GRID_CHAT.prompt.median + _GRID_CHAT.output.median
    _, nbytes, flops = step_kernels(MODELS[cfg.model], [1], context, decode=True)[ATTENTION]
    gpu = gpu_spec(cfg.gpu)
    return cfg.cost.kernel_s(gpu, nbytes, flops, blocks=cfg.grid_fault.blocks) / cfg.cost.kernel_s(gpu, nbytes, flops)


GRID_KERNEL_SLOWDOWN = _grid_kernel_slowdown()


def _grid_workload() -> Workload:
    return Workload(qps=GRID_QPS, duration_s=GRID_DURATION_S, phases=[
        Phase("before", 0.0, GRID_UPGRADE_S, (_GRID_CHAT,)),
        Phase("after-upgrade", GRID_UPGRADE_S, GRID_DURATION_S, (_GRID_CHAT,)),
    ])


def _correct_grid(cfg: EngineConfig) -> None:
    cfg.grid_fault = None


GRID_FIXES = {
    "correct-grid": Fix("correct-grid", "launch attention with the grid its shape calls for (batch x heads blocks)",
                        _correct_grid),
}

SCENARIOS: dict[str, Scenario] = {
    "cpu-starved": Scenario(
        "cpu-starved",
        "request preprocessing on the engine's one host thread: GPU ~10 % busy under real traffic",
        _starved_engine, _starved_workload,
        [("ramp", 0.0, STARVED_RAMP_S), ("steady", STARVED_RAMP_S, STARVED_DURATION_S)],
        STARVED_FIXES,
        ("cpu_starved_gpu",),
    ),
    "degenerate-grid": Scenario(
        "degenerate-grid",
        f"after an upgrade the attention kernel is launched with grid (1,1,1): a decode launch takes "
        f"{GRID_KERNEL_SLOWDOWN:.0f}x as long for the same work",
        _grid_engine, _grid_workload,
        [("before", 0.0, GRID_UPGRADE_S), ("after-upgrade", GRID_UPGRADE_S, GRID_DURATION_S)],
        GRID_FIXES,
        ("degenerate_kernel_launch",),
    ),
}
