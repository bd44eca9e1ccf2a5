"""Fault trials: SIGKILL a random rank at a random step, and check what the restart lost.

    python -m benchmarks.fault_trials [--trials 10] [--seed 0] [--snapshot-every 5]

Runs the digits demo at 2 processes under `torchrun --standalone --max-restarts=1`, with
dropout on (so every rank's RNG streams matter), a snapshot every `--snapshot-every` steps
and no durable checkpoint before the end. In each seeded trial one rank, chosen at random,
is SIGKILLed once rank 0 has logged a step chosen at random; torchrun restarts both, and
the run resumes from the newest snapshot. Each trial must lose at most `--snapshot-every`
steps (the trainer's own `resumed from step N (..., L steps lost)`) and end with weights
and optimizer state bit-identical to one uninterrupted run. Exit status 1 if any does not.
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
    resumed_from: int | None
    origin: str | None
    lost_steps: int | None
    identical: bool

    def passed(self, bound: int) -> bool:
        return self.identical and self.lost_steps is not None and self.lost_steps <= bound

    def describe(self, index: int) -> str:
        resumed = (
            f"resumed from step {self.resumed_from} ({self.origin}), {self.lost_steps} lost"
            if self.resumed_from is not None
            else "did not resume"
        )
        verdict = "bit-identical" if self.identical else "DIFFERENT"
        killed = f"SIGKILL rank {self.rank} after step {self.kill_after}"
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
    resumed, killed = None, False
    try:
        for line in agent.stdout:
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if not killed and record.get("event") == "progress" and record["step"] >= kill_after:
                killed = kill_rank(agent, rank)
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
    lost = [trial.lost_steps for trial in trials]
    passed = sum(trial.passed(args.snapshot_every) for trial in trials)
    print(
        f"{len(trials)} trials in {time.perf_counter() - started:.0f}s: steps lost {lost} "
        f"(bound {args.snapshot_every}); {passed}/{len(trials)} within it and bit-identical"
    )
    return 0 if passed == len(trials) else 1


if __name__ == "__main__":
    raise SystemExit(main())
