"""What the nodes' watchers say to each other through the job's store: two round trips per
node per poll, whatever the number of nodes.

One store (the TCPStore at MASTER_ADDR:MASTER_PORT, served from global rank 0's process on
node 0) answers every node. If each node read every other node's key, the store would serve
N(2N-1) round trips a second (2,096,128 at 1,024 nodes) and one node's poll would take 2N-1
in a row. Instead node 0's watcher is the collector:

- every other node `publish`es its progress under its own key and reads the collector's
  `Verdict` (`read_verdict`): 2 round trips;
- the collector reads every node's key at once (`collect`, one `multi_get`) and `announce`s a
  verdict: its own progress (so that the others can tell it is alive) and the node it found
  lost, if any: 2 round trips, and the only reader of N keys. The store moves O(N) bytes a
  poll, not O(N^2).

A lost node is judged on one clock, the collector's; every survivor then names the same node.
A survivor that reads a loss `acknowledge`s it, and the collector waits (a bounded while)
for those before it leaves: its process hosts the store, which goes with it.

`multi_get` and `get` wait for a key that is not there yet, so neither reads a key before it
exists: the collector writes an empty placeholder under each node's key once (`prepare`,
with `compare_set`, which writes only where the key is missing), and a verdict is read with
`compare_set(key, "", "")`, which returns the value, or writes and returns empty where there
is none (docs/facts.md, "The rendezvous store").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Protocol

KEY_PREFIX = "ddp-node-progress/"
VERDICT_KEY = f"{KEY_PREFIX}verdict"
ACK_KEY = f"{KEY_PREFIX}acknowledged"
COLLECTOR = 0  # node 0: its first rank hosts the store, so the collector's reads never leave it


class Store(Protocol):
    """The calls of torch.distributed.Store this protocol makes, one round trip each."""

    def set(self, key: str, value: bytes | str) -> None: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...


@dataclass(frozen=True)
class Progress:
    """What one node publishes: where its first rank stands."""

    node: int
    host: str
    step: int
    phase: str
    phase_s: float  # how long it has been in `phase`
    limit_s: float  # how long that phase may take
    seq: int

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Progress:
        return cls(**json.loads(raw))


@dataclass(frozen=True)
class Lost:
    """A node the collector found silent: who, for how long against its limit, and where it
    was when last heard."""

    node: int
    host: str
    silent_s: float
    limit_s: float
    last: Progress | None


@dataclass(frozen=True)
class Verdict:
    """What the collector announces every poll."""

    collector: Progress
    lost: Lost | None = None

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Verdict:
        fields = json.loads(raw)
        lost = fields["lost"]
        if lost is not None:
            last = lost["last"]
            lost = Lost(**{**lost, "last": last and Progress(**last)})
        return cls(Progress(**fields["collector"]), lost)


def node_key(node: int) -> str:
    return f"{KEY_PREFIX}{node}"


class Exchange:
    """One node's side of the protocol, over a store client of its own."""

    def __init__(self, store: Store, node: int, num_nodes: int) -> None:
        self.store, self.node, self.num_nodes = store, node, num_nodes
        self.peers = [node_key(peer) for peer in range(num_nodes) if peer != node]

    @property
    def is_collector(self) -> bool:
        return self.node == COLLECTOR

    def prepare(self) -> None:
        """The collector's, once: a placeholder under each node's key not yet written, so
        that `collect` never waits for a node that has not published."""
        for key in self.peers:
            self.store.compare_set(key, b"", b"")

    def collect(self) -> list[Progress]:
        """The collector's poll: every other node's newest progress (none yet: left out)."""
        return [Progress.decode(raw) for raw in self.store.multi_get(self.peers) if raw]

    def announce(self, verdict: Verdict) -> None:
        self.store.set(VERDICT_KEY, verdict.encode())

    def publish(self, mine: Progress) -> None:
        self.store.set(node_key(self.node), mine.encode())

    def read_verdict(self) -> Verdict | None:
        """The collector's newest verdict, or None before its first."""
        raw = self.store.compare_set(VERDICT_KEY, b"", b"")
        return Verdict.decode(raw) if raw else None

    def acknowledge(self) -> None:
        """This node read the loss: the collector need not wait for it."""
        self.store.add(ACK_KEY, 1)

    def acknowledged(self) -> int:
        return self.store.add(ACK_KEY, 0)
