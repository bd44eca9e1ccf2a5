"""A loopback HTTP server that answers Kubernetes API requests from recorded responses.

No API server runs on this machine, so the kubernetes-client calls are exercised against
responses shaped like the API's own (tests/recorded/), over real HTTP."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class ReplayApi:
    def __init__(self, routes: dict[tuple[str, str], tuple[int, str | dict]]) -> None:
        """`routes` maps (method, path with query) to (status, body); the longest matching
        path prefix wins, and unmatched requests get the API's 404."""
        self.routes = routes
        self.requests: list[tuple[str, str]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, folder: Path) -> Path:
        return write_kubeconfig(self.url, folder)

    def __enter__(self) -> ReplayApi:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        replay = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def _answer(self) -> None:
                replay.requests.append((self.command, self.path))
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                matches = [
                    (path, answer) for (method, path), answer in replay.routes.items()
                    if method == self.command and self.path.startswith(path)
                ]  # fmt: skip
                if matches:
                    status, body = max(matches, key=lambda match: len(match[0]))[1]
                else:
                    status, body = 404, {
                        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                        "message": "the server could not find the requested resource", "code": 404,
                    }  # fmt: skip
                payload = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header(
                    "Content-Type", "text/plain" if isinstance(body, str) else "application/json"
                )
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_DELETE = _answer

        return Handler


def write_kubeconfig(url: str, folder: Path) -> Path:
    """A kubeconfig in `folder` whose one cluster is the server at `url`."""
    path = folder / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "replay",
        "clusters": [{"name": "replay", "cluster": {"server": url}}],
        "users": [{"name": "replay", "user": {"token": "replay-token"}}],
        "contexts": [{"name": "replay", "context": {"cluster": "replay", "user": "replay"}}],
    }))  # fmt: skip
    return path
