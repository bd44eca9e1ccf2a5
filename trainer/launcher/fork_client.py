"""The fork server's client: what torchrun's worker process runs (`trainer/__main__.py`).

It asks the agent's server (`trainer.launcher.forkserver`) for a child that becomes this
worker, forwards torchrun's signals to it, and ends as it ends. It imports no torch: that is
the point of a warm restart, and a test holds it (tests/test_forkserver.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from trainer.launcher.fork_protocol import (
    HEADER,
    POLL_S,
    SOCKET_PATH_MAX,
    alive,
    read_reply,
    socket_path,
    wanted,
)
from trainer.lines import write_line

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def forked_run(argv: list[str]) -> int | None:
    """Run this worker as a child of the agent's server; its exit code, or None where there
    is no server to ask (the caller then runs the trainer itself, and the first such worker
    has started one)."""
    if not wanted():
        return None
    path = socket_path()
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(str(path))
    except OSError:
        connection.close()
        with contextlib.suppress(OSError):  # no room for one (a read-only /tmp): start cold
            start_server(path)
        return None
    with connection:
        forwarder = Forwarder()  # from before the order: a signal meanwhile is held, not lost
        order = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "umask": _umask()}
        payload = json.dumps(order).encode()
        try:
            socket.send_fds(connection, [HEADER.pack(len(payload))], [0, 1, 2])
            connection.sendall(payload)
            replies = connection.makefile("r")
            started = read_reply(replies)
        except OSError:  # a closed stdio, a server gone: nothing was started
            started = {}
        if "pid" not in started:  # refused: nothing was started, so start cold
            forwarder.restore()
            return None
        forwarder.started(started["pid"])
        return _outcome(started["pid"], replies)


class Forwarder:
    """torchrun's signals to this client, passed on to its child's group (its writer's
    too, as torchrun's `killpg` would reach them); held until the child's pid is known."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []
        self.previous = {sig: signal.signal(sig, self) for sig in FORWARDED}

    def __call__(self, signum: int, frame: object) -> None:
        if self.pid is None:
            self.pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signum)

    def started(self, pid: int) -> None:
        self.pid = pid
        for signum in self.pending:
            self(signum, None)

    def restore(self) -> None:
        """Back to this process's own handlers, and what came meanwhile delivered to it."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        for signum in self.pending:
            os.kill(os.getpid(), signum)


def _outcome(pid: int, replies) -> int:
    """The child's end, as the server reports it; this client's exit code for it."""
    ended = read_reply(replies)
    if "status" not in ended:  # the server itself is gone: wait the child out, blind
        while alive(pid):
            time.sleep(POLL_S)
        say = f"trainer: the fork server ended before worker {pid}; its exit code is unknown"
        write_line(say)
        return 1
    code = os.waitstatus_to_exitcode(ended["status"])
    if code >= 0:
        return code
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-code, signal.SIG_DFL)  # end as the child did: killed by the same signal
    os.kill(os.getpid(), -code)
    return 128 - code


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def start_server(path: Path) -> None:
    """Start the agent's server unless another worker of it has: the first to create the
    lock file does. The server outlives this worker; its output goes nowhere (a pipe held
    open would keep a reader of torchrun's output waiting for its end)."""
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:
        return  # a TMPDIR too deep for a Unix socket: every round starts cold
    path.parent.mkdir(mode=0o700, exist_ok=True)
    if path.parent.stat().st_uid != os.getuid() or path.parent.stat().st_mode & 0o077:
        return  # a folder someone else could enter: no server rather than one others can use
    try:
        os.close(os.open(path.with_suffix(".lock"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK")}
    subprocess.Popen(
        [sys.executable, "-u", "-m", "trainer.launcher.forkserver", str(path), str(os.getppid())],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
