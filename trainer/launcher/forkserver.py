"""A node's fork server: torchrun's restarted workers start warm, not from a bare interpreter.

A worker's start-up is mostly imports: torch, and torch._dynamo, which the optimizer's first
`@_disable_dynamo` method imports (torch/_compile.py:47; torch/optim/optimizer.py:680),
about 3 s of CPU on 2 cores, of a restart's 4.5 s. torchrun starts each worker as a fresh
process (`Popen`, its own session: elastic/multiprocessing/subprocess_handler/
subprocess_handler.py:63-77) and restarts all of them after any failure, so every restart
paid them again.

So the first round's workers (started cold, as ever) leave behind one process per torchrun
agent, `python -m trainer.launcher.forkserver`, that imports all of that once, at the
lowest CPU priority, and then waits on a Unix socket in a folder only this user can enter.
A later round's `python -m trainer` connects (`forked_run`), passes its stdin, stdout and
stderr, argv, environment, working directory and umask, and the server forks a child that
becomes that worker: its own session, as torchrun gives each worker, then `trainer.cli.main`.
The process torchrun watches stays the small client: it forwards the signals torchrun sends
(SIGTERM to its group, `os.killpg` in subprocess_handler.py:79-85) to the child's group, and
exits as the child did (the same code, or killed by the same signal). A client that dies
(SIGKILL after torchrun's 30 s) takes the child with it: the child watches the connection.

No worker waits for the server: one that finds none (the first round, a server still
importing) starts cold, and the first of those starts the server. The server forks only
while it has no thread but its main one and no CUDA context, and only for a worker whose
environment agrees with its own in what is read at import time (`IMPORT_TIME_ENV`). It ends
when its agent does. `TRAINER_FORK_SERVER=0` turns it off; it is off where torchrun restarts nothing
(`--max-restarts=0`) and outside torchrun.

This module is the server; the client is `trainer.launcher.fork_client` and what they
share is `trainer.launcher.fork_protocol`, neither of which imports torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from trainer.collection import uncollected_imports
from trainer.launcher.fork_protocol import HEADER, POLL_S, STDIO, alive

# inductor's compiler too, which a compiled run's restarted workers would otherwise import
# when they compile (0.7 s by py-spy, before a warm first step of 1.6 s): frozen after import
# (trainer.collection), the whole preload is 1.8 CPU-s, and the server listens within a run's
# first seconds even at the lowest priority (unfrozen, inductor's 0.6 s more had kept it from
# being ready for the restarts of a run's first minute)
PRELOAD = ("trainer.cli", "torch._dynamo", "torch._inductor.compile_fx")
# read once, when torch or Python start: a child forked from a server started under other
# values would not honour the worker's own
IMPORT_TIME_ENV = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH", "PYTHONHASHSEED", "LD_PRELOAD", "TORCH_CPP_LOG_LEVEL",
)  # fmt: skip
# dynamo's and inductor's configs, which `torch._dynamo` imports, read these when installed
# (torch/utils/_config_module.py:318 in torch 2.13, "environment variables are read at
# install time"): a child would compile under the server's settings, not its worker's
IMPORT_TIME_PREFIXES = ("TORCHDYNAMO_", "TORCHINDUCTOR_", "TORCH_COMPILE", "TORCH_LOGS", "TRITON_")
# as the server started: importing torch sets some (TORCHINDUCTOR_CACHE_DIR, by inductor's
# `cache_dir()`), which a worker's own environment does not have
STARTING_ENV = dict(os.environ)
IMPORT_NICENESS = 19
AUTOGROUP = Path("/proc/self/autogroup")
ORDER_TIMEOUT_S = 5.0


@dataclass
class Order:
    """What a forked child is to become: the worker whose client asked for it."""

    connection: socket.socket
    stdio: list[int]
    argv: list[str]
    env: dict[str, str]
    cwd: str
    umask: int


def lower_session_priority(niceness: int) -> None:
    """The nice value of this session's scheduling group, where the kernel groups tasks
    by session (autogroup: tasks of the root cgroup only, kernel/sched/autogroup.c
    `task_wants_autogroup`), and then ranks nice values within a group only (sched(7),
    "The autogroup feature"). A child that starts a session of its own leaves the group."""
    if os.getsid(0) != os.getpid():
        return  # the group is the caller's session too: not this process's to lower
    with contextlib.suppress(OSError):
        AUTOGROUP.write_text(str(niceness))


def preload(agent_pid: int) -> bool:
    """Import `PRELOAD` in a thread of the lowest CPU priority (Linux's nice is per thread),
    so that the imports take only idle cycles while the first round trains, and the main
    thread, whose priority the children inherit, keeps its own; the server's session is
    lowered as a whole (the children leave it). False if the agent ended meanwhile (a short
    run): then there is nothing to serve."""

    def imports() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IMPORT_NICENESS)
        with uncollected_imports():
            for module in PRELOAD:
                __import__(module)

    lower_session_priority(IMPORT_NICENESS)  # the children start sessions of their own
    importer = threading.Thread(target=imports, daemon=True)
    importer.start()
    while importer.is_alive():
        importer.join(POLL_S)
        if not alive(agent_pid):
            return False
    return True


def serve(path: Path, agent_pid: int) -> Order | None:
    """Preload, listen, and fork a child per client until the agent is gone. Returns in a
    child only, with its order; in the server, None at the end, its socket and lock gone."""
    server_pid = os.getpid()
    try:
        if not preload(agent_pid):
            return None
        with _listen(path) as listener:
            return _serve(listener, agent_pid)
    finally:
        if os.getpid() == server_pid:
            for stale in (path, path.with_suffix(".new"), path.with_suffix(".lock")):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()


def _listen(path: Path) -> socket.socket:
    """A socket listening at `path`, put there only once it listens: clients connect to a
    listening socket or to none."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staged = path.with_suffix(".new")
    with contextlib.suppress(FileNotFoundError):
        staged.unlink()
    listener.bind(str(staged))
    listener.listen(16)
    os.replace(staged, path)
    return listener


def _serve(listener: socket.socket, agent_pid: int) -> Order | None:
    children: dict[int, socket.socket] = {}
    ended, woken = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # a child's end wakes the loop
    signal.set_wakeup_fd(woken)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    while alive(agent_pid):
        readable, _, _ = select.select([listener, ended], [], [], POLL_S)
        if listener in readable:
            order = _accept(listener, children)
            if order is not None:  # in the child: nothing of the server's is its to keep
                for connection in children.values():
                    connection.close()
                os.close(ended)
                os.close(woken)
                return order
        if ended in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(ended, 512)
        _reap(children)
    return None


def _accept(listener: socket.socket, children: dict[int, socket.socket]) -> Order | None:
    """Take one client's order and fork its child; the order, in the child."""
    connection, _ = listener.accept()
    connection.settimeout(ORDER_TIMEOUT_S)  # a client that sends nothing must not hold the server
    try:
        order = _read_order(connection)
        connection.settimeout(None)
    except (OSError, ValueError):
        connection.close()
        return None
    refusal = _refusal(order)
    if refusal is not None:
        for fd in order.stdio:
            os.close(fd)
        with contextlib.suppress(OSError):
            connection.sendall(json.dumps({"refused": refusal}).encode() + b"\n")
        connection.close()
        return None
    pid = os.fork()
    if pid == 0:
        return order
    for fd in order.stdio:
        os.close(fd)
    children[pid] = connection
    with contextlib.suppress(OSError):
        connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return None


def _read_order(connection: socket.socket) -> Order:
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", credentials)
    header, fds, _, _ = socket.recv_fds(connection, HEADER.size, STDIO)
    if uid != os.getuid() or len(header) != HEADER.size or len(fds) != STDIO:
        for fd in fds:
            os.close(fd)
        raise ValueError("not an order from this user")
    (length,) = HEADER.unpack(header)
    payload = bytearray()
    while len(payload) < length:
        chunk = connection.recv(length - len(payload))
        if not chunk:
            raise ValueError("a partial order")
        payload += chunk
    order = json.loads(payload)
    return Order(connection, fds, order["argv"], order["env"], order["cwd"], order["umask"])


def _refusal(order: Order) -> str | None:
    if threading.active_count() != 1:
        return "the server runs threads: a fork would copy their locks"
    if sys.modules["torch"].cuda.is_initialized():
        return "the server has initialised CUDA, which a forked child cannot use"
    return differing_import_time_env(order.env, STARTING_ENV)


def differing_import_time_env(worker: dict[str, str], server: dict[str, str]) -> str | None:
    """Which variables read at import time the worker's environment sets otherwise than the
    server's, said as the refusal; None where they agree."""
    keys = set(IMPORT_TIME_ENV) | {key for key in {*worker, *server} if key.startswith(IMPORT_TIME_PREFIXES)}
    differing = sorted(key for key in keys if worker.get(key) != server.get(key))
    return f"{', '.join(differing)} differ from the server's" if differing else None


def _reap(children: dict[int, socket.socket]) -> None:
    """Tell each ended child's client how it ended."""
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            connection = children.pop(pid)
            with contextlib.suppress(OSError):
                connection.sendall(json.dumps({"status": status}).encode() + b"\n")
            connection.close()


# --- the child: becoming the worker ----------------------------------------------------


def become(order: Order) -> None:
    """Turn this forked child into the worker its client runs for: its session, stdio,
    directory, environment and argv; and its end, should the client die first."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    for target, fd in enumerate(order.stdio):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(order.cwd)
    os.umask(order.umask)
    os.environ.clear()
    os.environ.update(order.env)
    sys.argv = order.argv
    threading.Thread(target=_end_with_client, args=(order.connection,), daemon=True).start()


def _end_with_client(connection: socket.socket) -> None:
    """The client's end of the connection closes only when it exits: if this child is
    still running then, the client was killed (SIGKILL cannot be forwarded)."""
    with contextlib.suppress(OSError):
        while connection.recv(1):
            pass
    os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> int:
    path, agent_pid = Path(argv[0]), int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the workers
    order = serve(path, agent_pid)
    if order is None:
        return 0
    signal.signal(signal.SIGINT, signal.default_int_handler)
    become(order)
    from trainer.cli import main as trainer_main

    return trainer_main()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
