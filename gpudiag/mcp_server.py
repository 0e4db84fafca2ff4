"""``gpudiag mcp``: gpudiag's read-only investigations as tools of an MCP server, for an AI assistant.

Each tool calls the Python functions its command calls and returns the same
JSON document as that command's ``--json`` (as the result's structured
content), plus a short text summary for the model to read first:

* ``investigate``: ``gpudiag investigate --store PATH | --prometheus URL``;
* ``top``: ``gpudiag top --once --json`` (``--sim SCENARIO`` with ``sim``);
* ``list_findings``: the findings an agent recorded in its store, or the open
  ones a running agent exports on its ``/metrics`` endpoint;
* ``runbook``: ``gpudiag runbook [NAME] --json``;
* ``analyze_trace`` / ``analyze_snapshot``: ``gpudiag analyze trace|snapshot FILE --json``
  (the snapshot through the same restricted unpickler);
* ``repro``: ``gpudiag repro SCENARIO [--fix FIX] --json``, bounded in simulated
  time, one run at a time.

Nothing here writes a file, stops a process or changes a configuration. Every
path a tool is given is resolved (symlinks and ``..``) and must lie inside one
of the allowed directories (:class:`AllowedDirs`); URLs (Prometheus, an
agent's endpoint) are only read from.

Transports: stdio (:func:`serve_stdio`), or streamable HTTP (:func:`serve_http`)
behind a bearer token compared in constant time (:class:`BearerTokenGate`).
The MCP Python SDK is the ``mcp`` extra; it is imported only here.
"""

# No `from __future__ import annotations`: the SDK reads the tools' parameter annotations at run
# time, and they name types local to build_server.
# The command line registers `gpudiag mcp` on every `gpudiag --help`: what only serving or one tool
# needs (the SDK, HTTP, hashing) is imported where it is used.
import logging
import math
import os
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Annotated, Any

from gpudiag.errors import GpudiagError
from gpudiag.findings import json_ready

log = logging.getLogger("gpudiag.mcp")

SERVER_NAME = "gpudiag"
# The agent exporter listens on 9400; the MCP server sits next to it.
DEFAULT_HTTP_PORT = 9410
MCP_PATH = "/mcp"
TOKEN_ENV = "GPUDIAG_MCP_TOKEN"
# A token shorter than this can be guessed by a client allowed to try often enough; the generated
# one (secrets.token_urlsafe(32)) has 43 characters.
MIN_TOKEN_CHARS = 16
# A repro is refused past this much simulated time: the longest shipped scenario (tensor-leak)
# runs 3 h 15 min, about 5 s of one core; an assistant asking for days would hold a core for minutes.
MAX_REPRO_DURATION_S = 4 * 3600.0
# On Ctrl-C the HTTP server waits this long for an assistant's open event stream, then closes it.
HTTP_SHUTDOWN_GRACE_S = 2
# `top --once` takes a first sample and a second one after this many seconds: CPU figures and
# memory trends are differences (the CLI's default --interval, capped at 1 s there too).
TOP_BASELINE_S = 1.0
# A running agent's endpoint answers a scrape in milliseconds; one that does not within this is
# unreachable for an assistant waiting on it.
AGENT_SCRAPE_TIMEOUT_S = 5.0
# Findings listed in a tool's text summary (the structured content has all of them).
SUMMARY_MAX_FINDINGS = 10


# --- the documents -----------------------------------------------------------------------------



class AllowedDirs:
    """The directories whose files the tools may read; any other path is refused.

    A path is resolved first (relative to the server's working directory, through
    every symlink and ``..``), so a link inside an allowed directory that points
    outside it is refused like the outside path itself.
    """

    def __init__(self, dirs: list[str]):
        resolved = []
        for d in dirs:
            real = os.path.realpath(os.path.expanduser(d))
            if not os.path.isdir(real):
                raise GpudiagError(f"--allow-dir {d!r}: not a directory")
            if real not in resolved:
                resolved.append(real)
        if not resolved:
            raise GpudiagError("no directory is allowed: give --allow-dir DIR")
        self.dirs = resolved

    @classmethod
    def default(cls) -> "AllowedDirs":
        """The current directory, and the agent store's default directory when it exists.

        The current directory is left out when it is the file system's root: an assistant
        application may start its servers there, and that would allow every file.
        """
        from gpudiag.agent.config import default_store_path

        cwd = os.getcwd()
        dirs = [] if cwd == os.path.abspath(os.sep) else [cwd]
        store_dir = os.path.dirname(default_store_path())
        if os.path.isdir(store_dir):
            dirs.append(store_dir)
        if not dirs:
            raise GpudiagError(f"the current directory is {cwd} and the agent's store directory {store_dir} does not "
                               "exist: give the directories the tools may read with --allow-dir DIR")
        return cls(dirs)

    def resolve(self, path: str, what: str) -> str:
        """The real path of ``path`` when it lies inside an allowed directory; GpudiagError otherwise."""
        if not isinstance(path, str) or not path.strip():
            raise GpudiagError(f"{what}: give a path")
        real = os.path.realpath(os.path.expanduser(path))
        for d in self.dirs:
            if real == d or real.startswith(d.rstrip(os.sep) + os.sep):
                return real
        raise GpudiagError(f"{what} {path!r} resolves to {real}, outside the allowed directories "
                           f"({', '.join(self.dirs)}); start `gpudiag mcp` with --allow-dir DIR to allow another")


def investigation(allowed: AllowedDirs, *, store: str | None = None, prometheus: str | None = None,
                  files: list[str] | None = None, since: str | None = None, start: str | None = None,
                  end: str | None = None, node: str | None = None, gpu: int | None = None,
                  step: str | None = None) -> dict[str, Any]:
    """The document of ``gpudiag investigate --json`` over a window of a store or of Prometheus.

    ``files`` is the recorded-telemetry source of ``investigate --file``: its paths are
    confined like every other path, and its loader is called where the other sources' are.
    """
    from gpudiag import investigate as I
    from gpudiag.analyzers.registry import ANALYZERS, conclude

    reads: list = []
    given = [name for name, value in (("store", store), ("prometheus", prometheus), ("files", files)) if value]
    if len(given) != 1:
        raise GpudiagError("give the window's source: store (the agent's store file), prometheus (a URL) or files"
                           + (f", one of them, not {' and '.join(given)}" if given else ""))
    if step is not None and prometheus is None:
        raise GpudiagError("step applies to prometheus only (a store holds every sample)")
    if prometheus:
        from gpudiag import promql_source

        window = promql_source.load_window(prometheus, since=since, start=start, end=end, node=node, gpu=gpu,
                                           step=step)
    elif files:
        from gpudiag import file_source

        paths = [str(allowed.resolve(path, "file")) for path in files]
        window, reads = file_source.load_window(paths, since=since, start=start, end=end, node=node, gpu=gpu)
    else:
        window = I.load_store_window(allowed.resolve(store, "store"), since=since, start=start, end=end,
                                     node=node, gpu=gpu)
    # As `gpudiag investigate` does: logs' findings join the analyzers' before the chain is made.
    logged = [f for r in reads for f in r.findings]
    findings = conclude(window, logged + [f for analyze in ANALYZERS.values() for f in analyze(window)])
    covered = I.coverage(window)
    doc = I.document(window, findings, covered)
    if files:
        doc["files"] = [r.to_dict() for r in reads]
    return json_ready(doc)


def top_view(sim: str | None = None, seed: int = 0) -> dict[str, Any]:
    """The document of ``gpudiag top --once --json`` (``--sim SCENARIO`` when ``sim`` is given)."""
    from gpudiag.commands.top import TopModel
    from gpudiag.probes.node import open_probes

    model = TopModel(open_probes(sim, seed=seed), sim=sim)
    try:
        model.tick()
        time.sleep(TOP_BASELINE_S)
        return json_ready(model.tick())
    finally:
        model.close()


def store_findings(allowed: AllowedDirs, store: str | None, *, include_resolved: bool = False,
                   kind: str | None = None, gpu: int | None = None) -> dict[str, Any]:
    """The findings an agent recorded in its store (the open ones unless ``include_resolved``).

    Each is the agent's finding document: the ``investigate`` finding fields plus
    ``state`` (open, resolved, open_at_stop), ``opened_at_s``, ``resolved_at_s`` and ``last_evidence_s``;
    an open finding has no ``end_s`` yet, unless the agent stopped while it was open (``open_at_stop``: its
    end is the last sample the agent saw). Without ``store``, the agent's default store.
    """
    from gpudiag.agent.config import default_store_path
    from gpudiag.agent.store import Store

    if not store:
        store = default_store_path()
        if not os.path.exists(store):
            raise GpudiagError(f"no store given, and the agent's default store {store} does not exist: give store "
                               "(the agent's --store or [store] path) or agent (its endpoint)")
    path = allowed.resolve(store, "store")
    with Store.open(path, readonly=True) as s:
        found = s.findings(0.0, math.inf, kinds=None if kind is None else [kind], gpu=gpu)
    from gpudiag.agent.daemon import OPEN_AT_STOP

    # Open: no end yet, or still open when the agent stopped (nothing has resolved it since).
    open_ = [d for d in found if d.get("end_s") is None or d.get("state") == OPEN_AT_STOP]
    shown = found if include_resolved else open_
    return json_ready({"source": f"store:{path}", "open": len(open_), "resolved": len(found) - len(open_),
                       "findings": shown})


def agent_findings(url: str, *, kind: str | None = None, gpu: int | None = None) -> dict[str, Any]:
    """The open findings a running agent exports on ``url`` (its ``/metrics``): kind, severity, node, GPU.

    The endpoint carries no summary or evidence: those are in the agent's store.
    """
    import urllib.error
    import urllib.parse
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from gpudiag.catalog import CATALOG, M

    parsed = urllib.parse.urlparse(url or "")
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise GpudiagError(f"agent {url!r}: expected the agent's endpoint, http://HOST:PORT")
    metrics_url = url if parsed.path.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(metrics_url, timeout=AGENT_SCRAPE_TIMEOUT_S) as r:
            text = r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        raise GpudiagError(f"agent {metrics_url}: HTTP {exc.code} {exc.reason}"
                           + (" (the exporter asks for credentials: read its store instead)"
                              if exc.code == 401 else "")) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise GpudiagError(f"agent {metrics_url}: cannot reach it ({reason})") from None
    active = CATALOG[M.finding_active].name
    findings = []
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name != active or sample.value != 1:
                    continue
                labels = sample.labels
                index = int(labels["gpu"]) if labels.get("gpu", "").isdigit() else None
                if (kind is None or labels.get("kind") == kind) and (gpu is None or index == gpu):
                    findings.append({"kind": labels.get("kind"), "severity": labels.get("severity"),
                                     "node": labels.get("node"), "gpu": index, "state": "open",
                                     **{k: labels[k] for k in ("pod", "namespace") if labels.get(k)}})
    except ValueError as exc:
        raise GpudiagError(f"agent {metrics_url}: not a Prometheus exposition ({exc})") from None
    return {"source": f"agent:{metrics_url}", "open": len(findings), "resolved": None, "findings": findings,
            "missing": "the endpoint exports kind, severity, node and GPU of the open findings only: their "
                       "summary, evidence and history are in the agent's store (list_findings with store)"}


def runbook_document(name: str | None = None) -> dict[str, Any]:
    """The document of ``gpudiag runbook [NAME] --json``: the list of runbooks, or one runbook's Markdown."""
    from gpudiag.commands.runbook import resolve, runbooks, summary

    books = runbooks()
    if name is None:
        return {"runbooks": [{"name": k, "summary": summary(v)} for k, v in books.items()]}
    key = resolve(name, books)
    return {"name": key, "summary": summary(books[key]), "markdown": books[key]}


def trace_document(allowed: AllowedDirs, path: str) -> dict[str, Any]:
    """The document of ``gpudiag analyze trace FILE --json`` (a PyTorch profiler trace, .json or .json.gz)."""
    from gpudiag.analyzers.kineto import analyze_trace
    from gpudiag.analyzers.trace_reader import read_kineto_trace

    real = allowed.resolve(path, "trace")
    doc = analyze_trace(read_kineto_trace(real)).to_dict()
    doc["file"] = real
    return json_ready(doc)


def snapshot_document(allowed: AllowedDirs, path: str, device_total_gib: float | None = None) -> dict[str, Any]:
    """The document of ``gpudiag analyze snapshot FILE [--device-total-gib G] --json``, read by the restricted
    unpickler."""
    from gpudiag.analyzers.snapshot import fragmentation_report
    from gpudiag.safe_pickle import load_snapshot

    total_bytes = None
    if device_total_gib is not None:
        if not math.isfinite(device_total_gib) or device_total_gib <= 0:
            raise GpudiagError(f"device_total_gib must be a positive number of GiB, not {device_total_gib}")
        total_bytes = int(device_total_gib * 2**30)
    real = allowed.resolve(path, "snapshot")
    doc = fragmentation_report(load_snapshot(real), device_total_bytes=total_bytes).to_dict()
    doc["file"] = real
    doc["html"] = None
    return json_ready(doc)


_repro_running = threading.Lock()


def repro_document(scenario: str, fix: str | None = None, seed: int = 0,
                   duration_s: float | None = None) -> dict[str, Any]:
    """The document of ``gpudiag repro SCENARIO [--fix FIX] [--duration S] --json``.

    One run at a time (GpudiagError while another is running), at most
    MAX_REPRO_DURATION_S of simulated time.
    """
    from gpudiag import repro as R
    from gpudiag.reference_engine import scenarios

    sc = scenarios.get(scenario)
    if fix is not None and fix not in sc.fixes:
        raise GpudiagError(f"unknown fix {fix!r} for {sc.name}; valid: {', '.join(sc.fixes)}")
    planned = duration_s if duration_s is not None else sc.build(fix)[1].duration_s
    if not (0 < planned <= MAX_REPRO_DURATION_S):
        raise GpudiagError(f"duration_s {planned:g}: a repro here runs more than 0 and at most "
                           f"{MAX_REPRO_DURATION_S:g} simulated seconds")

    def overrides(cfg, workload):
        if duration_s is not None:
            workload.duration_s = duration_s
        workload.validate()
        cfg.validate()

    if not _repro_running.acquire(blocking=False):
        raise GpudiagError("a repro is already running (one at a time): try again when it has finished")
    try:
        docs = [R.document(R.run(sc, f, seed, overrides=overrides)) for f in ([None, fix] if fix else [None])]
    finally:
        _repro_running.release()
    doc = docs[-1]
    if fix is not None:
        doc["baseline_run"] = docs[0]
    return json_ready(doc)


# --- the text summaries ------------------------------------------------------------------------


def _when(t: float) -> str:
    if t < 1e9:  # a simulated time base counts from 0
        return f"{t:.0f} s"
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _finding_lines(findings: list[dict[str, Any]]) -> list[str]:
    lines = []
    for f in findings[:SUMMARY_MAX_FINDINGS]:
        where = "".join(x for x in (f" node {f['node']}" if f.get("node") else "",
                                    "" if f.get("gpu") is None else f" gpu {f['gpu']}",
                                    "" if f.get("pid") is None else f" pid {f['pid']}"))
        text = f": {f['summary']}" if f.get("summary") else ""
        lines.append(f"- [{f.get('severity')}] {f.get('kind')}{where}{text}")
    if len(findings) > SUMMARY_MAX_FINDINGS:
        lines.append(f"- ... {len(findings) - SUMMARY_MAX_FINDINGS} more in the structured result")
    return lines


def _investigate_summary(doc: dict[str, Any]) -> list[str]:
    from gpudiag.units import fmt_seconds

    w = doc["window"]
    found = (f"{len(doc['findings'])} finding(s), worst {doc['worst_severity']}" if doc["findings"]
             else "nothing found")
    return ([f"window {_when(w['start_s'])} to {_when(w['end_s'])} ({fmt_seconds(w['end_s'] - w['start_s'])}), "
             f"sources {', '.join(doc['sources'])}: {found}"]
            + _finding_lines(doc["findings"])
            + [f"next: {s['command']}" for s in doc["next_steps"]]
            + [f"could not check {g['check']}: {g['reason']}" for g in doc["gaps"]])


def _top_summary(doc: dict[str, Any]) -> list[str]:
    from gpudiag.catalog import M
    from gpudiag.units import fmt_ratio

    busy = ", ".join(f"GPU {g.get('gpu')} {fmt_ratio(g.get(M.gpu_utilization_ratio))}" for g in doc["gpus"])
    head = (f"node {doc['node']}" + (f" (simulated: {doc['sim']})" if doc.get("sim") else "")
            + f": {len(doc['gpus'])} GPU(s), {len(doc['processes'])} GPU process(es), {len(doc['engines'])} "
            "engine(s)" + (f"; {busy}" if busy else ""))
    return ([head] + [f"{name}: {error}" for name, error in doc["errors"].items()]
            + [f"{name} unavailable: {st.get('reason')}" for name, st in doc["probes"].items()
               if not st.get("available") and name not in doc["errors"]])


def _findings_summary(doc: dict[str, Any]) -> list[str]:
    resolved = "" if doc["resolved"] is None else f", {doc['resolved']} resolved"
    return [f"{doc['open']} open finding(s){resolved} ({doc['source']})"] + _finding_lines(doc["findings"])


def _runbook_summary(doc: dict[str, Any]) -> list[str]:
    if "runbooks" in doc:
        return [f"- {b['name']}: {b['summary']}" for b in doc["runbooks"]]
    return [f"{doc['name']}: {doc['summary']}"]


def _trace_summary(doc: dict[str, Any]) -> list[str]:
    from gpudiag.units import fmt_seconds

    def pct(v):
        return "n/a" if v is None else f"{v:.1f} %"

    return [f"{doc['file']}: span {fmt_seconds(doc['span_s'])}, idle {pct(doc['idle_pct'])}, compute "
            f"{pct(doc['compute_pct'])}, non-compute {pct(doc['non_compute_pct'])}"] + _finding_lines(doc["findings"])


def _snapshot_summary(doc: dict[str, Any]) -> list[str]:
    from gpudiag.units import fmt_bytes

    devices = "; ".join(f"GPU {d['device']}: {fmt_bytes(d['reserved_bytes'])} reserved, {fmt_bytes(d['free_bytes'])} "
                        f"free, largest free block {fmt_bytes(d['largest_free_block_bytes'])}" for d in doc["devices"])
    return [f"{doc['file']}: {devices or 'no segments'}"] + _finding_lines(doc["findings"])


def _repro_summary(doc: dict[str, Any]) -> list[str]:
    from gpudiag.units import fmt_seconds

    lines = []
    for run in ([doc["baseline_run"]] if "baseline_run" in doc else []) + [doc]:
        slo = run["slo"]
        found = ", ".join(f"{f['kind']} ({f['severity']})" for f in run["findings"]) or "none"
        lines.append(f"{run['scenario']}" + (f" --fix {run['fix']}" if run["fix"] else " (unfixed)")
                     + f", {fmt_seconds(run['duration_s'])} simulated: TTFT P99 {fmt_seconds(slo['ttft_p99_s'])}, "
                     f"TPOT P99 {fmt_seconds(slo['tpot_p99_s'])}; findings: {found}")
    return lines


_SUMMARIES = {"investigate": _investigate_summary, "top": _top_summary, "list_findings": _findings_summary,
              "runbook": _runbook_summary, "analyze_trace": _trace_summary, "analyze_snapshot": _snapshot_summary,
              "repro": _repro_summary}


def summarize(tool: str, doc: dict[str, Any]) -> str:
    """A few lines a model reads before the structured result: what was looked at and what was found."""
    return "\n".join(_SUMMARIES[tool](doc))


# --- the server --------------------------------------------------------------------------------

INSTRUCTIONS = """\
gpudiag diagnoses GPU nodes that serve or train LLMs. Every tool is read-only.
Start from an alert or a complaint with `investigate` over the agent's store (or Prometheus):
it returns the causal chain (root cause first), the evidence with figures, what could not be
checked and the next steps. `list_findings` shows what the agent has found on its own, `top`
the node right now, `runbook` what to do about a finding kind or alert, `repro` checks a fix on
the simulated GPU, `analyze_trace` / `analyze_snapshot` read a profiler trace or a memory
snapshot. File paths must lie inside the directories the server allows: {dirs}."""


def build_server(allowed: AllowedDirs):
    """The MCP server (the SDK's MCPServer) with gpudiag's read-only tools, confined to ``allowed``."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp.types import CallToolResult, TextContent, ToolAnnotations
    from pydantic import Field

    from gpudiag import __version__
    from gpudiag.reference_engine import scenarios

    server = MCPServer(SERVER_NAME, version=__version__, log_level="WARNING",
                       instructions=INSTRUCTIONS.format(dirs=", ".join(allowed.dirs)))
    Result = Annotated[CallToolResult, dict[str, Any]]

    def answer(tool: str, make) -> CallToolResult:
        try:
            doc = make()
        except GpudiagError as exc:
            raise ToolError(str(exc)) from None
        except Exception as exc:  # a bug: the assistant reads one line, the log has the traceback
            log.exception("tool %s failed", tool)
            raise ToolError(f"internal error: {type(exc).__name__}: {exc}") from None
        return CallToolResult(content=[TextContent(type="text", text=summarize(tool, doc))], structured_content=doc)

    def tool(name: str, *, title: str, reads_network: bool = False):
        def add(fn):
            # The docstring is the description, on one line (the SDK keeps the source's indentation).
            server.add_tool(fn, name=name, title=title, description=" ".join(fn.__doc__.split()),
                            # Read-only and idempotent: asking twice reads the same data (a live view moves on).
                            annotations=ToolAnnotations(read_only_hint=True, destructive_hint=False,
                                                        idempotent_hint=True, open_world_hint=reads_network))
            return fn

        return add

    Since = Annotated[str | None, Field(description="Window length back from the latest sample (the store) or now "
                                        "(Prometheus): 90s, 30m, 2h, 1d. Default 30m.")]
    From = Annotated[str | None, Field(validation_alias="from", description="Window start: ISO-8601 (no offset = "
                                       "the server's local time) or Unix seconds.")]
    To = Annotated[str | None, Field(description="Window end (default: the store's latest "
                                     "sample; now with prometheus).")]

    @tool("investigate", title="Investigate a window", reads_network=True)
    def investigate(
        store: Annotated[str | None, Field(description="The agent's timeline store (SQLite file), inside an "
                                           "allowed directory.")] = None,
        prometheus: Annotated[str | None, Field(description="Read the window from this Prometheus (or Thanos, "
                                                "Mimir) instead: http://prometheus:9090.")] = None,
        files: Annotated[list[str] | None, Field(description="Or recorded files, inside allowed directories: "
                                                 "nvidia-smi logs, dcgm-exporter dumps, OpenMetrics, folders of "
                                                 "/metrics scrapes, logs with PyTorch out-of-memory messages.")]
        = None,
        since: Since = None,
        from_: From = None,
        to: To = None,
        node: Annotated[str | None, Field(description="Only this node's rows.")] = None,
        gpu: Annotated[int | None, Field(description="Only this GPU's rows (index).")] = None,
        step: Annotated[str | None, Field(description="With prometheus: the range queries' step (15s).")] = None,
    ) -> Result:
        """Run every analyzer over a window of the agent's store, of Prometheus or of recorded files: the causal
        chain (root cause first), each finding's evidence, the three-colour memory of the implicated processes,
        the next steps and what could not be checked. The same document as `gpudiag investigate --json`."""
        return answer("investigate", lambda: investigation(
            allowed, store=store, prometheus=prometheus, files=files, since=since, start=from_, end=to, node=node,
            gpu=gpu, step=step))

    scenario_help = "; ".join(f"{s.name} (fixes: {', '.join(s.fixes) or 'none'})"
                              for s in scenarios.SCENARIOS.values())

    @tool("top", title="The node now")
    def top(
        sim: Annotated[str | None, Field(description="Read the simulated GPU running this scenario instead of the "
                                         f"node's GPUs: {', '.join(scenarios.SCENARIOS)}.")] = None,
        seed: Annotated[int, Field(description="With sim: the workload's random seed.")] = 0,
    ) -> Result:
        """One frame of the node: each GPU (utilization, memory, temperature, power, clocks, throttling), each GPU
        process's three memory colours and host CPU, each engine's queue and KV usage. The same document as
        `gpudiag top --once --json`; takes about a second (a second sample for rates)."""
        return answer("top", lambda: top_view(sim, seed))

    @tool("list_findings", title="Findings the agent recorded", reads_network=True)
    def list_findings(
        store: Annotated[str | None, Field(description="The agent's store (default: the agent's default store "
                                           "path).")] = None,
        agent: Annotated[str | None, Field(description="Instead, a running agent's endpoint (http://HOST:9400): "
                                           "its open findings without summary or evidence.")] = None,
        include_resolved: Annotated[bool, Field(description="With store: also the resolved findings.")] = False,
        kind: Annotated[str | None, Field(description="Only this finding kind (kv_eviction_storm).")] = None,
        gpu: Annotated[int | None, Field(description="Only this GPU (index).")] = None,
    ) -> Result:
        """The findings an agent opened on its own (the open ones; resolved ones on request): kind, severity,
        span, summary and evidence from its store, or the open ones a running agent exports."""
        if agent is not None and (store is not None or include_resolved):
            raise ToolError("agent reads a running agent's open findings: give store or agent, not both")
        if agent is not None:
            return answer("list_findings", lambda: agent_findings(agent, kind=kind, gpu=gpu))
        return answer("list_findings", lambda: store_findings(allowed, store, include_resolved=include_resolved,
                                                              kind=kind, gpu=gpu))

    @tool("runbook", title="A runbook")
    def runbook(
        name: Annotated[str | None, Field(description="An alert name (GpudiagKvEvictionStorm) or a finding kind "
                                          "(kv_eviction_storm); none lists the runbooks.")] = None,
    ) -> Result:
        """What a finding means, how to confirm it and what to do, as the alert's runbook says (Markdown); or the
        list of runbooks. The same document as `gpudiag runbook [NAME] --json`."""
        return answer("runbook", lambda: runbook_document(name))

    @tool("analyze_trace", title="Analyze a profiler trace")
    def analyze_trace(
        path: Annotated[str, Field(description="A PyTorch profiler (Kineto) trace, .json or .json.gz, inside an "
                                   "allowed directory.")],
    ) -> Result:
        """Idle, compute and non-compute GPU time per CUDA stream (Holistic Trace Analysis definitions), why the
        GPU was idle (host, kernel wait), launch queue and delay. The same document as
        `gpudiag analyze trace FILE --json`."""
        return answer("analyze_trace", lambda: trace_document(allowed, path))

    @tool("analyze_snapshot", title="Analyze a memory snapshot")
    def analyze_snapshot(
        path: Annotated[str, Field(description="A pickled torch.cuda.memory._snapshot(), inside an allowed "
                                   "directory; read without running any code it holds.")],
        device_total_gib: Annotated[float | None, Field(
            description="Each GPU's memory capacity in GiB, when the snapshot does not record it (torch's does "
                        "not): stranded memory near capacity is judged only with it.")] = None,
    ) -> Result:
        """PyTorch's caching allocator: stranded and releasable memory, holes and the largest free block per GPU
        and per segment, what each OOM ran into, with findings. The same document as
        `gpudiag analyze snapshot FILE [--device-total-gib G] --json`."""
        return answer("analyze_snapshot", lambda: snapshot_document(allowed, path, device_total_gib))

    @tool("repro", title="Reproduce on the simulated GPU")
    def repro(
        scenario: Annotated[str, Field(description=f"The scenario: {scenario_help}.")],
        fix: Annotated[str | None, Field(description="A fix of the scenario, compared with the unfixed run.")] = None,
        seed: Annotated[int, Field(description="Random seed; the same seed gives the same run.")] = 0,
        duration_s: Annotated[float | None, Field(description="Simulated seconds (default the scenario's own; at "
                                                  f"most {MAX_REPRO_DURATION_S:g}).")] = None,
    ) -> Result:
        """Reproduce a field incident on the simulated GPU, diagnose it, and with a fix compare both runs: SLOs
        overall and per phase, totals, findings. One run at a time. The same document as
        `gpudiag repro SCENARIO [--fix FIX] --json`."""
        return answer("repro", lambda: repro_document(scenario, fix, seed, duration_s))

    return server


def serve_stdio(server) -> None:
    """Serve MCP on stdin/stdout until the client closes stdin."""
    server.run("stdio")


# --- streamable HTTP behind a bearer token -----------------------------------------------------


def read_token(token_file: str | None, env: dict[str, str] | None = None) -> tuple[str, str]:
    """(token, where it came from): ``token_file``, else $GPUDIAG_MCP_TOKEN, else a new random one."""
    import secrets

    env = os.environ if env is None else env
    if token_file is not None:
        try:
            with open(token_file, encoding="utf-8") as fh:
                token, origin = fh.read(4096).strip(), f"--token-file {token_file}"
        except (OSError, UnicodeDecodeError) as exc:
            raise GpudiagError(f"--token-file {token_file}: cannot read it: {getattr(exc, 'strerror', None) or exc}"
                               ) from None
    elif env.get(TOKEN_ENV):
        token, origin = env[TOKEN_ENV].strip(), f"${TOKEN_ENV}"
    else:
        return secrets.token_urlsafe(32), "generated"
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise GpudiagError(f"{origin}: the token must be at least {MIN_TOKEN_CHARS} characters without spaces "
                           "(for example the output of `openssl rand -hex 32`)")
    return token, origin


class BearerTokenGate:
    """ASGI middleware: every HTTP request must carry ``Authorization: Bearer <token>``, else 401.

    Both sides are hashed before the constant-time comparison, so neither the
    token's content nor its length shows in the time a refusal takes.
    """

    def __init__(self, app, token: str):
        self.app = app
        self._digest = self._hash(token.encode())

    @staticmethod
    def _hash(value: bytes) -> bytes:
        import hashlib

        return hashlib.sha256(value).digest()

    def accepts(self, header: bytes | None) -> bool:
        """True when ``header`` (the Authorization header's value) names the token."""
        if not header:
            return False
        scheme, _, given = header.strip().partition(b" ")
        import hmac

        return scheme.lower() == b"bearer" and hmac.compare_digest(self._hash(given.strip()), self._digest)

    async def __call__(self, scope, receive, send):
        """Pass lifespan events and authorized requests on; answer anything else with 401."""
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if scope["type"] == "http" and self.accepts(header):
            return await self.app(scope, receive, send)
        if scope["type"] != "http":  # a websocket: nothing here serves one
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"error": "unauthorized: send Authorization: Bearer <token>"}'
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="gpudiag"')]})
        await send({"type": "http.response.body", "body": body})


def _listen_socket(host: str, port: int):
    """A listening TCP socket on (host, port); GpudiagError when it cannot be bound."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        raise GpudiagError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def serve_http(server, *, host: str, port: int, token: str, token_origin: str, loopback: bool) -> None:
    """Serve MCP over streamable HTTP at http://host:port/mcp, every request behind the bearer token."""
    import anyio
    import uvicorn

    sock = _listen_socket(host, port)
    bound = sock.getsockname()[1]
    # On loopback the SDK also checks the Host and Origin headers (DNS rebinding from a browser).
    app = server.streamable_http_app(streamable_http_path=MCP_PATH, host=host if loopback else "0.0.0.0")
    shown = f"[{host}]" if ":" in host else host
    sys.stderr.write(f"gpudiag mcp: streamable HTTP at http://{shown}:{bound}{MCP_PATH}\n")
    if token_origin == "generated":
        sys.stderr.write(f"gpudiag mcp: bearer token (send Authorization: Bearer <token>): {token}\n")
    else:
        sys.stderr.write(f"gpudiag mcp: bearer token from {token_origin}\n")
    sys.stderr.flush()
    config = uvicorn.Config(BearerTokenGate(app, token), log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=HTTP_SHUTDOWN_GRACE_S)
    anyio.run(uvicorn.Server(config).serve, [sock])
