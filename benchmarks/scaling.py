"""1 vs 2 processes on CPU (one thread each), ours and the bare DDP loop, measured speedup
next to `estimate`'s, and the plots.

    python -m benchmarks.scaling [--repeats 3] [--plots docs/performance] [--steps N]

Two workloads: a compute-bound CNN on 28x28 images and a communication-heavy wide MLP with
small batches. For each, steady-state samples/s of our trainer and of the bare loop at 1
and 2 processes, interleaved; speedup = rate(2) / rate(1), efficiency = speedup / 2.

The model's inputs are measured here, in every round beside the runs, as one would measure
them on a cluster: the time to all-reduce this model's gradients in DDP's buckets (and, for
comparison, what the ring formula makes of gloo's 1 KiB latency and 64 MiB bandwidth),
and the step time of one device. Two CPU cores are not two independent devices as two GPUs
are: they share caches and memory bandwidth. So "one device" is measured as a world of one
running beside a second, identical world of one (two jobs at once); the isolated
single-process step's prediction is printed too. On a CPU the all-reduce needs the same
cores as backward, so no overlap is the relevant column.

Two plots are written: throughput against processes with the ideal line, and our step
time split into data, compute, communication, checkpoint and loop bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.plots import plot_scaling, plot_step_split
from benchmarks.runner import run_baseline, run_trainer, torchrun
from benchmarks.scaling_results import Link, Scaling
from operator_scripts.reports.estimate import (
    ddp_bucket_bytes,
    ddp_buckets,
    with_communication,
)

WORKLOADS = {
    "compute-bound cnn": [
        "data.name=synthetic,data.synthetic.num_samples=8192,model.name=cnn,model.width=32,"
        "train.batch_size=32,train.epochs=1,train.max_steps=150"
    ],
    "communication-heavy mlp": [
        "data.name=digits,model.name=mlp,model.width=1024,model.depth=3,train.batch_size=8,"
        "train.epochs=20,train.max_steps=200"
    ],
}
COMMON = ["metrics.port=0", "train.clip_grad_norm=0", "optim.lr_scaling=none"]  # as the bare loop: same LR
LOG_EVERY = 10
PROCESSES = (1, 2)


def measure_link(gradient_bytes: float) -> Link:
    sizes = [str(int(size)) for size in ddp_bucket_bytes(gradient_bytes)]
    with tempfile.TemporaryDirectory() as workdir:
        out = torchrun(2, ["-m", "benchmarks.allreduce", "--bytes", *sizes], workdir).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return Link(result["latency_s"], result["bandwidth_bytes_s"], result["step_s"])


def measure(name: str, overrides: list[str], repeats: int) -> Scaling:
    scaling = Scaling(name)
    settings = [*COMMON, *overrides]
    for _ in range(repeats):
        for nproc in PROCESSES:
            run = run_trainer(nproc, settings, log_every=LOG_EVERY)
            scaling.parameters, scaling.per_rank_batch = run.parameters, run.per_rank_batch
            scaling.ours.setdefault(nproc, []).append(run.samples_per_second)
            scaling.split_ms.setdefault(nproc, []).append(run.split_ms)
            scaling.bare.setdefault(nproc, []).append(
                run_baseline("bare_ddp", nproc, settings, log_every=LOG_EVERY).samples_per_second
            )
        with ThreadPoolExecutor(2) as pool:  # two worlds of one at once
            pair = list(pool.map(lambda _: run_trainer(1, settings, log_every=LOG_EVERY), range(2)))
        scaling.beside_neighbour.append(statistics.mean(run.samples_per_second for run in pair))
        scaling.links.append(measure_link(4 * scaling.parameters))
    return scaling


def describe(scaling: Scaling) -> list[str]:
    gradient_bytes, link = 4 * scaling.parameters, scaling.link()
    lines = [
        f"{scaling.name}: {scaling.parameters:,} parameters "
        f"({gradient_bytes / 1e6:.1f} MB of fp32 gradients), batch {scaling.per_rank_batch} per process",
        "  runner   1 process    2 processes  speedup  efficiency",
    ]
    for runner in ("ours", "bare"):
        one, two, speedup = scaling.rate(runner, 1), scaling.rate(runner, 2), scaling.speedup(runner)
        lines.append(f"  {runner:6s} {one:>9,.0f}/s  {two:>11,.0f}/s  {speedup:>7.2f}  {50 * speedup:>9.0f}%")
    batch, measured = scaling.per_rank_batch, scaling.speedup("ours")
    alone = batch / scaling.rate("ours", 1)
    beside = batch / statistics.median(scaling.beside_neighbour)
    lines.append(
        f"  model inputs: one device's step {1000 * alone:.2f} ms alone, {1000 * beside:.2f} ms beside "
        f"a busy neighbour; all-reduce {1000 * link.step_seconds:.2f} ms measured in "
        f"{ddp_buckets(gradient_bytes)} buckets (ring model from {1e6 * link.latency:.0f} us per hop and "
        f"{link.bandwidth / 1e9:.2f} GB/s: {1000 * link.ring(gradient_bytes):.2f} ms)"
    )
    for overlap in (False, True):
        # the speedup is over the isolated single process, as measured; the step comes from beside
        predicted = with_communication(beside, link.step_seconds, 2, overlap=overlap)
        speedup = 2 * alone / predicted.step_seconds
        naive = with_communication(alone, link.step_seconds, 2, overlap=overlap).speedup
        lines.append(
            f"  predicted {'with' if overlap else 'without'} overlap: {speedup:.2f} "
            f"({100 * (speedup - measured) / measured:+.1f}% vs ours; from the step alone: {naive:.2f})"
        )
    for nproc in PROCESSES:
        parts = ", ".join(f"{name.removesuffix('_ms')} {ms:.2f}" for name, ms in scaling.split(nproc).items())
        lines.append(f"  ours, ms per step at {nproc} process{'es' if nproc > 1 else ''}: {parts}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting (default 3)")
    parser.add_argument("--plots", type=Path, default=Path("docs/performance"), help="folder for the PNGs")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: the workload's own)")
    parser.add_argument(
        "--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS), help="the ones to run"
    )
    args = parser.parse_args(argv)
    results = []
    steps = [f"train.max_steps={args.steps}"] if args.steps else []
    for name in args.workloads:
        results.append(measure(name, [*WORKLOADS[name], *steps], args.repeats))
        print("\n".join(describe(results[-1])))
    args.plots.mkdir(parents=True, exist_ok=True)
    for path in (
        plot_scaling(results, args.plots / "scaling.png"),
        plot_step_split(results, args.plots / "step-split.png"),
    ):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
