"""Run report: a PNG of throughput, loss (training and validation, log scale), LR and the
step split over steps.

    python -m operator_scripts.reports.report HISTORY.jsonl [--out run.png] [--title TEXT]

HISTORY is the run's own metrics log: the file rank 0 writes with
`metrics.history_file=PATH`, or rank 0's output with `log.format=json` (for example
`kubectl logs POD > run.jsonl`); lines that are not progress records are skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

PARTS = (  # the step split the history holds, in milliseconds per step (trainer/telemetry/timing.py)
    ("data_ms", "data"),
    ("compute_ms", "compute"),
    ("communication_ms", "communication"),
    ("checkpoint_ms", "checkpoint"),
    ("logging_ms", "logging"),
)


@dataclass(frozen=True)
class History:
    """A run's progress records and its validations, each in step order."""

    progress: list[dict]
    validation: list[dict]


def read_history(path: Path) -> History:
    """From either kind of log: the history file, or rank 0's JSON log."""
    progress, validation = [], []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or "step" not in record:
            continue
        kind = record.get("event", "progress")
        if kind == "progress":
            progress.append(record)
        elif kind == "validation":
            validation.append(record)
    by_step = lambda record: record["step"]  # noqa: E731
    return History(sorted(progress, key=by_step), sorted(validation, key=by_step))


def render(history: History, out: Path, title: str) -> None:
    """Throughput, loss (log scale, training and validation), LR, and the step split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = history.progress
    steps = [record["step"] for record in records]
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    throughput, loss, lr, split = axes.flat
    throughput.plot(steps, [record.get("samples_per_second") for record in records], marker=".", linewidth=1)
    throughput.set_title("global samples/s")
    throughput.set_ylim(bottom=0)
    loss.plot(steps, [record.get("loss") for record in records], linewidth=1, label="training")
    if history.validation:
        points = [(record["step"], record["val_loss"]) for record in history.validation]
        loss.plot(*zip(*points, strict=True), marker="o", linewidth=1, label="validation")
    loss.set_yscale("log")
    loss.set_title("loss (log scale)")
    loss.legend()
    lr.plot(steps, [record.get("lr") for record in records], linewidth=1)
    lr.set_title("learning rate")
    present = [(key, label) for key, label in PARTS if any(key in record for record in records)]
    if present:
        values = [[record.get(key) or 0.0 for record in records] for key, _ in present]
        split.stackplot(steps, values, labels=[label for _, label in present])
        split.legend(loc="upper left", fontsize="small")
    split.set_title("step split, ms per step")
    for axis in axes.flat:
        axis.grid(alpha=0.3)
    for axis in axes[1]:
        axis.set_xlabel("step")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("history", type=Path, help="metrics history or JSON log of rank 0")
    parser.add_argument("--out", type=Path, default=Path("run-report.png"), help="PNG to write")
    parser.add_argument("--title", default=None, help="figure title (default: the file name)")
    args = parser.parse_args(argv)
    if not args.history.is_file():
        print(f"report: error: {args.history} does not exist", file=sys.stderr)
        return 2
    history = read_history(args.history)
    records = history.progress
    if not records:
        print(
            f"report: error: {args.history} holds no progress records: give it metrics.history_file, "
            "or rank 0's output of a run with log.format=json",
            file=sys.stderr,
        )
        return 2
    render(history, args.out, args.title or args.history.name)
    span = f"steps {records[0]['step']}-{records[-1]['step']}"
    print(f"wrote {args.out} ({len(records)} points, {span}; {len(history.validation)} validations)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
