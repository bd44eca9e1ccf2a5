"""Beyond this machine: 64 to 1,024 nodes simulated against a real TCPStore (libuv, the
server torchrun and the trainer start), each node a client doing what its real counterpart
does, with the code its counterpart runs.

- **The nodes' watchers** (`watchers`): every simulated node runs the trainer's own
  `NodeWatcher` (two threads and a store connection each), with a progress of its own. The
  store is counted by the kernel (`store_traffic`); each node's poll is timed from its
  progress being read to its last store call's answer. Then one node freezes (its store
  calls stop, its judge too) and the time until the collector and every survivor named it is
  taken on the wall clock.
- **torchrun's agents** against the rendezvous store (`benchmarks.agent_load`), with torch's
  own rendezvous classes, up to 256 nodes; beyond, derived from the largest count measured.

Simulated nodes live in worker processes (`python -m benchmarks.store_load worker ...`,
`benchmarks.store_sim`), at most 128 a process, all on this machine's 2 cores. Needs a
network namespace of its own (root) for its thousand connections: this machine's DNS server
drops a burst of the reverse lookups each end of a connection makes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from benchmarks.agent_load import AGENTS_MAX, AgentLoad, agents, derived_agents, describe_agents, run_agents
from benchmarks.namespaces import on_a_host_of_its_own
from benchmarks.store_sim import (
    NODES_PER_PROCESS,
    TimedStore,
    percentile,
    results,
    start_store,
    wait_until,
    workers,
)
from benchmarks.store_traffic import served, thread_cpu_seconds
from trainer.config import WatchdogConfig
from trainer.distributed.node_exchange import Progress


@dataclass(frozen=True)
class WatchLoad:
    """The watchers of `nodes` simulated nodes, as measured."""

    nodes: int
    requests_per_s: float  # at the store, counted by the kernel
    per_node_per_poll: float
    bytes_per_s: float  # in and out
    store_busy: float  # the share of one core its server thread used
    poll_p50_ms: float
    poll_p99_ms: float
    named_by_collector_s: float | None
    named_by_all_s: float | None  # the last survivor's line
    survivors_named: int


class SimulatedNode:
    """One node's watcher, its poll times taken between its progress reads."""

    def __init__(self, node: int, nodes: int, port: int, config: WatchdogConfig) -> None:
        import torch.distributed as dist

        client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False
        )
        self.store = TimedStore(client)
        self.node, self.polls, self.poll_started = node, [], None
        self.left_at: float | None = None
        self.measuring = False
        from trainer.distributed.node_watch import NodeWatcher

        self.watcher = NodeWatcher(
            node, nodes, f"sim-{node}", config, logging.getLogger("simulated"),
            progress=self.progress, connect=lambda: self.store, leave=self.leave,
        )  # fmt: skip

    def progress(self, seq: int) -> Progress:
        if self.poll_started is not None and self.measuring:
            self.polls.append(self.store.last_answer - self.poll_started)
        self.poll_started = time.monotonic()
        return Progress(self.node, f"sim-{self.node}", seq, "step", 0.05, 5.0, seq)

    def leave(self) -> None:
        self.left_at = time.time()

    def freeze(self) -> None:
        self.store.thawed.clear()
        self.watcher.running.clear()


def run_watchers(first: int, last: int, nodes: int, port: int, timeline: dict) -> dict:
    """A worker's share of the watchers (nodes first..last), on the shared timeline."""
    logging.getLogger("simulated").addHandler(logging.NullHandler())
    logging.getLogger("simulated").propagate = False
    config = WatchdogConfig()
    simulated = [SimulatedNode(node, nodes, port, config) for node in range(first, last + 1)]
    wait_until(timeline["start"])
    for node in simulated:
        node.watcher.start()
    wait_until(timeline["measure"])
    calls_before = sum(node.store.calls for node in simulated)
    for node in simulated:
        node.measuring = True
    wait_until(timeline["freeze"])
    calls = sum(node.store.calls for node in simulated) - calls_before
    for node in simulated:
        node.measuring = False
        if node.node == timeline["frozen"]:
            node.freeze()
    wait_until(timeline["end"])
    stop_all(simulated)
    return {
        "calls": calls,
        "polls": [seconds for node in simulated for seconds in node.polls],
        "left": {node.node: node.left_at for node in simulated if node.left_at is not None},
    }


def stop_all(simulated: list[SimulatedNode]) -> None:
    """Stop every watcher before this process exits: a thread still inside a store call when
    the interpreter tears down aborts it (std::terminate, seen at 1,024 nodes)."""
    from concurrent.futures import ThreadPoolExecutor

    for node in simulated:
        node.store.thawed.set()  # the frozen node's calls go through again
    with ThreadPoolExecutor(max_workers=len(simulated)) as pool:
        list(pool.map(lambda node: node.watcher.stop(), simulated))
    for node in simulated:
        for thread in node.watcher.threads:
            thread.join(timeout=10)


def watchers(nodes: int, settle_s: float = 12.0, window_s: float = 10.0, after_s: float = 15.0) -> WatchLoad:
    """`nodes` watchers on one store: settled, counted over a window, then node `nodes // 2`
    frozen (a node in the middle of a worker's share, the collector's peers around it)."""
    store, server = start_store()
    start = time.time() + 3.0 + 0.5 * math.ceil(nodes / NODES_PER_PROCESS)  # the workers' imports
    timeline = {
        "start": start,
        "measure": start + settle_s,
        "freeze": start + settle_s + window_s,
        "end": start + settle_s + window_s + after_s,
        "frozen": nodes // 2,
    }
    processes = workers("watchers", nodes, store.port, timeline)
    wait_until(timeline["measure"])
    before, busy = served(store.port), thread_cpu_seconds(server)
    wait_until(timeline["freeze"])
    counted, busy = served(store.port) - before, thread_cpu_seconds(server) - busy
    found = results(processes)
    polls = [seconds for result in found for seconds in result["polls"]]
    left = {int(node): at for result in found for node, at in result["left"].items()}
    survivors = nodes - 1
    named = [at - timeline["freeze"] for node, at in left.items() if node != timeline["frozen"]]
    del store
    return WatchLoad(
        nodes=nodes,
        requests_per_s=counted.requests / window_s,
        per_node_per_poll=counted.requests / window_s / nodes * WatchdogConfig().node_poll_s,
        bytes_per_s=(counted.bytes_in + counted.bytes_out) / window_s,
        store_busy=busy / window_s,
        poll_p50_ms=1000 * statistics.median(polls),
        poll_p99_ms=1000 * percentile(polls, 0.99),
        named_by_collector_s=(left[0] - timeline["freeze"]) if 0 in left else None,
        named_by_all_s=max(named) if len(named) == survivors else None,
        survivors_named=len(named),
    )


def describe_watchers(load: WatchLoad) -> str:
    named = "never" if load.named_by_all_s is None else f"{load.named_by_all_s:.1f} s"
    return (
        f"{load.nodes:>5} nodes' watchers: {load.requests_per_s:,.0f} requests/s at the store "
        f"({load.per_node_per_poll:.2f} per node per poll), {load.bytes_per_s / 1e6:.2f} MB/s, server thread "
        f"{load.store_busy:.1%} busy; poll "
        f"median {load.poll_p50_ms:.1f} ms, p99 {load.poll_p99_ms:.1f} ms; a frozen node named by the "
        f"collector after {load.named_by_collector_s or math.nan:.1f} s, by all {load.survivors_named} "
        f"survivors after {named}"
    )


def worker(argv: list[str]) -> int:
    kind, first, last, nodes, port, timeline = argv
    run = {"watchers": run_watchers, "agents": run_agents}[kind]
    print(json.dumps(run(int(first), int(last), int(nodes), int(port), json.loads(timeline))))
    return 0


def simulate(
    counts: list[int], *, with_agents: bool = True, quick: bool = False, report=print
) -> tuple[list[WatchLoad], list[AgentLoad]]:
    """Each count's watchers, and its agents up to AGENTS_MAX (beyond, `derived_agents`), on
    a host of its own where root allows it. `quick`: shorter windows, for the suite's run."""
    timing = {"settle_s": 7.0, "window_s": 3.0, "after_s": 9.0} if quick else {}
    watched: list[WatchLoad] = []
    agent_loads: list[AgentLoad] = []

    def run() -> None:
        for nodes in counts:
            watched.append(watchers(nodes, **timing))
            report(describe_watchers(watched[-1]))
            if with_agents and nodes <= AGENTS_MAX:
                agent_loads.append(agents(nodes, window_s=timing.get("window_s", 10.0)))
                report(describe_agents(agent_loads[-1]))
            elif with_agents and agent_loads:
                report(derived_agents(agent_loads[-1], nodes))

    with tempfile.TemporaryDirectory() as workdir:
        on_a_host_of_its_own(Path(workdir), run)
    return watched, agent_loads


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", default="64,256,1024", help="simulated node counts")
    parser.add_argument("--no-agents", action="store_true", help="the watchers only")
    args = parser.parse_args(argv)
    simulate([int(count) for count in args.nodes.split(",")], with_agents=not args.no_agents)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
