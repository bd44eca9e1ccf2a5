"""What a worker's start costs in CPU time, with the collector off during its imports and
what they made frozen after (as shipped, `trainer/collection.py`) and collecting as Python
does by default, side by side.

    python -m benchmarks.startup [--rounds 5] [--steps 20]

Each round runs both, in turn, as one `python -m trainer` process (a world of one, the
digits demo, no checkpoints) for `--steps` steps, and takes its CPU-seconds (user + system,
its forked writer's included) from the kernel's account of the waited-for child, and its
wall time. "collecting" is the same entry point with `uncollected_imports` replaced by a
context that does nothing, so the two differ in that alone. A worker's imports are most of
a short run, and every restart and every pod pays them again.

Last line: `startup: shipped/collecting CPU X.XX (median of N rounds), wall Y.YY`.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.runner import checkout_path

# the entry point with the collector left on during the imports
COLLECTING = (
    "import contextlib, runpy, sys; import trainer.collection as collection; "
    "collection.uncollected_imports = contextlib.nullcontext; sys.argv[0] = 'trainer'; "
    "runpy.run_module('trainer', run_name='__main__', alter_sys=True)"
)
NO_SAVES = "checkpoint.every_steps=0,checkpoint.snapshot_every_steps=0"
WAYS = {"shipped": ["-m", "trainer"], "collecting": ["-c", COLLECTING]}


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(way: str, steps: int) -> tuple[float, float]:
    """One run started `way`: its CPU-seconds and its wall seconds."""
    overrides = f"train.max_steps={steps},{NO_SAVES},metrics.port=0"
    env = {**os.environ, "PYTHONPATH": checkout_path(), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    with tempfile.TemporaryDirectory() as workdir:
        command = [sys.executable, *WAYS[way], "--set", f"{overrides},checkpoint.uri={workdir}/checkpoints"]
        cpu, started = children_cpu(), time.perf_counter()
        done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, check=False)
        wall, cpu = time.perf_counter() - started, children_cpu() - cpu
    if done.returncode:
        raise SystemExit(f"startup: the {way} run failed: {done.stderr.strip()[-2000:]}")
    return cpu, wall


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    figures: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            figures[way].append(run_once(way, args.steps))
    for way, runs in figures.items():
        cpu, wall = (statistics.median(run[i] for run in runs) for i in (0, 1))
        print(f"{way:>10}: {cpu:.2f} CPU-s, {wall:.2f} s wall (median of {args.rounds})")
    pairs = list(zip(figures["shipped"], figures["collecting"], strict=True))
    cpu, wall = (statistics.median(ours[i] / theirs[i] for ours, theirs in pairs) for i in (0, 1))
    print(f"startup: shipped/collecting CPU {cpu:.2f} (median of {args.rounds} rounds), wall {wall:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
