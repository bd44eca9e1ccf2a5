"""What the fork server (`trainer.launcher.forkserver`) and its client
(`trainer.launcher.fork_client`) share: where the server listens, whether a worker wants
one, and how an order and its replies are framed. Torch-free, as the client must stay."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

SWITCH_ENV = "TRAINER_FORK_SERVER"
POLL_S = 0.5
HEADER = struct.Struct("!I")  # an order's length, sent with the worker's stdio descriptors
STDIO = 3
SOCKET_PATH_MAX = 107  # sun_path's 108 bytes, less the terminating NUL (unix(7))


def socket_path(env: dict[str, str] | os._Environ = os.environ, agent_pid: int | None = None) -> Path:
    """Where the server of this torchrun agent (the workers' parent) listens; the run id
    is hashed to keep the path within a Unix socket's 107 bytes."""
    run = hashlib.sha256(env.get("TORCHELASTIC_RUN_ID", "").encode()).hexdigest()[:12]
    agent = os.getppid() if agent_pid is None else agent_pid
    return Path(tempfile.gettempdir()) / f"ddp-forkserver-{os.getuid()}" / f"{agent}-{run}.sock"


def listening(agent_pid: int) -> bool:
    """Whether a server of the torchrun agent `agent_pid` listens (for any run id)."""
    folder = socket_path({}, agent_pid).parent
    return folder.is_dir() and any(folder.glob(f"{agent_pid}-*.sock"))


def wanted(env: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether this worker's restarts can use a server: under torchrun, restarts allowed."""
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    return env.get(SWITCH_ENV, "1") != "0" and "TORCHELASTIC_RUN_ID" in env and restarts not in ("", "0")


def read_reply(replies) -> dict:
    line = replies.readline()
    return json.loads(line) if line else {}


def alive(pid: int) -> bool:
    """psutil.pid_exists, without psutil's 60 ms import on the client's path."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
