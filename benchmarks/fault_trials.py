"""Fault trials: SIGKILL a random rank at a random step, and check what the restart lost.

    python -m benchmarks.fault_trials [--trials 10] [--seed 0] [--snapshot-every 5]

Runs the digits demo at 2 processes under `torchrun --standalone --max-restarts=1`, with
dropout on (so every rank's RNG streams matter), a snapshot every `--snapshot-every` steps
and no durable checkpoint before the end. In each seeded trial one rank, chosen at random,
is SIGKILLed once rank 0 has logged a step chosen at random; torchrun restarts both, and
the run resumes from the newest snapshot. Each trial must lose at most `--snapshot-every`
steps and end with weights and optimizer state bit-identical to one uninterrupted run.
Exit status 1 if any does not.

The steps lost are measured from outside: the harness kills after reading rank 0's line for
step K (so the run had completed at least K), and reads the step the restart resumed from;
K - resumed is at most what was lost. The trainer's own count (`..., L steps lost`) is a
cross-check: it must be at least K - resumed, and within the bound too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from trainer.distributed.launch import RDZV_ENV, signal_tree

OVERRIDES = (
    "model.dropout=0.3,checkpoint.every_steps=1000,log.every_steps=1,log.format=json,"
    "metrics.port=0,checkpoint.snapshot_every_steps={every},checkpoint.snapshot_dir={snapshots}"
)


@dataclass(frozen=True)
class Trial:
    rank: int
    kill_after: int
    seen_step: int | None  # the step of rank 0's last line before the kill: completed
    resumed_from: int | None
    origin: str | None
    lost_steps: int | None  # the trainer's own count
    identical: bool

    @property
    def seen_lost(self) -> int | None:
        """Steps lost as the harness saw them: at most what was lost."""
        if self.seen_step is None or self.resumed_from is None:
            return None
        return self.seen_step - self.resumed_from

    def passed(self, bound: int) -> bool:
        seen, told = self.seen_lost, self.lost_steps
        return (
            self.identical
            and seen is not None
            and told is not None
            and seen <= bound
            and seen <= told <= bound
        )

    def describe(self, index: int) -> str:
        resumed = (
            f"resumed from step {self.resumed_from} ({self.origin}), {self.seen_lost} lost as seen, "
            f"{self.lost_steps} as the trainer counts"
            if self.resumed_from is not None
            else "did not resume"
        )
        verdict = "bit-identical" if self.identical else "DIFFERENT"
        killed = f"SIGKILL rank {self.rank} after step {self.seen_step}"
        return f"trial {index}: {killed} -> {resumed}; final state {verdict}"


def command(uri: str, every: int, snapshots: Path, restarts: int) -> list[str]:
    overrides = OVERRIDES.format(every=every, snapshots=snapshots) + f",checkpoint.uri={uri}"
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        f"--max-restarts={restarts}", "-m", "trainer", "--config", "digits", "--set", overrides,
    ]  # fmt: skip


def environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **RDZV_ENV}


def final_state(folder: Path) -> dict:
    step = json.loads((folder / "latest.json").read_text())["step"]
    return torch.load(folder / f"step-{step}" / "checkpoint.pt", weights_only=True)


def same_state(a: dict, b: dict) -> bool:
    """Weights and optimizer state equal bit for bit, and the same progress."""
    if a["progress"] != b["progress"]:
        return False
    tensors = lambda state: [  # noqa: E731
        *state["model"].values(),
        *(value for slot in state["optimizer"]["state"].values() for value in slot.values()),
    ]
    return all(torch.equal(x, y) for x, y in zip(tensors(a), tensors(b), strict=True))


def kill_rank(agent: subprocess.Popen, rank: int) -> bool:
    for child in psutil.Process(agent.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "trainer" in child.cmdline():
                os.kill(child.pid, signal.SIGKILL)
                return True
        except psutil.NoSuchProcess:
            continue
    return False


def run_trial(workdir: Path, index: int, rank: int, kill_after: int, every: int, reference: dict) -> Trial:
    uri = workdir / f"trial-{index}"
    agent = subprocess.Popen(
        command(str(uri), every, workdir / "snapshots", restarts=1),
        cwd=workdir,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    resumed, killed, seen = None, False, None
    try:
        for line in agent.stdout:
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if not killed and record.get("event") == "progress" and record["step"] >= kill_after:
                killed = kill_rank(agent, rank)
                seen = record["step"] if killed else None
            if record.get("event") == "plan" and record.get("resumed_from") is not None:
                resumed = record
        agent.wait(timeout=300)
    finally:
        if agent.poll() is None:
            signal_tree(agent.pid)
    identical = agent.returncode == 0 and same_state(final_state(uri), reference)
    return Trial(
        rank,
        kill_after,
        seen,
        resumed and resumed["resumed_from"],
        resumed and resumed["resume_origin"],
        resumed and resumed["lost_steps"],
        identical,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot-every", type=int, default=5)
    args = parser.parse_args(argv)
    chooser = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="fault-trials-") as folder:
        workdir = Path(folder)
        started = time.perf_counter()
        subprocess.run(
            command(str(workdir / "reference"), args.snapshot_every, workdir / "snapshots", restarts=0),
            cwd=workdir, env=environment(), check=True, capture_output=True,
        )  # fmt: skip
        reference = final_state(workdir / "reference")
        steps = reference["progress"]["step"]
        trials = []
        for index in range(1, args.trials + 1):
            trial = run_trial(
                workdir,
                index,
                chooser.randrange(2),
                chooser.randrange(10, steps - 10),
                args.snapshot_every,
                reference,
            )
            print(trial.describe(index), flush=True)
            trials.append(trial)
    lost = [trial.seen_lost for trial in trials]
    passed = sum(trial.passed(args.snapshot_every) for trial in trials)
    print(
        f"{len(trials)} trials in {time.perf_counter() - started:.0f}s: steps lost as seen {lost} "
        f"(bound {args.snapshot_every}); {passed}/{len(trials)} within it and bit-identical"
    )
    return 0 if passed == len(trials) else 1


if __name__ == "__main__":
    raise SystemExit(main())
