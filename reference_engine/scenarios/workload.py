"""Workloads: when requests arrive, how long they are, which tier they belong to.

Arrivals are Poisson (exponential gaps at ``qps``) or read from a trace;
lengths are log-normal, clamped; phases switch the request mix over time
(for example a 30-minute long-sequence phase). Everything is drawn from one
seeded generator, so a seed fixes the run.
"""

from __future__ import annotations

import itertools
import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gpudiag.errors import GpudiagError
from gpudiag.reference_engine.core.sequence import TIERS, Sequence


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
    # Every prompt of the class starts with the same this many tokens (a system prompt, a
    # product description): ``prompt`` draws the part after it.
    shared_prefix_tokens: int = 0
    # Conversations: an arrival starts a conversation of this many turns; each turn's prompt is the
    # whole conversation so far (previous prompts and answers) plus a new message of ``prompt``
    # tokens. ``think_s``: seconds from one turn's arrival to the next (reading, typing).
    turns: LengthDist | None = None
    think_s: LengthDist = LengthDist(30, 0.5, 5, 300)


@dataclass(frozen=True)
class Phase:
    """A named span of the run with its own request mix and rate."""

    name: str
    start_s: float
    end_s: float
    mix: tuple[RequestClass, ...]
    qps: float | None = None  # None: the workload's rate


# Every request of a run is made up front and simulated. kv-eviction-storm asks for about 72,000 and
# runs in about a minute; this many would take half an hour and a gigabyte or so, and a --qps or
# --duration typed with a few zeros too many would run out of memory before printing anything.
MAX_REQUESTS = 2_000_000


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
        if not self.trace_path:
            rate = max([self.qps] + [ph.qps for ph in self.phases if ph.qps is not None])
            asked = rate * self.duration_s
            if not (asked <= MAX_REQUESTS):
                raise GpudiagError(f"{rate:g} QPS for {self.duration_s:g} s asks for up to {asked:.3g} requests; "
                                   f"at most {MAX_REQUESTS:,} are simulated: lower the QPS or the duration")
        if not self.phases and not self.trace_path:
            raise GpudiagError("a workload needs phases or a trace")
        for ph in self.phases:
            if ph.qps is not None and ph.qps < 0:
                raise GpudiagError(f"phase {ph.name!r}: QPS must not be negative")
            if ph.end_s <= ph.start_s:
                raise GpudiagError(f"phase {ph.name!r} ends before it starts")
            if not ph.mix or sum(c.weight for c in ph.mix) <= 0:
                raise GpudiagError(f"phase {ph.name!r} has no request mix")
            if any(c.shared_prefix_tokens < 0 for c in ph.mix):
                raise GpudiagError(f"phase {ph.name!r}: a shared prefix cannot be negative")

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
        segments = itertools.count(1)  # content ids of prompt messages and answers
        conversations = False
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
            prompt, output = cls.prompt.draw(rng), max(1, cls.output.draw(rng))
            if cls.shared_prefix_tokens or cls.turns is not None:
                seqs.extend(self._turns(rng, cls, t, tier, prompt, output, segments))
                conversations = conversations or cls.turns is not None
            else:
                seqs.append(Sequence(len(seqs), t, prompt, output, tier, cls.name))
        if conversations:  # later turns were drawn with their conversation's first
            seqs.sort(key=lambda s: s.arrival_s)
        for i, s in enumerate(seqs):
            s.seq_id = i
        return seqs

    def _turns(self, rng, cls: RequestClass, t: float, tier: int, prompt: int, output: int,
               segments) -> list[Sequence]:
        """The requests of one conversation of ``cls`` (one, without turns), their token content spelled out."""
        content: tuple[tuple[int, int], ...] = ()
        if cls.shared_prefix_tokens:
            content = ((_prefix_segment(cls.name), cls.shared_prefix_tokens),)
        out = []
        for turn in range(cls.turns.draw(rng) if cls.turns is not None else 1):
            if turn:
                t += cls.think_s.draw(rng)
                if t >= self.duration_s:
                    break
                prompt, output = cls.prompt.draw(rng), max(1, cls.output.draw(rng))
            content += ((next(segments), prompt),)
            seq = Sequence(0, t, sum(n for _, n in content), output, tier, cls.name)
            seq.content, seq.output_segment = content, next(segments)
            out.append(seq)
            content += ((seq.output_segment, output),)
        return out


def _prefix_segment(name: str) -> int:
    """The content id of a class's shared prefix: the same in every run, apart from message ids."""
    return (1 << 40) + zlib.crc32(name.encode())


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
