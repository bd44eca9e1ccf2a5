"""Two nodes of one job, as two torchrun agents of one process each, and their faults.

Each node is a `ddp-launch -- torchrun --nnodes=1:2` (what a pod runs) with its own
snapshot and cache folders, as pods have; both join one c10d rendezvous whose endpoint is
node `a`'s address. On loopback the two share one network; under a `Network`
(`benchmarks.namespaces`) each is a host of its own whose link can be cut.

Everything the trials and tests assert is read from outside, on the harness's clock: each
line either node prints, with the moment it arrived.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from trainer.distributed.launch import signal_tree

# the chart's settings (helm/values.yaml, elastic.rdzvConf): a frozen agent's keep-alive
# expires after 2 x 3 s, and a round with enough nodes closes 5 s after the last join
RDZV_CONF = "keep_alive_interval=2,keep_alive_max_attempt=3,last_call_timeout=5"
OVERRIDES = (
    "model.dropout=0.3,log.every_steps=1,log.format=json,metrics.port=0,checkpoint.every_steps=100000,"
    "checkpoint.snapshot_every_steps={every},train.epochs={epochs}"
)


@dataclass
class NodeProcess:
    """One node's launcher, and every line it printed with the harness's time of arrival."""

    name: str
    process: subprocess.Popen
    lines: list[tuple[float, str]] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)

    def read(self, stream: TextIO) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def records(self) -> list[tuple[float, dict]]:
        """The JSON lines (rank 0's log and every rank's errors), with their times."""
        found = []
        for at, line in list(self.lines):
            start = line.find("{")
            if start >= 0:
                try:
                    found.append((at, json.loads(line[start:])))
                except ValueError:
                    continue
        return found

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def freeze(self) -> None:
        """Every process of the node stopped at once, as a frozen kernel or a paused VM."""
        signal_tree(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        signal_tree(self.process.pid, signal.SIGCONT)


@dataclass
class TwoNodes:
    """Launch both nodes; `close` ends whatever is left of them, pass or fail."""

    workdir: Path
    port: int
    every: int = 5
    epochs: int = 60
    nnodes: str = "1:2"
    addresses: Sequence[str] = ("127.0.0.1", "127.0.0.1")
    prefixes: Sequence[Sequence[str]] = ((), ())
    extra: str = ""
    nodes: list[NodeProcess] = field(default_factory=list)

    def command(self, index: int) -> list[str]:
        name = "ab"[index]
        overrides = OVERRIDES.format(every=self.every, epochs=self.epochs) + (
            f",checkpoint.snapshot_dir={self.workdir / f'shm-{name}'},"
            f"checkpoint.cache_dir={self.workdir / f'cache-{name}'},"
            f"checkpoint.uri={self.workdir / 'checkpoints'}"
        )
        conf, local = RDZV_CONF, []
        if not self.addresses[index].startswith("127."):
            # a host's own address, not its name's: the agent publishes it as MASTER_ADDR, and
            # says whether it hosts the rendezvous store (its name resolves to neither address)
            conf, local = f"{conf},is_host={int(index == 0)}", [f"--local-addr={self.addresses[index]}"]
        return [
            *self.prefixes[index], sys.executable, "-m", "trainer.distributed.launch", "--relaunches=3", "--",
            f"--nnodes={self.nnodes}", "--nproc-per-node=1", "--max-restarts=5", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.addresses[0]}:{self.port}", "--rdzv-id=nodes", f"--rdzv-conf={conf}",
            *local, "-m", "trainer", "--config", "digits", "--set", overrides + self.extra,
        ]  # fmt: skip

    def start(self, env: dict[str, str]) -> None:
        for index in range(2):
            process = subprocess.Popen(
                self.command(index),
                cwd=self.workdir,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            node = NodeProcess("ab"[index], process)
            for stream in (process.stdout, process.stderr):
                reader = threading.Thread(target=node.read, args=(stream,), daemon=True)
                reader.start()
                node.readers.append(reader)
            self.nodes.append(node)
            time.sleep(0.5)  # node a first: it hosts the rendezvous store

    def rank0(self) -> NodeProcess:
        """The node whose first rank is global rank 0 now: the newest `start` line's."""
        starts = [(at, node) for node in self.nodes for at, r in node.records() if r.get("event") == "start"]
        return max(starts, key=lambda pair: pair[0])[1]

    def wait_for(self, found: Callable[[], object], timeout: float) -> object:
        """Poll `found` until it returns something truthy; raise after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if result := found():
                return result
            if all(node.process.poll() is not None for node in self.nodes):
                break
            time.sleep(0.05)
        raise TimeoutError(f"not seen within {timeout:.0f}s:\n" + self.tail())

    def wait(self, timeout: float) -> list[int]:
        codes = [node.process.wait(timeout=timeout) for node in self.nodes]
        for node in self.nodes:
            for reader in node.readers:
                reader.join(timeout=5)
        return codes

    def tail(self, lines: int = 40) -> str:
        return "\n".join(
            f"--- node {node.name}\n" + "\n".join(node.text().splitlines()[-lines:]) for node in self.nodes
        )

    def close(self) -> None:
        for node in self.nodes:
            if node.process.poll() is None:
                node.thaw()
                signal_tree(node.process.pid)
                node.process.wait(timeout=30)


def progress(node: NodeProcess, after: float = 0.0) -> list[tuple[float, dict]]:
    """Rank 0's step lines on `node` that arrived after `after`."""
    return [(at, r) for at, r in node.records() if at > after and r.get("event") == "progress"]


def lost_lines(node: NodeProcess, after: float = 0.0) -> list[tuple[float, dict]]:
    """The `node_lost` lines `node` printed after `after`."""
    return [(at, r) for at, r in node.records() if at > after and r.get("event") == "node_lost"]
