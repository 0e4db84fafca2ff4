"""The reference engine's /metrics in another engine's dialect (SGLang, TensorRT-LLM, Triton, NIM, llama.cpp).

``gpudiag engine serve --dialect sglang`` and ``gpudiag agent --sim SCENARIO --dialect sglang`` write
the engine's series as that engine names them (:func:`gpudiag.probes.engine_dialects.render`), so
the engine probe, ``investigate --prometheus``, the recording rules and the alerts can be tested
against every dialect with a running engine. ``--dialect 0=vllm,1=sglang`` gives each GPU of a
node its own engine (a mixed node). gpudiag's own series (``gpudiag_*``) are written as before.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gpudiag.errors import GpudiagError
from gpudiag.exposition import FramesRegistry, LatestFrames, catalog_samples, samples_text
from gpudiag.probes import engine_dialects


def parse_spec(text: str | None) -> str | dict[str, str] | None:
    """``sglang`` -> ``"sglang"``; ``0=vllm,1=sglang`` -> ``{"0": "vllm", "1": "sglang"}``.

    GpudiagError (one line, exit 2) on a name the reference engine does not speak.
    """
    if text is None:
        return None
    spoken = ", ".join(engine_dialects.SPOKEN)
    text = text.strip()
    if "=" not in text:
        if text not in engine_dialects.SPOKEN:
            raise GpudiagError(f"--dialect {text!r}: the reference engine speaks {spoken}")
        return text
    out: dict[str, str] = {}
    for part in text.split(","):
        gpu, _, name = part.strip().partition("=")
        if not gpu.strip().isdigit() or name.strip() not in engine_dialects.SPOKEN:
            raise GpudiagError(f"--dialect {text!r}: give NAME or GPU=NAME,... (GPU an index; NAME one of {spoken})")
        out[gpu.strip()] = name.strip()
    return out


class SpeakingRegistry(FramesRegistry):
    """A frames registry whose families are written in an engine dialect (per GPU where a map is given)."""

    def __init__(self, latest: LatestFrames, spec: str | dict[str, str]):
        super().__init__(latest)
        self.spec = spec

    def text(self) -> str:
        """The page in the dialect (Prometheus text format 0.0.4)."""
        own = samples_text(catalog_samples(self.frames.latest.snapshot())).decode("utf-8")
        return engine_dialects.render(own, self.spec)

    def text_exposition(self) -> bytes:
        """What /metrics answers in the text format (the exporter writes it as is)."""
        return self.text().encode("utf-8")

    def collect(self):
        yield from text_string_to_metric_families(self.text())


def speaking_registry(latest: LatestFrames, spec: str | dict[str, str] | None) -> FramesRegistry:
    """The registry /metrics is written from: the catalog's names, or ``spec``'s dialect."""
    if spec is None or spec == "vllm":
        return FramesRegistry(latest)
    return SpeakingRegistry(latest, spec)
