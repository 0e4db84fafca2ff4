"""A /metrics endpoint for the tests that scrape one: pages by path, served over real HTTP on loopback."""

from __future__ import annotations

import http.server
import threading


class PageServer:
    """Serves ``pages[path]`` (404 for any other path) with ``content_type``; ``page`` is /metrics' page.

    ``base`` is the server's address, ``url`` its /metrics.
    """

    def __init__(self):
        self.pages: dict[str, str] = {}
        self.content_type = "text/plain; version=0.0.4"
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                page = server.pages.get(self.path)
                body = (page if page is not None else "not found\n").encode()
                self.send_response(200 if page is not None else 404)
                self.send_header("Content-Type", server.content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.url = self.base + "/metrics"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def page(self) -> str:
        return self.pages.get("/metrics", "")

    @page.setter
    def page(self, text: str) -> None:
        self.pages["/metrics"] = text

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
