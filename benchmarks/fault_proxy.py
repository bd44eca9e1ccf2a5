"""A fault-injecting HTTP proxy on loopback, put between boto3 and the moto S3 server.

Every `every`-th request that `matches` gets the next fault of the rotation:
  drop      close the client's connection without answering;
  503       answer `503 SlowDown`, as S3 does when throttling;
  truncate  forward half the request body then cut both connections (an upload cut off),
            or, for a request without a body, send half the response body and close.
Everything else is forwarded unchanged. With `every=0` it injects nothing and only records
requests (and delays those that match by `delay_s`)."""

from __future__ import annotations

import contextlib
import http.client
import itertools
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        *,
        every: int = 3,
        faults: tuple[str, ...] = ("drop", "503", "truncate"),
        matches: Callable[[str, str], bool] = lambda method, path: True,
        delay_s: float = 0.0,
    ) -> None:
        self.upstream = urlsplit(upstream)
        self.delay_s = delay_s
        self.requests: list[tuple[str, str]] = []
        self.every, self.matches = every, matches
        self._rotation = itertools.cycle(faults)
        self._lock = threading.Lock()
        self._seen = 0
        self.injected: dict[str, int] = {fault: 0 for fault in faults}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _next_fault(self, method: str, path: str) -> str | None:
        if not self.every or not self.matches(method, path):
            return None
        with self._lock:
            self._seen += 1
            if self._seen % self.every:
                return None
            fault = next(self._rotation)
            self.injected[fault] += 1
            return fault

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                proxy.requests.append((self.command, self.path))
                if proxy.delay_s and proxy.matches(self.command, self.path):
                    time.sleep(proxy.delay_s)
                fault = proxy._next_fault(self.command, self.path)
                if fault == "drop":
                    self._cut()
                    return
                if fault == "503":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                upstream = http.client.HTTPConnection(
                    proxy.upstream.hostname, proxy.upstream.port, timeout=60
                )
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = proxy.upstream.netloc
                if fault == "truncate" and body:
                    upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for key, value in headers.items():
                        upstream.putheader(key, value)
                    upstream.endheaders()
                    upstream.send(body[: len(body) // 2])
                    upstream.close()
                    self._cut()
                    return
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                payload = response.read()
                self.send_response(response.status)
                dropped = {"transfer-encoding", "connection"}
                if self.command != "HEAD":  # a HEAD's Content-Length describes the object
                    dropped.add("content-length")
                for key, value in response.getheaders():
                    if key.lower() not in dropped:
                        self.send_header(key, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if fault == "truncate" and payload:
                    self.wfile.write(payload[: len(payload) // 2])
                    self.wfile.flush()
                    self._cut()
                    return
                self.wfile.write(payload)
                upstream.close()

            def _cut(self) -> None:
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        return Handler
