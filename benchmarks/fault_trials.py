"""Fault trials: hit a random rank at a random step, and check what the recovery lost.

    python -m benchmarks.fault_trials [--fault kill|stop|freeze|node-freeze|partition|host-freeze|
                                               writer-stop|slow-store|zombie]
                                      [--trials 10] [--seed 0]
                                      [--snapshot-every 5] [--epochs 60] [--fork-server on|off]
                                      [--set KEY=VALUE,...]

The faults:
  kill    SIGKILL one rank's worker: torchrun sees it exit and restarts both;
  stop    SIGSTOP one rank's worker (a stuck process: it crashes nothing): the node's
          watchdog must find it, name it and kill it, and torchrun restarts both;
  freeze  SIGSTOP every process of one pod of the chart's two-pod CPU job under `ddp-ops
          local` (a frozen node: its watchdog is frozen too): the kubelet's liveness probe
          (every 2 s, 3 failures) must fail, the pod is killed and re-created.
Between nodes (benchmarks.node_trials: two ddp-launch + torchrun agents, `--nnodes=1:2`):
  node-freeze  SIGSTOP every process of the node without rank 0: the other must name it
               within 10 s and train on alone within 30 s; thawed, it rejoins;
  partition    the same node's link unplugged at the switch of real network namespaces
               (root), then plugged back;
  host-freeze  SIGSTOP rank 0's node (it hosts the store): the other names it within 10 s and
               waits; thawed at once, both resume at world size 2, bit-identical at the end.
In the storage path (benchmarks.storage_trials, on moto's S3 server through the fault proxy):
  writer-stop  rank 0's writer SIGSTOPped mid-upload on a 20 KB/s link: 40 more steps within
               20 s, the writer named within 60 s and replaced, the run durable at its end;
  slow-store   every upload slower than the checkpoint interval: samples/s against the fast
               store's (>= 0.95x), the store at the run's last step;
  zombie       job A's latest.json write held while A is paused, job B takes over and ends:
               the store refuses the late write (412), A's restarts are refused, nothing
               changes after B's end.
A node trial's final state is held bit for bit to a run without the fault: the same job for
host-freeze; for a lost node, the trial's rounds replayed at their world sizes, each
stopped where the next resumed (`NodeJob.replay`, with a constant LR schedule), so that
equal bits show every sample trained exactly once across the resizes.
Each runs the digits demo at 2 ranks with dropout on (so every rank's RNG streams matter), a
snapshot every `--snapshot-every` steps and no durable checkpoint before the end, for
`--epochs` (60: 1,140 steps, some 12 s of training). A kill or a stop comes at a random
step once the agent's fork server listens (a failure in a run that has trained a while: the
server is ready about 4 s after the first step here), so that its restart starts warm;
`--fork-server off` restarts cold, as without it, for the side-by-side figure. A trial
must lose at most `--snapshot-every` steps and end with weights and optimizer state
bit-identical to one uninterrupted run of the same job (`--set` changes both alike:
`--set train.compile=model` holds a compiled run to itself, its restarts compiling from the
node's cache); a stop or freeze must be found
within 10 s and the run be training again within 30 s, with no other hang reported.
Exit status 1 if any trial does not.

Everything is measured from outside: the harness applies the fault after reading rank 0's
line for step K (so the run had completed at least K), times the fault's detection (the
watchdog's line, the kubelet's kill) and the first new step after the resume on its own
clock, and reads the step the restart resumed from; K - resumed is at most what was lost.
The trainer's own count (`..., L steps lost`) is a cross-check.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.metrics import free_port
from benchmarks.namespaces import linked_hosts
from benchmarks.node_trials import NODE_FAULTS, NodeJob, NodeTrial, node_trial, rounds
from benchmarks.pod_trials import freeze_trial, reference_job_state
from benchmarks.runner import checkout_path
from benchmarks.storage_trials import STORAGE_FAULTS, storage_trials
from benchmarks.trial_record import Timeline, Trial, final_state, same_state
from trainer.launcher.fork_protocol import SWITCH_ENV, listening
from trainer.launcher.launch import RDZV_ENV
from trainer.launcher.process_tree import signal_tree

OVERRIDES = (
    "model.dropout=0.3,checkpoint.every_steps=1000,log.every_steps=1,log.format=json,"
    "metrics.port=0,checkpoint.snapshot_every_steps={every},checkpoint.snapshot_dir={snapshots},"
    "train.epochs={epochs}"
)
# node trials: a schedule that `train.max_steps` leaves alone, so that a replay of the
# trial's rounds, each stopped where the next resumed, trains at the trial's rates
REPLAYABLE = ",optim.schedule=constant"


def environment(fork_server: bool = True) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **RDZV_ENV, SWITCH_ENV: "1" if fork_server else "0"}


def signal_rank(agent: subprocess.Popen, rank: int, sig: int) -> bool:
    for child in psutil.Process(agent.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "trainer" in child.cmdline():
                child.send_signal(sig)  # psutil checks that the pid is still this child's
                return True
        except psutil.NoSuchProcess:
            continue
    return False


@dataclass(frozen=True)
class Plan:
    """What every trial of one invocation shares."""

    every: int  # snapshot interval
    epochs: int
    fork_server: bool
    extra: str = ""  # more overrides, for the reference run and every trial

    def command(self, uri: Path, snapshots: Path, restarts: int) -> list[str]:
        """The digits job under `torchrun --max-restarts=RESTARTS`, checkpoints in `uri`."""
        overrides = OVERRIDES.format(every=self.every, snapshots=snapshots, epochs=self.epochs)
        overrides += f",{self.extra}" * bool(self.extra)
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            f"--max-restarts={restarts}", "-m", "trainer", "--config", "digits",
            "--set", f"{overrides},checkpoint.uri={uri}",
        ]  # fmt: skip


def process_trial(
    workdir: Path, index: int, fault: str, rank: int, fault_after: int, plan: Plan, reference: dict
) -> Trial:
    """A kill or a stop of one worker under `torchrun --max-restarts=1`, once step
    `fault_after` is done and (with the fork server on) the agent's server listens."""
    uri = workdir / f"trial-{index}"
    timeline = Timeline(fault_after)  # from the launch on: the run's cold start is timed too
    agent = subprocess.Popen(
        plan.command(uri, workdir / "snapshots", restarts=1),
        cwd=workdir,
        env=environment(plan.fork_server),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    warm = None
    try:
        for line in agent.stdout:
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            sig = signal.SIGKILL if fault == "kill" else signal.SIGSTOP
            ready = not plan.fork_server or listening(agent.pid)
            if timeline.due(record) and ready and signal_rank(agent, rank, sig):
                timeline.faulted(record["step"])
                warm = plan.fork_server
            timeline.read(record)
        agent.wait(timeout=300)
    finally:
        if agent.poll() is None:
            signal_tree(agent)
    identical = agent.returncode == 0 and same_state(final_state(uri), reference)
    resumed = timeline.resumed
    expected_hangs = 1 if fault == "stop" else 0
    return Trial(
        fault,
        rank,
        timeline.seen,
        resumed and resumed["resumed_from"],
        resumed and resumed["resume_origin"],
        resumed and resumed["lost_steps"],
        identical,
        timeline.since_fault(timeline.detected_at) if fault == "stop" else None,
        timeline.since_fault(timeline.training_at),
        abs(timeline.hangs - expected_hangs),
        timeline.cold_s,
        warm,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--fault", choices=("kill", "stop", "freeze", *NODE_FAULTS, *STORAGE_FAULTS), default="kill"
    )
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot-every", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=60, help="kill and stop trials' run length")
    parser.add_argument("--fork-server", choices=("on", "off"), default="on")
    parser.add_argument("--set", dest="extra", default="", help="kill and stop trials: more overrides")
    parser.add_argument("--keep", type=Path, help="node trials: copy a failed trial's files and logs here")
    args = parser.parse_args(argv)
    if args.fault in NODE_FAULTS:
        return node_trials(args)
    if args.fault in STORAGE_FAULTS:
        return storage_trials(args.fault, args.trials)
    plan = Plan(args.snapshot_every, args.epochs, args.fork_server == "on", args.extra)
    chooser = random.Random(args.seed)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fault-trials-") as folder:
        workdir = Path(folder)
        if args.fault == "freeze":
            reference = reference_job_state(workdir, args.snapshot_every)
        else:
            subprocess.run(
                plan.command(workdir / "reference", workdir / "snapshots", restarts=0),
                cwd=workdir, env=environment(plan.fork_server), check=True, capture_output=True,
            )  # fmt: skip
            reference = final_state(workdir / "reference")
        steps = reference["progress"]["step"]
        trials = []
        for index in range(1, args.trials + 1):
            fault_after = chooser.randrange(10, steps - 10)
            if args.fault == "freeze":
                trial = freeze_trial(workdir / f"trial-{index}", fault_after, args.snapshot_every, reference)
            else:
                rank = chooser.randrange(2)
                trial = process_trial(workdir, index, args.fault, rank, fault_after, plan, reference)
            print(trial.describe(index), flush=True)
            trials.append(trial)
    print(summary(trials, args.snapshot_every, time.perf_counter() - started))
    return 0 if all(trial.passed(args.snapshot_every) for trial in trials) else 1


def node_trials(args: argparse.Namespace) -> int:
    """Two nodes (benchmarks.node_trials), one of them frozen or cut off after a random step.
    The final state is held bit for bit to a run without a fault: for `host-freeze`, whose
    world size comes back at once, the same job run once; for a lost node, which the
    survivor trains without for a while, the trial's own rounds replayed at their world
    sizes (`NodeJob.replay`): equal bits mean every sample trained exactly once."""
    chooser = random.Random(args.seed)
    started = time.perf_counter()
    env = {**environment(args.fork_server == "on"), "PYTHONPATH": checkout_path()}
    epochs = 60 if args.fault == "host-freeze" else 150  # long enough to rejoin before the end
    trials: list[NodeTrial] = []
    with tempfile.TemporaryDirectory(prefix="node-trials-") as folder:
        workdir = Path(folder)
        reference = None
        if args.fault == "host-freeze":
            (workdir / "reference").mkdir()
            job = NodeJob(
                workdir / "reference", free_port(), every=args.snapshot_every, epochs=epochs, extra=REPLAYABLE
            )
            try:
                job.start(env)
                if job.wait(timeout=600) != [0, 0]:
                    raise RuntimeError("the reference run failed:\n" + job.tail())
            finally:
                job.close()
            reference = final_state(workdir / "reference" / "checkpoints")
        for index in range(1, args.trials + 1):
            trial_dir = workdir / f"trial-{index}"
            trial_dir.mkdir()
            fault_after = chooser.randrange(20, 200)
            with contextlib.ExitStack() as stack:
                network = stack.enter_context(linked_hosts(2)) if args.fault == "partition" else None
                job = NodeJob(
                    trial_dir, free_port(), every=args.snapshot_every, epochs=epochs, extra=REPLAYABLE,
                    addresses=network.addresses if network else ("127.0.0.1", "127.0.0.1"),
                    prefixes=[network.prefix(0), network.prefix(1)] if network else ((), ()),
                )  # fmt: skip
                stack.callback(job.close)
                trial = node_trial(job, args.fault, fault_after, env, network)
            if trial.complete and trial.codes == [0, 0]:
                if reference is None:
                    (trial_dir / "replay").mkdir()
                    expected = final_state(job.replay(trial_dir / "replay", env))
                else:
                    expected = reference
                same = same_state(final_state(trial_dir / "checkpoints"), expected)
                trial = dataclasses.replace(trial, identical=same)
            print(trial.describe(index), flush=True)
            if args.keep and not trial.passed(args.snapshot_every):
                kept = keep_trial(job, trial_dir, args.keep / f"{args.fault}-{index}")
                print(
                    f"  rounds (world size, resumed from) {rounds(job)}; its files are kept in {kept}",
                    flush=True,
                )
            trials.append(trial)
    found = [t.found_s for t in trials if t.found_s is not None]
    again = [t.training_s for t in trials if t.training_s is not None]
    passed = sum(t.passed(args.snapshot_every) for t in trials)
    seconds = time.perf_counter() - started
    line = f"{len(trials)} {args.fault} trials in {seconds:.0f}s: steps lost {[t.lost for t in trials]}"
    if found:
        line += f"; found in median {statistics.median(found):.1f}s, max {max(found):.1f}s"
    if again:
        line += f"; training again after median {statistics.median(again):.1f}s, max {max(again):.1f}s"
    print(line + f"; {passed}/{len(trials)} within the bounds")
    return 0 if passed == len(trials) else 1


def keep_trial(job: NodeJob, trial_dir: Path, destination: Path) -> Path:
    """A failed trial's folder (checkpoints, snapshots, replay) and each node's output."""
    for node in job.nodes:
        (trial_dir / f"node-{node.name}.log").write_text(node.text())
    shutil.copytree(trial_dir, destination, dirs_exist_ok=True)
    return destination


def summary(trials: list[Trial], bound: int, seconds: float) -> str:
    lost = [trial.seen_lost for trial in trials]
    passed = sum(trial.passed(bound) for trial in trials)
    line = f"{len(trials)} {trials[0].fault} trials in {seconds:.0f}s: steps lost {lost} (bound {bound})"
    for name, values in (
        ("found in", [t.detected_s for t in trials]),
        ("training again after", [t.training_s for t in trials]),
        ("cold start", [t.cold_s for t in trials]),
    ):
        known = [value for value in values if value is not None]
        if known:
            line += f"; {name} median {statistics.median(known):.1f}s, max {max(known):.1f}s"
    ratios = [t.training_s / t.cold_s for t in trials if t.training_s and t.cold_s]
    if ratios:  # the recovery against the same run's cold start, launch to first step
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        line += f"; recovery / cold start median {statistics.median(ratios):.2f} ({spread})"
    return line + f"; {passed}/{len(trials)} within the bounds and bit-identical"


if __name__ == "__main__":
    raise SystemExit(main())
