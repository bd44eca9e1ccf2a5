"""The nodes' watchers against a real TCPStore (libuv, as torchrun's): the round trips each
node makes per poll whatever the number of nodes, and a silent node named by every survivor,
the collector leaving only once they read it. Watchers run as threads of this process, each
with a store client of its own; the store client is wrapped only to count its calls (each
call of a TCPStore client is one request and its answer) and to freeze one node."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from benchmarks.namespaces import on_a_host_of_its_own
from trainer.config import WatchdogConfig
from trainer.distributed.node_exchange import Progress, Verdict
from trainer.distributed.node_judge import NodeWatch
from trainer.distributed.node_watch import NodeWatcher

POLL_S = 0.1


class CountingStore:
    """A real TCPStore client whose calls are counted, and held while `thawed` is clear (a
    node whose every process stopped: its calls never reach the store)."""

    def __init__(self, port: int) -> None:
        self.client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2), wait_for_workers=False
        )
        self.calls: Counter[str] = Counter()
        self.thawed = threading.Event()
        self.thawed.set()

    def __getattr__(self, name: str) -> Callable:
        method = getattr(self.client, name)

        def counted(*args):
            self.thawed.wait()
            self.calls[name] += 1
            return method(*args)

        return counted


class Node:
    """One simulated node: a NodeWatcher with a progress of its own, its store client counted."""

    def __init__(self, node: int, num_nodes: int, port: int, config: WatchdogConfig) -> None:
        self.store = CountingStore(port)
        self.left_at: float | None = None
        self.left = threading.Event()
        self.watcher = NodeWatcher(
            node, num_nodes, f"host-{node}", config, logging.getLogger(f"node-{node}"),
            progress=lambda seq: Progress(node, f"host-{node}", 0, "step", 0.0, 5.0, seq),
            connect=lambda: self.store,
            leave=self.leave,
        )  # fmt: skip

    def leave(self) -> None:
        self.left_at = time.monotonic()
        self.left.set()


@contextmanager
def watching_nodes(count: int, config: WatchdogConfig) -> Iterator[list[Node]]:
    """A store and `count` nodes watching through it, started; stopped on the way out, pass
    or fail (each stop waits up to two polls, so all at once)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    nodes = [Node(node, count, server.port, config) for node in range(count)]
    for node in nodes:
        node.watcher.start()
    try:
        yield nodes
    finally:
        for node in nodes:
            node.store.thawed.set()
        with ThreadPoolExecutor(max_workers=count) as stopping:
            list(stopping.map(lambda node: node.watcher.stop(), nodes))


def test_each_node_makes_at_most_two_round_trips_a_poll_whatever_the_number_of_nodes(tmp_path):
    """64 nodes: the watcher of before made 2 x 64 - 1 = 127 round trips a poll, one per peer's
    key twice and its own once."""

    def count_a_window() -> tuple[list[float], list[Node]]:
        with watching_nodes(64, WatchdogConfig(node_poll_s=POLL_S)) as nodes:
            time.sleep(1.0)  # ten polls: past the collector's once-only placeholders
            before = [sum(node.store.calls.values()) for node in nodes]
            started = time.monotonic()
            time.sleep(2.0)
            polls = (time.monotonic() - started) / POLL_S
            made = [sum(node.store.calls.values()) - calls for node, calls in zip(nodes, before, strict=True)]
            return [calls / polls for calls in made], nodes

    per_poll, nodes = on_a_host_of_its_own(tmp_path, count_a_window)
    assert max(per_poll) <= 3, (max(per_poll), nodes[0].store.calls, nodes[1].store.calls)
    assert min(per_poll) >= 1, per_poll  # every node exchanged: this counts no idle watcher
    assert not any(node.left.is_set() for node in nodes)  # nobody silent, nobody lost


def test_a_frozen_node_is_named_by_every_survivor_and_the_collector_leaves_after_they_read_it(
    tmp_path, caplog
):
    def freeze_node_3() -> tuple[list[Node], float]:
        with watching_nodes(5, WatchdogConfig(node_poll_s=POLL_S, node_floor_s=2.0)) as nodes:
            time.sleep(0.5)
            frozen = nodes[3]
            frozen.store.thawed.clear()
            frozen.watcher.running.clear()  # its judge too: a frozen node judges nothing
            frozen_at = time.monotonic()
            for node in nodes:
                if node is not frozen:
                    assert node.left.wait(10), f"node {node.watcher.node} never left"
            return nodes, frozen_at

    with caplog.at_level(logging.ERROR):
        nodes, frozen_at = on_a_host_of_its_own(tmp_path, freeze_node_3)
    lines = [record.getMessage() for record in caplog.records if getattr(record, "event", "") == "node_lost"]
    assert len(lines) == 4, lines  # one line from each survivor, none from the frozen node
    assert all(line.startswith("node 3 (host-3) has been silent for") for line in lines), lines
    survivors = [node for node in nodes if node.watcher.node != 3]
    named = [node.left_at - frozen_at for node in survivors]
    # the 2 s floor counts from its last publish that was read, up to a poll before the freeze;
    # then a poll or two
    assert all(2.0 - POLL_S <= delay < 4.0 for delay in named), named
    collector, followers = survivors[0], survivors[1:]
    assert collector.left_at >= max(node.left_at for node in followers) - POLL_S, named


def test_an_old_rounds_verdict_in_a_shared_store_is_not_taken():
    """A store shared across rounds (TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset) still holds the
    last round's verdict, naming a node lost; a new round's follower must not leave on it."""
    watch = NodeWatch(2, 3, limits=None)  # a follower: the limits do not enter
    old = Verdict.decode(
        b'{"collector": {"node": 0, "host": "a", "step": 9, "phase": "step", "phase_s": 0, "limit_s": 5, '
        b'"seq": 41}, "lost": {"node": 1, "host": "b", "silent_s": 6, "limit_s": 5, "last": null}}'
    )
    watch.observe(old.collector, 0.0)
    assert watch.report(old.lost) is False  # the collector has not been seen to publish yet
    watch.observe(old.collector, 1.0)  # the same verdict again: it never moves
    assert watch.report(old.lost) is False
    fresh = Progress(0, "a", 0, "startup", 0.0, 600.0, 1)
    watch.observe(fresh, 2.0)  # this round's collector overwrote it
    assert watch.report(old.lost) is True
