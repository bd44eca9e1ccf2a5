"""What the benchmarks share: launching a torchrun job and reading the trainer's steady
state from its JSON progress lines."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.baseline import WARMUP_WINDOWS
from benchmarks.cpu_time import TreeCpuSampler, per_thousand
from trainer.launcher.launch import RDZV_ENV

CHECKOUT = Path(__file__).resolve().parents[1]  # benchmarks/ is not installed: the checkout


@dataclass(frozen=True)
class Launched:
    """A finished torchrun job: its stdout, and its process tree's CPU time as it ran."""

    stdout: str
    cpu: TreeCpuSampler


def torchrun(nproc: int, args: list[str], cwd: str) -> Launched:
    """`torchrun --standalone --nproc_per_node=N ARGS`, one thread per process unless
    OMP_NUM_THREADS says otherwise, its process tree's CPU sampled from outside; a failed
    run raises with its stderr's tail."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *args,
    ]
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(
            command,
            stdout=stdout,
            stderr=stderr,
            text=True,
            cwd=cwd,
            env={**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": checkout_path(), **RDZV_ENV},
        )
        with TreeCpuSampler(process.pid) as cpu:
            returncode = process.wait()
        stdout.seek(0)
        stderr.seek(0)
        if returncode:
            raise RuntimeError(stderr.read()[-2000:])
        return Launched(stdout.read(), cpu)


def checkout_path() -> str:
    """PYTHONPATH with this checkout first: `-m benchmarks.NAME` in a process started
    elsewhere, since benchmarks/ is not installed."""
    return os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH", "")]))


SPLIT_FIELDS = ("data_ms", "compute_ms", "communication_ms", "checkpoint_ms", "logging_ms")


@dataclass(frozen=True)
class TrainerRun:
    """One run's median global samples/s (checkpoint and snapshot pauses counted as time, as
    the progress lines count them) and mean step split in ms (a mean, so that the occasional
    checkpoint counts; the first progress lines left out as warm-up), model size and
    per-rank batch."""

    samples_per_second: float
    cpu_per_1000: float  # CPU-seconds of the whole process tree per 1,000 samples, steady windows
    step_ms: float
    split_ms: dict[str, float]
    parameters: int
    per_rank_batch: int


def trainer_bench_parser(description: str, repeats: int) -> argparse.ArgumentParser:
    """The options every benchmark of our trainer takes: config, processes, rounds, settings."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="bundled config or YAML (default: the trainer's, digits)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (one thread each; default 2)")
    parser.add_argument(
        "--repeats", type=int, default=repeats, help=f"interleaved rounds (default {repeats})"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="trainer settings")
    return parser


def config_args(overrides: list[str], config: str | None) -> list[str]:
    """`[--config CONFIG] --set A --set B ...`, as the trainer and the baselines take them."""
    chosen = ["--config", config] if config else []
    return [*chosen, *(arg for override in overrides for arg in ("--set", override))]


@dataclass(frozen=True)
class TrainerRecords:
    """Rank 0's start record, its steady progress records (the first `WARMUP_WINDOWS` left
    out), and the run's CPU-seconds per 1,000 samples over them."""

    start: dict
    steady: list[dict]
    cpu_per_1000: float


def trainer_records(
    nproc: int, overrides: list[str], *, log_every: int, config: str | None = None
) -> TrainerRecords:
    """`torchrun -m trainer` with JSON logs and a throwaway checkpoint folder (those settings
    come last, so they win over `overrides`). The CPU time counts from the last warm-up
    record's time to the last record's."""
    with tempfile.TemporaryDirectory() as workdir:
        fixed = f"checkpoint.uri={workdir}/ckpt,log.format=json,log.every_steps={log_every}"
        launched = torchrun(nproc, ["-m", "trainer", *config_args([*overrides, fixed], config)], workdir)
    records = [json.loads(line) for line in launched.stdout.splitlines() if line.startswith("{")]
    start = next(record for record in records if record["event"] == "start")
    progress = [record for record in records if record["event"] == "progress"]
    cpu = math.nan  # too short a run to have steady windows
    if len(progress) > WARMUP_WINDOWS:
        before, last = progress[WARMUP_WINDOWS - 1], progress[-1]
        samples = (last["step"] - before["step"]) * start["global_batch"]
        cpu = per_thousand(launched.cpu.between(before["time"], last["time"]), samples)
    return TrainerRecords(start, progress[WARMUP_WINDOWS:], cpu)


def run_trainer(
    nproc: int,
    overrides: list[str],
    *,
    log_every: int,
    config: str | None = None,
) -> TrainerRun:
    """One trainer run's steady-state figures."""
    run = trainer_records(nproc, overrides, log_every=log_every, config=config)
    steady = run.steady
    return TrainerRun(
        statistics.median(record["samples_per_second"] for record in steady),
        run.cpu_per_1000,
        statistics.mean(record["step_ms"] for record in steady),
        {field: statistics.mean(record[field] for record in steady) for field in SPLIT_FIELDS},
        run.start["parameters"],
        run.start["global_batch"] // nproc,
    )


@dataclass(frozen=True)
class BaselineRun:
    """A baseline loop's median steady samples/s, and its CPU-seconds per 1,000 samples."""

    samples_per_second: float
    cpu_per_1000: float


def run_baseline(
    module: str, nproc: int, overrides: list[str], *, log_every: int, config: str | None = None
) -> BaselineRun:
    """`torchrun -m benchmarks.<module>` (bare_ddp or lightning_ddp), measured as ours is."""
    args = [
        "-m",
        f"benchmarks.{module}",
        *config_args(overrides, config),
        "--log-every",
        str(log_every),
    ]
    with tempfile.TemporaryDirectory() as workdir:
        launched = torchrun(nproc, args, workdir)
    report = json.loads(launched.stdout.strip().splitlines()[-1])
    ends = report["window_ends"]
    samples = (len(ends) - WARMUP_WINDOWS) * report["samples_per_window"]
    cpu = launched.cpu.between(ends[WARMUP_WINDOWS - 1], ends[-1])
    return BaselineRun(report["samples_per_second"], per_thousand(cpu, samples))
