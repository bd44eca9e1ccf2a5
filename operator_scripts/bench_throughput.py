"""Framework overhead: our trainer against the plainest DDP loop, same model, data and
world size, interleaved and repeated; PyTorch Lightning too where it is installed.

    python -m operator_scripts.bench_throughput [--nproc 2] [--repeats 3] [--set key=value ...]

Ours runs without gradient clipping here (the bare loop has none): the comparison is of
loop overhead, not of features that cost compute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from operator_scripts.benchrun import run_trainer, torchrun

DEFAULTS = ["train.epochs=30", "train.clip_grad_norm=0", "optim.lr_scaling=none", "metrics.port=0"]


def ours(nproc: int, overrides: list[str]) -> float:
    return run_trainer(nproc, overrides, log_every=20).samples_per_second


def bare(nproc: int, overrides: list[str]) -> float:
    with tempfile.TemporaryDirectory() as workdir:
        sets = [arg for o in overrides for arg in ("--set", o)]
        out = torchrun(nproc, ["-m", "operator_scripts.bare_ddp", *sets], workdir)
    return json.loads(out.strip().splitlines()[-1])["samples_per_second"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    overrides = [*DEFAULTS, *args.overrides]
    results: dict[str, list[float]] = {"ours": [], "bare DDP loop": []}
    try:
        import lightning  # noqa: F401

        print("PyTorch Lightning is installed but not wired in yet; comparing ours with the bare loop")
    except ImportError:
        print("PyTorch Lightning is not installed (optional); comparing ours with the bare loop")
    for _ in range(args.repeats):
        results["ours"].append(ours(args.nproc, overrides))
        results["bare DDP loop"].append(bare(args.nproc, overrides))
    for name, rates in results.items():
        spread = f"median of {len(rates)}, spread {min(rates):,.0f}-{max(rates):,.0f}"
        print(f"  {name:14s}: {statistics.median(rates):>9,.0f} samples/s ({spread})")
    ratio = statistics.median(results["ours"]) / statistics.median(results["bare DDP loop"])
    print(f"  ratio ours/bare: {ratio:.3f} (target >= 0.98)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
