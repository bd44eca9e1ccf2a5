"""Beyond this machine: 64 to 1,024 nodes simulated against a real TCPStore (libuv, the
server torchrun and the trainer start), each node a client doing what its real counterpart
does, with the code its counterpart runs.

- **The nodes' watchers** (`watchers`): every simulated node runs the trainer's own
  `NodeWatcher` (two threads and a store connection each), with a progress of its own. The
  store is counted by the kernel (`store_traffic`); each node's poll is timed from its
  progress being read to its last store call's answer. Then one node freezes (its store
  calls stop, its judge too) and the time until the collector and every survivor named it is
  taken on the wall clock.
- **torchrun's agents** (`agents`), against the rendezvous store: a completed round of N
  participants, and every agent doing what torchrun's does while its workers train: its
  monitor loop's `num_nodes_waiting` every 0.1 s, which reads the rendezvous state whenever
  its 1 s cache has expired, and its keep-alive every `keep_alive_interval` (the chart's 2
  s), a read-modify-`compare_set` of the whole state, retried on a conflict. These run
  torch's own rendezvous classes (`_BackendRendezvousStateHolder`,
  `_DistributedRendezvousOpExecutor`, `_RendezvousKeepAliveOp`) over torch's
  `C10dRendezvousBackend`.

Simulated nodes live in worker processes (`python -m benchmarks.store_load worker ...`), at
most 128 a process, all on this machine's 2 cores: where the clients themselves cannot keep
up (the agents' state decoding at 1,024), the figures say what was offered and what was
served. Needs a network namespace of its own (root) for its thousand connections: this
machine's DNS server drops a burst of the reverse lookups each end of a connection makes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from benchmarks.namespaces import on_a_host_of_its_own
from benchmarks.store_traffic import served, server_threads, thread_cpu_seconds
from trainer.config import WatchdogConfig
from trainer.distributed.node_exchange import Progress

NODES_PER_PROCESS = 128
RUN_ID = "ddp-run"
MONITOR_INTERVAL_S = 0.1  # torchrun's --monitor-interval default (elastic/agent/server/api.py:97)
KEEP_ALIVE_S = 2  # the chart's rdzvConf keep_alive_interval
KEEP_ALIVE_ATTEMPTS = 3


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


@dataclass(frozen=True)
class AgentLoad:
    """torchrun's agents of `nodes` simulated nodes, as measured."""

    nodes: int
    state_bytes: int  # the rendezvous state as the store holds it (base64 of its pickle)
    requests_per_s: float
    bytes_out_per_s: float
    bytes_in_per_s: float
    store_busy: float  # the share of one core its server thread used
    offered_reads_per_s: float  # what N agents would read: one state a second each
    read_p99_ms: float
    keep_alive_p99_ms: float
    conflicts_per_keep_alive: float
    dropped: int  # participants the state lost: agents whose keep-alive fell behind


def node_desc(index: int):
    """An agent's descriptor as a PyTorchJob's pod makes it: its host name, a pid, local id 0."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    return _NodeDesc(f"ddp-run-worker-{index}.ddp-run.training.svc", 40 + index, 0)


def rendezvous_settings(nodes: int):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousSettings, RendezvousTimeout

    return RendezvousSettings(
        RUN_ID, nodes - 1, nodes, RendezvousTimeout(), timedelta(seconds=KEEP_ALIVE_S), KEEP_ALIVE_ATTEMPTS
    )


def completed_round(nodes: int) -> bytes:
    """The state of a round every node joined, as its backend stores it."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    state = _RendezvousState()
    now = datetime.now(timezone.utc)
    for index in range(nodes):
        state.participants[node_desc(index)] = index
        state.last_heartbeats[node_desc(index)] = now
    state.complete = True
    return pickle.dumps(state)


def percentile(values: list[float], share: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(share * len(ordered)) - 1)]


class TimedStore:
    """A store client that times each call and counts it; held while `thawed` is clear."""

    def __init__(self, client) -> None:
        self.client = client
        self.calls = 0
        self.last_answer = 0.0
        self.thawed = threading.Event()
        self.thawed.set()

    def __getattr__(self, name: str):
        method = getattr(self.client, name)

        def timed(*args):
            self.thawed.wait()
            result = method(*args)
            self.calls += 1
            self.last_answer = time.monotonic()
            return result

        return timed


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


class SimulatedAgent:
    """One agent's steady work on the rendezvous store, with torch's own classes."""

    def __init__(self, index: int, nodes: int, port: int) -> None:
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            _BackendRendezvousStateHolder,
            _DistributedRendezvousOpExecutor,
        )

        client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False
        )
        self.store = TimedStore(client)
        backend = C10dRendezvousBackend(self.store, RUN_ID)
        settings = rendezvous_settings(nodes)
        self.holder = _BackendRendezvousStateHolder(backend, settings)
        self.executor = _DistributedRendezvousOpExecutor(node_desc(index), self.holder, settings)
        self.reads: list[float] = []
        self.keep_alives: list[float] = []
        self.sets = 0

    def work(self, until: float) -> None:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousKeepAliveOp

        # each agent's keep-alive timer starts when its rendezvous returned: within a second
        # of the others' (each polls the state once a second until the round completes)
        next_keep_alive = time.time() + random.random()
        while time.time() < until:
            started, calls = time.monotonic(), self.store.calls
            if time.time() >= next_keep_alive:
                self.executor.run(_RendezvousKeepAliveOp(), time.monotonic() + 60)
                self.keep_alives.append(time.monotonic() - started)
                self.sets += self.store.calls - calls
                next_keep_alive += KEEP_ALIVE_S
            else:
                self.holder.sync()  # what num_nodes_waiting does
                if self.store.calls > calls:
                    self.reads.append(time.monotonic() - started)
            time.sleep(MONITOR_INTERVAL_S)


def run_agents(first: int, last: int, nodes: int, port: int, timeline: dict) -> dict:
    agents = [SimulatedAgent(index, nodes, port) for index in range(first, last + 1)]
    wait_until(timeline["measure"])
    threads = [threading.Thread(target=agent.work, args=(timeline["end"],)) for agent in agents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {
        "reads": [seconds for agent in agents for seconds in agent.reads],
        "keep_alives": [seconds for agent in agents for seconds in agent.keep_alives],
        "keep_alive_calls": sum(agent.sets for agent in agents),
        "participants": len(agents[0].holder.state.participants),
    }


def wait_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.time()))


def workers(kind: str, nodes: int, port: int, timeline: dict) -> list[subprocess.Popen]:
    """Worker processes for `nodes` simulated nodes, at most NODES_PER_PROCESS each."""
    count = math.ceil(nodes / NODES_PER_PROCESS)
    started = []
    for index in range(count):
        first = index * nodes // count
        last = (index + 1) * nodes // count - 1
        command = [
            sys.executable, "-m", "benchmarks.store_load", "worker", kind, str(first), str(last),
            str(nodes), str(port), json.dumps(timeline),
        ]  # fmt: skip
        environment = {**os.environ, "OMP_NUM_THREADS": "1"}
        started.append(subprocess.Popen(command, stdout=subprocess.PIPE, env=environment, text=True))
    return started


def results(processes: list[subprocess.Popen]) -> list[dict]:
    found = []
    for process in processes:
        output, _ = process.communicate(timeout=600)
        if process.returncode != 0:
            raise RuntimeError(f"a simulation worker failed (exit {process.returncode})")
        found.append(json.loads(output.strip().splitlines()[-1]))
    return found


def start_store():
    """A libuv TCPStore served from this process, and its server thread's id."""
    import torch.distributed as dist

    before = server_threads()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    (thread,) = server_threads() - before
    return store, thread


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


def agents(nodes: int, window_s: float = 10.0) -> AgentLoad:
    """torchrun's agents of `nodes` nodes on the rendezvous store, over a window."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    store, server = start_store()
    backend = C10dRendezvousBackend(store, RUN_ID)
    start = time.time() + 3.0 + 1.0 * math.ceil(nodes / NODES_PER_PROCESS)
    timeline = {"measure": start, "end": start + window_s}
    processes = workers("agents", nodes, store.port, timeline)
    wait_until(timeline["measure"] - 0.5)  # the round completes: its heartbeats are fresh
    backend.set_state(completed_round(nodes))
    stored = len(store.get(backend._key))
    wait_until(timeline["measure"] + 1.0)  # past every agent's first keep-alive
    before, counted_from, busy = served(store.port), time.time(), thread_cpu_seconds(server)
    wait_until(timeline["end"])
    counted = served(store.port) - before
    elapsed = time.time() - counted_from
    busy = (thread_cpu_seconds(server) - busy) / elapsed
    found = results(processes)
    reads = [seconds for result in found for seconds in result["reads"]]
    keep_alives = [seconds for result in found for seconds in result["keep_alives"]]
    calls = sum(result["keep_alive_calls"] for result in found)
    participants = min(result["participants"] for result in found)
    del store
    return AgentLoad(
        nodes=nodes,
        state_bytes=stored,
        requests_per_s=counted.requests / elapsed,
        bytes_out_per_s=counted.bytes_out / elapsed,
        bytes_in_per_s=counted.bytes_in / elapsed,
        store_busy=busy,
        offered_reads_per_s=float(nodes),
        read_p99_ms=1000 * percentile(reads, 0.99),
        keep_alive_p99_ms=1000 * percentile(keep_alives, 0.99),
        # a keep-alive without conflict: the state read (cache expired or not) and one compare_set
        conflicts_per_keep_alive=max(0.0, calls / max(1, len(keep_alives)) - 2),
        dropped=nodes - participants,
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


def describe_agents(load: AgentLoad) -> str:
    offered = load.offered_reads_per_s * load.state_bytes / 1e6
    return (
        f"{load.nodes:>5} torchrun agents: state {load.state_bytes / 1e3:,.0f} kB; "
        f"{load.requests_per_s:,.0f} requests/s, {load.bytes_out_per_s / 1e6:,.1f} MB/s out and "
        f"{load.bytes_in_per_s / 1e6:,.1f} MB/s in at the store ({offered:,.1f} MB/s of reads offered), "
        f"server thread {load.store_busy:.1%} busy; "
        f"read p99 {load.read_p99_ms:.0f} ms, keep-alive p99 {load.keep_alive_p99_ms:.0f} ms, "
        f"{load.conflicts_per_keep_alive:.2f} conflicts per keep-alive; {load.dropped} participants dropped"
    )


def worker(argv: list[str]) -> int:
    kind, first, last, nodes, port, timeline = argv
    run = {"watchers": run_watchers, "agents": run_agents}[kind]
    print(json.dumps(run(int(first), int(last), int(nodes), int(port), json.loads(timeline))))
    return 0


AGENTS_MAX = 256  # more simulated agents than this machine's 2 cores can decode the state for


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


def derived_agents(measured: AgentLoad, nodes: int) -> str:
    """What `nodes` agents would ask of the rendezvous store, derived from a measured count:
    the state grows as N; each agent reads it once a second and writes it back (with the
    state it read as the expected value) every keep-alive; the store's thread costs what it
    cost per megabyte at the measured count."""
    state = measured.state_bytes * nodes / measured.nodes
    reads, writes = nodes * state, nodes / KEEP_ALIVE_S * 2 * state
    per_megabyte = measured.store_busy / ((measured.bytes_out_per_s + measured.bytes_in_per_s) / 1e6)
    busy = per_megabyte * (reads + writes) / 1e6
    return (
        f"{nodes:>5} torchrun agents (derived from {measured.nodes}): state {state / 1e3:,.0f} kB; "
        f"{reads / 1e6:,.0f} MB/s of reads and {writes / 1e6:,.0f} MB/s of keep-alive writes at the store, "
        f"its server thread {busy:.0%} of a core at the measured {1000 * per_megabyte:.1f} ms per MB"
    )


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
