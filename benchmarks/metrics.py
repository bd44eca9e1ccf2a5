"""Metrics overhead benchmark: samples/s with Prometheus metrics on vs off.

    python -m benchmarks.metrics [--config digits] [--nproc 2] [--repeats 3]

Runs the same torchrun job alternately with `metrics.port=0` and with metrics served,
takes each run's steady-state global samples/s (median of rank 0's progress records after
the first two), and prints the medians and their ratio (target >= 0.99).
"""

from __future__ import annotations

import argparse
import socket
import statistics

from benchmarks.runner import run_trainer


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def steady_rate(config: str, nproc: int, overrides: list[str]) -> float:
    """One run's median global samples/s, warm-up excluded."""
    return run_trainer(nproc, overrides, config=config, log_every=10).samples_per_second


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
