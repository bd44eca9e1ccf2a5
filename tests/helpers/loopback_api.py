"""What the test API servers share: an HTTP server on 127.0.0.1 that answers
Kubernetes-API-shaped requests, a kubeconfig naming it, and the API's Status documents.

No API server can run on this machine, so kubernetes-client calls are exercised over real
HTTP against answers shaped like the API's own; subclasses decide each answer."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

NOT_SERVED = "the server could not find the requested resource"


class LoopbackApi:
    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, method: str, target: str, headers: Any, body: bytes) -> tuple[int, str | dict]:
        """(status, body) for `method` on `target` (path and query); a str body is text."""
        raise NotImplementedError

    def kubeconfig(self, folder: Path) -> Path:
        """A kubeconfig in `folder` whose one cluster is this server."""
        path = folder / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "loopback",
            "clusters": [{"name": "loopback", "cluster": {"server": self.url}}],
            "users": [{"name": "loopback", "user": {"token": "loopback-token"}}],
            "contexts": [{"name": "loopback", "context": {"cluster": "loopback", "user": "loopback"}}],
        }))  # fmt: skip
        return path

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, document = api.answer(self.command, self.path, self.headers, body)
                text = isinstance(document, str)
                payload = document.encode() if text else json.dumps(document).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PATCH = do_DELETE = _answer

        return Handler


def status(code: int, reason: str, message: str) -> dict:
    """The API's Status document."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Success" if code < 400 else "Failure",
        "reason": reason,
        "message": message,
        "code": code,
    }
