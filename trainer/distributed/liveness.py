"""`GET /healthz` beside a pod's ranks: the kubelet's liveness probe of a trainer pod.

`ddp-launch --health-port N` serves it for as long as the pod runs, across torchrun's
restarts and relaunches. It answers 200 while the pod's ranks make progress (start-up
included: its phase has its own, generous limit) and 503, naming the rank, once one has
been silent for twice its limit without the node's watchdog having found it waiting for a
peer elsewhere (`trainer.distributed.watchdog.pod_health`). A frozen pod (a node's kernel
stuck, `docker pause`) does not answer at all; either way the kubelet restarts it after
`failureThreshold` probes.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from trainer.distributed.watchdog import pod_health


def serve_health(address: tuple[str, int], base: Path) -> ThreadingHTTPServer:
    """Serve `/healthz` for the records under `base` on (host, port), in a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/healthz":
                self.send_error(404)
                return
            healthy, reason = pod_health(base)
            body = (reason + "\n").encode()
            self.send_response(200 if healthy else 503)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # a probe every few seconds is no news

    server = ThreadingHTTPServer(address, Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="healthz", daemon=True).start()
    return server
