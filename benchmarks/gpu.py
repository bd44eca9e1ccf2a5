"""GPU benchmark: our trainer on a bf16-autocast decoder transformer, reporting tokens/s,
MFU and peak memory per device from rank 0's JSON progress lines.

    python -m benchmarks.gpu [--gpus 1] [--steps 60]   # ~236M parameters, seq 1024
    python -m benchmarks.gpu --reduced                 # the same path, small, on a CPU

One short call on a lent H200 (about two minutes with start-up). `--reduced` runs the
bundled `tokens` shape on the CPU with two processes, so CI exercises every line but the
device's own numbers. MFU needs a peak: the trainer's table knows H200/H100/A100/L40S/A10/L4;
elsewhere pass `--peak-tflops`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass

from benchmarks.runner import trainer_records

FULL = [
    "data.synthetic.num_samples=8192",
    "data.synthetic.seq_len=1024",
    "data.synthetic.vocab_size=32768",
    "model.width=1024",
    "model.depth=16",
    "model.heads=16",
    "train.batch_size=16",
    "train.eval_batch_size=16",
    "train.device=cuda",
]
REDUCED = ["train.batch_size=8", "train.device=cpu"]
COMMON = [
    "train.amp=bf16",
    "train.epochs=1000",
    "train.clip_grad_norm=1.0",
    "checkpoint.every_steps=0",
    "metrics.port=0",
]


@dataclass(frozen=True)
class GpuFigures:
    """Steady-state figures of one run (medians over progress lines after warm-up)."""

    device_name: str
    world_size: int
    parameters: int
    tokens_per_sample: int
    global_batch: int
    samples_per_second: float
    mfu: float | None
    peak_memory_mb: float
    step_ms: float

    @property
    def tokens_per_second(self) -> float:
        return self.samples_per_second * self.tokens_per_sample

    def lines(self) -> list[str]:
        mfu = f"{self.mfu:.1%}" if self.mfu is not None else "n/a (no peak known: pass --peak-tflops)"
        return [
            f"device: {self.device_name} x {self.world_size}, bf16 autocast",
            f"model: transformer, {self.parameters / 1e6:.1f}M parameters, "
            f"sequence {self.tokens_per_sample}, global batch {self.global_batch}",
            f"tokens/s: {self.tokens_per_second:,.0f} global, "
            f"{self.tokens_per_second / self.world_size:,.0f} per device ({self.step_ms:.1f} ms per step)",
            f"MFU: {mfu}",
            f"peak memory: {self.peak_memory_mb / 1024:.2f} GiB per device (rank 0)",
        ]


def figures(start: dict, steady: list[dict]) -> GpuFigures:
    """Rank 0's start record and steady progress records, summarised."""
    if not steady:
        raise ValueError("no progress lines after warm-up: raise --steps")
    mfus = [record["mfu"] for record in steady if record["mfu"] is not None]
    return GpuFigures(
        device_name=start["device_name"],
        world_size=start["world_size"],
        parameters=start["parameters"],
        tokens_per_sample=start["tokens_per_sample"],
        global_batch=start["global_batch"],
        samples_per_second=statistics.median(record["samples_per_second"] for record in steady),
        mfu=statistics.median(mfus) if mfus else None,
        peak_memory_mb=max(record["peak_memory_mb"] for record in steady),
        step_ms=statistics.median(record["step_ms"] for record in steady),
    )


def measure(nproc: int, steps: int, *, reduced: bool = False, peak_tflops: float | None = None) -> GpuFigures:
    """Train the benchmark model (or the reduced one on CPUs) for `steps` and summarise it."""
    overrides = [*(REDUCED if reduced else FULL), *COMMON, f"train.max_steps={steps}"]
    if peak_tflops:
        overrides.append(f"metrics.peak_flops_per_device={peak_tflops * 1e12:g}")
    run = trainer_records(nproc, overrides, log_every=max(1, steps // 10), config="tokens")
    return figures(run.start, run.steady)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, default=1, help="processes, one per GPU (default 1)")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    parser.add_argument("--reduced", action="store_true", help="small model on 2 CPU processes")
    parser.add_argument("--peak-tflops", type=float, help="peak dense bf16 TFLOP/s of one device")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    result = measure(
        2 if args.reduced else args.gpus, args.steps, reduced=args.reduced, peak_tflops=args.peak_tflops
    )
    if args.json:
        print(json.dumps({**result.__dict__, "tokens_per_second": result.tokens_per_second}))
    else:
        print("\n".join(result.lines()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
