"""Tokens per second of the real-tensor reference engine on the CPU: prefill and decode measured apart.

Each run builds nothing new: one engine (the ``small`` preset by default,
~25 M parameters, float32, paged KV) takes a batch of prompts; the first
step is their prefill (all prompts in one packed step), then every step is a
decode over the whole batch. Prefill tokens/s = prompt tokens / prefill
time; decode tokens/s = batch x steps / decode time. Printed: the median of
``--runs`` runs (after one warm-up run), and the spread; beside the wall-clock
rates, tokens per CPU second of this process, which a machine shared with
other work does not move as much. Before a figure: the prefill took the whole batch in
one step and every sequence decoded every step; otherwise exit 3 with the reason.

One torch thread by default: on a small shared VM, torch's intra-op threads
wait on each other at every operator (measured here: an [8, 512] x [512,
1408] matmul took 0.7 ms on one thread and 23 ms on two with the second core
busy elsewhere). ``--threads 0`` keeps torch's own choice.

    .venv/bin/python bench/bench_engine_cpu.py [--model small] [--batch 8] [--prompt-len 128]
        [--decode-steps 32] [--runs 5] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import expect  # noqa: E402


def one_run(engine, batch: int, prompt_len: int, decode_steps: int, seed: int) -> dict:
    """Prefill and decode timings of one batch through ``engine``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    seqs = [engine.add_request(p, decode_steps + 1, stop_at_eos=False) for p in prompts]
    t0, c0 = time.perf_counter(), time.process_time()
    done = engine.step()
    t1, c1 = time.perf_counter(), time.process_time()
    expect(len(done) == batch and all(s.generated == 1 for s in seqs),
           f"the prefill took {len(done)} of {batch} prompts ({[s.generated for s in seqs]} tokens generated)")
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
    t2, c2 = time.perf_counter(), time.process_time()
    expect(steps == decode_steps and all(s.generated == decode_steps + 1 for s in seqs),
           f"the decode took {steps} steps for {decode_steps} ({[s.generated for s in seqs]} tokens generated)")
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1,
            "prefill_tokens_per_s": batch * prompt_len / (t1 - t0),
            "decode_tokens_per_s": batch * decode_steps / (t2 - t1),
            "decode_step_ms": (t2 - t1) / decode_steps * 1e3,
            "prefill_tokens_per_cpu_s": batch * prompt_len / (c1 - c0),
            "decode_tokens_per_cpu_s": batch * decode_steps / (c2 - c1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="preset or JSON config (default small)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1; 0: torch's own choice)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()

    import torch

    from gpudiag.reference_engine.core.scheduler import SchedulerConfig
    from gpudiag.reference_engine.model.llm_engine import LLMEngine, LLMEngineConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(LLMEngineConfig(device="cpu", model=args.model, kv_capacity_bytes=256 << 20,
                                       scheduler=SchedulerConfig(max_num_seqs=max(args.batch, 1))))
    one_run(engine, args.batch, args.prompt_len, args.decode_steps, seed=-1)  # warm-up: allocator, caches
    runs = [one_run(engine, args.batch, args.prompt_len, args.decode_steps, seed=i) for i in range(args.runs)]
    keys = ("prefill_tokens_per_s", "decode_tokens_per_s", "decode_step_ms", "prefill_s", "decode_s",
            "prefill_tokens_per_cpu_s", "decode_tokens_per_cpu_s")
    summary = {k: statistics.median(r[k] for r in runs) for k in keys}
    spread = {k: (min(r[k] for r in runs), max(r[k] for r in runs)) for k in keys}
    setup = {"model": engine.model_config.name, "params": engine.model_config.param_count(),
             "dtype": engine.model_config.dtype, "batch": args.batch, "prompt_len": args.prompt_len,
             "decode_steps": args.decode_steps, "runs": args.runs, "threads": torch.get_num_threads(),
             "torch": torch.__version__}
    if args.json:
        print(json.dumps({"setup": setup, "median": summary, "min_max": spread}, indent=2))
        return 0
    print(f"model {setup['model']} ({setup['params'] / 1e6:.1f} M params, {setup['dtype']}), batch {args.batch}, "
          f"prompt {args.prompt_len} tokens, {args.decode_steps} decode steps, {setup['threads']} threads, "
          f"torch {setup['torch']}; median of {args.runs} runs [min, max]")
    print(f"  prefill: {summary['prefill_tokens_per_s']:>9.0f} tokens/s  "
          f"[{spread['prefill_tokens_per_s'][0]:.0f}, {spread['prefill_tokens_per_s'][1]:.0f}]  "
          f"({summary['prefill_s'] * 1e3:.1f} ms for {args.batch * args.prompt_len} tokens; "
          f"{summary['prefill_tokens_per_cpu_s']:.0f} per CPU second)")
    print(f"  decode:  {summary['decode_tokens_per_s']:>9.0f} tokens/s  "
          f"[{spread['decode_tokens_per_s'][0]:.0f}, {spread['decode_tokens_per_s'][1]:.0f}]  "
          f"({summary['decode_step_ms']:.2f} ms per step of {args.batch}; "
          f"{summary['decode_tokens_per_cpu_s']:.0f} per CPU second)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
