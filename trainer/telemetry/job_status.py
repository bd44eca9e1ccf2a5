"""Rank 0's progress in its TrainJob's status, through Kubeflow Trainer's status server.

With the `TrainJobStatus` feature gate on, Trainer (v2.2 and later, KEP-2779) injects into
every trainer container the server's URL, its CA and a projected service-account token
(`KUBEFLOW_TRAINER_SERVER_URL`, `..._CA_CERT`, `..._TOKEN`: plugins/trainjobstatus/
trainjobstatus.go:43-45), and applies what a pod POSTs there to `status.trainerStatus`:
progressPercentage (0-100), estimatedRemainingSeconds, up to 256 metrics whose names and
values are strings of 1 to 64 characters, and lastUpdatedTime, which it requires
(trainjob_types.go:565-607; docs/facts.md, "Trainer's status server").

A thread posts the newest figures at most every `metrics.status_post_every_s`: the loop only
hands them over under a lock, so a slow server, or one that never answers, costs a step
nothing. Three failed posts in a row (an HTTP error, or no answer within `TIMEOUT_S`) are one
warning, and the run posts no more.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import ssl
import threading
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from trainer.telemetry.checkpoint_stats import CheckpointStats
from trainer.telemetry.metrics import Metrics
from trainer.telemetry.timing import StepSeconds
from trainer.telemetry.trainer_status import trainer_status

URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
CA_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"
TIMEOUT_S = 5.0  # the server's own read and write timeouts are 10 s (statusserver/server.go:45-46)
FAILURES_TO_STOP = 3
CLOSE_WAIT_S = 2.0  # how long the run's end waits for its last post


class StatusServer:
    """Where to post, and with what credentials: the token file is read at each post, since
    the kubelet rotates a projected token before it expires (an hour, trainjobstatus.go:54)."""

    def __init__(self, url: str, ca_file: str, token_file: str, timeout_s: float = TIMEOUT_S) -> None:
        self.url, self.token_file, self.timeout_s = url, Path(token_file), timeout_s
        self.tls = ssl.create_default_context(cafile=ca_file) if url.startswith("https:") else None

    @classmethod
    def from_environment(cls) -> StatusServer | None:
        url = os.environ.get(URL_ENV)
        return cls(url, os.environ.get(CA_ENV, ""), os.environ.get(TOKEN_ENV, "")) if url else None

    def post(self, body: dict) -> None:
        """POST `body`; an HTTP error, a refused connection or a timeout raises OSError."""
        request = urllib.request.Request(
            self.url,
            data=json.dumps(body).encode(),
            method="POST",
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {self.token_file.read_text().strip()}",
            },
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s, context=self.tls) as answer:
            answer.read()


def failure(error: OSError) -> str:
    if isinstance(error, urllib.error.HTTPError):
        said = error.read().decode(errors="replace")
        with contextlib.suppress(ValueError, AttributeError):  # the server's metav1.Status, mostly
            said = json.loads(said).get("message", said)
        return f"HTTP {error.code}: {said.strip()[:200]}"
    return str(getattr(error, "reason", None) or error)


class JobStatusPost(Metrics):
    """Rank 0's figures as the loop reports them to its metrics, posted from a thread."""

    def __init__(self, server: StatusServer, every_s: float, log: logging.Logger) -> None:
        self.server, self.every_s, self.log = server, every_s, log
        self.figures: dict[str, float] = {}
        self.posted: dict[str, float] = {}
        self.lock = threading.Lock()
        self.changed, self.closing = threading.Event(), threading.Event()
        self.failures, self.last_failure = 0, ""
        self.thread = threading.Thread(target=self._post_loop, name="job-status", daemon=True)
        self.thread.start()

    def progress(self, values: dict[str, float | None]) -> None:
        self._update({k: v for k, v in values.items() if v is not None})

    def validation(self, loss: float, accuracy: float) -> None:
        self._update({"val_loss": loss})

    def checkpoints(self, stats: CheckpointStats, step: int) -> None:
        if stats.last_success_step is not None:
            self._update({"durable_step": stats.last_success_step})

    def close(self) -> None:
        """The newest figures go out in a last post, waited for `CLOSE_WAIT_S` at most: a
        server that answers does so in milliseconds, and one that does not holds no exit."""
        self.closing.set()
        self.changed.set()
        self.thread.join(CLOSE_WAIT_S)

    def _update(self, figures: dict[str, float]) -> None:
        with self.lock:
            self.figures.update(figures)
        self.changed.set()

    def _post_loop(self) -> None:
        while not self.closing.is_set():
            self.changed.wait()
            self.changed.clear()
            if not self._post_newest():
                return
            self.closing.wait(self.every_s)  # the rate's bound; a close cuts it short
        if self._post_newest() and self.failures:  # the run ends with its progress unposted
            self._give_up("the TrainJob's status lacks the run's last progress")

    def _post_newest(self) -> bool:
        """Post the figures if they changed; False once posting is given up."""
        with self.lock:
            figures = dict(self.figures)
        if figures == self.posted or "step" not in figures:
            return True
        try:
            self.server.post(trainer_status(figures, datetime.now(timezone.utc)))
        except OSError as error:
            self.failures, self.last_failure = self.failures + 1, failure(error)
            if self.failures >= FAILURES_TO_STOP:
                self._give_up("training goes on and posts no more progress to the TrainJob's status")
                return False
            return True
        self.failures, self.posted = 0, figures
        return True

    def _give_up(self, then: str) -> None:
        self.log.warning(
            "job status: %d %s to %s failed (last: %s); %s",
            self.failures,
            "post" if self.failures == 1 else "posts in a row",
            self.server.url,
            self.last_failure,
            then,
        )


class Fanout(Metrics):
    """Several recorders as one: the loop reports once."""

    def __init__(self, *recorders: Metrics) -> None:
        self.recorders = recorders

    def step(self, seconds: StepSeconds, *, samples: int, tokens: int) -> None:
        for recorder in self.recorders:
            recorder.step(seconds, samples=samples, tokens=tokens)

    def progress(self, values: dict[str, float | None]) -> None:
        for recorder in self.recorders:
            recorder.progress(values)

    def validation(self, loss: float, accuracy: float) -> None:
        for recorder in self.recorders:
            recorder.validation(loss, accuracy)

    def startup(self, parts: list[tuple[str, float]]) -> None:
        for recorder in self.recorders:
            recorder.startup(parts)

    def checkpoints(self, stats: CheckpointStats, step: int) -> None:
        for recorder in self.recorders:
            recorder.checkpoints(stats, step)

    def flush(self) -> None:
        for recorder in self.recorders:
            recorder.flush()

    def close(self) -> None:
        for recorder in self.recorders:
            recorder.close()


def with_job_status(metrics: Metrics, is_main: bool, every_s: float, log: logging.Logger) -> Metrics:
    """`metrics`, and on rank 0 of a TrainJob whose status server is injected the poster."""
    server = StatusServer.from_environment() if is_main and every_s > 0 else None
    return metrics if server is None else Fanout(metrics, JobStatusPost(server, every_s, log))
