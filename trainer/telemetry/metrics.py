"""Prometheus metrics from every rank, one scrape port per pod.

Each rank writes its series through prometheus-client's multiprocess mode into a folder
per restart attempt; local rank 0 serves them all on `metrics.port`. Every series carries
`rank`, `local_rank` and `node_rank`. The loop hands over per-step timings cheaply; they
reach the shared files in batches (at each progress log, or after a second), so metrics
cost the loop next to nothing.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config import MetricsConfig
from trainer.distributed.process_group import DistContext
from trainer.telemetry.checkpoint_stats import CheckpointStats
from trainer.telemetry.log import event
from trainer.telemetry.timing import PARTS, StepSeconds

RANK_LABELS = ("rank", "local_rank", "node_rank")
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
FLUSH_SECONDS = 1.0
# a counter per part of the step (trainer/timing.py), device time on CUDA
PART_COUNTERS = {
    "data": ("ddp_train_data_wait_seconds_total", "Time this rank's steps waited for batches."),
    "compute": (
        "ddp_train_compute_seconds_total",
        "Time this rank spent computing (forward, backward, optimizer), less its wait for gradients.",
    ),
    "communication": (
        "ddp_train_communication_seconds_total",
        "Time this rank waited for the gradient all-reduce after its own backward, peers included.",
    ),
    "checkpoint": (
        "ddp_train_checkpoint_seconds_total",
        "Time training paused for checkpoints and snapshots.",
    ),
    "logging": (
        "ddp_train_logging_seconds_total",
        "Loop bookkeeping between steps: progress gathering, metrics, stop checks.",
    ),
}
# bf16 dense (not sparse) peak FLOP/s per device from NVIDIA's data sheets (docs/facts.md),
# by the whole name `torch.cuda.get_device_name` gives: the H100's three forms differ by a
# quarter, and a substring would take an A10G for an A10 or an L40S for an L4
PEAK_FLOPS = {
    r"NVIDIA H100 80GB HBM3|NVIDIA H100 SXM5.*": 989e12,
    r"NVIDIA H100 NVL": 835e12,
    r"NVIDIA H100 PCIe": 756e12,
    r"NVIDIA H200": 989e12,
    r"NVIDIA H200 NVL": 835e12,
    r"NVIDIA GH200.*": 989e12,
    r"NVIDIA B200": 2250e12,
    r"NVIDIA A100[- ].*": 312e12,
    r"NVIDIA L40S": 362e12,
    r"NVIDIA A10": 125e12,
    r"NVIDIA L4": 121e12,
}


def peak_flops(config: MetricsConfig, device_name: str) -> float:
    """Configured peak, else the table's entry for this device, else 0 (MFU unknown: set
    `metrics.peak_flops_per_device`)."""
    if config.peak_flops_per_device:
        return config.peak_flops_per_device
    return next((flops for name, flops in PEAK_FLOPS.items() if re.fullmatch(name, device_name)), 0.0)


@dataclass
class StepBatch:
    """Per-step figures gathered between flushes."""

    steps: int = 0
    samples: int = 0
    tokens: int = 0
    part_seconds: list[float] = field(default_factory=lambda: [0.0] * len(PARTS))
    step_seconds: list[float] = field(default_factory=list)


class Metrics:
    """The no-op recorder (metrics.port=0): the loop calls the same methods either way."""

    def step(self, seconds: StepSeconds, *, samples: int, tokens: int) -> None:
        """One optimizer step on this rank: its seconds in each part (`timing.PARTS`)."""

    def progress(self, values: dict[str, float | None]) -> None:
        """Gauges that change at progress logs (loss, lr, throughput, MFU, stragglers)."""

    def validation(self, loss: float, accuracy: float) -> None:
        """The latest validation metrics."""

    def checkpoints(self, stats: CheckpointStats, step: int) -> None:
        """This node's checkpoint writer figures (durable ones on rank 0 only) at `step`."""

    def startup(self, parts: list[tuple[str, float]]) -> None:
        """Where this process's start went, phase by phase (`trainer.telemetry.startup`)."""

    def flush(self) -> None:
        """Push buffered step figures to the shared files."""

    def close(self) -> None:
        """Stop serving and mark this process dead for live gauges."""


class PrometheusMetrics(Metrics):
    """The real recorder; create it through `start_metrics`."""

    def __init__(self, context: DistContext, run_info: dict[str, str], device: Any) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        labels = {
            "rank": str(context.rank),
            "local_rank": str(context.local_rank),
            "node_rank": str(context.node_rank),
        }
        self._device = device
        self._batch = StepBatch()
        self._flushed_at = time.monotonic()
        self._lock = threading.Lock()
        self._checkpoint_seen: dict[str, float] = {}

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, RANK_LABELS).labels(**labels)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            metric = Gauge(name, doc, RANK_LABELS + extra, multiprocess_mode="livemostrecent")
            return metric if extra else metric.labels(**labels)

        self.samples = counter("ddp_train_samples_total", "Samples this rank has trained on.")
        self.tokens = counter("ddp_train_tokens_total", "Tokens this rank has trained on.")
        self.steps = counter("ddp_train_steps_total", "Optimizer steps this rank has taken.")
        self.part_counters = [counter(*PART_COUNTERS[part]) for part in PARTS]
        self.step_seconds = Histogram(
            "ddp_train_step_seconds",
            "Time of one optimizer step, with the bookkeeping and checkpoint pause before it.",
            RANK_LABELS,
            buckets=STEP_BUCKETS,
        ).labels(**labels)
        self.gauges = {
            "loss": gauge("ddp_train_loss", "Mean training loss over ranks since the last log."),
            "lr": gauge("ddp_train_learning_rate", "Current learning rate."),
            "grad_norm": gauge("ddp_train_grad_norm", "Gradient norm before clipping."),
            "epoch": gauge("ddp_train_epoch", "Current epoch (1-based)."),
            "step": gauge("ddp_train_step", "The run's optimizer steps at rank 0's last progress line."),
            "total_steps": gauge("ddp_train_total_steps", "The run's planned optimizer steps."),
            "eta_seconds": gauge(
                "ddp_train_eta_seconds", "Rank 0's estimate of the time left, from the last progress line."
            ),
            "global_batch": gauge(
                "ddp_train_global_batch_size", "Samples per optimizer step over all ranks."
            ),
            "world_size": gauge("ddp_world_size", "Number of ranks."),
            "restart_count": gauge("ddp_elastic_restarts", "torchrun restarts of this node's workers."),
            "samples_per_second": gauge(
                "ddp_train_global_samples_per_second", "Global samples/s as rank 0 measures it."
            ),
            "mfu": gauge("ddp_train_mfu_ratio", "Model FLOPs utilisation: achieved / peak dense FLOP/s."),
            "peak_flops": gauge("ddp_device_peak_flops", "Peak dense FLOP/s of one device used for MFU."),
            "straggler_lag": gauge(
                "ddp_train_straggler_lag_ratio", "Slowest rank's busy time over the median rank's, minus 1."
            ),
            "slowest_rank": gauge(
                "ddp_train_slowest_rank", "The rank with the most busy time last interval."
            ),
            "val_loss": gauge("ddp_val_loss", "Latest validation loss."),
            "val_accuracy": gauge("ddp_val_accuracy", "Latest validation accuracy (0-1)."),
            "memory_allocated": gauge("ddp_cuda_memory_allocated_bytes", "CUDA memory held by tensors."),
            "memory_reserved": gauge(
                "ddp_cuda_memory_reserved_bytes", "CUDA memory reserved by the allocator."
            ),
            "memory_peak": gauge("ddp_cuda_memory_peak_bytes", "Peak CUDA memory held by tensors."),
            "checkpoint_timestamp": gauge(
                "ddp_checkpoint_last_success_timestamp_seconds", "When the newest checkpoint was committed."
            ),
            "checkpoint_step": gauge("ddp_checkpoint_last_success_step", "Step of the newest checkpoint."),
            "checkpoint_every_steps": gauge(
                "ddp_checkpoint_every_steps", "Configured steps between checkpoints."
            ),
            "checkpoint_bytes": gauge("ddp_checkpoint_bytes", "Size of the newest checkpoint."),
            "checkpoint_write": gauge(
                "ddp_checkpoint_write_seconds", "Serialize, upload and commit time of the newest checkpoint."
            ),
            "checkpoint_stall": gauge(
                "ddp_checkpoint_stall_seconds", "Time training paused for the newest checkpoint's snapshot."
            ),
            "snapshot_step": gauge("ddp_snapshot_last_step", "Step of this node's newest local snapshot."),
            "snapshot_every_steps": gauge("ddp_snapshot_every_steps", "Steps between node-local snapshots."),
            "snapshot_bytes": gauge("ddp_snapshot_bytes", "Size of this node's newest local snapshot."),
            "snapshot_write": gauge(
                "ddp_snapshot_write_seconds", "Time the writer took for the newest local snapshot."
            ),
            "recovery_lost_steps": gauge(
                "ddp_recovery_lost_steps",
                "Steps completed before the last restart that the resume point did not hold (redone).",
            ),
            "epoch_restarted_after": gauge(
                "ddp_resume_epoch_restarted_after_samples",
                "Samples of the interrupted epoch trained on before its data changed; the epoch "
                "started again from its beginning (data.on_change=restart_epoch).",
            ),
        }
        # CheckpointStats field -> the counter that exports its growth
        self.checkpoint_counters = {
            "saves_total": counter("ddp_checkpoint_saves_total", "Checkpoints committed."),
            "failures_total": counter("ddp_checkpoint_failures_total", "Checkpoints given up on."),
            "skipped_total": counter(
                "ddp_checkpoint_skipped_total",
                "Saves skipped: the writer had not taken the state before within checkpoint.save_wait_s.",
            ),
            "coalesced_total": counter(
                "ddp_checkpoint_coalesced_total",
                "Durable writes replaced by a newer one while an upload ran (latest wins).",
            ),
            "writer_replacements_total": counter(
                "ddp_checkpoint_writer_replacements_total", "Checkpoint writers found stuck and replaced."
            ),
            "wait_seconds_total": counter(
                "ddp_checkpoint_wait_seconds_total",
                "Time saves waited for the writer to take the state before.",
            ),
        }
        self.startup_seconds = gauge(
            "ddp_startup_seconds",
            "Seconds of each phase of this rank's start, from the container's to the first step's end.",
            ("phase",),
        )
        self._labels = labels
        self.durable_lag = gauge(
            "ddp_checkpoint_durable_lag_steps", "Steps trained since the newest step the store holds."
        )
        info = gauge("ddp_run_info", "The run's identity; the value is always 1.", tuple(sorted(run_info)))
        info.labels(**labels, **run_info).set(1)

    def step(self, seconds: StepSeconds, *, samples: int, tokens: int) -> None:
        batch = self._batch
        batch.steps += 1
        batch.samples += samples
        batch.tokens += tokens
        for part, spent in enumerate(seconds):
            batch.part_seconds[part] += spent
        batch.step_seconds.append(sum(seconds))
        if time.monotonic() - self._flushed_at >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            batch, self._batch = self._batch, StepBatch()
            self._flushed_at = time.monotonic()
        if batch.steps:
            self.steps.inc(batch.steps)
            self.samples.inc(batch.samples)
            self.tokens.inc(batch.tokens)
            for counter, spent in zip(self.part_counters, batch.part_seconds, strict=True):
                counter.inc(spent)
            for seconds in batch.step_seconds:
                self.step_seconds.observe(seconds)
        if self._device.type == "cuda":
            import torch

            self.gauges["memory_allocated"].set(torch.cuda.memory_allocated(self._device))
            self.gauges["memory_reserved"].set(torch.cuda.memory_reserved(self._device))
            self.gauges["memory_peak"].set(torch.cuda.max_memory_allocated(self._device))

    def progress(self, values: dict[str, float | None]) -> None:
        for name, value in values.items():
            if value is not None:
                self.gauges[name].set(value)
        self.flush()

    def startup(self, parts: list[tuple[str, float]]) -> None:
        for phase, seconds in parts:
            self.startup_seconds.labels(**self._labels, phase=phase).set(seconds)

    def validation(self, loss: float, accuracy: float) -> None:
        self.gauges["val_loss"].set(loss)
        self.gauges["val_accuracy"].set(accuracy)

    def checkpoints(self, stats: CheckpointStats, step: int) -> None:
        for field_name, counter in self.checkpoint_counters.items():
            total = getattr(stats, field_name)
            counter.inc(total - self._checkpoint_seen.get(field_name, 0))
            self._checkpoint_seen[field_name] = total
        self.durable_lag.set(step - (stats.last_success_step or 0))
        if stats.last_success_timestamp is not None:
            self.gauges["checkpoint_timestamp"].set(stats.last_success_timestamp)
            self.gauges["checkpoint_step"].set(stats.last_success_step)
            self.gauges["checkpoint_bytes"].set(stats.last_bytes)
            self.gauges["checkpoint_write"].set(stats.last_write_seconds)
            self.gauges["checkpoint_stall"].set(stats.last_stall_seconds)
        if stats.last_snapshot_step is not None:
            self.gauges["snapshot_step"].set(stats.last_snapshot_step)
            self.gauges["snapshot_bytes"].set(stats.last_snapshot_bytes)
            self.gauges["snapshot_write"].set(stats.last_snapshot_seconds)

    def close(self) -> None:
        self.flush()


def attempt_dir(config: MetricsConfig, context: DistContext) -> Path:
    """`<base>/<run id>/attempt-<restart count>`: a restarted round starts from clean files."""
    base = (
        Path(config.multiproc_dir)
        if config.multiproc_dir
        else Path(tempfile.gettempdir()) / "ddp-trainer-metrics"
    )
    return base / context.run_id / f"attempt-{context.restart_count}"


def prepare_multiprocess_dir(config: MetricsConfig, context: DistContext) -> Path | None:
    """Point prometheus-client at this attempt's folder; must run before it is imported.
    Local rank 0 removes earlier attempts' folders."""
    if config.port == 0:
        return None
    folder = attempt_dir(config, context)
    folder.mkdir(parents=True, exist_ok=True)
    if context.is_node_main:
        for stale in folder.parent.glob("attempt-*"):
            if stale != folder:
                shutil.rmtree(stale, ignore_errors=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
    return folder


def start_metrics(
    config: MetricsConfig, context: DistContext, run_info: dict[str, str], device: Any, logger: Any
) -> Metrics:
    """The recorder for this rank; local rank 0 also serves the pod's scrape endpoint."""
    if config.port == 0:
        return Metrics()
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    metrics = PrometheusMetrics(context, run_info, device)
    atexit.register(multiprocess.mark_process_dead, os.getpid())
    if context.is_node_main:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        try:
            server, _ = start_http_server(config.port, addr=config.address, registry=registry)
        except OSError as error:
            logger.warning(
                "metrics not served: cannot listen on %s:%d (%s)", config.address, config.port, error
            )
        else:
            atexit.register(server.shutdown)
            url = f"http://{config.address}:{config.port}/metrics"
            event(logger, "metrics", f"metrics on {url}", url=url)
    return metrics
