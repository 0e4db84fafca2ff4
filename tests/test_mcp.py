"""`gpudiag mcp`: an AI assistant reaches gpudiag's read-only investigations over MCP, by stdio and by HTTP.

The assistant's side is the MCP Python SDK's own client: over stdio it spawns
`.venv/bin/gpudiag mcp` as a subprocess, over HTTP it talks to the server
started as a subprocess on a free 127.0.0.1 port. The data is real: a store
and a live endpoint of `gpudiag agent --sim cpu-starved`, a Kineto trace, and
a trace and a memory snapshot this file writes.
"""

import gzip
import json
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="the MCP Python SDK is not installed (the `mcp` extra of gpudiag)")

import anyio  # noqa: E402 - installed with the SDK
import httpx2  # noqa: E402
from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

from gpudiag import mcp_server as S  # noqa: E402
from gpudiag.catalog import CATALOG, M  # noqa: E402
from gpudiag.cli import main  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GPUDIAG = Path(sys.executable).parent / "gpudiag"
KINETO_TRACE = REPO / ".." / "shared" / "data" / "kineto" / "a100_simple_add.json.gz"
TOOLS = {"investigate", "top", "list_findings", "runbook", "analyze_trace", "analyze_snapshot", "repro"}
MIB = 2**20
# The simulated agent reaches its first findings within seconds; a shared, busy machine is slower.
AGENT_FINDINGS_TIMEOUT_S = 90.0
SERVER_START_TIMEOUT_S = 30.0


# --- what the tests read -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_trace(path: Path) -> Path:
    """Stream 7 runs two 100 µs kernels, the second launched late: a trace the analyzer reads in no time."""
    def x(name, cat, ts, dur, **args):
        runtime = cat == "cuda_runtime"
        return {"ph": "X", "cat": cat, "name": name, "pid": 4242 if runtime else 0, "tid": 1 if runtime else 7,
                "ts": ts, "dur": dur, "args": args}

    events = [x("cudaLaunchKernel", "cuda_runtime", 990, 5, correlation=1),
              x("cudaLaunchKernel", "cuda_runtime", 1400, 5, correlation=2),
              x("gemm", "kernel", 1000, 100, stream=7, correlation=1, device=0),
              x("gemm", "kernel", 1500, 100, stream=7, correlation=2, device=0)]
    path.write_bytes(gzip.compress(json.dumps({"schemaVersion": 1, "traceEvents": events}).encode()))
    return path


def _tiny_snapshot(path: Path) -> Path:
    """One 20 MiB segment: 4 MiB allocated, a 12 MiB hole and a 4 MiB one."""
    blocks = [{"address": 0, "size": size, "requested_size": size, "state": state, "frames": []}
              for size, state in ((2 * MIB, "active_allocated"), (4 * MIB, "inactive"),
                                  (2 * MIB, "active_allocated"), (12 * MIB, "inactive"))]
    segment = {"device": 0, "address": 0x7F0000000000, "total_size": 20 * MIB, "allocated_size": 4 * MIB,
               "active_size": 4 * MIB, "requested_size": 0, "stream": 0, "segment_type": "large",
               "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks}
    path.write_bytes(pickle.dumps({"segments": [segment], "device_traces": [[]]}))
    return path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """allowed/ (what the server may read) and outside/, with a symlink of each kind leading out."""
    root = tmp_path_factory.mktemp("mcp")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    for d in (allowed, outside):
        _tiny_trace(d / "trace.json.gz")
        _tiny_snapshot(d / "snapshot.pickle")
    (allowed / "escape").symlink_to(outside, target_is_directory=True)
    (allowed / "trace-link.json.gz").symlink_to(outside / "trace.json.gz")
    return allowed, outside


class _Agent:
    """A `gpudiag agent --sim cpu-starved` run: its store, its endpoint, and stop()."""

    def __init__(self, proc, store: Path, url: str, log: Path):
        self.proc, self.store, self.url, self.log = proc, store, url, log

    def stop(self) -> None:
        """SIGINT, as an operator stops it: the agent flushes and closes its store."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def agent(workspace):
    """A simulated agent writing into allowed/agent/, running once its first findings are open.

    The HTTP tests read its endpoint live; the stdio tests (later in this file) stop it first, so the
    command line and the tools read the same finished store.
    """
    allowed, _ = workspace
    (allowed / "agent").mkdir()
    store, log = allowed / "agent" / "timeline.db", allowed.parent / "agent.log"
    port = _free_port()
    with open(log, "w") as fh:
        proc = subprocess.Popen([str(GPUDIAG), "agent", "--sim", "cpu-starved", "--speed", "100", "--store",
                                 str(store), "--listen", f"127.0.0.1:{port}"], stdout=fh, stderr=fh)
    run = _Agent(proc, store, f"http://127.0.0.1:{port}", log)
    active = CATALOG[M.finding_active].name
    deadline = time.monotonic() + AGENT_FINDINGS_TIMEOUT_S
    try:
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(run.url + "/metrics", timeout=5) as r:
                    lines = r.read().decode().splitlines()
                if any(line.startswith(active) and 'kind="cpu_starved_gpu"' in line for line in lines):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"no finding within {AGENT_FINDINGS_TIMEOUT_S} s:\n{log.read_text()}"
            time.sleep(0.5)
        yield run
    finally:
        run.stop()


@pytest.fixture
def cli_json(capsys):
    """``gpudiag ARGS... --json`` in this process: the document it prints."""

    def run(*args):
        main([str(a) for a in args] + ["--json"])
        out, err = capsys.readouterr()
        assert out, err
        return json.loads(out)

    return run


def _cli_error(capsys, *args) -> str:
    """The one error line of a `gpudiag` call that must fail with exit 2."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpudiag: error: "), err
    return lines[0]


# --- the assistant's side ----------------------------------------------------------------------


@asynccontextmanager
async def _stdio(*args, cwd: Path):
    """An initialized client session with `gpudiag mcp ARGS` spawned over stdio in ``cwd`` (a test's folder:
    the server's stderr goes to a log beside it)."""
    params = StdioServerParameters(command=str(GPUDIAG), args=["mcp", *map(str, args)], cwd=str(cwd))
    with open(cwd.parent / f"{cwd.name}-mcp-stderr.log", "a") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                yield session


@asynccontextmanager
async def _http(url: str, token: str | None, statuses: list[int] | None = None):
    """An initialized client session with the HTTP server at ``url``, sending ``token``; ``statuses`` collects
    the HTTP status of every response."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}

    async def record(response):
        if statuses is not None:
            statuses.append(response.status_code)

    async with httpx2.AsyncClient(headers=headers, timeout=60, event_hooks={"response": [record]}) as client:
        async with streamable_http_client(url, http_client=client) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                yield session


def _read_lines(proc, count: int, timeout_s: float = SERVER_START_TIMEOUT_S) -> list[str]:
    """The first ``count`` lines the server writes on stderr (read unbuffered, so a timeout applies)."""
    data, deadline = b"", time.monotonic() + timeout_s
    while data.count(b"\n") < count:
        ready, _, _ = select.select([proc.stderr], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no {count} lines from the server within {timeout_s} s: {data!r}"
        chunk = os.read(proc.stderr.fileno(), 4096)
        assert chunk, f"the server exited ({proc.wait()}): {data!r}"
        data += chunk
    return [line.strip() for line in data.decode().splitlines()[:count]]


class _HttpServer:
    def __init__(self, proc, url: str, first_lines: list[str]):
        self.proc, self.url, self.first_lines = proc, url, first_lines


def _start_http(*args, cwd: Path, env: dict | None = None) -> _HttpServer:
    """`gpudiag mcp --http ARGS` as a subprocess; its URL and its first stderr lines (address, token)."""
    proc = subprocess.Popen([str(GPUDIAG), "mcp", "--http", *map(str, args)], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env)
    try:
        lines = _read_lines(proc, 2)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    assert lines[0].startswith("gpudiag mcp: streamable HTTP at http://"), lines
    url = lines[0].split(" at ", 1)[1].replace("0.0.0.0", "127.0.0.1")
    return _HttpServer(proc, url, lines)


def _stop(server: _HttpServer) -> None:
    server.proc.terminate()
    server.proc.wait(timeout=30)
    server.proc.stderr.close()


def _post_status(url: str, headers: dict) -> int:
    """The HTTP status of an MCP initialize request carrying ``headers``."""
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "0"}}})
    req = urllib.request.Request(url, data=body.encode(), headers={
        "Content-Type": "application/json", "Accept": "application/json, text/event-stream", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _text(result) -> str:
    return "\n".join(c.text for c in result.content if c.type == "text")


# --- HTTP ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http_server(workspace):
    """The HTTP server as an operator starts it: defaults (127.0.0.1, a generated token), run from allowed/."""
    allowed, _ = workspace
    env = {k: v for k, v in os.environ.items() if k != S.TOKEN_ENV}
    server = _start_http("--listen", "127.0.0.1:0", cwd=allowed, env=env)
    yield server
    _stop(server)


def test_over_http_a_call_without_the_token_or_with_a_wrong_one_is_refused(http_server):
    head, token_line = http_server.first_lines
    assert head.startswith("gpudiag mcp: streamable HTTP at http://127.0.0.1:")
    token = token_line.rsplit(": ", 1)[1]
    assert len(token) >= S.MIN_TOKEN_CHARS
    assert _post_status(http_server.url, {}) == 401
    assert _post_status(http_server.url, {"Authorization": "Bearer " + "x" * len(token)}) == 401
    assert _post_status(http_server.url, {"Authorization": f"Basic {token}"}) == 401
    assert _post_status(http_server.url, {"Authorization": f"Bearer {token}"}) == 200

    statuses = []

    async def wrong_token():
        async with _http(http_server.url, "not-the-token-at-all", statuses):
            pass

    with pytest.raises(Exception, match="unhandled errors"):  # the SDK's client fails to initialize
        anyio.run(wrong_token)
    assert statuses == [401]


def test_over_http_with_the_token_an_assistant_reads_a_running_agent_s_open_findings(http_server, agent):
    token = http_server.first_lines[1].rsplit(": ", 1)[1]

    async def go():
        async with _http(http_server.url, token) as session:
            names = {t.name for t in (await session.list_tools()).tools}
            live = await session.call_tool("list_findings", {"agent": agent.url})
            # The server runs in allowed/: by default the current directory is readable, relative paths too.
            stored = await session.call_tool("list_findings", {"store": "agent/timeline.db"})
            return names, live, stored

    names, live, stored = anyio.run(go)
    assert names == TOOLS
    assert not live.is_error, _text(live)
    doc = live.structured_content
    assert doc["source"] == f"agent:{agent.url}/metrics"
    found = {(f["kind"], f["severity"], f["gpu"]) for f in doc["findings"]}
    assert ("cpu_starved_gpu", "critical", 0) in found
    assert "store" in doc["missing"]  # the endpoint has no evidence: the store does
    assert "cpu_starved_gpu" in _text(live)
    assert not stored.is_error, _text(stored)
    assert stored.structured_content["source"] == f"store:{agent.store.resolve()}"


def test_a_token_file_gives_the_token_and_a_remote_bind_with_allow_remote_still_requires_it(workspace, tmp_path):
    allowed, _ = workspace
    secret = tmp_path / "token"
    secret.write_text("s3cret-token-from-a-file-0123456789\n")
    server = _start_http("--listen", "0.0.0.0:0", "--allow-remote", "--token-file", secret, cwd=allowed)
    try:
        assert server.first_lines[1] == f"gpudiag mcp: bearer token from --token-file {secret}"
        assert _post_status(server.url, {}) == 401
        assert _post_status(server.url, {"Authorization": "Bearer s3cret-token-from-a-file-0123456789"}) == 200
    finally:
        _stop(server)


def test_the_token_comes_from_the_file_then_the_environment_else_a_new_one(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("from-the-file-0123456789\n")
    env = {S.TOKEN_ENV: "from-the-environment-0123456789"}
    assert S.read_token(str(secret), env) == ("from-the-file-0123456789", f"--token-file {secret}")
    assert S.read_token(None, env) == ("from-the-environment-0123456789", f"${S.TOKEN_ENV}")
    token, origin = S.read_token(None, {})
    assert origin == "generated" and len(token) >= 40 and token != S.read_token(None, {})[0]
    gate = S.BearerTokenGate(None, "from-the-file-0123456789")
    assert gate.accepts(b"Bearer from-the-file-0123456789") and gate.accepts(b"bearer  from-the-file-0123456789")
    for header in (None, b"", b"Bearer", b"Bearer from-the-file-012345678", b"Bearer from-the-file-01234567890",
                   b"Token from-the-file-0123456789"):
        assert not gate.accepts(header), header


def test_bad_arguments_are_one_line_and_exit_2(capsys, tmp_path):
    assert "not a loopback address" in _cli_error(capsys, "mcp", "--http", "--listen", "0.0.0.0:9410")
    assert "--allow-remote" in _cli_error(capsys, "mcp", "--http", "--listen", "0.0.0.0:9410")
    assert "expected HOST:PORT" in _cli_error(capsys, "mcp", "--http", "--listen", "9410")
    assert "port must be a number" in _cli_error(capsys, "mcp", "--http", "--listen", "127.0.0.1:http")
    assert "applies to --http only" in _cli_error(capsys, "mcp", "--token-file", tmp_path / "t")
    assert "applies to --http only" in _cli_error(capsys, "mcp", "--allow-remote")
    assert "not a directory" in _cli_error(capsys, "mcp", "--allow-dir", tmp_path / "nowhere")
    assert "cannot read it" in _cli_error(capsys, "mcp", "--http", "--token-file", tmp_path / "missing")
    (tmp_path / "short").write_text("abc\n")
    assert f"at least {S.MIN_TOKEN_CHARS} characters" in _cli_error(
        capsys, "mcp", "--http", "--token-file", tmp_path / "short")
    (tmp_path / "long").write_text("a-long-enough-token-0123\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert f"cannot listen on 127.0.0.1:{port}" in _cli_error(
            capsys, "mcp", "--http", "--listen", f"127.0.0.1:{port}", "--token-file", tmp_path / "long")


# --- stdio ---------------------------------------------------------------------------------------


def test_over_stdio_each_tool_answers_with_the_document_of_its_command_s_json(workspace, agent, cli_json):
    allowed, _ = workspace
    agent.stop()  # a finished store: the CLI and the tool read the same window
    store = str(agent.store.resolve())
    trace, snapshot = str(allowed / "trace.json.gz"), str(allowed / "snapshot.pickle")
    log = allowed / "gpu.log"  # an nvidia-smi query log: the recorded-files source
    log.write_text("timestamp, index, name, utilization.gpu [%], memory.used [MiB], memory.total [MiB]\n" + "".join(
        f"2026/02/15 06:{m:02d}:{s:02d}.000, 0, NVIDIA H100 80GB HBM3, {40 + s % 7} %, 30000 MiB, 81559 MiB\n"
        for m in range(10) for s in range(0, 60, 10)))

    async def go():
        async with _stdio("--allow-dir", allowed, cwd=allowed) as session:
            calls = {
                "investigate": ("investigate", {"store": store, "since": "5m"}),
                "investigate_from_to": ("investigate", {"store": store, "from": "0", "to": "9999999999"}),
                "investigate_file": ("investigate", {"files": [str(log)]}),
                "list_findings": ("list_findings", {"store": store}),
                "runbooks": ("runbook", {}),
                "runbook": ("runbook", {"name": "cpu_starved_gpu"}),
                "analyze_trace": ("analyze_trace", {"path": trace}),
                "analyze_snapshot": ("analyze_snapshot", {"path": snapshot}),
                "analyze_snapshot_80gib": ("analyze_snapshot", {"path": snapshot, "device_total_gib": 80}),
                "repro": ("repro", {"scenario": "cpu-starved", "fix": "preprocess-workers", "duration_s": 120}),
                "top": ("top", {"sim": "healthy"}),
            }
            return {key: await session.call_tool(name, args) for key, (name, args) in calls.items()}

    got = anyio.run(go)
    for key, result in got.items():
        assert not result.is_error, (key, _text(result))
        assert _text(result), key  # a summary to read first
    doc = lambda key: got[key].structured_content  # noqa: E731

    assert doc("investigate") == cli_json("investigate", "--store", store, "--since", "5m")
    assert doc("investigate_from_to") == cli_json("investigate", "--store", store, "--from", "0", "--to", "9999999999")
    assert "cpu_starved_gpu" in [f["kind"] for f in doc("investigate")["findings"]]
    assert doc("investigate_file") == cli_json("investigate", "--file", str(log))
    assert doc("investigate_file")["files"][0]["format"] == "nvidia-smi"
    assert "[critical] cpu_starved_gpu" in _text(got["investigate"])
    assert doc("runbooks") == cli_json("runbook")
    assert doc("runbook") == cli_json("runbook", "cpu_starved_gpu")
    assert doc("analyze_trace") == cli_json("analyze", "trace", trace)
    assert doc("analyze_snapshot") == cli_json("analyze", "snapshot", snapshot)
    assert doc("analyze_snapshot")["largest_free_block_bytes"] == 12 * MIB
    assert doc("analyze_snapshot_80gib") == cli_json("analyze", "snapshot", snapshot, "--device-total-gib", "80")
    assert doc("analyze_snapshot_80gib")["devices"][0]["device_total_bytes"] == 80 * 2**30
    assert doc("repro") == cli_json("repro", "cpu-starved", "--fix", "preprocess-workers", "--duration", "120")
    assert "cpu-starved --fix preprocess-workers" in _text(got["repro"])

    findings = doc("list_findings")
    assert findings["source"] == f"store:{store}" and findings["open"] == len(findings["findings"]) >= 1
    # The agent stopped: what was open then ends at its last sample and stays open (nothing resolved it).
    assert all(f["state"] == "open_at_stop" and f["end_s"] is not None for f in findings["findings"])
    assert ("cpu_starved_gpu", "critical") in {(f["kind"], f["severity"]) for f in findings["findings"]}

    view = doc("top")
    assert set(view) == {"t", "node", "sim", "host", "gpus", "processes", "engines", "probes", "errors"}
    assert view["sim"] == "healthy" and len(view["gpus"]) == 1 and view["engines"]


def test_the_real_a100_trace_reads_the_same_over_mcp_as_from_the_command_line(cli_json, tmp_path):
    if not KINETO_TRACE.exists():
        pytest.skip(f"HTA's test trace is not in {KINETO_TRACE.parent.resolve()} (shared data not mounted)")
    folder = KINETO_TRACE.parent.resolve()
    path = str(KINETO_TRACE.resolve())

    async def go():
        async with _stdio("--allow-dir", folder, cwd=tmp_path) as session:
            return await session.call_tool("analyze_trace", {"path": path})

    result = anyio.run(go)
    assert not result.is_error, _text(result)
    assert result.structured_content == cli_json("analyze", "trace", path)
    assert "idle 99.7 %" in _text(result) and "cpu_starved_gpu" in _text(result)


def test_a_path_outside_the_allowed_directories_is_refused_even_through_dotdot_or_a_symlink(workspace):
    allowed, outside = workspace
    refused = {
        "outside": ("analyze_trace", {"path": str(outside / "trace.json.gz")}),
        "dotdot": ("analyze_trace", {"path": str(allowed / ".." / "outside" / "trace.json.gz")}),
        "relative dotdot": ("analyze_snapshot", {"path": "../outside/snapshot.pickle"}),
        "directory symlink": ("analyze_snapshot", {"path": str(allowed / "escape" / "snapshot.pickle")}),
        "file symlink": ("analyze_trace", {"path": str(allowed / "trace-link.json.gz")}),
        "store": ("investigate", {"store": str(allowed / "escape" / "timeline.db")}),
        "findings": ("list_findings", {"store": "/etc/passwd"}),
    }

    async def go():
        async with _stdio("--allow-dir", allowed, cwd=allowed) as session:
            out = {key: await session.call_tool(name, args) for key, (name, args) in refused.items()}
            out["inside"] = await session.call_tool("analyze_trace", {"path": "trace.json.gz"})
            return out

    got = anyio.run(go)
    assert not got.pop("inside").is_error  # the same file, inside: read
    for key, result in got.items():
        assert result.is_error and result.structured_content is None, key
        assert "outside the allowed directories" in _text(result) and str(allowed) in _text(result), key


def test_one_repro_runs_at_a_time_and_its_simulated_time_is_capped(workspace):
    allowed, _ = workspace

    async def go():
        async with _stdio("--allow-dir", allowed, cwd=allowed) as session:
            results = {}

            async def call(key, delay_s, args):
                await anyio.sleep(delay_s)
                results[key] = await session.call_tool("repro", args)

            async with anyio.create_task_group() as tg:
                tg.start_soon(call, "long", 0, {"scenario": "queue-avalanche"})  # a few seconds of simulation
                tg.start_soon(call, "second", 0.5, {"scenario": "healthy", "duration_s": 30})
            results["too long"] = await session.call_tool("repro", {"scenario": "healthy", "duration_s": 1e6})
            results["unknown"] = await session.call_tool("repro", {"scenario": "no-such-scenario"})
            results["after"] = await session.call_tool("repro", {"scenario": "healthy", "duration_s": 30})
            return results

    got = anyio.run(go)
    assert not got["long"].is_error and got["long"].structured_content["scenario"] == "queue-avalanche"
    assert got["second"].is_error and "already running" in _text(got["second"])
    assert got["too long"].is_error and f"at most {S.MAX_REPRO_DURATION_S:g}" in _text(got["too long"])
    assert got["unknown"].is_error and "valid: kv-eviction-storm" in _text(got["unknown"])
    assert not got["after"].is_error  # the lock is released after a run


def test_no_tool_name_suggests_a_write_and_every_tool_is_marked_read_only(tmp_path):
    server = S.build_server(S.AllowedDirs([str(tmp_path)]))
    tools = anyio.run(server.list_tools)
    assert {t.name for t in tools} == TOOLS
    writes = ("write", "delete", "remove", "kill", "stop", "restart", "set", "update", "create", "apply", "exec",
              "run", "put", "post", "patch", "drop", "clear", "reset", "config", "install", "save")
    for t in tools:
        assert not any(w in t.name.lower().split("_") for w in writes), t.name
        assert t.annotations.read_only_hint is True and t.annotations.destructive_hint is False, t.name
        assert t.output_schema and t.output_schema["type"] == "object", t.name
