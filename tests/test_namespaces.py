"""The network-namespace harness (benchmarks.namespaces.linked_hosts) leaves nothing behind:
its namespaces go when the block ends, when its process is stopped with SIGTERM, and, for a
process SIGKILLed (which runs no clean-up), at the next harness's start. A cut link loses
packets; a healed one carries them again. A delayed link adds its delay each way and keeps
its rate."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import REPO, process_env

from benchmarks.namespaces import isolation_available, linked_hosts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not isolation_available(), reason="needs root and network namespaces"),
]
HOLD = (  # with a delayed link: its delaying process must go too
    "from benchmarks.namespaces import linked_hosts; import time\n"
    "with linked_hosts(2) as network:\n network.delay(0, 1)\n"
    " print('up', network.delayers[0].pid, flush=True); time.sleep(60)"
)


def namespaces_of(pid: int) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(f"ddp{pid}-")]


def holder() -> tuple[subprocess.Popen, int]:
    """The harness holding two hosts, and its link delayer's pid."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD], cwd=REPO, env=process_env(), stdout=subprocess.PIPE, text=True
    )
    up, delayer = process.stdout.readline().split()
    assert up == "up"
    assert len(namespaces_of(process.pid)) == 3  # two hosts and the switch
    return process, int(delayer)


def running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def reaches(network, source: int, address: str, port: int) -> bool:
    """Whether host `source` opens a TCP connection to address:port within a second."""
    connect = f"import socket; socket.create_connection(({address!r}, {port}), timeout=1)"
    return (
        subprocess.run(
            [*network.prefix(source), sys.executable, "-c", connect], capture_output=True
        ).returncode
        == 0
    )


def test_a_cut_link_loses_packets_and_a_healed_one_carries_them():
    serve = "import socket, time; s = socket.create_server(('0.0.0.0', 7070)); s.listen(); time.sleep(60)"
    with linked_hosts(2) as network:
        server = subprocess.Popen([*network.prefix(1), sys.executable, "-c", serve])
        try:
            deadline = time.monotonic() + 10
            while not reaches(network, 0, network.addresses[1], 7070) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert reaches(network, 0, network.addresses[1], 7070)
            network.cut(1)
            assert not reaches(network, 0, network.addresses[1], 7070)  # no reset: packets vanish
            network.heal(1)
            assert reaches(network, 0, network.addresses[1], 7070)
        finally:
            server.kill()
            server.wait()
    assert namespaces_of(os.getpid()) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_harness_leaves_no_namespace_behind(sig):
    process, delayer = holder()
    assert running(delayer)
    process.send_signal(sig)
    process.wait(timeout=30)
    if sig == signal.SIGKILL:  # nothing of it ran: the next harness removes what it left
        assert namespaces_of(process.pid)
        with linked_hosts(1):
            pass
    deadline = time.monotonic() + 5
    while (namespaces_of(process.pid) or running(delayer)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert namespaces_of(process.pid) == []
    assert not running(delayer)  # stopped by the harness, or, SIGKILLed, by its parent-death signal


# on host 1: answers each 1-byte ping at once, and a transfer of `size` bytes with one byte
ECHO = """
import socket, sys
size = int(sys.argv[1])
server = socket.create_server(("0.0.0.0", 7071)); print("up", flush=True)
while True:
    peer, _ = server.accept(); peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (first := peer.recv(1)):
        got = 1 if first == b"b" else size
        while got < size:
            got += len(peer.recv(1 << 20))
        peer.sendall(b"k")
"""
# on host 0, on a connection of its own (made on the link as it is now): "ping" prints the
# median of 20 round trips (ms), "bulk" the seconds until `size` bytes are answered
CLIENT = """
import socket, statistics, sys, time
address, size, command = sys.argv[1], int(sys.argv[2]), sys.argv[3]
peer = socket.create_connection((address, 7071))
peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(20 if command == "ping" else 1):
    started = time.perf_counter()
    peer.sendall(b"p" if command == "ping" else b"b" * size)
    peer.recv(1)
    times.append(time.perf_counter() - started)
print(1000 * statistics.median(times) if command == "ping" else times[0])
"""


def test_a_delayed_link_adds_its_delay_each_way_and_keeps_its_rate():
    size = 10_000_000  # 0.8 s at 100 Mbit/s
    with linked_hosts(2) as network:
        server = subprocess.Popen(
            [*network.prefix(1), sys.executable, "-c", ECHO, str(size)], stdout=subprocess.PIPE, text=True
        )

        def measure(command: str) -> float:
            client = [
                *network.prefix(0),
                sys.executable,
                "-c",
                CLIENT,
                network.addresses[1],
                str(size),
                command,
            ]
            return float(
                subprocess.run(client, capture_output=True, text=True, check=True, timeout=30).stdout
            )

        try:
            assert server.stdout.readline().strip() == "up"
            plain_ms = measure("ping")
            for host in range(2):
                network.delay(host, 10)
            delayed_ms = measure("ping")
            assert 20 <= delayed_ms - plain_ms < 30, (plain_ms, delayed_ms)  # 10 ms each way
            for host in range(2):
                network.shape(host, 100)
            # the rate holds under the delay: a held packet does not count against the
            # sender's own queue (ramping up takes a few round trips of 20 ms)
            assert 0.8 <= measure("bulk") < 1.6
            for host in range(2):
                network.delay(host, None)
            assert measure("ping") < plain_ms + 5
            network.delay(0, 3)
            delayers = [*network.delayers.values()]
        finally:
            server.kill()
            server.wait()
    assert namespaces_of(os.getpid()) == []
    assert delayers and all(delayer.poll() is not None for delayer in delayers)  # gone with the hosts
