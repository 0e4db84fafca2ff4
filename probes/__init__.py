"""Everything that reads the world: NVML, eBPF, torch, procfs, serving engines, the simulated GPU."""
