"""The agent's configuration file (TOML), validated key by key.

Every key, its type, default and bounds is in :data:`SCHEMA`; a file may give
any subset. An unknown key, a wrong type or a value out of bounds is a
GpudiagError naming the key and the reason (one line, exit 2), so a typo never
silently falls back to a default. Example (every key at its default)::

    [agent]
    node = ""                       # "" = the host name

    [exporter]
    listen = "127.0.0.1:9400"
    allow_non_loopback = false      # true to listen beyond this host
    tls_cert = ""                   # PEM files; both or neither
    tls_key = ""
    basic_auth_user = ""
    basic_auth_password_hash = ""   # gpudiag.agent.prom_exporter.hash_password(), never the password

    [store]
    path = ""                       # "" = /var/lib/gpudiag/timeline.db (root) or ~/.local/state/gpudiag/
    retention_s = 604800            # 7 days
    max_bytes = 2147483648          # 2 GiB

    [otlp]
    endpoint = ""                   # e.g. http://collector:4318; "" = no OTLP
    interval_s = 15

    [probes]
    nvml_interval_s = 1
    host_interval_s = 1
    torch_interval_s = 1
    tracker_interval_s = 1
    ebpf = "auto"                   # auto | on | off
    ebpf_interval_s = 1
    engine_interval_s = 5
    engine_urls = []                # serving engines' /metrics (vLLM dialect)

    [analyzers]
    interval_s = 10
    window_s = 900                  # 15 minutes, kept in memory

    [kubernetes]
    mode = "auto"                   # auto (on where the kubelet's socket or log links are) | on | off
    pod_resources_socket = "/var/lib/kubelet/pod-resources/kubelet.sock"
    kubeconfig = ""                 # pod names from the API server too ("" = the node's records only)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import tomllib

from gpudiag.errors import GpudiagError

EBPF_MODES = ("auto", "on", "off")
KUBERNETES_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class _Key:
    type: type | tuple[type, ...]
    default: Any
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None


# Intervals below 50 ms would make the agent itself the load on the node; a day is the
# longest interval that still makes a timeline.
_INTERVAL = dict(minimum=0.05, maximum=86400.0)

SCHEMA: dict[str, dict[str, _Key]] = {
    "agent": {"node": _Key(str, "")},
    "exporter": {
        "listen": _Key(str, "127.0.0.1:9400"),
        "allow_non_loopback": _Key(bool, False),
        "tls_cert": _Key(str, ""),
        "tls_key": _Key(str, ""),
        "basic_auth_user": _Key(str, ""),
        "basic_auth_password_hash": _Key(str, ""),
    },
    "store": {
        "path": _Key(str, ""),
        # An hour is the shortest retention that still holds a 15-minute analyzer window
        # several times over; ten years is far beyond any disk budget.
        "retention_s": _Key((int, float), 7 * 86400.0, minimum=3600.0, maximum=10 * 365 * 86400.0),
        # 16 MiB holds a few hours of a large node; below it retention would thrash.
        "max_bytes": _Key(int, 2 * 1024**3, minimum=16 * 1024**2, maximum=2**50),
    },
    "otlp": {
        "endpoint": _Key(str, ""),
        "interval_s": _Key((int, float), 15.0, minimum=1.0, maximum=3600.0),
    },
    "probes": {
        "nvml_interval_s": _Key((int, float), 1.0, **_INTERVAL),
        "host_interval_s": _Key((int, float), 1.0, **_INTERVAL),
        "torch_interval_s": _Key((int, float), 1.0, **_INTERVAL),
        "tracker_interval_s": _Key((int, float), 1.0, **_INTERVAL),
        "ebpf": _Key(str, "auto", choices=EBPF_MODES),
        "ebpf_interval_s": _Key((int, float), 1.0, **_INTERVAL),
        # Engines are scraped less often: their counters change per request, and a
        # /metrics render of a busy vLLM costs it tens of milliseconds.
        "engine_interval_s": _Key((int, float), 5.0, **_INTERVAL),
        "engine_urls": _Key(list, []),
    },
    "kubernetes": {
        "mode": _Key(str, "auto", choices=KUBERNETES_MODES),
        "pod_resources_socket": _Key(str, "/var/lib/kubelet/pod-resources/kubelet.sock"),
        "kubeconfig": _Key(str, ""),
    },
    "analyzers": {
        "interval_s": _Key((int, float), 10.0, minimum=1.0, maximum=3600.0),
        # The analyzers' own trailing windows reach 300 s (merge gaps, trends): a shorter
        # window would cut episodes in half; six hours of 1 s frames is the memory ceiling.
        "window_s": _Key((int, float), 900.0, minimum=300.0, maximum=6 * 3600.0),
    },
}


def default_store_path() -> str:
    """Where the timeline store lives when neither the config nor ``--store`` says."""
    if os.geteuid() == 0:
        return "/var/lib/gpudiag/timeline.db"
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(state, "gpudiag", "timeline.db")


@dataclass(frozen=True)
class AgentConfig:
    """The validated configuration: ``values[section][key]``, plus where it came from."""

    values: dict[str, dict[str, Any]] = field(default_factory=lambda: {
        s: {k: spec.default for k, spec in keys.items()} for s, keys in SCHEMA.items()})
    source: str | None = None

    def get(self, dotted: str) -> Any:
        """One value by its dotted key, e.g. ``config.get("probes.nvml_interval_s")``."""
        section, _, key = dotted.partition(".")
        return self.values[section][key]

    def with_overrides(self, overrides: dict[str, Any]) -> AgentConfig:
        """A copy with dotted keys replaced (command-line options), validated like the file."""
        values = {s: dict(v) for s, v in self.values.items()}
        for dotted, value in overrides.items():
            if value is None:
                continue
            section, _, key = dotted.partition(".")
            values[section][key] = _validated(section, key, value, self.source or "command line")
        cfg = replace(self, values=values)
        _check_combinations(cfg)
        return cfg

    def store_path(self) -> str:
        """The store file: the configured path or :func:`default_store_path`."""
        return self.get("store.path") or default_store_path()

    def diff(self, other: AgentConfig) -> list[str]:
        """Dotted keys whose values differ between the two configurations."""
        return [f"{s}.{k}" for s, keys in SCHEMA.items() for k in keys
                if self.values[s][k] != other.values[s][k]]


def _fail(source: str, key: str, reason: str):
    raise GpudiagError(f"config {source}: {key}: {reason}")


def _validated(section: str, key: str, value: Any, source: str) -> Any:
    dotted = f"{section}.{key}"
    spec = SCHEMA[section].get(key)
    if spec is None:
        _fail(source, dotted, f"unknown key (known in [{section}]: {', '.join(SCHEMA[section])})")
    types = spec.type if isinstance(spec.type, tuple) else (spec.type,)
    # bool is an int in Python; a number key given true/false is still a mistake.
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = " or ".join({int: "an integer", float: "a number", str: "a string", bool: "true or false",
                             list: "a list"}[t] for t in types)
        _fail(source, dotted, f"must be {names}, not {value!r}")
    if isinstance(value, float) and value != value:  # TOML's nan: every bound below would let it through
        _fail(source, dotted, "must be a number, not nan")
    if spec.minimum is not None and value < spec.minimum:
        _fail(source, dotted, f"must be at least {spec.minimum:g}, not {value!r}")
    if spec.maximum is not None and value > spec.maximum:
        _fail(source, dotted, f"must be at most {spec.maximum:g}, not {value!r}")
    if spec.choices is not None and value not in spec.choices:
        _fail(source, dotted, f"must be one of {', '.join(spec.choices)}, not {value!r}")
    if dotted == "probes.engine_urls":
        for url in value:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                _fail(source, dotted, f"each entry must be an http:// or https:// URL, not {url!r}")
        value = list(value)
    if dotted == "exporter.listen":
        from gpudiag.agent.prom_exporter import parse_listen

        try:
            parse_listen(value)
        except GpudiagError as exc:
            _fail(source, dotted, str(exc).replace("--listen ", ""))
    if dotted == "otlp.endpoint" and value and not value.startswith(("http://", "https://")):
        _fail(source, dotted, f"must be an http:// or https:// URL (OTLP/HTTP), not {value!r}")
    if isinstance(spec.default, float) and isinstance(value, int):
        value = float(value)
    return value


def _check_combinations(cfg: AgentConfig) -> None:
    source = cfg.source or "command line"
    cert, key = cfg.get("exporter.tls_cert"), cfg.get("exporter.tls_key")
    if bool(cert) != bool(key):
        _fail(source, "exporter.tls_cert" if not cert else "exporter.tls_key",
              "TLS needs both tls_cert and tls_key")
    for name, path in (("exporter.tls_cert", cert), ("exporter.tls_key", key)):
        if path and not os.path.isfile(path):
            _fail(source, name, f"no such file {path!r}")
    user, digest = cfg.get("exporter.basic_auth_user"), cfg.get("exporter.basic_auth_password_hash")
    if bool(user) != bool(digest):
        _fail(source, "exporter.basic_auth_password_hash" if user else "exporter.basic_auth_user",
              "basic auth needs both basic_auth_user and basic_auth_password_hash")
    if user:
        from gpudiag.agent.prom_exporter import BasicAuth

        try:
            BasicAuth(user, digest)
        except GpudiagError as exc:
            _fail(source, "exporter.basic_auth_password_hash", str(exc))


def parse(text: str, source: str = "<text>") -> AgentConfig:
    """Validate TOML text into an AgentConfig (GpudiagError naming the key and the reason)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise GpudiagError(f"config {source}: not valid TOML: {exc}") from None
    cfg = AgentConfig(source=source)
    values = {s: dict(v) for s, v in cfg.values.items()}
    for section, body in doc.items():
        if section not in SCHEMA:
            _fail(source, section, f"unknown section (known: {', '.join(SCHEMA)})")
        if not isinstance(body, dict):
            _fail(source, section, "must be a [section] table")
        for key, value in body.items():
            values[section][key] = _validated(section, key, value, source)
    cfg = replace(cfg, values=values)
    _check_combinations(cfg)
    return cfg


# A config is a few hundred bytes of TOML; a path to something else (a device, a stream that never
# ends, a large file given by mistake) is refused after this much, not read until memory runs out.
MAX_CONFIG_BYTES = 1 << 20


def load(path: str | None) -> AgentConfig:
    """The configuration in ``path`` (TOML), or every default when ``path`` is None."""
    if path is None:
        return AgentConfig()
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise GpudiagError(f"config {path}: cannot read it: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise GpudiagError(f"config {path}: more than {MAX_CONFIG_BYTES} bytes; not an agent config "
                           "(a device or a stream that does not end?)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise GpudiagError(f"config {path}: not UTF-8 text") from None
    return parse(text, path)
