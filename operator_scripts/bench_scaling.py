"""1 vs 2 processes on CPU (one thread each): measured speedup next to `estimate`'s.

    python -m operator_scripts.bench_scaling [--repeats 3]

For a compute-bound model (a CNN on 28x28 images) and a communication-heavy one (a wide
MLP with small batches): steady-state samples/s of our trainer at 1 and 2 processes,
interleaved; the single-process step time and gradient size feed the ring model with this
machine's measured gloo latency and bandwidth, and the predictions (with and without
overlap of communication and backward) are printed beside the measurement. On a CPU the
all-reduce competes with the backward pass for the same cores, so no-overlap is the
relevant column there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from operator_scripts.benchrun import run_trainer, torchrun
from operator_scripts.estimate import Interconnect, predict

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


def measure_link() -> Interconnect:
    with tempfile.TemporaryDirectory() as workdir:
        result = json.loads(
            torchrun(2, ["-m", "operator_scripts.measure_allreduce"], workdir, omp_threads="1")
            .strip()
            .splitlines()[-1]
        )
    return Interconnect("gloo loopback", result["bandwidth_bytes_s"], result["latency_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting (default 3)")
    args = parser.parse_args(argv)
    link = measure_link()
    print(f"{link.name}: {link.bandwidth / 1e9:.2f} GB/s, {link.latency * 1e6:.0f} us per hop (measured)")
    for name, overrides in WORKLOADS.items():
        single, double = [], []
        for _ in range(args.repeats):
            run = run_trainer(1, [*overrides, "metrics.port=0"], log_every=10, omp_threads="1")
            params, batch = run.parameters, run.per_rank_batch
            single.append(run.samples_per_second)
            double.append(
                run_trainer(
                    2, [*overrides, "metrics.port=0"], log_every=10, omp_threads="1"
                ).samples_per_second
            )
        one, two = statistics.median(single), statistics.median(double)
        measured = two / one
        step = batch / one
        plain, hidden = (predict(step, 4 * params, 2, link, overlap=o).speedup for o in (False, True))
        print(f"{name}: {params:,} params; 1 proc {one:,.0f} samples/s, 2 procs {two:,.0f} samples/s")
        print(f"  speedup measured {measured:.2f} (efficiency {50 * measured:.0f}%)")
        print(f"  predicted without overlap {plain:.2f} ({100 * (plain - measured) / measured:+.1f}%), "
              f"with overlap {hidden:.2f} ({100 * (hidden - measured) / measured:+.1f}%)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
