"""End to end on one node: `gpudiag engine serve` under load with `gpudiag agent` beside it.

Starts the reference engine (``--device cuda`` by default; ``cpu`` runs anywhere),
an agent that scrapes it, and ``--clients`` clients posting /generate for
``--load-s`` seconds; scrapes the agent's /metrics meanwhile; then runs
``gpudiag top --once --json``, ``gpudiag doctor --json``, stops the agent with
SIGTERM and runs ``gpudiag investigate`` over the store it wrote. Prints what a
node owner checks first (requests served, scrape latency, the GPU, process and
engine series the agent exports, the stop) and writes every figure as JSON to
``--json`` (default ``$OUT/node_e2e.json`` when OUT is set). Before a figure: requests were
served and the agent's store holds its rows (GPU and process rows on a GPU, engine rows
everywhere) with none dropped; otherwise exit 3 with the reason (the JSON is written first).

    python bench/node_e2e.py [--device cuda|cpu] [--load-s 40] [--clients 16]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import expect, store_rows  # noqa: E402

from gpudiag.catalog import CATALOG, M  # noqa: E402

# The series printed: the GPU (NVML), the engine process's memory colours, the engine, the agent.
SERIES = tuple(CATALOG[c].name for c in (
    M.gpu_utilization_ratio, M.gpu_memory_used_bytes, M.gpu_power_watts, M.process_gpu_memory_bytes,
    M.process_torch_allocated_bytes, M.process_torch_reserved_bytes, M.engine_batch_size, M.engine_kv_used_bytes,
    M.agent_probe_errors_total))


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _wait(url: str, limit_s: float, proc: subprocess.Popen) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s and proc.poll() is None:
        try:
            _get(url, 2.0)
            return time.monotonic() - t0
        except OSError:
            time.sleep(0.5)
    return None


def _series(text: str, name: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith((name + "{", name + " "))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu", "sim"))
    ap.add_argument("--load-s", type=float, default=40.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--engine-port", type=int, default=8011)
    ap.add_argument("--agent-port", type=int, default=9411)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    for name, value, least in (("--load-s", args.load_s, 1), ("--clients", args.clients, 1),
                               ("--max-tokens", args.max_tokens, 1)):
        if value < least:
            ap.error(f"{name} must be at least {least}")
    out_path = args.json or (os.path.join(os.environ["OUT"], "node_e2e.json") if os.environ.get("OUT") else None)
    work = tempfile.mkdtemp(prefix="gpudiag-node-e2e-")
    runtime = os.path.join(work, "runtime")
    os.makedirs(runtime, mode=0o700)
    env = dict(os.environ, GPUDIAG_RUNTIME_DIR=runtime)
    py, res = sys.executable, {"device": args.device}
    engine_url = f"http://127.0.0.1:{args.engine_port}"
    agent_url = f"http://127.0.0.1:{args.agent_port}/metrics"

    elog = open(os.path.join(work, "engine.log"), "w")
    engine = subprocess.Popen([py, "-m", "gpudiag", "engine", "serve", "--device", args.device,
                               "--port", str(args.engine_port), "--max-queue", "256"],
                              stdout=elog, stderr=subprocess.STDOUT, env=env)
    res["engine_up_s"] = _wait(engine_url + "/health", 180, engine)
    if res["engine_up_s"] is None:
        engine.kill()
        print(open(elog.name).read()[-3000:], file=sys.stderr)
        print("node_e2e: the engine did not come up", file=sys.stderr)
        return 1
    cfg = os.path.join(work, "agent.toml")
    store = os.path.join(work, "timeline.db")
    with open(cfg, "w") as f:
        f.write(f'[exporter]\nlisten = "127.0.0.1:{args.agent_port}"\n[store]\npath = "{store}"\n'
                f'[probes]\nengine_interval_s = 2\nengine_urls = ["{engine_url}/metrics"]\n')
    alog = open(os.path.join(work, "agent.log"), "w")
    agent = subprocess.Popen([py, "-m", "gpudiag", "agent", "--config", cfg], stdout=alog,
                             stderr=subprocess.STDOUT, env=env)
    res["agent_up_s"] = _wait(agent_url, 60, agent)
    if res["agent_up_s"] is None:
        agent.kill()
        engine.kill()
        print(open(alog.name).read()[-3000:], file=sys.stderr)
        print("node_e2e: the agent did not come up", file=sys.stderr)
        return 1

    latencies: list[float] = []
    errors: list[str] = []

    def one(i: int) -> None:
        body = json.dumps({"prompt": f"GPU node {i} reports", "max_tokens": args.max_tokens}).encode()
        t = time.monotonic()
        try:
            req = urllib.request.Request(engine_url + "/generate", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
            latencies.append(time.monotonic() - t)
        except OSError as exc:
            errors.append(repr(exc)[:160])

    scrapes: list[float] = []
    end = time.monotonic() + args.load_s
    i = 0
    with cf.ThreadPoolExecutor(args.clients) as pool:
        running: list[cf.Future] = []
        while time.monotonic() < end:
            running = [f for f in running if not f.done()]
            while len(running) < args.clients:
                running.append(pool.submit(one, i))
                i += 1
            time.sleep(0.05)
            if time.monotonic() > end - args.load_s / 2 and len(scrapes) < 5:
                t = time.monotonic()
                _get(agent_url)
                scrapes.append(time.monotonic() - t)
                time.sleep(1.0)
    text = _get(agent_url)
    latencies.sort()
    res.update(requests_ok=len(latencies), request_errors=len(errors), first_errors=errors[:3],
               e2e_p50_s=latencies[len(latencies) // 2] if latencies else None,
               scrape_s=[round(s, 4) for s in scrapes],
               metric_families=len(set(re.findall(r"^# TYPE (\S+)", text, re.M))),
               series={name: _series(text, name)[:4] for name in SERIES})
    top = subprocess.run([py, "-m", "gpudiag", "top", "--once", "--json", "--engine", engine_url + "/metrics",
                          "--runtime-dir", runtime], capture_output=True, text=True, env=env, timeout=120)
    res["top_rc"] = top.returncode
    try:
        doc = json.loads(top.stdout)
        res["top"] = {"gpus": [{k: g.get(k) for k in ("name", "driver_version", "gpu_memory_used_bytes",
                                                        "gpu_utilization_ratio")} for g in doc.get("gpus", [])],
                      "processes": [{k: p.get(k) for k in ("pid", "process_gpu_memory_bytes",
                                                            "process_torch_reserved_bytes",
                                                            "process_torch_allocated_bytes")}
                                    for p in doc.get("processes", [])]}
    except ValueError:
        res["top_error"] = (top.stdout + top.stderr)[-1000:]
    doctor = subprocess.run([py, "-m", "gpudiag", "doctor", "--json"], capture_output=True, text=True, env=env,
                            timeout=120)
    res["doctor_rc"] = doctor.returncode
    try:
        res["doctor_not_ok"] = [(c["feature"], c["name"], c["status"]) for c in json.loads(doctor.stdout)["checks"]
                                if c["status"] != "ok"]
    except (ValueError, KeyError):
        res["doctor_error"] = (doctor.stdout + doctor.stderr)[-1000:]
    t = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    res["agent_rc"] = agent.wait(30)
    res["agent_stop_s"] = round(time.monotonic() - t, 2)
    engine.send_signal(signal.SIGTERM)
    try:
        res["engine_rc"] = engine.wait(60)
    except subprocess.TimeoutExpired:
        engine.kill()
        res["engine_rc"] = "killed after 60 s"
    inv = subprocess.run([py, "-m", "gpudiag", "investigate", "--store", store, "--since", "10m", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    res["investigate_rc"] = inv.returncode
    try:
        d = json.loads(inv.stdout)
        res["findings"] = [(f.get("kind"), f.get("severity")) for f in d.get("findings", [])]
        res["gaps"] = [g.get("check") for g in d.get("gaps", [])]
    except ValueError:
        res["investigate_error"] = (inv.stdout + inv.stderr)[-1000:]
    res["store_rows"] = store_rows(store, ("gpu", "process", "engine", "node")) if os.path.exists(store) else {}
    dropped = CATALOG[M.agent_dropped_events_total].name
    res["store_dropped_rows"] = sum(float(ln.rsplit(" ", 1)[1]) for ln in _series(text, dropped)
                                    if 'probe="store"' in ln)
    engine_log = open(elog.name).read()
    res["engine_log_tracebacks"] = engine_log.count("Traceback")
    res["agent_log_warnings"] = [ln for ln in open(alog.name).read().splitlines() if " WARNING " in ln][:5]

    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1, default=str)
    # The input of every figure below: requests served, and the agent's store holding the rows it
    # exported (GPU and process rows from NVML on a GPU; the engine's everywhere), none dropped.
    expect(res["requests_ok"] > 0, f"no request was served ({res['request_errors']} failed: {res['first_errors']})")
    needed = ("gpu", "process", "engine") if args.device == "cuda" else ("engine",)
    empty = [k for k in needed if not res["store_rows"].get(k)]
    expect(not empty, f"the agent's store holds no {', '.join(empty)} rows ({res['store_rows']})")
    expect(not res["store_dropped_rows"], f"the agent's store dropped {res['store_dropped_rows']:.0f} rows")
    print(f"engine ({args.device}) up in {res['engine_up_s']:.1f} s; agent up in {res['agent_up_s']:.1f} s")
    print(f"load: {res['requests_ok']} requests from {args.clients} clients in {args.load_s:g} s, "
          f"{res['request_errors']} failed, e2e P50 {res['e2e_p50_s'] or 0:.3f} s")
    print(f"agent /metrics: {res['metric_families']} families, scrapes {res['scrape_s']} s")
    for name, lines in res["series"].items():
        print(f"  {name}: {lines[0] if lines else 'absent'}")
    print(f"top --once: rc {res['top_rc']}; doctor: rc {res['doctor_rc']}, not ok: {res.get('doctor_not_ok')}")
    print(f"agent SIGTERM: rc {res['agent_rc']} in {res['agent_stop_s']} s; engine rc {res['engine_rc']}; "
          f"tracebacks in the engine log: {res['engine_log_tracebacks']}")
    print(f"investigate: rc {res['investigate_rc']}, findings {res.get('findings')}, gaps {res.get('gaps')}")
    print(f"store: {', '.join(f'{k} {n}' for k, n in res['store_rows'].items())} rows, none dropped")
    # investigate: nothing of warning level on a calm node; 3 says some analyzers could not judge the
    # window (a few minutes of data, no eBPF), which a short run always leaves.
    ok = (res["requests_ok"] > 0 and res["agent_rc"] == 0 and res["engine_rc"] == 0
          and res["investigate_rc"] in (0, 3) and res["top_rc"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
