"""The network-namespace harness (benchmarks.namespaces.linked_hosts) leaves nothing behind:
its namespaces go when the block ends, when its process is stopped with SIGTERM, and, for a
process SIGKILLed (which runs no clean-up), at the next harness's start. A cut link loses
packets; a healed one carries them again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, process_env

from benchmarks.namespaces import isolation_available, linked_hosts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not isolation_available(), reason="needs root and network namespaces"),
]
HOLD = (
    "from benchmarks.namespaces import linked_hosts; import time\n"
    "with linked_hosts(2):\n print('up', flush=True); time.sleep(60)"
)


def namespaces_of(pid: int) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(f"ddp{pid}-")]


def holder() -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD], cwd=REPO, env=process_env(), stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "up"
    assert len(namespaces_of(process.pid)) == 3  # two hosts and the switch
    return process


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
    process = holder()
    process.send_signal(sig)
    process.wait(timeout=30)
    if sig == signal.SIGKILL:  # nothing of it ran: the next harness removes what it left
        assert namespaces_of(process.pid)
        with linked_hosts(1):
            pass
    deadline = time.monotonic() + 5
    while namespaces_of(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert namespaces_of(process.pid) == []
