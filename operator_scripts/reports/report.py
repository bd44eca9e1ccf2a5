"""Run report: a PNG of throughput, loss, LR and data-wait share over steps.

    python -m operator_scripts.reports.report HISTORY.jsonl [--out run.png] [--title TEXT]

HISTORY is the run's own metrics log: the file rank 0 writes with
`metrics.history_file=PATH`, or rank 0's output with `log.format=json` (for example
`kubectl logs POD > run.jsonl`); lines that are not progress records are skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SERIES = (
    ("samples_per_second", "global samples/s"),
    ("loss", "training loss"),
    ("lr", "learning rate"),
    ("data_wait_share", "data-wait share"),
)


def read_history(path: Path) -> list[dict]:
    """Progress records in step order, from either kind of log."""
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record and record.get("event", "progress") == "progress":
            records.append(record)
    return sorted(records, key=lambda record: record["step"])


def render(records: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [record["step"] for record in records]
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for axis, (key, label) in zip(axes.flat, SERIES, strict=True):
        axis.plot(steps, [record.get(key) for record in records], marker=".", linewidth=1)
        axis.set_title(label)
        axis.grid(alpha=0.3)
    for axis in axes[1]:
        axis.set_xlabel("step")
    axes[1][1].set_ylim(bottom=0)
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
    records = read_history(args.history)
    if not records:
        print(
            f"report: error: {args.history} holds no progress records: give it metrics.history_file, "
            "or rank 0's output of a run with log.format=json",
            file=sys.stderr,
        )
        return 2
    render(records, args.out, args.title or args.history.name)
    print(f"wrote {args.out} ({len(records)} points, steps {records[0]['step']}-{records[-1]['step']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
