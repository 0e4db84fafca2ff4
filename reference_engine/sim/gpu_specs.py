"""Datasheet figures of the GPUs the simulated device can be.

Sources (NVIDIA datasheets): A100 Tensor Core GPU datasheet (2021) for the
A100 40GB/80GB SXM; H100 Tensor Core GPU datasheet (2023) for H100 SXM; H200
Tensor Core GPU product brief (2024); L4 Tensor Core GPU datasheet (2023);
T4 Tensor Core GPU datasheet (2019). Peak FLOP/s are dense BF16 tensor-core
figures (without sparsity; the T4 has no BF16, so its FP16 figure). Memory is
what NVML reports as total (A100-80GB: 81920 MiB; T4: 15360 MiB of its 16 GB).
The host link is the datasheet's PCIe figure, which counts both directions:
one direction carries half (PCIe Gen3 x16 32 GB/s, Gen4 64 GB/s, Gen5 128 GB/s).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpudiag.errors import GpudiagError

GIB = 1024**3


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model's capacity and speed."""

    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    peak_bf16_flops: float
    sm_clock_max_hz: float
    memory_clock_max_hz: float
    power_limit_w: float
    idle_power_w: float
    host_link_bytes_per_s: float  # PCIe, one direction (host to device)


SPECS: dict[str, GPUSpec] = {
    # A100 SXM4 40GB: 1,555 GB/s HBM2, 312 TFLOPS BF16, 1410 MHz boost, 400 W, PCIe Gen4.
    "A100-40GB": GPUSpec("NVIDIA A100-SXM4-40GB", 40 * GIB, 1.555e12, 312e12, 1410e6, 1215e6, 400.0, 55.0, 32e9),
    # A100 SXM4 80GB: 2,039 GB/s HBM2e, 312 TFLOPS BF16, 1410 MHz boost, 400 W, PCIe Gen4.
    "A100-80GB": GPUSpec("NVIDIA A100-SXM4-80GB", 80 * GIB, 2.039e12, 312e12, 1410e6, 1593e6, 400.0, 60.0, 32e9),
    # H100 SXM5 80GB: 3.35 TB/s HBM3, 989 TFLOPS BF16 dense, 1980 MHz boost, 700 W, PCIe Gen5.
    "H100-SXM": GPUSpec("NVIDIA H100 80GB HBM3", 80 * GIB, 3.35e12, 989e12, 1980e6, 2619e6, 700.0, 70.0, 64e9),
    # H200 SXM 141GB: 4.8 TB/s HBM3e, 989 TFLOPS BF16 dense, 1980 MHz boost, 700 W, PCIe Gen5.
    "H200": GPUSpec("NVIDIA H200", 141 * 10**9, 4.8e12, 989e12, 1980e6, 3201e6, 700.0, 75.0, 64e9),
    # L4 24GB: 300 GB/s GDDR6, 121 TFLOPS BF16 dense, 2040 MHz boost, 72 W, PCIe Gen4.
    "L4": GPUSpec("NVIDIA L4", 24 * GIB, 300e9, 121e12, 2040e6, 6251e6, 72.0, 16.0, 32e9),
    # B200 (HGX B200 datasheet, 2024: per GPU 180 GB HBM3e at 8 TB/s; FP16/BF16 tensor 36 PFLOPS
    # for eight GPUs with sparsity, so 2.25 PFLOPS dense each; up to 1000 W). NVML reports 183359 MiB
    # total and a 1965 MHz maximum SM clock on B200 nodes (nvidia-smi). The HBM3e memory clock is not in
    # the datasheet: 3996 MHz is an estimate, used only for the clock gauge. Idle power: nvidia-smi shows
    # 130-190 W at P0 with no process. Host link: PCIe Gen5 x16 to the host (HGX B200).
    "B200": GPUSpec("NVIDIA B200", 183359 * 1024**2, 8.0e12, 2.25e15, 1965e6, 3996e6, 1000.0, 140.0, 64e9),
    # T4 16GB: 320 GB/s GDDR6, 65 TFLOPS FP16 mixed precision, 1590 MHz boost, 70 W, PCIe Gen3.
    "T4": GPUSpec("Tesla T4", 15 * GIB, 320e9, 65e12, 1590e6, 5001e6, 70.0, 10.0, 16e9),
}


def spec(name: str) -> GPUSpec:
    """The spec of a GPU by its short name (A100-80GB, H100-SXM, ...)."""
    try:
        return SPECS[name]
    except KeyError:
        raise GpudiagError(f"unknown GPU {name!r}; known: {', '.join(SPECS)}") from None
