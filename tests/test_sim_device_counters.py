"""The simulated GPU's PCIe, throttle-reason and error counters: honest readings of a healthy device."""

from __future__ import annotations

import pytest

from gpudiag.catalog import M
from gpudiag.probes.nvml import NVLINK_ERROR_KINDS, THROTTLE_REASON_BITS
from gpudiag.reference_engine import scenarios
from gpudiag.reference_engine.sim import engine as engine_mod
from gpudiag.reference_engine.sim.engine import PCIE_D2H_BYTES_PER_TOKEN, PCIE_H2D_BYTES_PER_TOKEN, SimEngine

SECONDS = 60


def run_storm(gpu: str = "A100-80GB", seconds: int = SECONDS) -> list[tuple[dict, dict]]:
    """(gpu row, engine row) of each simulated second of the storm scenario's healthy start."""
    cfg, wl = scenarios.get("kv-eviction-storm").build()
    cfg.gpu = gpu
    if gpu == "L4":  # 24 GB: the 7B model fits with a smaller activation reserve
        cfg.layout.memory_fraction, cfg.layout.activation_bytes = 0.9, 2 * 1024**3
    wl.duration_s = seconds
    out, gpu_row = [], None
    for fr in SimEngine(cfg, wl, seed=0).frames():
        if fr.kind == "gpu":
            gpu_row = fr.rows[0]
        elif fr.kind == "engine":
            out.append((gpu_row, fr.rows[0]))
    return out


@pytest.fixture(scope="module")
def storm_start():
    return run_storm()


def test_a_healthy_simulated_gpu_reads_zero_on_every_error_counter(storm_start):
    for g, _ in storm_start:
        assert g[M.gpu_ecc_errors_total] == {"volatile": {"corrected": 0, "uncorrected": 0},
                                             "aggregate": {"corrected": 0, "uncorrected": 0}}
        assert g[M.gpu_nvlink_errors_total] == dict.fromkeys(NVLINK_ERROR_KINDS, 0)
        assert g[M.gpu_remapped_rows_total] == {"correctable": 0, "uncorrectable": 0}
        assert g[M.gpu_pcie_replay_total] == 0
        # no XID has happened, so there is no code to count; page retirement is pre-Ampere
        assert M.gpu_xid_errors_total not in g and M.gpu_retired_pages_total not in g


def test_throttle_reasons_are_nvmls_and_none_is_active_while_the_gpu_is_cool(storm_start):
    for g, _ in storm_start:
        reasons = g[M.gpu_clock_throttle_active]
        assert set(reasons) == set(THROTTLE_REASON_BITS)
        assert g[M.gpu_temperature_celsius] < engine_mod.SIM_SLOWDOWN_C
        assert set(reasons.values()) == {0}


def test_a_gpu_at_its_slowdown_temperature_reports_thermal_slowdown(monkeypatch):
    monkeypatch.setattr(engine_mod, "SIM_SLOWDOWN_C", 40.0)  # the thermal model passes 40 °C under this load
    rows = run_storm(seconds=120)
    hot = [g for g, _ in rows if g[M.gpu_temperature_celsius] >= 40.0]
    cool = [g for g, _ in rows if g[M.gpu_temperature_celsius] < 40.0]
    assert hot and cool
    assert all(g[M.gpu_clock_throttle_active]["sw_thermal_slowdown"] == 1 for g in hot)
    assert all(g[M.gpu_clock_throttle_active]["sw_thermal_slowdown"] == 0 for g in cool)
    assert all(g[M.gpu_clock_throttle_active]["sw_power_cap"] == 0 for g, _ in rows)  # 85 % of the limit at most


def test_pcie_traffic_is_the_step_inputs_in_and_the_sampled_tokens_out(storm_start):
    prev_prompt = prev_generated = 0
    rx_total = tx_total = 0.0
    for g, e in storm_start:
        prompt, generated = e[M.prompt_tokens_total], e[M.generation_tokens_total]
        new_generated = generated - prev_generated
        assert g[M.gpu_pcie_rx_bytes_per_second] == PCIE_H2D_BYTES_PER_TOKEN * (prompt - prev_prompt + new_generated)
        assert g[M.gpu_pcie_tx_bytes_per_second] == PCIE_D2H_BYTES_PER_TOKEN * new_generated
        prev_prompt, prev_generated = prompt, generated
        rx_total += g[M.gpu_pcie_rx_bytes_per_second]
        tx_total += g[M.gpu_pcie_tx_bytes_per_second]
    assert rx_total > tx_total > 0


def test_a_pcie_card_without_nvlink_reports_no_nvlink_or_row_remap_counters():
    for g, _ in run_storm(gpu="L4", seconds=3):
        assert M.gpu_nvlink_errors_total not in g and M.gpu_remapped_rows_total not in g
        assert g[M.gpu_ecc_errors_total]["volatile"] == {"corrected": 0, "uncorrected": 0}
