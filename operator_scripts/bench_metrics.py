"""Metrics overhead benchmark: samples/s with Prometheus metrics on vs off.

    python -m operator_scripts.bench_metrics [--config digits] [--nproc 2] [--repeats 3]

Runs the same torchrun job alternately with `metrics.port=0` and with metrics served,
takes each run's steady-state global samples/s (median of rank 0's progress records after
the first two), and prints the medians and their ratio (target >= 0.99).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def steady_rate(config: str, nproc: int, overrides: list[str]) -> float:
    """One run's median global samples/s, warm-up excluded."""
    with tempfile.TemporaryDirectory() as workdir:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "trainer", "--config", config,
            "--set", f"checkpoint.uri={workdir}/ckpt,log.format=json,log.every_steps=10",
            *[arg for override in overrides for arg in ("--set", override)],
        ]  # fmt: skip
        completed = subprocess.run(command, capture_output=True, text=True, cwd=workdir, check=False)
    if completed.returncode:
        raise RuntimeError(completed.stderr[-2000:])
    records = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
    rates = [record["samples_per_second"] for record in records if record["event"] == "progress"][2:]
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="digits", help="bundled config or YAML (default digits)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting (default 3)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=["train.epochs=30"],
        help="extra overrides for both settings (default train.epochs=30)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    off, on = [], []
    for _ in range(args.repeats):
        off.append(steady_rate(args.config, args.nproc, [*args.overrides, "metrics.port=0"]))
        on.append(steady_rate(args.config, args.nproc, [*args.overrides, f"metrics.port={free_port()}"]))
    print(
        f"{args.config}, {args.nproc} processes, {args.repeats} runs each (median of steady-state samples/s)"
    )
    for label, rates in (("off", off), ("on ", on)):
        runs = ", ".join(f"{rate:,.0f}" for rate in rates)
        print(f"  metrics {label} : {statistics.median(rates):,.0f} samples/s  (runs: {runs})")
    print(f"  ratio on/off: {statistics.median(on) / statistics.median(off):.3f} (target >= 0.99)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
