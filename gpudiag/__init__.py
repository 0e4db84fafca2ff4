"""gpudiag: GPU observability and diagnostics for LLM inference and training nodes."""

__version__ = "0.1.0"


def instrument(**kwargs):
    """Start the in-process PyTorch memory reporter (see gpudiag.probes.torch_reporter).

    Safe to call anywhere: without torch or CUDA it logs one line and does nothing.
    """
    from gpudiag.probes.torch_reporter import instrument as _instrument

    return _instrument(**kwargs)
