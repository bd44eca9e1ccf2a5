"""The metrics' weight at scale: the series one pod of 8 ranks serves, read from its scrape
endpoint, and at 1,024 GPUs by arithmetic (one pod per 8 GPUs). A label whose values grow
as a run goes on (steps, pids, run ids) would multiply series for good: the pod is scraped
three times, after its first checkpoint and as it trains on, and any series the later
scrapes add is named.

    python -m benchmarks.metric_series [--ranks 8]

The pod is `torchrun --standalone` with 8 CPU processes training the digits CNN.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from benchmarks.metrics import free_port
from benchmarks.runner import checkout_path
from trainer.launcher.launch import RDZV_ENV
from trainer.launcher.process_tree import signal_tree

GPUS = 1024
SERIES = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s")
SCRAPE_GAP_S = 8.0


@dataclass(frozen=True)
class SeriesFigures:
    ranks: int
    per_pod: int
    added_later: list[str]  # series the later scrapes had that the first did not

    @property
    def at_scale(self) -> int:
        return GPUS // self.ranks * self.per_pod


def scrape(port: int) -> set[str]:
    """The series (name and labels) the pod serves now."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        match.group(1) + (match.group(2) or "") for line in text.splitlines() if (match := SERIES.match(line))
    }


def checkpointed(port: int) -> bool:
    try:
        return any(series.startswith("ddp_checkpoint_last_success_step") for series in scrape(port))
    except OSError:
        return False


def measure(ranks: int) -> SeriesFigures:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ddp-series-") as scratch:
        settings = (
            f"metrics.port={port},metrics.address=127.0.0.1,train.epochs=10000,checkpoint.every_steps=20,"
            f"checkpoint.uri={scratch}/checkpoints,checkpoint.snapshot_dir={scratch}/shm,log.every_steps=10"
        )
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", "trainer", "--config", "digits", "--set", settings,
        ]  # fmt: skip
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": checkout_path(), **RDZV_ENV}
        pod = subprocess.Popen(
            command, cwd=scratch, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + 300
            while not checkpointed(port):
                if pod.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the {ranks}-rank pod served no checkpoint's metrics (exit {pod.poll()})"
                    )
                time.sleep(1.0)
            scrapes = [scrape(port)]
            for _ in range(2):
                time.sleep(SCRAPE_GAP_S)
                scrapes.append(scrape(port))
        finally:
            signal_tree(pod)
            pod.wait(timeout=60)
    added = sorted(set().union(*scrapes[1:]) - scrapes[0])
    return SeriesFigures(ranks, len(scrapes[-1]), added)


def describe(figures: SeriesFigures) -> str:
    added = "none" if not figures.added_later else ", ".join(figures.added_later[:5])
    return (
        f"metrics: {figures.per_pod:,} series per pod of {figures.ranks} ranks; {GPUS:,} GPUs in "
        f"{GPUS // figures.ranks} pods: {figures.at_scale:,} series (derived); series added after the first "
        f"checkpoint over {2 * SCRAPE_GAP_S:.0f} s: {added}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=8, help="processes in the pod (default 8)")
    args = parser.parse_args(argv)
    print(describe(measure(args.ranks)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
