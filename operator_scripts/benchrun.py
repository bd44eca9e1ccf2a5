"""What the benchmarks share: launching a torchrun job and reading the trainer's steady
state from its JSON progress lines."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass


def torchrun(nproc: int, args: list[str], cwd: str, *, omp_threads: str | None = None) -> str:
    """stdout of `torchrun --standalone --nproc_per_node=N ARGS`; OMP_NUM_THREADS defaults
    to 1 (or is forced to `omp_threads`); a failed run raises with its stderr's tail."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *args,
    ]
    threads = omp_threads or os.environ.get("OMP_NUM_THREADS", "1")
    completed = subprocess.run(
        command, capture_output=True, text=True, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": threads}
    )
    if completed.returncode:
        raise RuntimeError(completed.stderr[-2000:])
    return completed.stdout


@dataclass(frozen=True)
class TrainerRun:
    """One run's median global samples/s (the first two progress lines left out as
    warm-up), model size and per-rank batch."""

    samples_per_second: float
    parameters: int
    per_rank_batch: int


def run_trainer(
    nproc: int,
    overrides: list[str],
    *,
    log_every: int,
    config: str | None = None,
    omp_threads: str | None = None,
) -> TrainerRun:
    """`torchrun -m trainer [--config CONFIG]` with JSON logs and a throwaway checkpoint
    folder (those settings come last, so they win over `overrides`)."""
    with tempfile.TemporaryDirectory() as workdir:
        fixed = f"checkpoint.uri={workdir}/ckpt,log.format=json,log.every_steps={log_every}"
        sets = [arg for override in [*overrides, fixed] for arg in ("--set", override)]
        chosen = ["--config", config] if config else []
        out = torchrun(nproc, ["-m", "trainer", *chosen, *sets], workdir, omp_threads=omp_threads)
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    start = next(record for record in records if record["event"] == "start")
    rates = [record["samples_per_second"] for record in records if record["event"] == "progress"][2:]
    return TrainerRun(statistics.median(rates), start["parameters"], start["global_batch"] // nproc)
