"""One owner per checkpoint location: a lease in the store, renewed by a heartbeat.

Two jobs on one location (two releases on one bucket prefix, a re-install while the old
pods are in their grace period) each crash nothing and end silently wrong: one's
checkpoints replace the other's. So rank 0 takes `lease.json` before it writes anything,
with a conditional write (S3's If-None-Match / If-Match, a flock'd compare-and-swap on a
directory), and renews it every `lease_s`:
- absent: taken;
- held by this job (a torchrun restart, a re-rendezvous, a re-created pod: the same
  `TRAINER_JOB_ID`, or torchrun's run id): taken back at once;
- held by another job whose heartbeat is older than `STALE_INTERVALS` of its interval, or
  whose process on this very host is gone: its owner died; taken over, with a warning;
- held by another live job: refused, one line naming the owner (exit 2);
- released (its last run ended and let go): taken.
Each holder's lease carries an epoch that rises whenever another job takes it, and the
jobs whose stale lease was taken over stay listed as `superseded`, also once the new owner
has released it: a superseded job's torchrun restarts, re-rendezvous and re-created pods
are refused (exit 2), and it writes nothing more there. A new install is a new job
(`TRAINER_JOB_ID`, which the chart makes unique per install), which may take the location.
Every publish of a step and of `latest.json` is fenced: the commit reads the lease first
and refuses when it is no longer this run's (`LeaseFence`), and the store itself refuses a
write made against an older version (`Checkpointer.commit`). A renewal that finds another
owner stops the run (`on_lost`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from trainer.checkpoint.store import CheckpointStore
from trainer.config import ConfigError

LEASE_FILE = "lease.json"
STALE_INTERVALS = 3
SUPERSEDED_KEPT = 32  # the newest superseded jobs a lease remembers
JOB_ID_ENV = "TRAINER_JOB_ID"  # set by the chart: the job, whichever pod or attempt runs it
log = logging.getLogger("trainer.checkpoint")


class LeaseLost(OSError):
    """The location's lease is another run's now: this one must publish nothing more."""


def job_id(run_id: str) -> str:
    """Who "this job" is: the chart's id, else torchrun's run id (one per torchrun, kept
    across its restarts), else nobody else (a fresh id)."""
    return os.environ.get(JOB_ID_ENV) or (run_id if run_id not in ("", "none", "local") else uuid.uuid4().hex)


def describe(holder: dict[str, Any], now: float) -> str:
    age = now - float(holder.get("heartbeat_at", 0))
    return (
        f"job {holder.get('job')} (pod {holder.get('pod')}, host {holder.get('host')}, "
        f"pid {holder.get('pid')}), heartbeat {age:.0f}s ago"
    )


@dataclass(frozen=True)
class LeaseFence:
    """What a commit checks, in whichever process commits: the lease still holds `token`;
    and the lease's `epoch`, which every manifest and `latest.json` this run writes carry."""

    token: str
    epoch: int = 0

    def holder(self, store: CheckpointStore) -> tuple[dict[str, Any] | None, str | None, bool]:
        """The lease's holder now, its version, and whether it is this run."""
        current = store.get_versioned(LEASE_FILE)
        if current is None:
            return None, None, False
        holder = _parse(current[0])
        return holder, current[1], holder is not None and holder.get("token") == self.token

    def check(self, store: CheckpointStore) -> None:
        holder, _, ours = self.holder(store)
        if not ours:
            owner = describe(holder, time.time()) if holder else "nobody"
            raise LeaseLost(f"the lease of {store.uri} is no longer this run's: {owner} holds it")


class Lease:
    """Rank 0's hold on the location: `acquire`, then a heartbeat thread, then `release`."""

    def __init__(self, store: CheckpointStore, job: str, run_id: str, interval_s: float) -> None:
        self.store, self.interval_s = store, interval_s
        self.fence = LeaseFence(uuid.uuid4().hex)
        self.superseded: list[str] = []  # jobs that held this location before and were taken over
        self.holder: dict[str, Any] = {
            "token": self.fence.token,
            "job": job,
            "pod": os.environ.get("HOSTNAME") or socket.gethostname(),
            "host": socket.gethostname(),
            "run_id": run_id,
            "pid": os.getpid(),
            "interval_s": interval_s,
        }
        self.version: str | None = None
        self.lost_to: str | None = None
        self._found: bytes | None = None  # the lease as acquire found it, for `give_back`
        self.took_over = False  # from another job, whose lease had gone stale
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def _document(self, **released: Any) -> bytes:
        document = {
            **self.holder,
            "epoch": self.fence.epoch,
            "superseded": self.superseded,
            "heartbeat_at": time.time(),
            **released,
        }
        return json.dumps(document, indent=2).encode() + b"\n"

    def acquire(self) -> None:
        """Take the lease, or raise ConfigError naming its live owner, or saying that this
        job was superseded here."""
        for _ in range(5):  # each lost race re-reads what won it
            current = self.store.get_versioned(LEASE_FILE)
            holder = None if current is None else _parse(current[0])
            self._refuse_superseded(holder)
            taken_over = self._refuse_live_owner(holder)
            ours = holder is not None and holder.get("job") == self.holder["job"]
            epoch = int((holder or {}).get("epoch", 0))
            self.fence = LeaseFence(self.fence.token, epoch if ours else epoch + 1)
            self.superseded = list((holder or {}).get("superseded", []))
            if taken_over:
                self.superseded = [*self.superseded, holder.get("job")][-SUPERSEDED_KEPT:]
            if self._write(None if current is None else current[1]):
                self._found, self.took_over = (None if current is None else current[0]), taken_over
                if taken_over:
                    log.warning(
                        "took over the checkpoint lease of %s: its owner died (%s); that job may write "
                        "here no more (lease epoch %d)",
                        self.store.uri, describe(holder, time.time()), self.fence.epoch,
                    )  # fmt: skip
                return
        raise ConfigError("checkpoint.uri", self.store.uri, "its lease changed hands 5 times as it was taken")

    def refuse_if_taken(self) -> None:
        """Raise ConfigError naming the live owner if another job holds the lease now, or if
        this job was superseded here: the quick refusal, before this run waits for anything
        (`acquire` checks again)."""
        current = self.store.get_versioned(LEASE_FILE)
        if current is not None:
            holder = _parse(current[0])
            self._refuse_superseded(holder)
            self._refuse_live_owner(holder)

    def _refuse_superseded(self, holder: dict[str, Any] | None) -> None:
        """A job whose stale lease another took over never writes here again: its restarts,
        its re-created pods and a process of it that thaws late are refused (exit 2)."""
        if holder is None or self.holder["job"] not in holder.get("superseded", []):
            return
        now_held = "released by" if holder.get("released_at") else "held by"
        raise ConfigError(
            "checkpoint.uri",
            self.store.uri,
            f"job {self.holder['job']} was superseded here (another job took over its stale lease, now at "
            f"epoch {holder.get('epoch', 0)}, {now_held} {describe(holder, time.time())}): a superseded job "
            "writes nothing more here; a new install is a new job and may take it, or use another "
            "checkpoint.uri",
        )

    def _refuse_live_owner(self, holder: dict[str, Any] | None) -> bool:
        """Raise ConfigError if `holder` is another job that is alive; True if it is another
        job that died (its lease may be taken over)."""
        if holder is None or holder.get("job") == self.holder["job"] or holder.get("released_at"):
            return False
        now = time.time()
        age = now - float(holder.get("heartbeat_at", 0))
        stale_after = STALE_INTERVALS * float(holder.get("interval_s", self.interval_s))
        if age <= stale_after and not self._died_here(holder):
            raise ConfigError(
                "checkpoint.uri",
                self.store.uri,
                f"is in use by {describe(holder, now)}; stop that job, or wait {stale_after - age:.0f}s "
                "for its lease to expire if it died, or use another checkpoint.uri",
            )
        return True

    def _died_here(self, holder: dict[str, Any]) -> bool:
        """Whether the owner ran on this host and its process is gone (a run killed on a
        laptop and started again): no need to wait for its heartbeat to go stale."""
        if holder.get("host") != self.holder["host"]:
            return False
        try:
            return not psutil.pid_exists(int(holder.get("pid", 0)))
        except (TypeError, ValueError):
            return False

    def _write(self, version: str | None) -> bool:
        """A conditional write of a fresh heartbeat (and this holder's epoch and list of
        superseded jobs); its version kept for the next one."""
        written = self.store.put_if(LEASE_FILE, self._document(), version)
        if written is not None:
            self.version = written
        return written is not None

    def start(self, on_lost: Callable[[str], None]) -> None:
        """Renew every `interval_s` until `release`; `on_lost(owner)` once another run has it."""
        self._thread = threading.Thread(target=self._beat, args=(on_lost,), name="lease", daemon=True)
        self._thread.start()

    def _beat(self, on_lost: Callable[[str], None]) -> None:
        failing = False
        while not self._stopping.wait(self.interval_s):
            try:
                if not self.renew():
                    on_lost(self.lost_to or "nobody")
                    return
                failing = False
            except Exception as error:  # the store failing: the lease may go stale; the fence holds
                if not failing:
                    log.warning("renewing the checkpoint lease of %s failed: %s", self.store.uri, error)
                failing = True

    def renew(self) -> bool:
        """Write a fresh heartbeat over our own; False (and `lost_to` set) once another run
        holds the lease."""
        if self._write(self.version):
            return True
        holder, version, ours = self.fence.holder(self.store)
        if ours:
            self.version = version  # ours still: a retried request had rewritten it
            return True
        self.lost_to = describe(holder, time.time()) if holder else "nobody (it was removed)"
        return False

    def give_back(self) -> None:
        """Put the lease back as `acquire` found it (a run refused before it wrote anything
        leaves the location as it was)."""
        self._stop_renewing()
        if self.version is None or self.lost_to is not None:
            return
        try:
            if self._found is None:
                self.store.delete_if(LEASE_FILE, self.version)
            else:
                self.store.put_if(LEASE_FILE, self._found, self.version)
        except Exception as error:  # it goes stale instead
            log.warning("giving back the checkpoint lease of %s failed: %s", self.store.uri, error)

    def _stop_renewing(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def release(self) -> None:
        """Stop renewing and mark the lease released if it is still ours, so that the next
        run need not wait for it to go stale; its epoch and the superseded jobs stay."""
        self._stop_renewing()
        if self.version is not None and self.lost_to is None:
            try:
                self.store.put_if(LEASE_FILE, self._document(released_at=time.time()), self.version)
            except Exception as error:  # it goes stale instead
                log.warning("releasing the checkpoint lease of %s failed: %s", self.store.uri, error)


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        document = json.loads(raw)
    except ValueError:
        return None
    return document if isinstance(document, dict) else None
