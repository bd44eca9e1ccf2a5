"""Judging the other nodes on this node's own clock: when a peer's silence makes it lost,
and what the line that names it says. No threads and no store here (`node_watch` runs them),
so that every rule is testable with made-up times."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trainer.config import WatchdogConfig
from trainer.distributed.elastic_bounds import describe
from trainer.distributed.heartbeat import DONE
from trainer.distributed.node_exchange import COLLECTOR, Lost, Progress


@dataclass
class Seen:
    """A peer as this node's watcher last saw it, on this node's clock."""

    progress: Progress
    changed_at: float
    longest_gap_s: float = 0.0
    moved: bool = False  # its sequence number changed since the first read: it publishes in this round


@dataclass
class NodeLimits:
    """How long a node may stay silent: derived from its publishes' gaps, or fixed."""

    config: WatchdogConfig

    def limit(self, longest_gap_s: float) -> float:
        if self.config.node_timeout_s != "auto":
            return float(self.config.node_timeout_s)
        return max(self.config.node_floor_s, self.config.node_multiple * longest_gap_s)


@dataclass
class NodeWatch:
    """One node's view of the others, on its own clock (testable without threads or stores):
    `observe` each progress read, `report` each verdict's loss, `answered` each exchange the
    store completed, `lost` to judge. The collector watches every other node; the others
    watch the collector, whose verdicts carry its progress."""

    node: int
    num_nodes: int
    limits: NodeLimits
    seen: dict[int, Seen] = field(default_factory=dict)
    started_at: float = 0.0
    answered_at: float = 0.0  # the store's last completed exchange
    reported: Lost | None = None  # the collector's verdict: a node it found lost

    @property
    def watched(self) -> list[int]:
        if self.node == COLLECTOR:
            return [node for node in range(self.num_nodes) if node != COLLECTOR]
        return [COLLECTOR]

    def observe(self, progress: Progress, now: float) -> None:
        """A peer's progress as read now: its clock restarts when its sequence number moves."""
        before = self.seen.get(progress.node)
        if before is None:
            self.seen[progress.node] = Seen(progress, now)
        elif progress.seq != before.progress.seq:
            gap = now - before.changed_at
            before.longest_gap_s = max(before.longest_gap_s, gap)
            before.progress, before.changed_at, before.moved = progress, now, True

    def report(self, lost: Lost) -> bool:
        """The collector's verdict names a lost node: taken once the collector was seen to
        publish in this round (a store shared across rounds keeps an old round's verdict,
        which never moves), and said whether it was taken."""
        collector = self.seen.get(COLLECTOR)
        if collector is None or not collector.moved:
            return False
        self.reported = lost
        return True

    def lost(self, now: float) -> Loss | None:
        """The lost peer, or None while all answer. While the store does not answer, no
        peer can be heard: then only the store's host (node 0) can be found lost."""
        if now - self.answered_at > self.limits.limit(0.0) / 2:  # an exchange takes one poll
            silent, limit = now - self.answered_at, self.limits.limit(0.0)
            if silent <= limit:
                return None
            last = self.seen.get(COLLECTOR)
            store = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            return Loss(
                COLLECTOR, f"the rendezvous host (store {store})", silent, limit, last and last.progress, True
            )
        if self.reported is not None:
            return Loss.of(self.reported)
        for node in self.watched:
            seen = self.seen.get(node)
            since = seen.changed_at if seen is not None else self.started_at
            limit = self.limits.limit(seen.longest_gap_s if seen is not None else 0.0)
            if now - since > limit and not (seen and seen.progress.phase == DONE):
                last = seen and seen.progress
                return Loss(node, last.host if last else "?", now - since, limit, last)
        return None


@dataclass(frozen=True)
class Loss:
    """A node found lost: who, for how long, and where it was when last heard."""

    node: int
    host: str
    silent_s: float
    limit_s: float
    last: Progress | None
    store_host: bool = False  # the store stopped answering: its host is the one lost

    @classmethod
    def of(cls, lost: Lost) -> Loss:
        return cls(lost.node, lost.host, lost.silent_s, lost.limit_s, lost.last)

    def announced(self) -> Lost:
        """What the collector's verdict says of it."""
        return Lost(self.node, self.host, self.silent_s, self.limit_s, self.last)

    def describe(self) -> str:
        last = self.last
        where = f"after step {last.step} in {last.phase}" if last else "before its first publish"
        return (
            f"node {self.node} ({self.host}) has been silent for {self.silent_s:.1f}s "
            f"(limit {self.limit_s:.1f}s) {where}: it is lost"
        )

    def fields(self) -> dict[str, object]:
        return {
            "node": self.node,
            "host": self.host,
            "silent_s": round(self.silent_s, 2),
            "limit_s": round(self.limit_s, 2),
            "step": self.last.step if self.last else None,
            "phase": self.last.phase if self.last else None,
        }


def going_on(loss: Loss, num_nodes: int, bounds: tuple[int, int] | None, me: str) -> tuple[bool, str]:
    """Whether the survivors can train without the lost node, and what this node does: the
    words that end the lost line."""
    if loss.store_host:
        return False, (
            f"{me} leaves the group; torchrun cannot rendezvous without the store's host, so "
            "ddp-launch stops torchrun and starts it again once that store answers (its node back, "
            "or its pod re-created)"
        )
    if bounds is not None and num_nodes - 1 < bounds[0]:
        left = num_nodes - 1
        return False, (
            f"the job's bounds ({describe(bounds)}) do not allow training on {left} node{'s' * (left != 1)}: "
            f"{me} leaves the group and waits in torchrun's rendezvous until the node is back or replaced"
        )
    return True, (
        f"{me} leaves the group so that torchrun re-rendezvouses without it and resumes from the newest "
        "snapshot"
    )
