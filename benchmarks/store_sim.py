"""What the store simulations share (`benchmarks.store_load`, `benchmarks.agent_load`): a
libuv TCPStore served from this process, worker processes of at most 128 simulated nodes on
one timeline, and a store client that times and counts its calls."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time

from benchmarks.store_traffic import server_threads

NODES_PER_PROCESS = 128


def percentile(values: list[float], share: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(share * len(ordered)) - 1)]


class TimedStore:
    """A store client that times each call and counts it; held while `thawed` is clear."""

    def __init__(self, client) -> None:
        self.client = client
        self.calls = 0
        self.last_answer = 0.0
        self.thawed = threading.Event()
        self.thawed.set()

    def __getattr__(self, name: str):
        method = getattr(self.client, name)

        def timed(*args):
            self.thawed.wait()
            result = method(*args)
            self.calls += 1
            self.last_answer = time.monotonic()
            return result

        return timed


def wait_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.time()))


def workers(kind: str, nodes: int, port: int, timeline: dict) -> list[subprocess.Popen]:
    """Worker processes for `nodes` simulated nodes, at most NODES_PER_PROCESS each."""
    count = math.ceil(nodes / NODES_PER_PROCESS)
    started = []
    for index in range(count):
        first = index * nodes // count
        last = (index + 1) * nodes // count - 1
        command = [
            sys.executable, "-m", "benchmarks.store_load", "worker", kind, str(first), str(last),
            str(nodes), str(port), json.dumps(timeline),
        ]  # fmt: skip
        environment = {**os.environ, "OMP_NUM_THREADS": "1"}
        started.append(subprocess.Popen(command, stdout=subprocess.PIPE, env=environment, text=True))
    return started


def results(processes: list[subprocess.Popen]) -> list[dict]:
    found = []
    for process in processes:
        output, _ = process.communicate(timeout=600)
        if process.returncode != 0:
            raise RuntimeError(f"a simulation worker failed (exit {process.returncode})")
        found.append(json.loads(output.strip().splitlines()[-1]))
    return found


def start_store():
    """A libuv TCPStore served from this process, and its server thread's id."""
    import torch.distributed as dist

    before = server_threads()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    (thread,) = server_threads() - before
    return store, thread
