"""The checkpoint figures a node exports: filled by its checkpoint writer, read by the metrics
exporter, so that neither package needs the other's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointStats:
    """What the metrics exporter reports about checkpoints and snapshots."""

    saves_total: int = 0
    failures_total: int = 0
    skipped_total: int = 0  # saves not made: the writer had not taken the state before
    coalesced_total: int = 0  # durable writes replaced by a newer one before they began
    writer_replacements_total: int = 0
    wait_seconds_total: float = 0.0  # training's time waiting for the writer to take a state
    last_success_step: int | None = None
    last_success_timestamp: float | None = None
    last_bytes: int = 0
    last_write_seconds: float = 0.0
    last_stall_seconds: float = 0.0
    snapshots_total: int = 0
    snapshot_failures_total: int = 0
    last_snapshot_step: int | None = None
    last_snapshot_bytes: int = 0
    last_snapshot_seconds: float = 0.0
