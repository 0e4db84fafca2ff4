"""The agent's /metrics HTTP server: loopback by default, TLS, basic auth.

What it serves is encoded by :mod:`gpudiag.exposition` (the frames as catalog-named
metric families).

The server binds 127.0.0.1 by default and refuses any other address unless
called with ``allow_non_loopback=True`` (the agent's config key
``exporter.allow_non_loopback``); TLS takes a PEM certificate and key; basic
auth takes a user and a salted SHA-256 of the password (:func:`hash_password`),
never the password itself.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import hashlib
import hmac
import ipaddress
import logging
import os
import selectors
import socket
import socketserver
import ssl
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from gpudiag.errors import GpudiagError
from gpudiag.exposition import TEXT_CONTENT_TYPE, encode_text, log_request_failure

log = logging.getLogger("gpudiag.agent.prom_exporter")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9400
# A slow or stuck client must not hold a server thread (or, with TLS, a handshake) forever.
CLIENT_TIMEOUT_S = 10.0


_HASH_SCHEME = "sha256"


def hash_password(password: str, salt: bytes | None = None) -> str:
    """The config form of a scrape password: ``sha256$<salt hex>$<hex of sha256(salt + password)>``.

    A scrape credential is machine-generated and long, so one salted SHA-256 is
    enough (and keeps each scrape cheap); the salt stops equal passwords from
    showing as equal hashes.
    """
    salt = os.urandom(16) if salt is None else salt
    digest = hashlib.sha256(salt + password.encode()).hexdigest()
    return f"{_HASH_SCHEME}${salt.hex()}${digest}"


@dataclass(frozen=True)
class BasicAuth:
    """HTTP basic auth for /metrics: a user and :func:`hash_password`'s form of the password."""

    user: str
    password_hash: str

    def __post_init__(self):
        parts = self.password_hash.split("$")
        if len(parts) != 3 or parts[0] != _HASH_SCHEME:
            raise GpudiagError("exporter basic_auth password must be given as sha256$<salt hex>$<digest hex> "
                               "(make it with gpudiag.agent.prom_exporter.hash_password), not in plain text")
        try:
            bytes.fromhex(parts[1])
            if len(bytes.fromhex(parts[2])) != 32:
                raise ValueError
        except ValueError:
            raise GpudiagError("exporter basic_auth password hash is not sha256$<salt hex>$<64 hex digits>") from None
        if not self.user or ":" in self.user:
            raise GpudiagError("exporter basic_auth user must be non-empty and contain no ':'")

    def check(self, authorization: str | None) -> bool:
        """True when an Authorization header carries this user and password (constant-time compare)."""
        if not authorization or not authorization.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(authorization[6:], validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        _, salt_hex, digest_hex = self.password_hash.split("$")
        given = hashlib.sha256(bytes.fromhex(salt_hex) + password.encode()).digest()
        # Both comparisons always run, so the time does not tell a wrong user from a wrong password.
        user_ok = hmac.compare_digest(user.encode(), self.user.encode())
        password_ok = hmac.compare_digest(given, bytes.fromhex(digest_hex))
        return user_ok and password_ok


# --- the HTTP server ---------------------------------------------------------------------------


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9400`` for IPv6, ``:9400`` for the default host) as (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        raise GpudiagError(f"--listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:{DEFAULT_PORT}")
    host = host.strip("[]") or DEFAULT_HOST
    try:
        number = int(port)
        if not 0 <= number <= 65535:
            raise ValueError
    except ValueError:
        raise GpudiagError(f"--listen {text!r}: port must be a number 0..65535") from None
    return host, number


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


class _Handler(BaseHTTPRequestHandler):
    server: _MetricsHTTPServer
    timeout = CLIENT_TIMEOUT_S
    server_version = "gpudiag-agent"
    sys_version = ""

    def do_GET(self):
        srv = self.server
        if srv.auth is not None and not srv.auth.check(self.headers.get("Authorization")):
            self._send(401, b"unauthorized\n", "text/plain; charset=utf-8",
                       {"WWW-Authenticate": 'Basic realm="gpudiag", charset="UTF-8"'})
            return
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            accept = self.headers.get("Accept", "")
            if "openmetrics" in accept and "text/plain" not in accept and "*/*" not in accept:
                encoder, content_type = choose_encoder(accept)  # a client that takes nothing else
            else:
                # Every Prometheus accepts the text format; it is served whenever the client
                # takes it, because it is the one encoded without per-sample validation.
                encoder, content_type = encode_text, TEXT_CONTENT_TYPE
            try:
                body = encoder(srv.registry)
            except Exception as exc:  # noqa: BLE001 - a collector bug: the scraper gets a 500, the log one line
                log.error("collecting /metrics failed: %s: %s", type(exc).__name__, exc)
                self._send(500, b"collecting the metrics failed; the agent's log says why\n",
                           "text/plain; charset=utf-8")
                return
            extra = {}
            if "gzip" in self.headers.get("Accept-Encoding", ""):
                body = gzip.compress(body, compresslevel=1)  # level 1: a third of the bytes, for ~1 ms
                extra["Content-Encoding"] = "gzip"
            self._send(200, body, content_type, extra)
        elif path == "/healthz":
            self._send(200, b"ok\n", "text/plain; charset=utf-8")
        elif path == "/":
            self._send(200, b'<html><body><a href="/metrics">gpudiag agent metrics</a></body></html>\n',
                       "text/html; charset=utf-8")
        else:
            self._send(404, b"not found\n", "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):
        log.debug("%s %s", self.address_string(), format % args)


class _MetricsHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    # socketserver listens with a backlog of 5: several scrapers at once (Prometheus replicas,
    # a federation, curl loops) overflow it and the kernel drops or resets their connections.
    request_queue_size = 128

    def __init__(self, address, family, registry, auth, tls: ssl.SSLContext | None):
        self.address_family = family
        self.registry, self.auth, self.tls = registry, auth, tls
        super().__init__(address, _Handler)

    def server_bind(self):
        # HTTPServer.server_bind resolves the host's FQDN, a DNS query that can hang for
        # seconds on a node with broken resolvers; the name is never used here.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def finish_request(self, request, client_address):
        if self.tls is None:
            return super().finish_request(request, client_address)
        # The handshake happens here, in the request's own thread, so a client that
        # connects and says nothing cannot stall the accept loop.
        request.settimeout(CLIENT_TIMEOUT_S)
        try:
            conn = self.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            log.debug("TLS handshake with %s failed: %s", client_address, exc)
            return None
        try:
            return super().finish_request(conn, client_address)
        finally:
            conn.close()

    def handle_error(self, request, client_address):
        # Called from socketserver's own except block: the exception is the current one.
        log_request_failure(log, client_address, sys.exc_info()[1])


class MetricsServer:
    """A running /metrics endpoint: ``.host``, ``.port``, ``.url`` and ``.close()``.

    The accept loop sleeps until a client connects or :meth:`close` wakes it: an idle
    endpoint costs no CPU (socketserver's ``serve_forever`` wakes every poll interval,
    0.07 % of a core at 5 wake-ups a second).
    """

    def __init__(self, httpd: _MetricsHTTPServer, scheme: str):
        self._httpd = httpd
        self.host, self.port = httpd.server_address[:2]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"{scheme}://{host}:{self.port}/metrics"
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="gpudiag-metrics", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._httpd, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r:
                        return
                    # accept, then hand the connection to its own thread (ThreadingMixIn)
                    self._httpd._handle_request_noblock()

    def close(self) -> None:
        """Stop serving and release the port. Safe to call twice."""
        if self._thread.is_alive():
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
            self._thread.join(timeout=5)
        self._httpd.server_close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


def _tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise GpudiagError(f"cannot load the exporter's TLS certificate {cert} and key {key}: {exc}") from None
    return ctx


def serve(registry: CollectorRegistry, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
          tls_cert: str | None = None, tls_key: str | None = None,
          basic_auth: BasicAuth | tuple[str, str] | None = None,
          allow_non_loopback: bool = False) -> MetricsServer:
    """Serve ``registry`` on http(s)://host:port/metrics in a background thread.

    Binds 127.0.0.1 by default. Any address that is not loopback (``0.0.0.0``,
    a LAN address, a name that resolves off the host) is refused with a
    GpudiagError unless ``allow_non_loopback`` is set; then give ``tls_cert`` and
    ``tls_key`` (PEM files) and ``basic_auth`` (user, :func:`hash_password` form)
    too. ``port=0`` picks a free port (see ``.port``).
    """
    if not allow_non_loopback and not is_loopback(host):
        raise GpudiagError(f"refusing to expose metrics on {host}:{port}: not a loopback address. Set "
                           "exporter.allow_non_loopback = true in the agent config to listen beyond this host "
                           "(and give tls_cert/tls_key and basic_auth)")
    if (tls_cert is None) != (tls_key is None):
        raise GpudiagError("exporter TLS needs both tls_cert and tls_key")
    tls = _tls_context(tls_cert, tls_key) if tls_cert else None
    auth = BasicAuth(*basic_auth) if isinstance(basic_auth, tuple) else basic_auth
    if not is_loopback(host) and (tls is None or auth is None):
        log.warning("metrics on %s:%d without %s: anyone on the network can read them", host, port,
                    " and ".join(x for x, missing in (("TLS", tls is None), ("basic auth", auth is None))
                                 if missing))
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        httpd = _MetricsHTTPServer(address[:2], family, registry, auth, tls)
    except OSError as exc:
        raise GpudiagError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return MetricsServer(httpd, "https" if tls else "http")
