"""Network namespaces for the harnesses: a process that is a host of its own, and hosts
joined by links that can be cut (`linked_hosts`).

A process in a network namespace of its own has its own loopback, ports and abstract Unix
sockets (unix(7): the abstract namespace is per network namespace). The test suite gives each
xdist worker one, so two `ddp-ops local` runs, each a set of pods on 127.0.0.x with a
rendezvous store listening on every address, run side by side as on two hosts.

Such a host reaches no DNS server, and glibc's getnameinfo then fails with EAI_AGAIN instead of
falling back to the numeric address, which c10d prints on every accepted connection ("The
hostname of the client socket cannot be retrieved. err=-3"). So the namespace also gets a
mount namespace of its own where /etc/nsswitch.conf resolves host names from /etc/hosts
alone, as an air-gapped host would.

Needs root (CAP_SYS_ADMIN); `isolation_available` says whether this machine allows it. A
namespace made by `unshare` has no name and nothing to remove: the kernel frees it with the
last process in it, and a private mount namespace's mounts never reach the host's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import functools
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from operator_scripts.local.runtimes.sandbox import bind_mount

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000  # linux/sched.h
MS_REC, MS_PRIVATE = 0x4000, 0x40000  # linux/mount.h
NSSWITCH = Path("/etc/nsswitch.conf")
SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8913, 0x8914  # linux/sockios.h
IFF_UP = 0x1  # linux/if.h
IFREQ = struct.Struct("16sH22x")  # struct ifreq: the name, then ifr_flags in a 24-byte union
T = TypeVar("T")


@functools.cache
def isolation_available() -> bool:
    """Whether this process may give a child a network namespace of its own (root, and a
    kernel and container that allow it): tried once, with util-linux's `unshare`."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--net", "--mount", "true"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def enter_private_network(workdir: Path) -> None:
    """Move the calling thread (and every process and thread it starts after) into a new
    network namespace whose loopback is up, as a fresh host's is (127.0.0.0/8 and ::1 come
    with it: the kernel adds them when `lo` goes up), and whose host names come from
    /etc/hosts only. WORKDIR must outlive the namespace: it holds the nsswitch.conf bound over
    the host's (mounting over a mount whose file is gone fails with ENOENT, and the pods of
    `ddp-ops local` mount their own over it)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    _check(libc, libc.unshare(CLONE_NEWNET | CLONE_NEWNS), "unshare(CLONE_NEWNET|CLONE_NEWNS)")
    # private first: a bind mount in a mount namespace that shares propagation with the
    # host's would appear on the host too
    _check(libc, libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount / private")
    if NSSWITCH.exists():  # musl and friends have no NSS: nothing to bind over
        copy = workdir / NSSWITCH.name
        text, found = re.subn(r"(?m)^hosts:.*$", "hosts: files", NSSWITCH.read_text())
        copy.write_text(text if found else text + "hosts: files\n")
        bind_mount(str(copy), str(NSSWITCH))
    set_link_up("lo")


def on_a_host_of_its_own(workdir: Path, body: Callable[[], T]) -> T:
    """`body()` on a thread of its own that is a host of its own (`enter_private_network`)
    where root allows it, else on that thread as it is; its result, or its exception raised
    here. What the thread starts (threads, processes, a TCPStore's server) is on that host
    too. Many TCPStore connections at once need it here: both ends of each connection look
    up the other's address (a v4-mapped one, which /etc/hosts does not hold) in DNS, and this
    machine's DNS server drops a burst of them: 24 connections, then a 5 s stall each."""
    outcome: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            if isolation_available():
                enter_private_network(workdir)
            outcome.append((True, body()))
        except BaseException as error:  # handed to the caller's thread
            outcome.append((False, error))

    thread = threading.Thread(target=run, name="own-host")
    thread.start()
    thread.join()
    done, value = outcome[0]
    if not done:
        raise value
    return value


def _check(libc: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def set_link_up(name: str) -> None:
    """Bring a link of this namespace up (what `ip link set NAME up` does), without iproute2."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as control:
        request = IFREQ.pack(name.encode(), 0)
        flags = IFREQ.unpack(fcntl.ioctl(control, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(control, SIOCSIFFLAGS, IFREQ.pack(name.encode(), flags | IFF_UP))


@dataclass
class Network:
    """Hosts in network namespaces of their own, each linked by a veth pair to one switch (a
    bridge in a namespace of its own), as nodes on one rack: `cut` unplugs a host's cable at
    the switch, so that its packets are lost (no error, no reset: a real partition's
    retransmits and timeouts), and `heal` plugs it back. Made by `linked_hosts`, which
    removes every namespace, and with them every link and address, pass or fail."""

    names: list[str]
    switch: str
    addresses: list[str]
    delayers: dict[int, subprocess.Popen] = field(default_factory=dict)

    def prefix(self, host: int) -> list[str]:
        """The command prefix that runs a program on `host`. Gloo binds the address of the
        host's name unless told an interface, and the name resolves to 127.0.0.1 here."""
        return ["ip", "netns", "exec", self.names[host], "env", "GLOO_SOCKET_IFNAME=eth0"]

    def cut(self, host: int) -> None:
        _ip("-n", self.switch, "link", "set", _port(host), "down")

    def heal(self, host: int) -> None:
        _ip("-n", self.switch, "link", "set", _port(host), "up")

    def shape(self, host: int, rate_mbit: float | None) -> None:
        """Cap what `host` sends at `rate_mbit` (a token bucket on its end of the cable, so
        each direction of a link between two shaped hosts gets that rate), or lift the cap
        (None). The qdisc lives in the host's namespace and goes with it. Rate only: this
        kernel has no sch_netem (`tc qdisc add ... netem`: "Specified qdisc kind is
        unknown"): `delay` adds latency."""
        if rate_mbit is None:
            subprocess.run(
                ["tc", "-n", self.names[host], "qdisc", "del", "dev", "eth0", "root"], capture_output=True
            )
            return
        # the bucket holds at least 4 ms at the rate, and a 64 KiB GSO segment with room to spare
        burst = max(256 * 1024, int(rate_mbit * 1e6 / 8 * 0.004))
        _tc(
            "-n", self.names[host], "qdisc", "replace", "dev", "eth0", "root", "tbf",
            "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms",
        )  # fmt: skip

    def delay(self, host: int, delay_ms: float | None) -> None:
        """Hold what reaches `host` `delay_ms` before its stack sees it (so a round trip
        between two delayed hosts takes twice that more), or stop holding it (None). This
        kernel has no sch_netem, fq or etf: the packets go through an NFQUEUE to
        `benchmarks.link_delay`, run in the host's namespace. On the receiving side, because
        a sender's own queue counts against TCP's small-queue limit (a socket may have only
        about a millisecond of its rate below it), which held packets would fill: 20 MB took
        18 s with 5 ms held on the way out, 0.17 s held on the way in. The rule and the
        process go with `linked_hosts`."""
        rule = ["INPUT", "-i", "eth0", "-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass"]
        iptables = ["ip", "netns", "exec", self.names[host], "iptables", "-w"]
        running = self.delayers.pop(host, None)
        if running is not None:
            _run(*iptables, "-D", *rule)
            _stop(running)
        if delay_ms is None:
            return
        from benchmarks.runner import checkout_path  # imports torch: only where a delay is asked for

        command = [
            *self.prefix(host),
            sys.executable,
            "-m",
            "benchmarks.link_delay",
            f"--delay-ms={delay_ms}",
        ]
        environment = {**os.environ, "PYTHONPATH": checkout_path()}
        delayer = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment
        )
        if delayer.stdout.readline().strip() != "ready":  # bound to its queue, or failed saying why
            _stop(delayer)
            raise OSError(f"benchmarks.link_delay on {self.names[host]}: {delayer.stderr.read().strip()}")
        self.delayers[host] = delayer
        _run(*iptables, "-A", *rule)


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _remove_orphans() -> None:
    """Namespaces of an earlier harness whose process is gone (SIGKILLed, which runs no
    `finally`): each is named for its maker's pid."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in re.findall(r"^(ddp(\d+)-\S+)", listed, re.MULTILINE):
        if not Path(f"/proc/{name[1]}").exists():
            subprocess.run(["ip", "netns", "del", name[0]], capture_output=True)


@contextmanager
def _terminated_as_exit() -> Iterator[None]:
    """A SIGTERM meanwhile (a harness stopped by `kill`, a CI runner's timeout) raises
    SystemExit instead of ending the process at once, so that the namespaces are removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def linked_hosts(count: int, subnet: str = "10.77.0") -> Iterator[Network]:
    """`count` hosts at SUBNET.1, SUBNET.2, ... on one switch; needs root (`ip` of iproute2).
    Removed on the way out, after a SIGTERM too; an earlier harness's, SIGKILLed, first."""
    _remove_orphans()
    tag = f"ddp{os.getpid()}"
    network = Network([f"{tag}-host{index}" for index in range(count)], f"{tag}-switch", [])
    made: list[str] = []
    try:
        with _terminated_as_exit():
            for name in (network.switch, *network.names):
                _ip("netns", "add", name)
                made.append(name)
            _ip("-n", network.switch, "link", "add", "switch", "type", "bridge")
            _ip("-n", network.switch, "link", "set", "switch", "up")
            for index, name in enumerate(network.names):
                address = f"{subnet}.{index + 1}"
                # created in the switch's namespace, so that no link ever exists in the caller's
                _ip("-n", network.switch, "link", "add", _port(index), "type", "veth", "peer", "name", "eth0")
                _ip("-n", network.switch, "link", "set", "eth0", "netns", name)
                _ip("-n", network.switch, "link", "set", _port(index), "master", "switch", "up")
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
                network.addresses.append(address)
            yield network
    finally:
        for delayer in network.delayers.values():
            _stop(delayer)
        for name in reversed(made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _port(host: int) -> str:
    return f"port{host}"


def _run(*argv: str) -> None:
    """An iproute2 command (`ip`, `tc`) that must succeed: OSError with its own message."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"{' '.join(argv)}: {done.stderr.strip()}")


def _ip(*args: str) -> None:
    _run("ip", *args)


def _tc(*args: str) -> None:
    _run("tc", *args)
