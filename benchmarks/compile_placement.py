"""Where compile goes around DDP, measured side by side: the trainer's `DDP(compiled
forward)` and `blocks` against `torch.compile(DDP(model))` (dynamo's DDPOptimizer, a graph
per bucket).

    python -m benchmarks.compile_placement [--config tokens] [--steps 30]

Runs itself under `torchrun --standalone --nproc_per_node=2` (gloo, one thread a rank). For
each placement, on the config's model and a fixed batch: the first step's time (the
compile), the median of `--steps` steady steps, and the graphs dynamo made; rank 0 prints a
line each, then `placement: DDP(compiled) X ms, blocks Y ms, compile(DDP) Z ms a step`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.runner import checkout_path
from trainer.config import load_config
from trainer.data import build_data
from trainer.distributed.process_group import process_group, read_env
from trainer.launcher.launch import RDZV_ENV
from trainer.loop.compiling import compile_in_place, graphs_compiled
from trainer.loop.ddp import wrap
from trainer.loop.objective import training_loss
from trainer.models import build_model

PLACEMENTS = ("DDP(compiled)", "blocks", "compile(DDP)")


def placed(name: str, module: nn.Module, config) -> nn.Module:
    """`module` wrapped as `name` places compile and DDP."""
    cpu = torch.device("cpu")
    if name == "compile(DDP)":
        return torch.compile(DistributedDataParallel(module, bucket_cap_mb=config.ddp.bucket_cap_mb))
    compile_in_place(module, "model" if name == "DDP(compiled)" else "blocks", config.model.name)
    return wrap(module, cpu, config.ddp)


def measure(name: str, config, steps: int) -> tuple[float, float, int]:
    """First step's seconds, the steady steps' median in ms, graphs compiled."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    splits = build_data(config.data, config.seed)
    module = build_model(config.model, splits.spec)
    model = placed(name, module, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = [splits.train[index] for index in range(config.train.batch_size)]
    inputs = torch.stack([torch.as_tensor(sample[0]) for sample in batch])
    targets = torch.stack([torch.as_tensor(sample[1]) for sample in batch])
    graphs = graphs_compiled()
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        started = time.perf_counter()
        training_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return times[0], 1000 * statistics.median(times[1:]), graphs_compiled() - graphs


def worker(config_name: str, steps: int) -> None:
    context = read_env()
    config = load_config(config_name, [])
    with process_group(context, torch.device("cpu"), timeout_s=600):
        results = {name: measure(name, config, steps) for name in PLACEMENTS}
    if context.is_main:
        for name, (first_s, step_ms, graphs) in results.items():
            print(f"{name}: first step {first_s:.1f}s, then {step_ms:.1f} ms a step; {graphs} graphs")
        print(
            "placement: " + ", ".join(f"{name} {results[name][1]:.1f} ms" for name in PLACEMENTS) + " a step"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="tokens")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.config, args.steps)
        return 0
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "benchmarks.compile_placement", "--worker", "--config", args.config, "--steps", str(args.steps),
    ]  # fmt: skip
    env = {**os.environ, **RDZV_ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": checkout_path()}
    return subprocess.run(command, env=env, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
