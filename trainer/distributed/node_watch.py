"""Nodes watching each other: a frozen or cut-off node is found by its peers in seconds.

A node whose kernel froze, whose VM was paused or whose link was cut crashes nothing: its
peers wait in the next all-reduce, and each node's watchdog (`trainer.distributed.watchdog`)
excuses a rank that waits for a peer elsewhere until `watchdog.first_s`. So each node's
first rank runs a watcher thread beside the loop. Every `node_poll_s` it publishes its
node's progress (newest step, phase, for how long, the phase's limit) in the job's store
(the TCPStore at MASTER_ADDR:MASTER_PORT, which every worker of the group reaches), through
`trainer.distributed.node_exchange`: node 0's watcher, the collector, reads every node's
progress and announces a verdict, which every other node reads. Two round trips per node
and poll, whatever the number of nodes; the store's load grows as N, not N squared.

A node whose progress has not changed for its limit is lost. The limit is derived from what
was observed, as the phases' limits are: `node_multiple` (3) times the longest gap seen
between that node's publishes, at least `node_floor_s` (a fixed `node_timeout_s` replaces
it). The collector judges every other node so; every other node judges the collector by its
verdicts. The publisher runs on its own thread, so a slow phase is not silence: a node that
validates, writes a checkpoint or downloads a resume keeps publishing, and is reported in
that phase. A store that stops answering for as long is the rendezvous host lost (node 0
hosts it).

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
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.config import WatchdogConfig
from trainer.distributed.elastic_bounds import node_bounds
from trainer.distributed.heartbeat import DONE, Heartbeat, read_records, signal_rank
from trainer.distributed.leaving import mark_left
from trainer.distributed.node_exchange import COLLECTOR, Exchange, Progress, Store, Verdict
from trainer.distributed.node_judge import Loss, NodeLimits, NodeWatch, going_on

if TYPE_CHECKING:  # torch is imported where a watch starts: ddp-launch reads STORE_LOST_FILE_ENV torch-free
    import torch.distributed as dist

    from trainer.distributed.process_group import DistContext

EXIT_NODE_LOST = 1  # a failure: torchrun restarts the workers while it has restarts left
STORE_LOST_FILE_ENV = "TRAINER_STORE_LOST_FILE"  # set by ddp-launch: where to say the store's host is lost


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
    """Two threads: one talks to the store (a call to a frozen or cut-off store blocks:
    TCPStore's client has no timeout on a reply, seen with `check` on a SIGSTOPped server),
    the other judges on its own clock and acts. The collector's judge, having found a node
    lost, waits until the exchange has announced it and the survivors have acknowledged it
    (at most `2 * node_poll_s` more), since the store leaves with the collector's process."""

    def __init__(
        self,
        node: int,
        num_nodes: int,
        host: str,
        config: WatchdogConfig,
        logger: logging.Logger,
        progress: Callable[[int], Progress],
        connect: Callable[[], Store],
        leave: Callable[[], None],
    ) -> None:
        """`progress(seq)` is this node's progress now, `connect()` a store client of the
        watcher's own, `leave()` ends this node's ranks (it does not return in a trainer)."""
        self.node, self.num_nodes, self.host, self.config, self.log = node, num_nodes, host, config, logger
        self.progress, self.connect, self.leave = progress, connect, leave
        self.watch = NodeWatch(node, num_nodes, NodeLimits(config))
        self.running, self.stopping, self.said_done = threading.Event(), threading.Event(), threading.Event()
        self.wake_exchange, self.wake_judge = threading.Event(), threading.Event()
        self.announced = threading.Event()  # the collector's finding announced and acknowledged
        self.lock = threading.Lock()
        self.announcing: Loss | None = None  # the collector's finding, for the exchange to announce
        self.acknowledged = False  # a follower said it read the collector's finding
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
        self.wake_exchange.set()
        self.said_done.wait(2 * self.config.node_poll_s)

    def _exchange(self) -> Exchange:
        exchange = Exchange(self.connect(), self.node, self.num_nodes)
        if exchange.is_collector:
            exchange.prepare()
        return exchange

    def _exchange_loop(self) -> None:
        """Every poll, the collector reads every node and announces its verdict; every other
        node publishes its progress and reads that verdict."""
        exchange, seq = None, 0
        while not self.stopping.is_set():
            seq += 1
            try:
                exchange = exchange or self._exchange()
                mine = self.progress(seq)
                if exchange.is_collector:
                    self._collect(exchange, mine)
                else:
                    self._follow(exchange, mine)
            except (RuntimeError, OSError, ValueError):  # DistStoreError, a reset connection
                exchange = None
            self.wake_exchange.wait(self.config.node_poll_s)
            self.wake_exchange.clear()
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            last = self.progress(seq + 1)
            done = dataclasses.replace(last, phase=DONE)
            exchange = exchange or self._exchange()
            if exchange.is_collector:
                exchange.announce(Verdict(done))
            else:
                exchange.publish(done)
        self.said_done.set()

    def _collect(self, exchange: Exchange, mine: Progress) -> None:
        read = exchange.collect()
        with self.lock:
            now = time.monotonic()
            for progress in read:
                self.watch.observe(progress, now)
            self.watch.answered_at = now
            loss = self.announcing
        exchange.announce(Verdict(mine, loss and loss.announced()))
        if loss is not None:
            self._await_acknowledgements(exchange, loss)

    def _await_acknowledgements(self, exchange: Exchange, loss: Loss) -> None:
        """Until every survivor said it read the loss, or two polls passed."""
        with self.lock:
            alive = [node for node in self.watch.watched if node != loss.node]
            expected = sum(1 for node in alive if not self._done(node))
        deadline = time.monotonic() + 2 * self.config.node_poll_s
        while exchange.acknowledged() < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        self.announced.set()

    def _done(self, node: int) -> bool:
        seen = self.watch.seen.get(node)
        return seen is not None and seen.progress.phase == DONE

    def _follow(self, exchange: Exchange, mine: Progress) -> None:
        exchange.publish(mine)
        verdict = exchange.read_verdict()
        with self.lock:
            now = time.monotonic()
            if verdict is not None:
                self.watch.observe(verdict.collector, now)
            self.watch.answered_at = now
            taken = verdict is not None and verdict.lost is not None and self.watch.report(verdict.lost)
        if taken and not self.acknowledged:
            exchange.acknowledge()
            self.acknowledged = True
            self.wake_judge.set()

    def _judge_loop(self) -> None:
        poll = self.config.node_poll_s
        last = time.monotonic()
        while self.running.is_set():
            self.wake_judge.wait(poll)
            self.wake_judge.clear()
            now = time.monotonic()
            if now - last > self.watch.limits.limit(0.0):
                self._leave_thawed(now - last - poll)
                return
            last = now
            with self.lock:
                loss = self.watch.lost(now)
            if loss is not None and self.running.is_set():
                self._leave_lost(loss)
                return

    def _leave_lost(self, loss: Loss) -> None:
        me = f"node {self.node} ({self.host})"
        goes_on, then = going_on(loss, self.num_nodes, node_bounds(os.environ), me)
        self.log.error(
            f"{loss.describe()}; {then}",
            extra={"event": "node_lost", "fields": {**loss.fields(), "goes_on": goes_on}},
        )
        if loss.store_host and STORE_LOST_FILE_ENV in os.environ:
            Path(os.environ[STORE_LOST_FILE_ENV]).write_text(loss.describe() + "\n")
        if self.watch.node == COLLECTOR and not loss.store_host:
            with self.lock:
                self.announcing = loss
            self.wake_exchange.set()
            self.announced.wait(3 * self.config.node_poll_s)
        self.leave()

    def _leave_thawed(self, stopped_s: float) -> None:
        """This node was the frozen one, longer than its peers wait: they have found it and
        gone on. Its ranks may wait on in a collective with peers that are gone (seen: 36 s
        after a thaw, until the agent gave up), so it leaves at once too, blaming nobody,
        and rejoins at torchrun's next rendezvous."""
        self.log.error(
            f"node {self.node} ({self.host}) was itself stopped for "
            f"{stopped_s:.1f}s (frozen or paused), longer than its peers wait: it leaves the group "
            "and rejoins at torchrun's next rendezvous",
            extra={"event": "node_thawed", "fields": {"stopped_s": round(stopped_s, 2)}},
        )
        self.leave()


def connect_store(config: WatchdogConfig) -> dist.Store:
    """A connection of the watcher's own to the group's store: a blocked call there holds up
    no collective's use of the group's."""
    import torch.distributed as dist

    timeout = timedelta(seconds=max(1.0, config.node_poll_s * 2))
    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout,
        wait_for_workers=False,
    )  # fmt: skip


def start_node_watch(
    context: DistContext, config: WatchdogConfig, heartbeat: Heartbeat, logger: logging.Logger
) -> NodeWatcher | None:
    """The watcher of a multi-node group's node's first rank; None where there is nothing to
    watch (one node, no torchrun, or the watchdog off)."""
    multi_node = context.launched_by_torchrun and context.num_nodes > 1 and "MASTER_ADDR" in os.environ
    if not (config.enabled and config.nodes and context.is_node_main and multi_node):
        return None
    node, host = context.node_rank, context.hostname
    watcher = NodeWatcher(
        node, context.num_nodes, host, config, logger,
        progress=lambda seq: own_progress(heartbeat, node, host, seq),
        connect=lambda: connect_store(config),
        leave=lambda: leave_group(heartbeat),
    )  # fmt: skip
    watcher.start()
    return watcher
