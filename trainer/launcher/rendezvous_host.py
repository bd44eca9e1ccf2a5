"""The rendezvous host as a pod that is not it sees it: its name, which resolves only while
its pod is Ready (common/service.go:229-244 in training-operator v1.9.4), and its store, which
a frozen or cut-off node holds without answering.

A call to a store whose process is stopped never returns: TCPStore's client sets no timeout
on a reply, neither in its constructor's handshake nor in `get` or `compare_set` (measured
with torch 2.13 against a SIGSTOPped server; docs/facts.md, "Losing a node"). So torchrun's
agent, which asks that store in its rendezvous, waits for good once the host freezes, and so
would a probe run in the waiting thread: the probe here runs in a thread of its own."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

PROBE_S = 3.0  # a live store answers a check in milliseconds, on a loaded node in well under 1 s
PROBE_KEY = "ddp-launch/probe"


def torchrun_option(args: Sequence[str], names: Sequence[str]) -> str | None:
    """A torchrun option's value from its command line (`--x v` or `--x=v`, dashes or underscores)."""
    wanted = {name.replace("_", "-") for name in names}
    for index, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if key.replace("_", "-") in wanted:
            return value or (args[index + 1] if index + 1 < len(args) else None)
    return None


def store_address(torchrun_args: Sequence[str], env: dict[str, str]) -> tuple[str, str] | None:
    """Where torchrun's rendezvous store listens: the c10d endpoint in elastic mode, the
    Master's address in static mode; None for a standalone run. torchrun reads `--foo` from
    PET_FOO; the command line wins."""
    if "--standalone" in torchrun_args or env.get("PET_STANDALONE") is not None:
        return None
    endpoint = torchrun_option(torchrun_args, ["--rdzv-endpoint"]) or env.get("PET_RDZV_ENDPOINT")
    if endpoint:
        host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "29400")
        return host, port
    master = torchrun_option(torchrun_args, ["--master-addr"]) or env.get("PET_MASTER_ADDR")
    if master:
        port = torchrun_option(torchrun_args, ["--master-port"]) or env.get("PET_MASTER_PORT", "29500")
        return master, port
    return None


def rendezvous_host(torchrun_args: Sequence[str], env: dict[str, str]) -> tuple[str, str] | None:
    """The host (and port) this pod must reach before torchrun can start; None when this
    pod is that host (in static mode: node rank 0) or the run is standalone."""
    address = store_address(torchrun_args, env)
    if address is None or is_this_host(address[0]):
        return None
    elastic = torchrun_option(torchrun_args, ["--rdzv-endpoint"]) or env.get("PET_RDZV_ENDPOINT")
    node_rank = torchrun_option(torchrun_args, ["--node-rank"]) or env.get("PET_NODE_RANK", "0")
    return address if elastic or node_rank != "0" else None


def is_this_host(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn())


def resolves(host: str, port: str) -> bool:
    try:
        socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return True


@dataclass
class StoreProbe:
    """Whether the store at host:port answers a check within `within_s`. A probe still
    blocked (its host frozen) is not started again: it answers for the next look too, so
    that a long freeze holds one thread, which ends once the host thaws or is gone."""

    host: str
    port: str
    within_s: float = PROBE_S
    pending: threading.Thread | None = None
    answered: list[bool] = field(default_factory=list)

    def answers(self) -> bool:
        if self.pending is None or not self.pending.is_alive():
            self.answered = []
            self.pending = threading.Thread(target=self._ask, args=(self.answered,), daemon=True)
            self.pending.start()
        self.pending.join(self.within_s)
        return bool(self.answered) and self.answered[0]

    def _ask(self, answered: list[bool]) -> None:
        import torch.distributed as dist

        try:
            store = dist.TCPStore(
                self.host, int(self.port), is_master=False, timeout=timedelta(seconds=self.within_s),
                wait_for_workers=False,
            )  # fmt: skip
            store.check([PROBE_KEY])
        except (RuntimeError, OSError, ValueError):  # refused, reset, or no answer to the connect
            answered.append(False)
            return
        answered.append(True)


def wait_for_host(
    host: str, port: str, timeout: float, say: Callable[[str], None], store_lost: bool = False
) -> bool:
    """Block until `host` resolves and, after its store was found lost, until that store
    answers; one line if it does not at once, one when it does. False on timeout. A signal
    meanwhile ends the process (ddp-launch's handlers), as nothing runs yet."""
    deadline = time.monotonic() + timeout
    probe = StoreProbe(host, port) if store_lost else None
    announced = False
    while True:
        named = resolves(host, port)
        if named and (probe is None or probe.answers()):
            if announced:
                say(f"rendezvous host {host} {'answers' if probe else 'resolves'}; starting torchrun")
            return True
        if not announced:
            why = (
                "its store does not answer (its node frozen or cut off); it answers once the node is "
                "back or its pod is re-created"
                if named
                else "its name resolves once its pod runs (an image pull, a node scale-up, a pod re-created)"
            )
            say(f"waiting for the rendezvous host {host}:{port}: {why}, up to {timeout:.0f}s")
            announced = True
        if time.monotonic() >= deadline:
            return False
        time.sleep(1.0)
