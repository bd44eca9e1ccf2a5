"""What the scaling benchmark measures, per workload: the rates at each process count, the
link's latency and bandwidth, and the step split; read by its report and by its plots."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from benchmarks.runner import SPLIT_FIELDS
from operator_scripts.reports.estimate import Interconnect, ring_allreduce_seconds

LINK_FIELDS = ("latency", "bandwidth", "step_seconds")


@dataclass(frozen=True)
class Link:
    """gloo on this machine: per-hop latency (1 KiB), bandwidth (64 MiB), and one step's
    all-reduce time for a given gradient size in DDP's buckets."""

    latency: float
    bandwidth: float
    step_seconds: float

    def ring(self, gradient_bytes: float, devices: int = 2) -> float:
        """The ring model's all-reduce time from the fitted latency and bandwidth."""
        return ring_allreduce_seconds(
            gradient_bytes, devices, Interconnect("gloo", self.bandwidth, self.latency)
        )


@dataclass
class Scaling:
    """One workload's measurements at each process count."""

    name: str
    parameters: int = 0
    per_rank_batch: int = 0
    ours: dict[int, list[float]] = field(default_factory=dict)
    bare: dict[int, list[float]] = field(default_factory=dict)
    beside_neighbour: list[float] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    split_ms: dict[int, list[dict[str, float]]] = field(default_factory=dict)

    def rate(self, runner: str, nproc: int) -> float:
        return statistics.median(getattr(self, runner)[nproc])

    def speedup(self, runner: str) -> float:
        return self.rate(runner, 2) / self.rate(runner, 1)

    def link(self) -> Link:
        """Medians over the rounds' link measurements."""
        return Link(*(statistics.median(getattr(link, name) for link in self.links) for name in LINK_FIELDS))

    def split(self, nproc: int) -> dict[str, float]:
        """Median of each part over the repeats."""
        return {name: statistics.median(run[name] for run in self.split_ms[nproc]) for name in SPLIT_FIELDS}
