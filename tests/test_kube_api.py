"""Pod names from a real HTTPS server speaking the API server's pod list, through a kubeconfig.

The server is Python's own HTTPS server with a certificate made here by
openssl for 127.0.0.1; it answers ``GET /api/v1/pods?fieldSelector=spec.nodeName=...``
with a ``PodList`` to the right bearer token and 401 otherwise, as an API
server does.
"""

from __future__ import annotations

import base64
import http.server
import json
import shutil
import socket
import ssl
import subprocess
import threading
import urllib.parse

import pytest

from gpudiag.frames import Frame
from gpudiag.probes.kube import PodResolver
from gpudiag.probes.kube_api import KubeApi, KubeApiError

TOKEN = "abc.def.ghi"
UID = "1f2e3d4c-5b6a-4987-a6b5-c4d3e2f1a0b9"
CID = "d" * 64
POD_LIST = {"kind": "PodList", "apiVersion": "v1", "items": [{
    "metadata": {"name": "vllm-llama-0", "namespace": "serving", "uid": UID},
    "status": {"containerStatuses": [{"name": "vllm", "containerID": f"containerd://{CID}"}],
               "initContainerStatuses": [{"name": "fetch-weights", "containerID": f"containerd://{'e' * 64}"}]}}]}


@pytest.fixture(scope="module")
def api_server(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("apiserver")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kube",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(d / "key.pem"), "-out",
                    str(d / "cert.pem")], check=True, capture_output=True)
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server interface
            url = urllib.parse.urlparse(self.path)
            seen.append((url.path, urllib.parse.parse_qs(url.query)))
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self.send_response(401)
                self.end_headers()
                return
            body = json.dumps(POD_LIST).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "cert.pem", d / "key.pem")
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {"url": f"https://127.0.0.1:{server.server_address[1]}", "ca": (d / "cert.pem").read_bytes(), "seen": seen}
    server.shutdown()


def kubeconfig(tmp_path, server, ca_pem, user):
    import yaml

    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "ctx",
           "clusters": [{"name": "c", "cluster": {"server": server,
                                                  "certificate-authority-data": base64.b64encode(ca_pem).decode()}}],
           "users": [{"name": "u", "user": user}],
           "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_the_nodes_pods_name_a_cgroups_pod_and_container(api_server, tmp_path):
    api = KubeApi(kubeconfig(tmp_path, api_server["url"], api_server["ca"], {"token": TOKEN}))
    names = api.node_pods("gpu-node-7")
    assert names.by_uid == {UID: ("vllm-llama-0", "serving")}
    assert names.by_container[CID] == ("vllm-llama-0", "serving", "vllm")
    assert api_server["seen"][-1] == ("/api/v1/pods", {"fieldSelector": ["spec.nodeName=gpu-node-7"]})
    proc = tmp_path / "proc" / "77"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/"
                                 f"cri-containerd-{CID}.scope\n")
    r = PodResolver(proc_root=str(tmp_path / "proc"), pod_resources_socket=None, container_logs_dir=None,
                    pod_logs_dir=None, api=api, node="gpu-node-7")
    row = r.annotate([Frame("process", 1.0, [{"pid": 77, "gpu": 0}])])[0].rows[0]
    assert (row["pod"], row["namespace"], row["container"]) == ("vllm-llama-0", "serving", "vllm")
    r.close()


def test_a_rejected_token_is_one_line(api_server, tmp_path):
    api = KubeApi(kubeconfig(tmp_path, api_server["url"], api_server["ca"], {"token": "wrong"}))
    with pytest.raises(KubeApiError, match=r"HTTP 401 .*token or certificate is not accepted"):
        api.node_pods("n")


def test_an_unknown_ca_is_refused(api_server, tmp_path):
    other = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                            "/CN=other", "-keyout", str(tmp_path / "k"), "-out", "/dev/stdout"],
                           check=True, capture_output=True).stdout
    api = KubeApi(kubeconfig(tmp_path, api_server["url"], other, {"token": TOKEN}))
    with pytest.raises(KubeApiError, match="cannot reach it .*CERTIFICATE_VERIFY_FAILED"):
        api.node_pods("n")


def test_unreachable_server_plugin_users_and_bad_files_are_one_line(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(KubeApiError, match="cannot reach it"):
        KubeApi(kubeconfig(tmp_path, f"https://127.0.0.1:{port}", b"", {"token": TOKEN})).node_pods("n")
    with pytest.raises(KubeApiError, match="logs in through a plugin"):
        KubeApi(kubeconfig(tmp_path, "https://127.0.0.1:1", b"", {"exec": {"command": "aws"}}))
    bad = tmp_path / "bad"
    bad.write_text("clusters: [\n")
    with pytest.raises(KubeApiError, match="is not YAML"):
        KubeApi(str(bad))
    bad.write_text("apiVersion: v1\nkind: Config\n")
    with pytest.raises(KubeApiError, match="no current-context"):
        KubeApi(str(bad))
    with pytest.raises(KubeApiError, match="No such file"):
        KubeApi(str(tmp_path / "absent"))
