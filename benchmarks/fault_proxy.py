"""A fault-injecting HTTP proxy on loopback, put between boto3 and the moto S3 server.

Every `every`-th request that `matches` gets the next fault of the rotation:
  drop      close the client's connection without answering;
  503       answer `503 SlowDown`, as S3 does when throttling;
  truncate  forward half the request body then cut both connections (an upload cut off),
            or, for a request without a body, send half the response body and close.
Everything else is forwarded unchanged. With `every=0` it injects nothing and only records
requests (and delays those that match by `delay_s`). Two more faults, for the storage path:
`rate_bps` reads the bodies of matching requests at that many bytes a second (a slow or
congested link: the client's upload slows to it), and `hold(matches)` keeps the next
request that matches, read whole, until its `release()` (a request delayed in the network,
which then arrives after what was sent after it)."""

from __future__ import annotations

import contextlib
import http.client
import itertools
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import BinaryIO
from urllib.parse import urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


RATE_CHUNK = 4096  # bytes read at a time from a rate-limited body


@dataclass
class Held:
    """One request kept back by the proxy: `arrived` once it is held, sent on at `release`."""

    matches: Callable[[str, str], bool]
    arrived: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    answered: threading.Event = field(default_factory=threading.Event)
    status: int | None = None  # what the server answered it, once sent on

    def release(self) -> None:
        self.released.set()


class _QuietServer(ThreadingHTTPServer):
    """A client that goes away mid-request (a killed writer, a cut connection) is the faults'
    business, not a traceback on the test's output."""

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        *,
        every: int = 3,
        faults: tuple[str, ...] = ("drop", "503", "truncate"),
        matches: Callable[[str, str], bool] = lambda method, path: True,
        delay_s: float = 0.0,
        rate_bps: float = 0.0,
    ) -> None:
        self.upstream = urlsplit(upstream)
        self.delay_s, self.rate_bps = delay_s, rate_bps
        self._holds: list[Held] = []  # waiting for their request
        self._every_hold: list[Held] = []
        self.requests: list[tuple[str, str]] = []
        self.every, self.matches = every, matches
        self._rotation = itertools.cycle(faults)
        self._lock = threading.Lock()
        self._seen = 0
        self.injected: dict[str, int] = {fault: 0 for fault in faults}
        self.server = _QuietServer(("127.0.0.1", 0), self._handler_class())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for held in self._every_hold:  # a test that failed before its release
            held.release()
        self.server.shutdown()
        self.server.server_close()

    def hold(self, matches: Callable[[str, str], bool]) -> Held:
        """Keep the next request that `matches` until the returned hold is released."""
        held = Held(matches)
        with self._lock:
            self._holds.append(held)
            self._every_hold.append(held)
        return held

    def _held(self, method: str, path: str) -> Held | None:
        with self._lock:
            for held in self._holds:
                if held.matches(method, path):
                    self._holds.remove(held)
                    return held
        return None

    def _read_body(self, stream: BinaryIO, length: int, limited: bool) -> bytes:
        """The request body, at `rate_bps` where it applies."""
        rate = self.rate_bps  # as the request began: a change applies to the next one
        if not (limited and rate):
            return stream.read(length) if length else b""
        chunks, left = [], length
        while left:
            chunk = stream.read(min(left, RATE_CHUNK))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
            time.sleep(len(chunk) / rate)
        return b"".join(chunks)

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
                matching = proxy.matches(self.command, self.path)
                body = proxy._read_body(self.rfile, length, matching)
                proxy.requests.append((self.command, self.path))
                if proxy.delay_s and matching:
                    time.sleep(proxy.delay_s)
                held = proxy._held(self.command, self.path)
                if held is not None:
                    held.arrived.set()
                    held.released.wait()
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
                if held is not None:
                    held.status = response.status
                    held.answered.set()
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
