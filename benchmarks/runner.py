"""What the benchmarks share: launching a torchrun job and reading the trainer's steady
state from its JSON progress lines."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from benchmarks.baseline import WARMUP_WINDOWS
from trainer.distributed.launch import RDZV_ENV


def torchrun(nproc: int, args: list[str], cwd: str) -> str:
    """stdout of `torchrun --standalone --nproc_per_node=N ARGS`, one thread per process
    unless OMP_NUM_THREADS says otherwise; a failed run raises with its stderr's tail."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *args,
    ]
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    completed = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": threads, **RDZV_ENV},
    )
    if completed.returncode:
        raise RuntimeError(completed.stderr[-2000:])
    return completed.stdout


SPLIT_FIELDS = ("data_ms", "compute_ms", "communication_ms", "checkpoint_ms", "logging_ms")


@dataclass(frozen=True)
class TrainerRun:
    """One run's median global samples/s (checkpoint and snapshot pauses counted as time, as
    the progress lines count them) and mean step split in ms (a mean, so that the occasional
    checkpoint counts; the first progress lines left out as warm-up), model size and
    per-rank batch."""

    samples_per_second: float
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


def trainer_records(
    nproc: int, overrides: list[str], *, log_every: int, config: str | None = None
) -> tuple[dict, list[dict]]:
    """`torchrun -m trainer` with JSON logs and a throwaway checkpoint folder (those settings
    come last, so they win over `overrides`): rank 0's start record and its steady progress
    records (the first `WARMUP_WINDOWS` left out)."""
    with tempfile.TemporaryDirectory() as workdir:
        fixed = f"checkpoint.uri={workdir}/ckpt,log.format=json,log.every_steps={log_every}"
        out = torchrun(nproc, ["-m", "trainer", *config_args([*overrides, fixed], config)], workdir)
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    start = next(record for record in records if record["event"] == "start")
    return start, [record for record in records if record["event"] == "progress"][WARMUP_WINDOWS:]


def run_trainer(
    nproc: int,
    overrides: list[str],
    *,
    log_every: int,
    config: str | None = None,
) -> TrainerRun:
    """One trainer run's steady-state figures."""
    start, steady = trainer_records(nproc, overrides, log_every=log_every, config=config)
    return TrainerRun(
        statistics.median(record["samples_per_second"] for record in steady),
        statistics.mean(record["step_ms"] for record in steady),
        {field: statistics.mean(record[field] for record in steady) for field in SPLIT_FIELDS},
        start["parameters"],
        start["global_batch"] // nproc,
    )


def run_baseline(
    module: str, nproc: int, overrides: list[str], *, log_every: int, config: str | None = None
) -> float:
    """samples/s of `torchrun -m benchmarks.<module>` (bare_ddp or lightning_ddp)."""
    args = [
        "-m",
        f"benchmarks.{module}",
        *config_args(overrides, config),
        "--log-every",
        str(log_every),
    ]
    with tempfile.TemporaryDirectory() as workdir:
        out = torchrun(nproc, args, workdir)
    return json.loads(out.strip().splitlines()[-1])["samples_per_second"]
