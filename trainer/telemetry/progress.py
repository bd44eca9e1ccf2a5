"""Rank 0's progress lines and summary: every rank's loss and step split, gathered while the
next step runs, then logged, exported to the metrics and appended to the run's history."""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from trainer.distributed.process_group import DistContext, wait_for_peers
from trainer.telemetry.log import duration, event, plural
from trainer.telemetry.metrics import Metrics
from trainer.telemetry.step_split import StepSplit
from trainer.telemetry.timing import CHECKPOINT, PARTS, StepSeconds


class Window:
    """What a progress line covers: the steps since the last line with their summed loss,
    and the time of the steps the clock has resolved meanwhile, per part (on CUDA those the
    GPU has finished, so a line's split may trail its loss by a step or two). It runs across
    epoch boundaries, so every line covers the same number of steps."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.loss_sum: torch.Tensor | None = None
        self.timed_steps = 0
        self.saves = 0
        self.seconds = [0.0] * len(PARTS)

    def add(self, loss: torch.Tensor) -> None:
        self.steps += 1
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss

    def add_times(self, seconds: StepSeconds) -> None:
        self.timed_steps += 1
        self.saves += seconds[CHECKPOINT] > 0
        for part, spent in enumerate(seconds):
            self.seconds[part] += spent

    def timings(self) -> list[float]:
        """This rank's timed steps and their seconds per part, gathered beside its loss."""
        return [self.timed_steps, *self.seconds]


@dataclass
class PendingProgress:
    """A progress line whose numbers are still being gathered from every rank, with what
    rank 0 knew when its window closed."""

    work: dist.Work
    gathered: list[torch.Tensor]
    step: int
    epoch: int
    total_steps: int
    steps: int
    lr: float
    grad_norm: torch.Tensor | None


@dataclass(frozen=True)
class RunShape:
    """What a progress line needs to know about the run, fixed for its length."""

    global_batch: int
    epochs: int
    flops_per_sample: float | None
    peak_flops: float
    history_file: str


class ProgressLog:
    """Progress lines in two halves, so that the loop never waits for its peers to log:
    `gather` starts an async all-gather of every rank's window after a log step, and `read`,
    called after the next step, waits for it and reports."""

    def __init__(
        self,
        context: DistContext,
        device: torch.device,
        logger: logging.Logger,
        metrics: Metrics,
        shape: RunShape,
    ) -> None:
        self.context, self.device, self.log, self.metrics = context, device, logger, metrics
        self.shape = shape
        self.pending: PendingProgress | None = None

    def gather(
        self,
        window: Window,
        *,
        step: int,
        epoch: int,
        total_steps: int,
        lr: float,
        grad_norm: torch.Tensor | None,
        proposal: int,
    ) -> None:
        """Send this rank's window, and rank 0's `proposal` (its snapshot interval) with it;
        the window starts over."""
        row = [*window.timings(), proposal]
        local = torch.cat(
            [window.loss_sum.double().reshape(1), torch.tensor(row, dtype=torch.float64).to(self.device)]
        )
        gathered = [torch.empty_like(local) for _ in range(self.context.world_size)]
        self.pending = PendingProgress(
            work=dist.all_gather(gathered, local, async_op=True),
            gathered=gathered,
            step=step,
            epoch=epoch,
            total_steps=total_steps,
            steps=window.steps,
            lr=lr,
            grad_norm=grad_norm,
        )
        window.reset()

    def read(self) -> int | None:
        """Wait for the gathered line, if one is on its way: rank 0 logs and exports it.
        Returns rank 0's proposal on every rank."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        wait_for_peers(pending.work)
        table = torch.stack(pending.gathered).cpu()
        if self.context.is_main:
            self._report(pending, table)
        else:
            self.metrics.progress({"epoch": pending.epoch})
        return int(table[0, -1])

    def _report(self, pending: PendingProgress, table: torch.Tensor) -> None:
        shape, world = self.shape, self.context.world_size
        mean_loss = float(table[:, 0].sum()) / world / pending.steps
        split = StepSplit.of(table[:, 1:-1])
        rate = shape.global_batch / split.step_seconds if split.step_seconds else 0.0
        eta = (pending.total_steps - pending.step) * split.step_seconds
        mfu = None
        if shape.flops_per_sample and shape.peak_flops:
            mfu = shape.flops_per_sample * rate / (shape.peak_flops * world)
        fields = {
            "epoch": pending.epoch,
            "epochs": shape.epochs,
            "step": pending.step,
            "total_steps": pending.total_steps,
            "loss": round(mean_loss, 6),
            "lr": pending.lr,
            "samples_per_second": round(rate, 1),
            "data_wait_share": round(split.data_share, 4),
            "eta_seconds": round(eta, 1),
            "mfu": None if mfu is None else round(mfu, 4),
            "peak_memory_mb": round(peak_memory_bytes(self.device) / 2**20, 1),
            **split.milliseconds(),
            "straggler_lag": round(split.straggler_lag, 4),
            "slowest_rank": split.slowest_rank,
        }
        event(
            self.log,
            "progress",
            f"epoch {pending.epoch}/{shape.epochs} step {pending.step}/{pending.total_steps} "
            f"loss {mean_loss:.4f} lr {pending.lr:.3e} {rate:,.0f} samples/s "
            f"data wait {100 * split.data_share:.1f}% eta {duration(eta)}",
            **fields,
        )
        self.metrics.progress(
            {
                "loss": mean_loss,
                "lr": pending.lr,
                "grad_norm": None if pending.grad_norm is None else float(pending.grad_norm),
                "epoch": pending.epoch,
                "step": pending.step,
                "total_steps": pending.total_steps,
                "eta_seconds": eta,
                "samples_per_second": rate,
                "mfu": mfu,
                "straggler_lag": split.straggler_lag,
                "slowest_rank": split.slowest_rank,
            }
        )
        append_history(shape.history_file, fields)


def append_history(path: str, record: dict) -> None:
    """One record of the run report's input (`metrics.history_file`, rank 0's), if it is kept."""
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps({**record, "time": time.time()}) + "\n")


def peak_memory_bytes(device: torch.device) -> int:
    """Most memory this rank has held: CUDA tensors on a GPU, the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def summary_line(summary: dict[str, Any]) -> str:
    """The run's last line: steps, time, validation and test metrics, the checkpoint."""

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.2f}%"

    def num(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    return (
        f"done: {plural(summary['steps'], 'step')}, {plural(summary['epochs_completed'], 'epoch')} in "
        f"{duration(summary['wall_seconds'])}; val loss {num(summary['val_loss'])} "
        f"accuracy {pct(summary['val_accuracy'])}; test loss {num(summary['test_loss'])} "
        f"accuracy {pct(summary['test_accuracy'])}; checkpoint {summary['checkpoint']}"
    )


def progress_bar(context: DistContext, total_steps: int, step: int) -> tqdm:
    """A step bar on rank 0's terminal; off elsewhere (a pod's log, other ranks)."""
    return tqdm(
        total=total_steps,
        initial=step,
        file=sys.stdout,
        disable=not (context.is_main and sys.stdout.isatty()),
        unit="step",
        dynamic_ncols=True,
    )


@contextlib.contextmanager
def logs_above_the_bar(bar: tqdm, logger: logging.Logger) -> Iterator[None]:
    """While a terminal shows the bar, log lines go above it (tqdm's redirect). Elsewhere (a
    pod's log, a pipe) the handlers stay as they are: tqdm writes a line's text and its
    newline in two writes, which the other writers of a shared, unbuffered stdout
    (PYTHONUNBUFFERED, as the image sets) can split; ours make one (trainer/lines.py)."""
    if bar.disable:
        yield
        return
    with logging_redirect_tqdm(loggers=[logger]):
        yield
