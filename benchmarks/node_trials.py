"""The nodes of one job, each a torchrun agent of one process, and their faults.

Each node is a `ddp-launch -- torchrun --nnodes=1:2` (what a pod runs; two nodes unless
`addresses` names more) with its own snapshot and cache folders, as pods have; all join one
c10d rendezvous whose endpoint is node `a`'s address. On loopback the two share one network; under a `Network`
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

from benchmarks.namespaces import Network
from benchmarks.trial_record import DETECTION_BOUND_S, TRAINING_BOUND_S
from trainer.launcher.process_tree import signal_tree

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
        signal_tree(self.process, signal.SIGSTOP)

    def thaw(self) -> None:
        signal_tree(self.process, signal.SIGCONT)


NODE_NAMES = "abcdefghijklmnopqrstuvwxyz"


@dataclass
class NodeJob:
    """Launch the nodes (one per address); `close` ends whatever is left of them, pass or fail."""

    workdir: Path
    port: int
    every: int = 5
    epochs: int = 60
    nnodes: str = "1:2"
    addresses: Sequence[str] = ("127.0.0.1", "127.0.0.1")
    prefixes: Sequence[Sequence[str]] = ((), ())
    extra: str = ""
    replay_extra: str = ""  # the replay's settings over `extra` (data that need not wait)
    launcher_args: Sequence[str] = ()  # ddp-launch's own options
    nodes: list[NodeProcess] = field(default_factory=list)

    def overrides(self, workdir: Path, node: str) -> str:
        """The trainer's settings for one node whose files are under `workdir`: its own
        folders, as a pod's /tmp and /dev/shm are its own (the nodes here share one machine's:
        a node's rank 0 clears earlier attempts' metrics folders, and a shared one crashed
        another node's rank that was writing there)."""
        return OVERRIDES.format(every=self.every, epochs=self.epochs) + (
            f",checkpoint.snapshot_dir={workdir / f'shm-{node}'},"
            f"checkpoint.cache_dir={workdir / f'cache-{node}'},checkpoint.uri={workdir / 'checkpoints'},"
            f"metrics.multiproc_dir={workdir / f'metrics-{node}'}"
        )

    def command(self, index: int) -> list[str]:
        overrides = self.overrides(self.workdir, NODE_NAMES[index])
        conf, local = RDZV_CONF, []
        if not self.addresses[index].startswith("127."):
            # a host's own address, not its name's: the agent publishes it as MASTER_ADDR, and
            # says whether it hosts the rendezvous store (its name resolves to neither address)
            conf, local = f"{conf},is_host={int(index == 0)}", [f"--local-addr={self.addresses[index]}"]
        return [
            *self.prefixes[index], sys.executable, "-m", "trainer.launcher.launch", "--relaunches=3",
            *self.launcher_args, "--",
            f"--nnodes={self.nnodes}", "--nproc-per-node=1", "--max-restarts=5", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.addresses[0]}:{self.port}", "--rdzv-id=nodes", f"--rdzv-conf={conf}",
            *local, "-m", "trainer", "--config", "digits", "--set", overrides + self.extra,
        ]  # fmt: skip

    def replay(self, workdir: Path, env: dict[str, str]) -> Path:
        """The same job again without a fault, through the rounds this run trained: each at
        its world size on one host (`torchrun --standalone`), stopped (`train.max_steps`) at
        the step the next round resumed from. Its checkpoints' folder, whose final state
        equals this run's bit for bit where every sample of every epoch was trained exactly
        once, at the same world sizes, and nothing else differed (it needs a schedule that
        `max_steps` does not change: `optim.schedule=constant`)."""
        settings = f"{self.overrides(workdir, 'r')}{self.extra}{self.replay_extra}"
        for world, stop in replay_segments(rounds(self)):
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                "-m", "trainer", "--config", "digits",
                "--set", f"{settings},train.max_steps={stop}",
            ]  # fmt: skip
            done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                lines = done.stderr.splitlines()
                said = [line for line in lines if "watchdog" in line or "trainer: error" in line][:5]
                failed = f"the replay's round at world size {world} failed"
                raise RuntimeError("\n".join([f"{failed}:", *said, done.stderr[-2000:]]))
        return workdir / "checkpoints"

    def start(self, env: dict[str, str]) -> None:
        for index in range(len(self.addresses)):
            process = subprocess.Popen(
                self.command(index),
                cwd=self.workdir,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            node = NodeProcess(NODE_NAMES[index], process)
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
                signal_tree(node.process)
                node.process.wait(timeout=30)


def progress(node: NodeProcess, after: float = 0.0) -> list[tuple[float, dict]]:
    """Rank 0's step lines on `node` that arrived after `after`."""
    return [(at, r) for at, r in node.records() if at > after and r.get("event") == "progress"]


def events(job: NodeJob, name: str, after: float = 0.0) -> list[tuple[float, dict]]:
    """Both nodes' `name` lines that arrived after `after`, in the order they arrived."""
    found = [(at, r) for node in job.nodes for at, r in node.records() if at > after]
    return sorted(((at, r) for at, r in found if r.get("event") == name), key=lambda pair: pair[0])


def lost_lines(node: NodeProcess, after: float = 0.0) -> list[tuple[float, dict]]:
    """The `node_lost` lines `node` printed after `after`."""
    return [(at, r) for at, r in node.records() if at > after and r.get("event") == "node_lost"]


def rounds(job: NodeJob) -> list[tuple[int, int]]:
    """(world size, the step it resumed from: 0 for none) of every round rank 0 started."""
    return [(r["world_size"], r["resumed_from_step"] or 0) for _, r in events(job, "start")]


def replay_segments(started: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(world size, the step to stop at: 0 for the run's end) that replay `started`: a round
    trains until the step the next surviving round resumed from; a round none of whose
    steps survived (the next resumed from its start or before) adds nothing, and rounds at
    one world size in a row are one segment."""
    kept: list[tuple[int, int]] = []
    for world, resumed in reversed(started):
        if not kept or kept[-1][1] > resumed:
            kept.append((world, resumed))
    kept.reverse()
    segments: list[tuple[int, int]] = []
    for index, (world, _) in enumerate(kept):
        stop = kept[index + 1][1] if index + 1 < len(kept) else 0
        if segments and segments[-1][0] == world:
            segments.pop()
        segments.append((world, stop))
    return segments


NODE_FAULTS = ("node-freeze", "partition", "host-freeze")


def starts(job: NodeJob, after: float = 0.0) -> list[tuple[float, dict]]:
    """Rank 0's `start` lines (a new round: its world size) after `after`, in arrival order."""
    return events(job, "start", after)


@dataclass(frozen=True)
class NodeTrial:
    """One fault between nodes, as measured from outside."""

    fault: str
    seen_step: int  # the step of rank 0's line the fault came after: completed
    victim: int  # the index of the node frozen or cut off in `job.nodes`
    found: dict | None  # the survivor's `node_lost` line
    found_s: float | None  # fault to that line
    training_s: float | None  # fault to the survivor's first step after its resume
    resumed_from: int | None
    world_after: int | None  # the world size of the first round after the fault
    rejoined: list[int]  # the world sizes of the rounds after the undo
    thawed: list[dict]  # the victim's `node_thawed` lines
    codes: list[int]
    complete: bool  # the run ended at its last epoch, latest.json naming its last step
    identical: bool | None  # against the run without the fault, or its replay, where one was made
    alarms: list[str]  # hangs the local watchdogs reported: none is the fault's

    @property
    def false_alarms(self) -> int:
        return len(self.alarms)

    @property
    def lost(self) -> int | None:
        return None if self.resumed_from is None else self.seen_step - self.resumed_from

    def timely(self) -> bool:
        """Found within 10 s; but for the host (which the other waits for), training again
        within 30 s at world size 1, and back at world size 2 once the fault is undone."""
        timely = self.found_s is not None and self.found_s <= DETECTION_BOUND_S
        if self.fault == "host-freeze":
            return timely
        again = self.training_s is not None and self.training_s <= TRAINING_BOUND_S
        return timely and again and self.world_after == 1 and 2 in self.rejoined

    def passed(self, bound: int) -> bool:
        exact = self.identical is not False and self.complete and self.codes == [0, 0]
        return (
            self.timely()
            and exact
            and self.false_alarms == 0
            and self.lost is not None
            and self.lost <= bound
        )

    def describe(self, index: int) -> str:
        found = "not found" if self.found_s is None else f"found in {self.found_s:.1f}s"
        again = "" if self.training_s is None else f", training again after {self.training_s:.1f}s"
        world = "" if self.world_after is None else f" at world size {self.world_after}"
        rejoined = ", rejoined" if 2 in self.rejoined else ""
        final = {
            True: "bit-identical",
            False: "DIFFERENT",
            None: "complete" if self.complete else "INCOMPLETE",
        }
        return (
            f"trial {index}: {self.fault} after step {self.seen_step} -> {found}{again}{world}{rejoined}; "
            f"resumed from step {self.resumed_from} ({self.lost} lost); exit codes {self.codes}; "
            f"final state {final[self.identical]}"
            + "".join(f"; FALSE ALARM: {alarm}" for alarm in self.alarms)
        )


def node_trial(
    job: NodeJob,
    fault: str,
    fault_after: int,
    env: dict[str, str],
    network: Network | None = None,
    undo_when: Callable[[NodeProcess, float], object] | None = None,
) -> NodeTrial:
    """Run `job`, apply `fault` after rank 0's step `fault_after`, undo it once
    `undo_when(survivor, found_at)` holds (by default: at once for the host, which the
    survivor waits for; else once the survivor trains again), and measure."""
    job.start(env)
    seen = job.wait_for(
        lambda: [r["step"] for n in job.nodes for _, r in progress(n) if r["step"] >= fault_after], 180
    )
    host = job.rank0()
    victim = host if fault == "host-freeze" else next(node for node in job.nodes if node is not host)
    survivor = next(node for node in job.nodes if node is not victim)
    index = job.nodes.index(victim)
    if network is None:
        victim.freeze()
    else:
        network.cut(index)
    faulted = time.monotonic()
    found_at, found = job.wait_for(lambda: lost_lines(survivor, faulted), 60)[0]
    again = []
    if fault != "host-freeze":
        again = job.wait_for(lambda: progress(survivor, found_at), 60) if undo_when is None else []
    if undo_when is not None:
        job.wait_for(lambda: undo_when(survivor, found_at), 120)
    undone = time.monotonic()
    if network is None:
        victim.thaw()
    else:
        network.heal(index)
    codes = job.wait(timeout=600)
    resumes = [r.get("resumed_from") for _, r in events(job, "plan", faulted)]
    rounds = starts(job, faulted)
    summary = [r for _, r in events(job, "summary")]
    latest = job.workdir / "checkpoints" / "latest.json"
    final = json.loads(latest.read_text())["step"] if latest.exists() else None
    again = again or progress(survivor, found_at)
    return NodeTrial(
        fault=fault,
        seen_step=seen[0],
        victim=index,
        found=found,
        found_s=found_at - faulted,
        training_s=again[0][0] - faulted if again else None,
        resumed_from=min((step for step in resumes if step is not None), default=None),
        world_after=rounds[0][1]["world_size"] if rounds else None,
        rejoined=[r["world_size"] for at, r in rounds if at > undone],
        thawed=[r for _, r in victim.records() if r.get("event") == "node_thawed"],
        codes=codes,
        complete=bool(summary)
        and summary[-1]["steps"] == final
        and summary[-1]["epochs_completed"] == job.epochs,
        identical=None,
        alarms=[r["message"] for _, r in events(job, "hang")],
    )
