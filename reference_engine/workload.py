"""Workloads: when requests arrive, how long they are, which tier they belong to.

Arrivals are Poisson (exponential gaps at ``qps``) or read from a trace;
lengths are log-normal, clamped; phases switch the request mix over time
(for example a 30-minute long-sequence phase). Everything is drawn from one
seeded generator, so a seed fixes the run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gpudiag.errors import GpudiagError
from gpudiag.reference_engine.sequence import TIERS, Sequence


@dataclass(frozen=True)
class LengthDist:
    """Log-normal token count: median, sigma of log, clamped to [lo, hi]."""

    median: int
    sigma: float = 0.5
    lo: int = 1
    hi: int = 1 << 20

    def draw(self, rng: np.random.Generator) -> int:
        v = rng.lognormal(math.log(self.median), self.sigma) if self.sigma > 0 else self.median
        return int(min(self.hi, max(self.lo, round(v))))


@dataclass(frozen=True)
class RequestClass:
    """One kind of request in a mix."""

    name: str
    weight: float
    prompt: LengthDist
    output: LengthDist
    tier_weights: tuple[float, float, float] = (0.2, 0.5, 0.3)  # vip, internal, batch


@dataclass(frozen=True)
class Phase:
    """A named span of the run with its own request mix and rate."""

    name: str
    start_s: float
    end_s: float
    mix: tuple[RequestClass, ...]
    qps: float | None = None  # None: the workload's rate


@dataclass
class Workload:
    """Arrival process plus phases; ``generate`` gives the run's requests."""

    qps: float
    duration_s: float
    phases: list[Phase] = field(default_factory=list)
    trace_path: str | None = None

    def validate(self) -> None:
        """Raise GpudiagError on a workload that cannot be run."""
        if not (self.qps > 0) or math.isinf(self.qps):
            raise GpudiagError(f"QPS must be a positive number, got {self.qps}")
        if not (self.duration_s > 0):
            raise GpudiagError(f"duration must be positive, got {self.duration_s}")
        if not self.phases and not self.trace_path:
            raise GpudiagError("a workload needs phases or a trace")
        for ph in self.phases:
            if ph.qps is not None and ph.qps < 0:
                raise GpudiagError(f"phase {ph.name!r}: QPS must not be negative")
            if ph.end_s <= ph.start_s:
                raise GpudiagError(f"phase {ph.name!r} ends before it starts")
            if not ph.mix or sum(c.weight for c in ph.mix) <= 0:
                raise GpudiagError(f"phase {ph.name!r} has no request mix")

    def phase_at(self, t: float) -> Phase | None:
        for ph in self.phases:
            if ph.start_s <= t < ph.end_s:
                return ph
        return None

    def generate(self, seed: int) -> list[Sequence]:
        """All requests of the run, in arrival order."""
        self.validate()
        if self.trace_path:
            return load_trace(self.trace_path, self.duration_s)
        rng = np.random.default_rng(seed)
        seqs: list[Sequence] = []
        t = 0.0
        while True:
            ph = self.phase_at(t)
            rate = (ph.qps if ph and ph.qps is not None else self.qps) if ph else self.qps
            if rate <= 0:
                nxt = min((p.start_s for p in self.phases if p.start_s > t), default=self.duration_s)
                t = nxt
                if t >= self.duration_s:
                    break
                continue
            t += rng.exponential(1.0 / rate)
            if t >= self.duration_s:
                break
            ph = self.phase_at(t)
            if ph is None:
                continue
            weights = np.array([c.weight for c in ph.mix], dtype=float)
            cls = ph.mix[int(rng.choice(len(ph.mix), p=weights / weights.sum()))]
            tw = np.array(cls.tier_weights, dtype=float)
            tier = int(rng.choice(len(TIERS), p=tw / tw.sum()))
            seqs.append(Sequence(len(seqs), t, cls.prompt.draw(rng), max(1, cls.output.draw(rng)), tier, cls.name))
        return seqs


def load_trace(path: str, duration_s: float) -> list[Sequence]:
    """Requests from a JSON-lines trace: {"arrival_s", "prompt_tokens", "output_tokens", "tier"?, "kind"?}."""
    p = Path(path)
    if not p.is_file():
        raise GpudiagError(f"trace file {path} does not exist")
    seqs = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            arrival, prompt, out = float(r["arrival_s"]), int(r["prompt_tokens"]), int(r["output_tokens"])
            tier = TIERS.index(r["tier"]) if isinstance(r.get("tier"), str) else int(r.get("tier", 1))
        except (ValueError, KeyError, TypeError) as exc:
            raise GpudiagError(f"{path}:{lineno}: not a trace record ({exc})") from None
        if prompt <= 0 or out <= 0 or arrival < 0 or not 0 <= tier < len(TIERS):
            raise GpudiagError(f"{path}:{lineno}: token counts must be positive, arrival non-negative, "
                               f"tier one of {', '.join(TIERS)}")
        if arrival < duration_s:
            seqs.append(Sequence(len(seqs), arrival, prompt, out, tier, str(r.get("kind", "trace"))))
    seqs.sort(key=lambda s: s.arrival_s)
    for i, s in enumerate(seqs):
        s.seq_id = i
    return seqs
