"""Snapshot overhead: training throughput with node-local snapshots against none.

    python -m benchmarks.snapshot [--config NAME] [--nproc 2] [--repeats 5] [--every auto 5 50]

Runs our trainer with no snapshots and with snapshots every N steps (or `auto`, the
default, which sizes the interval itself), interleaved and repeated (the order rotated each
round), durable checkpoints off in all. Throughput counts the snapshot pauses as time (the
progress lines' step split has them as `checkpoint_ms`). It prints samples/s, each
interval's ratio to none (median and range over rounds), the pause as a share of step time
and, for a fixed N, per snapshot; and the target at the trainer's default: at most 2 %
slower on the digits CNN, 1 % on the tokens transformer.
"""

from __future__ import annotations

import statistics

from benchmarks.runner import TrainerRun, run_trainer, trainer_bench_parser
from trainer.config import CheckpointConfig

DEFAULT_EVERY = CheckpointConfig().snapshot_every_steps
TARGETS = {"tokens": 0.99}  # slower by at most 1 % on the transformer, 2 % elsewhere
LOG_EVERY = 20


def measure(config: str | None, nproc: int, repeats: int, intervals: list[str], extra: list[str]) -> dict:
    """TrainerRuns per interval ("0": none), `repeats` rounds, the order rotated each round."""
    contenders = ["0", *intervals]
    runs: dict[str, list[TrainerRun]] = {every: [] for every in contenders}
    for round_ in range(repeats):
        for every in contenders[round_ % len(contenders) :] + contenders[: round_ % len(contenders)]:
            overrides = [
                "checkpoint.every_steps=0",
                "metrics.port=0",
                *extra,
                f"checkpoint.snapshot_every_steps={every}",
            ]
            runs[every].append(run_trainer(nproc, overrides, log_every=LOG_EVERY, config=config))
    return runs


def summary(runs: dict[str, list[TrainerRun]], target: float) -> list[str]:
    rates = {every: [run.samples_per_second for run in contender] for every, contender in runs.items()}
    lines = [f"  no snapshots     : {statistics.median(rates['0']):>9,.0f} samples/s"]
    for every, contender in runs.items():
        if every == "0":
            continue
        ratios = [mine / theirs for mine, theirs in zip(rates[every], rates["0"], strict=True)]
        share = statistics.median(run.split_ms["checkpoint_ms"] / run.step_ms for run in contender)
        per_snapshot = ""
        if every.isdigit():
            pause_ms = statistics.median(run.split_ms["checkpoint_ms"] * int(every) for run in contender)
            per_snapshot = f", {pause_ms:.2f} ms per snapshot"
        goal = f"; target >= {target:.2f}" if every == str(DEFAULT_EVERY) else ""
        lines.append(
            f"  every {every:>4s} steps: {statistics.median(rates[every]):>9,.0f} samples/s, "
            f"ratio {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}{goal}); "
            f"pauses {100 * share:.2f}% of step time{per_snapshot}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = trainer_bench_parser(__doc__, repeats=5)
    parser.add_argument(
        "--every", nargs="+", default=[str(DEFAULT_EVERY), "5", "50"], help="intervals to compare (or auto)"
    )
    args = parser.parse_args(argv)
    runs = measure(args.config, args.nproc, args.repeats, args.every, args.overrides)
    target = TARGETS.get(args.config or "digits", 0.98)
    processes = f"{args.nproc} process{'es' if args.nproc > 1 else ''}"
    print(
        f"{args.config or 'digits'}, {processes}: samples/s with snapshot pauses counted, "
        f"median of {args.repeats} interleaved rounds; default interval {DEFAULT_EVERY}"
    )
    print("\n".join(summary(runs, target)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
