"""torchrun's agents against the rendezvous store, simulated (`benchmarks.store_load`): a
completed round of N participants, and every agent doing what torchrun's does while its
workers train, with torch's own rendezvous classes over torch's `C10dRendezvousBackend`:
its monitor loop's `num_nodes_waiting` every 0.1 s (a read of the whole state whenever its
1 s cache expired), and its keep-alive every `keep_alive_interval` (the chart's 2 s), a
read-modify-`compare_set` of the whole state, retried on a conflict. Up to AGENTS_MAX
agents: beyond, this machine's 2 cores cannot decode the state as often as the agents ask
for it, and the figures are derived from the largest count measured."""

from __future__ import annotations

import math
import pickle
import random
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

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

RUN_ID = "ddp-run"


MONITOR_INTERVAL_S = 0.1  # torchrun's --monitor-interval default (elastic/agent/server/api.py:97)


KEEP_ALIVE_S = 2  # the chart's rdzvConf keep_alive_interval


KEEP_ALIVE_ATTEMPTS = 3


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


AGENTS_MAX = 256  # more simulated agents than this machine's 2 cores can decode the state for


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
