"""Real nodes on this machine: 2 to 16 hosts, each a network namespace with its own
`ddp-launch` and torchrun agent and one rank (as the node trials run them), training the
digits CNN together; then one node frozen mid-run.

For each count, read from outside on the harness's clock:
- **start-up**: launch to rank 0's first step, and its parts. The agents' and workers'
  imports are what 2 cores serialize (N interpreters importing torch at once); the *control
  plane* is what is left, each part taken where it waits for nobody's imports: the
  rendezvous of the last agent to arrive (its "Rendezvous'ing worker group" line to its
  "Rendezvous complete"), and the process group of the last rank to arrive (the least of
  every rank's `ddp_startup_seconds{phase="process group"}`, scraped from each node: the
  gloo mesh and the store's barrier);
- **steady step**: the median of rank 0's step times over a window of steady training;
- **store traffic** over the same window, counted by the kernel (`store_traffic`): the
  group's store (MASTER_PORT, served from rank 0's process) and the rendezvous store (the
  agents', at the rendezvous endpoint);
- **a frozen node** (every process of its tree SIGSTOPped, as a frozen VM): the time until
  a survivor names it and until rank 0 logs a step again at N-1 nodes.

Needs root (network namespaces). Each node's processes stay at most `--max-nodes`; the
memory a node takes is measured on the first count, and a count this machine cannot hold is
refused in one line before it starts.
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.metrics import free_port
from benchmarks.namespaces import Network, linked_hosts
from benchmarks.node_trials import NodeJob, NodeProcess, events, lost_lines, progress
from benchmarks.runner import CHECKOUT, checkout_path
from benchmarks.store_traffic import Traffic, served
from trainer.launcher.fork_protocol import SWITCH_ENV, listening
from trainer.launcher.launch import RDZV_ENV

# the agent's INFO lines around its rendezvous (torch/distributed/elastic/agent/server/api.py:707, 553)
READY = re.compile(r"Rendezvous'ing worker group")
JOINED = re.compile(r"Rendezvous complete for workers")
METRICS_PORT = 9401
# steps that wait for their data (64 ms each): the window measures the group's coordination
# on top of a fixed step, not 2 cores shared by N ranks' compute
EXTRA = (
    ",optim.schedule=constant,data.name=plugins:slow_digits,data.options.delay_s=0.002,"
    f"metrics.port={METRICS_PORT}"  # on each node's loopback, scraped from inside its namespace
)
WINDOW_S = 15.0
FORK_SERVER_WAIT_S = 240.0
NODE_MEMORY_MB = 900  # what one node's processes take here (launcher, agent, rank, writer, fork server)


@dataclass(frozen=True)
class NodesFigures:
    """One node count's figures, in seconds but where named."""

    nodes: int
    first_step_s: float  # the first node's launch to rank 0's first step
    split: dict[str, float]  # rank 0's start-up split
    rendezvous_s: float | None  # the last agent ready to the last agent joined
    step_ms: float
    group_store: Traffic  # over window_s
    rendezvous_store: Traffic
    named_s: float | None  # the freeze to the first survivor's line naming it
    training_s: float | None  # the freeze to rank 0's first step after it
    window_s: float
    fork_servers_s: float | None  # the first step to every node's fork server listening

    process_group_s: float | None = None  # the last rank to arrive's process group phase

    @property
    def control_plane_s(self) -> float:
        """The rendezvous and the process group's forming: what grows with N besides imports."""
        return (self.rendezvous_s or 0.0) + (self.process_group_s or 0.0)


def refusal(counts: list[int]) -> str | None:
    """The one line that refuses a count this machine cannot hold, or None."""
    available_mb = psutil.virtual_memory().available / 2**20
    for count in counts:
        if count < 2:
            return f"scale_nodes: --nodes {count}: a job of nodes needs at least 2"
        if count * NODE_MEMORY_MB > available_mb:
            largest = int(available_mb // NODE_MEMORY_MB)
            return (
                f"scale_nodes: --nodes {count}: {count} nodes need about {count * NODE_MEMORY_MB / 1024:.1f} "
                f"GiB ({NODE_MEMORY_MB} MiB each: launcher, agent, rank, writer, fork server); this machine "
                f"has {available_mb / 1024:.1f} GiB available: at most {largest} nodes here"
            )
    return None


def environment() -> dict[str, str]:
    """The nodes' environment: torchrun's INFO lines (its rendezvous's) on, the fork server
    on as in a pod, one thread per process."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "LOGLEVEL": "INFO",
        "PYTHONPATH": os.pathsep.join([checkout_path(), str(CHECKOUT / "tests" / "helpers")]),  # slow_digits
        SWITCH_ENV: "1",
        **RDZV_ENV,
    }


def arrivals(job: NodeJob, pattern: re.Pattern, after: float = 0.0) -> dict[str, float]:
    """Each node's first line matching `pattern` after `after`: its arrival."""
    found = {}
    for node in job.nodes:
        for at, line in list(node.lines):
            if at > after and pattern.search(line):
                found[node.name] = at
                break
    return found


def master_port(node: NodeProcess) -> int | None:
    """The group's store port, from the environment of a rank under `node`'s launcher."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(node.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                environ = child.environ()
                if "MASTER_PORT" in environ and "trainer" in child.cmdline():
                    return int(environ["MASTER_PORT"])
    return None


def counted(network: Network, ports: list[int], seconds: float) -> list[Traffic]:
    """What each store on node 0 served over the next `seconds`."""
    before = [served(port, network.names[0]) for port in ports]
    time.sleep(seconds)
    return [served(port, network.names[0]) - then for port, then in zip(ports, before, strict=True)]


def run_nodes(
    count: int, window_s: float = WINDOW_S, fork_server_wait_s: float = FORK_SERVER_WAIT_S
) -> NodesFigures:
    """One job of `count` nodes, measured over `window_s` of steady training, its frozen
    node once every fork server listens (or `fork_server_wait_s` passed), then closed."""
    with tempfile.TemporaryDirectory(prefix="ddp-scale-") as scratch, linked_hosts(count) as network:
        job = NodeJob(
            Path(scratch), free_port(), every=20, epochs=10_000, nnodes=f"{count - 1}:{count}", extra=EXTRA,
            addresses=network.addresses, prefixes=[network.prefix(host) for host in range(count)],
        )  # fmt: skip
        try:
            return measure(job, network, count, window_s, fork_server_wait_s)
        finally:
            job.close()


def measure(
    job: NodeJob, network: Network, count: int, window_s: float, fork_server_wait_s: float
) -> NodesFigures:
    launched = time.monotonic()
    job.start(environment())
    first = job.wait_for(lambda: progress(job.nodes[0]) or progress_anywhere(job), 600)[0]
    first_step_s = first[0] - launched
    startup = job.wait_for(lambda: events(job, "startup"), 60)[0][1]
    phases = ("launch_and_rendezvous", "imports", "data_and_model", "process_group", "resume", "first_step")
    split = {phase: float(startup[phase]) for phase in phases if phase in startup}
    ready, joined = arrivals(job, READY), arrivals(job, JOINED)
    last = max(ready, key=ready.get, default=None)
    rendezvous_s = joined[last] - ready[last] if last in joined and len(ready) == count else None
    groups: dict[int, float] = {}
    for host in range(count):
        groups.update(phase_seconds(network, host, "process group"))
    process_group_s = min(groups.values()) if len(groups) == count else None
    time.sleep(5.0)  # past the first steps' warm-up and the first snapshot
    rank0 = job.rank0()
    window_started = time.monotonic()
    group_store, rendezvous_store = counted(network, [master_port(rank0) or 0, job.port], window_s)
    steps = [r["step_ms"] for at, r in progress(rank0) if at > window_started and "step_ms" in r]
    step_ms = statistics.median(steps) if steps else float("nan")
    ready = wait_for_fork_servers(job, fork_server_wait_s)
    fork_servers_s = None if ready is None else time.monotonic() - first[0]
    victim = job.nodes[-1]  # never node 0: it hosts both stores
    victim.freeze()
    frozen_at = time.monotonic()
    named_s = training_s = None
    with contextlib.suppress(TimeoutError):
        named = job.wait_for(
            lambda: [at for node in job.nodes if node is not victim for at, _ in lost_lines(node, frozen_at)],
            60,
        )
        named_s = min(named) - frozen_at
        again = job.wait_for(lambda: progress_anywhere(job, after=min(named)), 90)
        training_s = again[0][0] - frozen_at
    return NodesFigures(
        count, first_step_s, split, rendezvous_s, step_ms, group_store, rendezvous_store, named_s, training_s,
        window_s, fork_servers_s, process_group_s,
    )  # fmt: skip


SCRAPE = (
    "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=10)"
    ".read().decode())"
)


def phase_seconds(network: Network, host: int, phase: str) -> dict[int, float]:
    """`ddp_startup_seconds{phase=PHASE}` by rank, as `host`'s node serves it (here the nodes
    share one /tmp, so each serves every rank's series)."""
    command = [
        "ip",
        "netns",
        "exec",
        network.names[host],
        sys.executable,
        "-c",
        SCRAPE.format(port=METRICS_PORT),
    ]
    scraped = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
    pattern = rf'^ddp_startup_seconds{{([^}}]*phase="{phase}"[^}}]*)}} ([\d.e+-]+)$'
    found = {}
    for labels, value in re.findall(pattern, scraped, re.MULTILINE):
        if rank := re.search(r'\brank="(\d+)"', labels):
            found[int(rank[1])] = float(value)
    return found


def agent_pid(node: NodeProcess) -> int | None:
    """The torchrun agent under `node`'s launcher."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(node.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "torch.distributed.run" in child.cmdline():
                    return child.pid
    return None


def wait_for_fork_servers(job: NodeJob, timeout_s: float) -> float | None:
    """Wait until every node's fork server listens (its imports run at nice 19, on what 16
    ranks on 2 cores leave idle: little), so that the restart after the freeze forks its
    workers as a node with spare cores would; the seconds waited, or None if some did not
    within `timeout_s`."""
    started = time.monotonic()
    agents = [agent_pid(node) for node in job.nodes]
    while time.monotonic() - started < timeout_s:
        if all(pid is not None and listening(pid) for pid in agents):
            return time.monotonic() - started
        time.sleep(0.5)
    return None


def progress_anywhere(job: NodeJob, after: float = 0.0) -> list[tuple[float, dict]]:
    """Rank 0's step lines after `after`, whichever node holds rank 0 now."""
    return sorted((pair for node in job.nodes for pair in progress(node, after)), key=lambda pair: pair[0])


def describe(figures: NodesFigures) -> str:
    split = ", ".join(f"{phase} {seconds:.1f}s" for phase, seconds in figures.split.items())
    rendezvous = "?" if figures.rendezvous_s is None else f"{figures.rendezvous_s:.2f}s"
    group = "?" if figures.process_group_s is None else f"{figures.process_group_s:.2f}s"
    named = "not named" if figures.named_s is None else f"named {figures.named_s:.1f} s"
    again = "" if figures.training_s is None else f", training again {figures.training_s:.1f} s"
    if figures.fork_servers_s is None:
        again += " (not every fork server listened yet: workers started cold)"
    store = figures.group_store
    agents = figures.rendezvous_store
    return (
        f"{figures.nodes:>3} nodes: first step {figures.first_step_s:.1f} s ({split}); the last agent's "
        f"rendezvous {rendezvous} and the last rank's process group {group}: control plane "
        f"{figures.control_plane_s:.2f} s; step {figures.step_ms:.1f} ms; "
        f"group store {store.requests / figures.window_s:,.1f} requests/s ({store.connections} connections), "
        f"rendezvous store {agents.requests / figures.window_s:,.1f} requests/s, "
        f"{agents.bytes_out / figures.window_s / 1e3:,.1f} kB/s out; a frozen node {named}{again}"
    )
