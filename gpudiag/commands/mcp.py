"""``gpudiag mcp``: serve gpudiag's read-only investigations to an AI assistant (Model Context Protocol).

The tools and their confinement are in :mod:`gpudiag.mcp_server`; this module
checks the command line and picks the transport.
"""

from __future__ import annotations

from typing import Optional

import typer

from gpudiag.errors import GpudiagError

# The MCP Python SDK and what it brings (the `mcp` extra): a missing one means the extra is not installed.
SDK_MODULES = ("mcp", "mcp_types", "pydantic", "anyio", "starlette", "uvicorn")

HELP = """Serve gpudiag to an AI assistant over MCP (Model Context Protocol): stdio by default, or
streamable HTTP with --http.

Tools, all read-only (each returns the same JSON document as the command's --json, plus a short
summary): investigate (a window of a store or Prometheus), top (one frame of the node, or of the
simulated GPU), list_findings (an agent's store, or a running agent's endpoint), runbook,
analyze_trace, analyze_snapshot, repro (the simulated GPU; at most
{max_repro:g} simulated seconds, one run at a time). No tool writes a file, stops a process or
changes a configuration.

Files: a tool reads a file (a store, a trace, a snapshot) only inside an allowed directory:
--allow-dir DIR, repeatable; by default the current directory (unless it is /) and the agent store's default
directory (when it exists). A path is resolved first (symlinks and '..'), so a link that leads
outside is refused like the outside path. URLs (prometheus, an agent's endpoint) are read, never
written.

HTTP: binds 127.0.0.1:{port} by default, serves http://HOST:PORT/mcp, and answers only requests
with 'Authorization: Bearer TOKEN'. The token comes from --token-file, else ${env}, else a new
one is generated and printed on stderr. A non-loopback address needs --allow-remote (the token is
still required; put TLS in front of it).
"""


def register(app: typer.Typer) -> None:
    """Add ``gpudiag mcp``."""
    from gpudiag import mcp_server as S

    help_text = HELP.format(max_repro=S.MAX_REPRO_DURATION_S, port=S.DEFAULT_HTTP_PORT, env=S.TOKEN_ENV)

    @app.command("mcp", help=help_text)
    def mcp_command(
        http: bool = typer.Option(False, "--http", help="Serve streamable HTTP instead of stdio."),
        listen: Optional[str] = typer.Option(
            None, "--listen", metavar="HOST:PORT",
            help=f"With --http: the address (default 127.0.0.1:{S.DEFAULT_HTTP_PORT}; port 0 picks a free one)."),
        token_file: Optional[str] = typer.Option(
            None, "--token-file", metavar="FILE",
            help=f"With --http: a file holding the bearer token (else ${S.TOKEN_ENV}, else a generated one printed "
            "on stderr)."),
        allow_remote: bool = typer.Option(
            False, "--allow-remote", help="With --http: allow a non-loopback address (the token is still required)."),
        allow_dir: Optional[list[str]] = typer.Option(
            None, "--allow-dir", metavar="DIR", help="A directory whose files the tools may read (repeatable; "
            "default: the current directory and the agent store's directory)."),
    ):
        run(http=http, listen=listen, token_file=token_file, allow_remote=allow_remote, allow_dir=allow_dir)


def run(*, http: bool, listen: str | None, token_file: str | None, allow_remote: bool,
        allow_dir: list[str] | None) -> None:
    """Check the options, build the server and serve until the client (or Ctrl-C) ends it."""
    from gpudiag import mcp_server as S
    from gpudiag.agent.prom_exporter import is_loopback, parse_listen

    if not http:
        given = [name for name, value in (("--listen", listen), ("--token-file", token_file),
                                          ("--allow-remote", allow_remote)) if value]
        if given:
            raise GpudiagError(f"{', '.join(given)} applies to --http only (stdio needs no address or token)")
    allowed = S.AllowedDirs(allow_dir) if allow_dir else S.AllowedDirs.default()
    if http:
        listen = listen or f"127.0.0.1:{S.DEFAULT_HTTP_PORT}"
        if ":" not in listen:
            raise GpudiagError(f"--listen {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:{S.DEFAULT_HTTP_PORT}")
        host, port = parse_listen(listen)
        loopback = is_loopback(host)
        if not loopback and not allow_remote:
            raise GpudiagError(f"--listen {host}: not a loopback address; anyone who reaches it could ask for "
                               "this node's diagnostics: add --allow-remote to serve it (the token is still "
                               "required)")
        token, origin = S.read_token(token_file)
    try:
        server = S.build_server(allowed)
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in SDK_MODULES:
            raise
        raise GpudiagError(f"the MCP server needs the MCP Python SDK ({exc.name or exc}): "
                           "pip install 'gpudiag[mcp]'") from None
    if http:
        S.serve_http(server, host=host, port=port, token=token, token_origin=origin, loopback=loopback)
    else:
        S.serve_stdio(server)
