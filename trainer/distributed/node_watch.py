"""Nodes watching each other: a frozen or cut-off node is found by its peers in seconds.

A node whose kernel froze, whose VM was paused or whose link was cut crashes nothing: its
peers wait in the next all-reduce, and each node's watchdog (`trainer.distributed.watchdog`)
excuses a rank that waits for a peer elsewhere until `watchdog.first_s`. So each node's
first rank runs a watcher thread beside the loop. Every `node_poll_s` it publishes its
node's progress (newest step, phase, for how long, the phase's limit) under a key of its
own in the job's store (the TCPStore at MASTER_ADDR:MASTER_PORT, which every worker of the
group reaches), and reads every other node's key.

A node whose key has not changed for its limit is lost. The limit is derived from what was
observed, as the phases' limits are: `node_multiple` (3) times the longest gap seen between
that node's publishes, at least `node_floor_s` (a fixed `node_timeout_s` replaces it). The
publisher runs on its own thread, so a slow phase is not silence: a node that validates,
writes a checkpoint or downloads a resume keeps publishing, and is reported in that phase.
A store that stops answering for as long is the rendezvous host lost (node 0 hosts it).

A lost node is named in one line by every survivor (node rank, host, last step, phase,
silence). The survivor then leaves the broken group at once: it kills its node's other
ranks and exits, so that its torchrun re-rendezvouses without the lost node (its keep-alive
has expired by then: the chart's `keep_alive_*` settings) and resumes from the newest
snapshot, at the smaller world size where `--nnodes` allows it; where it does not, the line
says so and the survivors wait in torchrun's rendezvous for the node to come back or be
replaced (`ddp-launch` says so again at a steady interval). Where the lost node is the
store's host, torchrun's agent would wait on that store for good (its client has no reply
timeout), so the survivor tells `ddp-launch` (a file), which stops torchrun and starts it
again once the store answers: its node back, or its pod re-created. A node that finds its own
clock jumped past the limit was the frozen one: it blames nobody, and leaves too, so that
it rejoins at the next round instead of waiting in a collective whose peers are gone.

The thread costs the loop nothing per step: it reads the heartbeat record the loop already
keeps (`trainer.distributed.heartbeat`) and talks to the store on its own connection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.config import WatchdogConfig
from trainer.distributed.elastic_bounds import describe, node_bounds
from trainer.distributed.heartbeat import DONE, Heartbeat, read_records, signal_rank
from trainer.distributed.leaving import mark_left

if TYPE_CHECKING:  # torch is imported where a watch starts: ddp-launch reads STORE_LOST_FILE_ENV torch-free
    import torch.distributed as dist

    from trainer.distributed.process_group import DistContext

KEY_PREFIX = "ddp-node-progress/"
EXIT_NODE_LOST = 1  # a failure: torchrun restarts the workers while it has restarts left
STORE_LOST_FILE_ENV = "TRAINER_STORE_LOST_FILE"  # set by ddp-launch: where to say the store's host is lost


@dataclass(frozen=True)
class Progress:
    """What one node publishes: where its first rank stands."""

    node: int
    host: str
    step: int
    phase: str
    phase_s: float  # how long it has been in `phase`
    limit_s: float  # how long that phase may take
    seq: int

    def encode(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Progress:
        return cls(**json.loads(raw))


@dataclass
class Seen:
    """A peer as this node's watcher last saw it, on this node's clock."""

    progress: Progress
    changed_at: float
    longest_gap_s: float = 0.0


@dataclass
class NodeLimits:
    """How long a node may stay silent: derived from its publishes' gaps, or fixed."""

    config: WatchdogConfig

    def limit(self, longest_gap_s: float) -> float:
        if self.config.node_timeout_s != "auto":
            return float(self.config.node_timeout_s)
        return max(self.config.node_floor_s, self.config.node_multiple * longest_gap_s)


@dataclass
class NodeWatch:
    """One node's view of the others, on its own clock (testable without threads or stores):
    `observe` each key read, `answered` each exchange the store completed, `lost` to judge."""

    node: int
    num_nodes: int
    limits: NodeLimits
    seen: dict[int, Seen] = field(default_factory=dict)
    started_at: float = 0.0
    answered_at: float = 0.0  # the store's last completed exchange

    def observe(self, progress: Progress, now: float) -> None:
        """A peer's key as read now: its clock restarts when its sequence number moves."""
        before = self.seen.get(progress.node)
        if before is None:
            self.seen[progress.node] = Seen(progress, now)
        elif progress.seq != before.progress.seq:
            gap = now - before.changed_at
            before.longest_gap_s = max(before.longest_gap_s, gap)
            before.progress, before.changed_at = progress, now

    def lost(self, now: float) -> Loss | None:
        """The lost peer, or None while all answer. While the store does not answer, no
        peer can be heard: then only the store's host (node 0) can be found lost."""
        if now - self.answered_at > self.limits.limit(0.0) / 2:  # an exchange takes one poll
            silent, limit = now - self.answered_at, self.limits.limit(0.0)
            if silent <= limit:
                return None
            last = self.seen.get(0)
            store = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            return Loss(
                0, f"the rendezvous host (store {store})", silent, limit, last and last.progress, True
            )
        for node in range(self.num_nodes):
            seen = self.seen.get(node)
            since = seen.changed_at if seen is not None else self.started_at
            limit = self.limits.limit(seen.longest_gap_s if seen is not None else 0.0)
            if node != self.node and now - since > limit and not (seen and seen.progress.phase == DONE):
                last = seen and seen.progress
                return Loss(node, last.host if last else "?", now - since, limit, last)
        return None


@dataclass(frozen=True)
class Loss:
    """A node found lost: who, for how long, and where it was when last heard."""

    node: int
    host: str
    silent_s: float
    limit_s: float
    last: Progress | None
    store_host: bool = False  # the store stopped answering: its host is the one lost

    def describe(self) -> str:
        last = self.last
        where = f"after step {last.step} in {last.phase}" if last else "before its first publish"
        return (
            f"node {self.node} ({self.host}) has been silent for {self.silent_s:.1f}s "
            f"(limit {self.limit_s:.1f}s) {where}: it is lost"
        )

    def fields(self) -> dict[str, object]:
        return {
            "node": self.node,
            "host": self.host,
            "silent_s": round(self.silent_s, 2),
            "limit_s": round(self.limit_s, 2),
            "step": self.last.step if self.last else None,
            "phase": self.last.phase if self.last else None,
        }


def going_on(loss: Loss, num_nodes: int, bounds: tuple[int, int] | None, me: str) -> tuple[bool, str]:
    """Whether the survivors can train without the lost node, and what this node does: the
    words that end the lost line."""
    if loss.store_host:
        return False, (
            f"{me} leaves the group; torchrun cannot rendezvous without the store's host, so "
            "ddp-launch stops torchrun and starts it again once that store answers (its node back, "
            "or its pod re-created)"
        )
    if bounds is not None and num_nodes - 1 < bounds[0]:
        left = num_nodes - 1
        return False, (
            f"the job's bounds ({describe(bounds)}) do not allow training on {left} node{'s' * (left != 1)}: "
            f"{me} leaves the group and waits in torchrun's rendezvous until the node is back or replaced"
        )
    return True, (
        f"{me} leaves the group so that torchrun re-rendezvouses without it and resumes from the newest "
        "snapshot"
    )


def own_progress(heartbeat: Heartbeat, node: int, host: str, seq: int) -> Progress:
    """This node's progress: its first rank's record, the newest step of its ranks."""
    now = time.monotonic()
    steps = [record.step for record in read_records(heartbeat.folder)] or [heartbeat.step]
    limit = heartbeat.explicit_limit_s
    if limit is None:
        limit = heartbeat.limits.limit(heartbeat.phase_name)
    return Progress(node, host, max(steps), heartbeat.phase_name, now - heartbeat.since, limit, seq)


def leave_group(heartbeat: Heartbeat) -> None:
    """End this node's ranks now: the others first (SIGKILL: they wait in a collective that
    will never finish), then this process, so that torchrun sees failed workers."""
    mark_left("its node left the group")
    me = os.getpid()
    for record in read_records(heartbeat.folder):
        if record.pid != me:
            signal_rank(record, signal.SIGKILL)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_NODE_LOST)


class NodeWatcher:
    """Two threads: one publishes this node's progress and reads the others' (a call to a
    frozen or cut-off store blocks: TCPStore's client has no timeout on a reply, seen with
    `check` on a SIGSTOPped server), the other judges on its own clock and acts."""

    def __init__(
        self,
        context: DistContext,
        config: WatchdogConfig,
        heartbeat: Heartbeat,
        logger: logging.Logger,
        leave: Callable[[Heartbeat], None] = leave_group,
    ) -> None:
        self.context, self.config, self.heartbeat, self.log = context, config, heartbeat, logger
        self.leave = leave
        self.watch = NodeWatch(context.node_rank, context.num_nodes, NodeLimits(config))
        self.running, self.stopping, self.said_done = threading.Event(), threading.Event(), threading.Event()
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._exchange_loop, name="node-exchange", daemon=True),
            threading.Thread(target=self._judge_loop, name="node-judge", daemon=True),
        ]

    def start(self) -> None:
        self.running.set()
        self.watch.started_at = self.watch.answered_at = time.monotonic()
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        """Stop judging, and tell the other nodes that this one is done (within two polls),
        so that a peer still writing its last checkpoint or testing does not find it lost."""
        self.running.clear()
        self.stopping.set()
        self.said_done.wait(2 * self.config.node_poll_s)

    def _connect(self) -> dist.TCPStore:
        """A connection of its own to the group's store: a blocked call here holds up no
        collective's use of the group's."""
        import torch.distributed as dist

        timeout = timedelta(seconds=max(1.0, self.config.node_poll_s * 2))
        return dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout,
            wait_for_workers=False,
        )  # fmt: skip

    def _exchange_loop(self) -> None:
        """Publish this node's progress and read every other node's, every poll."""
        store, seq = None, 0
        while not self.stopping.is_set():
            seq += 1
            try:
                store = store or self._connect()
                mine = own_progress(self.heartbeat, self.context.node_rank, self.context.hostname, seq)
                store.set(f"{KEY_PREFIX}{mine.node}", mine.encode())
                peers = [f"{KEY_PREFIX}{node}" for node in range(self.context.num_nodes) if node != mine.node]
                published = [key for key in peers if store.check([key])]
                read = [Progress.decode(store.get(key)) for key in published]
                with self.lock:
                    now = time.monotonic()
                    for progress in read:
                        self.watch.observe(progress, now)
                    self.watch.answered_at = now
            except (RuntimeError, OSError, ValueError):  # DistStoreError, a reset connection
                store = None
            self.stopping.wait(self.config.node_poll_s)
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            last = own_progress(self.heartbeat, self.context.node_rank, self.context.hostname, seq + 1)
            done = dataclasses.replace(last, phase=DONE)
            (store or self._connect()).set(f"{KEY_PREFIX}{done.node}", done.encode())
        self.said_done.set()

    def _judge_loop(self) -> None:
        poll = self.config.node_poll_s
        last = time.monotonic()
        while self.running.is_set():
            time.sleep(poll)
            now = time.monotonic()
            if now - last > self.watch.limits.limit(0.0):
                self._leave_thawed(now - last - poll)
                return
            last = now
            with self.lock:
                loss = self.watch.lost(now)
            if loss is not None and self.running.is_set():
                me = f"node {self.context.node_rank} ({self.context.hostname})"
                goes_on, then = going_on(loss, self.context.num_nodes, node_bounds(os.environ), me)
                self.log.error(
                    f"{loss.describe()}; {then}",
                    extra={"event": "node_lost", "fields": {**loss.fields(), "goes_on": goes_on}},
                )
                if loss.store_host and STORE_LOST_FILE_ENV in os.environ:
                    Path(os.environ[STORE_LOST_FILE_ENV]).write_text(loss.describe() + "\n")
                self.leave(self.heartbeat)
                return

    def _leave_thawed(self, stopped_s: float) -> None:
        """This node was the frozen one, longer than its peers wait: they have found it and
        gone on. Its ranks may wait on in a collective with peers that are gone (seen: 36 s
        after a thaw, until the agent gave up), so it leaves at once too, blaming nobody,
        and rejoins at torchrun's next rendezvous."""
        self.log.error(
            f"node {self.context.node_rank} ({self.context.hostname}) was itself stopped for "
            f"{stopped_s:.1f}s (frozen or paused), longer than its peers wait: it leaves the group "
            "and rejoins at torchrun's next rendezvous",
            extra={"event": "node_thawed", "fields": {"stopped_s": round(stopped_s, 2)}},
        )
        self.leave(self.heartbeat)


def start_node_watch(
    context: DistContext, config: WatchdogConfig, heartbeat: Heartbeat, logger: logging.Logger
) -> NodeWatcher | None:
    """The watcher of a multi-node group's node's first rank; None where there is nothing to
    watch (one node, no torchrun, or the watchdog off)."""
    multi_node = context.launched_by_torchrun and context.num_nodes > 1 and "MASTER_ADDR" in os.environ
    if not (config.enabled and config.nodes and context.is_node_main and multi_node):
        return None
    watcher = NodeWatcher(context, config, heartbeat, logger)
    watcher.start()
    return watcher
