"""Pod names from the Kubernetes API server, for a node whose own records cannot be read.

Given a kubeconfig, one ``GET /api/v1/pods?fieldSelector=spec.nodeName=NODE``
lists the node's pods: each one's UID, name and namespace, and each
container's runtime ID (``containerd://<id>``) and name. That is what
:class:`gpudiag.probes.kube.PodResolver` needs to turn the cgroup's pod UID
and container ID into names.

Authentication is what a kubeconfig states for its current context: a bearer
token (``token`` or ``tokenFile``) or a client certificate and key (files or
``-data``), and a CA (file or ``-data``). Exec and auth-provider plugins (cloud
logins) are not run: the agent gets a token of its own. Every failure is a
:class:`KubeApiError` with one line.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from gpudiag.errors import GpudiagError

# The API server answers a node's pod list in well under a second; a hung one must not hold the agent's tick.
DEFAULT_TIMEOUT_S = 5.0


class KubeApiError(GpudiagError):
    """The API server could not be read; the message is one line saying why."""


@dataclass(frozen=True)
class PodNames:
    """``{pod UID: (pod, namespace)}`` and ``{container ID: (pod, namespace, container)}``."""

    by_uid: dict[str, tuple[str, str]]
    by_container: dict[str, tuple[str, str, str]]


def _yaml(path: str) -> dict:
    try:
        import yaml
    except ImportError:
        raise KubeApiError("reading a kubeconfig needs PyYAML: pip install 'gpudiag[kubernetes]'") from None
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise KubeApiError(f"kubeconfig {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise KubeApiError(f"kubeconfig {path} is not YAML: {' '.join(str(e).split())}") from None
    if not isinstance(doc, dict):
        raise KubeApiError(f"kubeconfig {path} is not a kubeconfig (no mapping at its top)")
    return doc


def _named(doc: dict, section: str, name: str, path: str) -> dict:
    for entry in doc.get(section) or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            inner = entry.get(section[:-1])  # clusters -> cluster, users -> user, contexts -> context
            if isinstance(inner, dict):
                return inner
    raise KubeApiError(f"kubeconfig {path}: no {section[:-1]} named {name!r}")


class KubeApi:
    """The API server of a kubeconfig's current context (or ``context``)."""

    def __init__(self, kubeconfig: str, *, context: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.kubeconfig = kubeconfig
        self.timeout_s = timeout_s
        doc = _yaml(kubeconfig)
        name = context or doc.get("current-context")
        if not name:
            raise KubeApiError(f"kubeconfig {kubeconfig}: no current-context (give a context)")
        ctx = _named(doc, "contexts", name, kubeconfig)
        cluster = _named(doc, "clusters", ctx.get("cluster", ""), kubeconfig)
        user = _named(doc, "users", ctx.get("user", ""), kubeconfig) if ctx.get("user") else {}
        self.server = str(cluster.get("server") or "").rstrip("/")
        if not self.server.startswith(("https://", "http://")):
            raise KubeApiError(f"kubeconfig {kubeconfig}: cluster {ctx.get('cluster')!r} has no https:// server")
        if "exec" in user or "auth-provider" in user:
            raise KubeApiError(f"kubeconfig {kubeconfig}: user {ctx.get('user')!r} logs in through a plugin, which "
                               "the agent does not run; give it a token or a client certificate")
        base = os.path.dirname(os.path.abspath(kubeconfig))
        self._tmp = tempfile.TemporaryDirectory(prefix="gpudiag-kube-")
        self.token = user.get("token")
        if not self.token and user.get("tokenFile"):
            self.token = self._read(os.path.join(base, user["tokenFile"])).strip()
        self.ssl = None
        if self.server.startswith("https://"):
            ctx_ssl = ssl.create_default_context(cafile=self._file(cluster, "certificate-authority", base))
            if cluster.get("insecure-skip-tls-verify"):
                ctx_ssl.check_hostname = False
                ctx_ssl.verify_mode = ssl.CERT_NONE
            cert = self._file(user, "client-certificate", base)
            key = self._file(user, "client-key", base)
            if cert and key:
                try:
                    ctx_ssl.load_cert_chain(cert, key)
                except (ssl.SSLError, OSError) as e:
                    raise KubeApiError(f"kubeconfig {kubeconfig}: client certificate unusable: {e}") from None
            self.ssl = ctx_ssl

    def _read(self, path: str) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise KubeApiError(f"kubeconfig {self.kubeconfig}: {path}: {e.strerror or e}") from None

    def _file(self, section: dict, key: str, base: str) -> str | None:
        """A PEM the kubeconfig names as a file or embeds as ``<key>-data`` (written to a private file)."""
        if section.get(f"{key}-data"):
            try:
                pem = base64.b64decode(section[f"{key}-data"], validate=True)
            except (ValueError, TypeError):
                raise KubeApiError(f"kubeconfig {self.kubeconfig}: {key}-data is not base64") from None
            path = os.path.join(self._tmp.name, key)
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(pem)
            return path
        if section.get(key):
            return os.path.join(base, section[key])
        return None

    def node_pods(self, node: str) -> PodNames:
        """The pods the API server places on ``node``."""
        query = urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={node}"})
        req = urllib.request.Request(f"{self.server}/api/v1/pods?{query}", headers={"Accept": "application/json"})
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self.ssl) as r:
                doc = json.loads(r.read().decode("utf-8", "replace"))
        except urllib.error.HTTPError as e:
            hint = {401: " (the token or certificate is not accepted)",
                    403: " (the user may not list pods: grant it get/list on pods)"}.get(e.code, "")
            raise KubeApiError(f"API server {self.server}: HTTP {e.code} {e.reason}{hint}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise KubeApiError(f"API server {self.server}: cannot reach it ({reason})") from None
        except ValueError as e:
            raise KubeApiError(f"API server {self.server}: the pod list is not JSON ({e})") from None
        return pod_names(doc)

    def close(self) -> None:
        self._tmp.cleanup()


def pod_names(doc: dict) -> PodNames:
    """A ``PodList`` document -> names by pod UID and by container ID (runtime prefix stripped)."""
    by_uid: dict[str, tuple[str, str]] = {}
    by_container: dict[str, tuple[str, str, str]] = {}
    for item in doc.get("items") or []:
        meta = item.get("metadata") or {}
        name, ns, uid = meta.get("name"), meta.get("namespace"), meta.get("uid")
        if not (name and ns):
            continue
        if uid:
            by_uid[uid] = (name, ns)
        status = item.get("status") or {}
        for key in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
            for c in status.get(key) or []:
                cid = str(c.get("containerID") or "")
                if "://" in cid and c.get("name"):
                    by_container[cid.split("://", 1)[1]] = (name, ns, c["name"])
    return PodNames(by_uid, by_container)
