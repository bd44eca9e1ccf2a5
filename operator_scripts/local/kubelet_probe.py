"""The kubelet's startup and liveness probes of a local pod's container (`ddp-ops local`).

As the kubelet runs `httpGet` probes (docs/facts.md, "The kubelet"): after
`initialDelaySeconds`, a GET every `periodSeconds` that fails when it gets no answer within
`timeoutSeconds` or a status outside 200-399. A startup probe runs first, and the liveness
probe only once it has succeeded; `failureThreshold` failures in a row of either and the
kubelet kills the container, after which the pod's restart policy applies as to any exit
(137 after the SIGKILL that ends a frozen container: the operator re-creates the pod under
ExitCode, the kubelet restarts it in place under OnFailure). The kill's grace period is the
probe's `terminationGracePeriodSeconds`, else the pod's. Defaults are the API's: 10 s, 1 s,
3, 0.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProbeSpec:
    path: str
    port: int
    period_s: float = 10
    timeout_s: float = 1
    failure_threshold: int = 3
    initial_delay_s: float = 0
    grace_s: float | None = None  # the probe's terminationGracePeriodSeconds; None: the pod's

    @classmethod
    def of(cls, container: dict[str, Any], kind: str = "livenessProbe") -> ProbeSpec | None:
        """The container's `<kind>.httpGet`, its named port resolved; None without one."""
        probe = container.get(kind) or {}
        get = probe.get("httpGet")
        if not get:
            return None
        port = get["port"]
        if isinstance(port, str):
            (port,) = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
        return cls(
            path=get.get("path", "/"),
            port=int(port),
            period_s=probe.get("periodSeconds", 10),
            timeout_s=probe.get("timeoutSeconds", 1),
            failure_threshold=probe.get("failureThreshold", 3),
            initial_delay_s=probe.get("initialDelaySeconds", 0),
            grace_s=probe.get("terminationGracePeriodSeconds"),
        )


class ContainerProber:
    """Probes one container from a thread of its own, the startup probe then the liveness
    one; `failed` holds why, once a threshold is reached (the caller kills the container)."""

    def __init__(self, startup: ProbeSpec | None, liveness: ProbeSpec, address: str) -> None:
        self.address = address
        self.failed: str | None = None
        self.grace_s: float | None = None  # the failed probe's grace period, if it has one
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(startup, liveness), name=f"probes {address}", daemon=True
        )
        self._thread.start()

    @classmethod
    def of(cls, container: dict[str, Any], address: str) -> ContainerProber | None:
        liveness = ProbeSpec.of(container)
        if liveness is None:
            return None
        return cls(ProbeSpec.of(container, "startupProbe"), liveness, address)

    def _probe(self, spec: ProbeSpec) -> str | None:
        """None on success, else what failed."""
        try:
            url = f"http://{self.address}:{spec.port}{spec.path}"
            with urllib.request.urlopen(url, timeout=spec.timeout_s) as answer:
                status = answer.status
        except urllib.error.HTTPError as error:
            status = error.code
        except (OSError, ValueError) as error:  # refused, timed out, reset
            return f"no answer within {spec.timeout_s:g}s ({getattr(error, 'reason', error)})"
        return None if 200 <= status < 400 else f"HTTP {status}"

    def _run(self, startup: ProbeSpec | None, liveness: ProbeSpec) -> None:
        if startup is not None and not self._until(startup, "startup", succeeded=True):
            return
        self._until(liveness, "liveness", succeeded=False)

    def _until(self, spec: ProbeSpec, kind: str, *, succeeded: bool) -> bool:
        """Probe every period; True at the first success when `succeeded` is asked for, False
        once `failureThreshold` failures in a row are reached (or on stop)."""
        if self._stopped.wait(spec.initial_delay_s):
            return False
        failures = 0
        while not self._stopped.is_set():
            started = time.monotonic()
            problem = self._probe(spec)
            if problem is None and succeeded:
                return True
            failures = failures + 1 if problem else 0
            if failures >= spec.failure_threshold:
                self.grace_s = spec.grace_s
                self.failed = f"{failures} {kind} probes failed in a row, the last: {problem}"
                return False
            self._stopped.wait(max(0.0, spec.period_s - (time.monotonic() - started)))
        return False

    def stop(self) -> None:
        self._stopped.set()
