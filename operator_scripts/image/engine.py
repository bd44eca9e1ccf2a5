"""A Docker engine for `make image` and `make image-e2e`, also on a machine where none runs.

When an engine answers (DOCKER_HOST, or the default socket), it is used and left alone.
Otherwise, as root with Debian's `docker.io` installed, a private dockerd is started for the
duration of the `with` block and stopped at its end, pass or fail. Its flags leave the
host's network as it was (no docker0 bridge, no iptables rules, no forwarding): builds run
with `--network host`, and `ddp-ops local --runtime docker` makes, and removes, one internal
network of its own. The data root is kept, so a second build reuses the 5 GB layer.

    python -m operator_scripts.image.engine -- COMMAND...   # COMMAND with DOCKER_HOST set
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from operator_scripts.parent_death import dies_with_parent
from trainer.lines import last_line

DATA_ROOT = Path(os.environ.get("DDP_DOCKER_DATA_ROOT", "/var/lib/ddp-trainer/docker"))
EXEC_ROOT = Path("/run/ddp-trainer-docker")  # short: the socket's path must fit in 108 bytes
SOCKET = EXEC_ROOT / "docker.sock"
PRIVATE_FLAGS = ["--iptables=false", "--ip-forward=false", "--bridge=none"]


class EngineError(Exception):
    """Why no engine can be had, in one line that says what to do."""


@dataclass(frozen=True)
class Engine:
    """How to reach an engine: the CLI that builds with BuildKit and the environment for it."""

    cli: str
    env: dict[str, str]
    private: bool

    def run(self, *args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """`docker ARGS`, its output captured as text; a failure raises with docker's last line."""
        completed = subprocess.run([self.cli, *args], env=self.env, capture_output=True, text=True, **kwargs)
        if check and completed.returncode != 0:
            reason = last_line(completed.stderr, "no output")
            raise EngineError(f"docker {args[0]} failed: {reason}")
        return completed


def building_cli() -> str:
    """A docker CLI that builds with BuildKit: one with the buildx plugin, or Debian's 20.10
    CLI, which has BuildKit built in (DOCKER_BUILDKIT=1). A newer CLI without buildx refuses
    to build with BuildKit, and the Dockerfile's secret and bind mounts need it."""
    candidates = [path for path in (shutil.which("docker"), "/usr/bin/docker") if path]
    for cli in dict.fromkeys(path for path in candidates if Path(path).exists()):
        if subprocess.run([cli, "buildx", "version"], capture_output=True).returncode == 0:
            return cli
        version = subprocess.run([cli, "--version"], capture_output=True, text=True).stdout
        if version.startswith("Docker version 20.") or version.startswith("Docker version 19."):
            return cli
    raise EngineError(
        "no docker CLI that builds with BuildKit: apt-get install docker.io (or docker-buildx-plugin)"
    )


def _answers(cli: str, env: dict[str, str]) -> bool:
    return subprocess.run([cli, "version"], env=env, capture_output=True, timeout=30).returncode == 0


def _start_private(cli: str, env: dict[str, str]) -> subprocess.Popen:
    if os.geteuid() != 0:
        raise EngineError("no Docker engine answers; starting one needs root: start docker, or run as root")
    if shutil.which("dockerd") is None:
        raise EngineError("no Docker engine answers; dockerd is not installed: apt-get install docker.io")
    DATA_ROOT.mkdir(parents=True, exist_ok=True)
    EXEC_ROOT.mkdir(parents=True, exist_ok=True)
    log = open(EXEC_ROOT / "dockerd.log", "w")  # noqa: SIM115  (the daemon's for its lifetime)
    # SIGTERM when this process dies, however (setpriv's parent-death signal): the daemon
    # then stops its containers and itself, so a killed run leaves no daemon behind
    orphan_guard = dies_with_parent("TERM") if shutil.which("setpriv") else []
    command = [
        *orphan_guard, "dockerd", "--data-root", str(DATA_ROOT), "--exec-root", str(EXEC_ROOT),
        "--host", f"unix://{SOCKET}", "--pidfile", str(EXEC_ROOT / "dockerd.pid"), *PRIVATE_FLAGS,
    ]  # fmt: skip
    daemon = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not _answers(cli, env):
        if daemon.poll() is not None or time.monotonic() > deadline:
            _stop_private(daemon)
            tail = last_line((EXEC_ROOT / "dockerd.log").read_text(), "no output")
            raise EngineError(f"the private dockerd did not start: {tail}")
        time.sleep(0.2)
    return daemon


def _stop_private(daemon: subprocess.Popen) -> None:
    """SIGTERM, which stops its containers and its containerd, then SIGKILL after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(daemon.pid, signal.SIGKILL)
        daemon.wait()


@contextlib.contextmanager
def engine() -> Iterator[Engine]:
    """An engine that answers for the block: the one running, or a private one stopped after."""
    cli = building_cli()
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    if _answers(cli, env):
        yield Engine(cli, env, private=False)
        return
    env["DOCKER_HOST"] = f"unix://{SOCKET}"
    daemon = _start_private(cli, env)
    # a SIGTERM to this process (CI's timeout, Ctrl-C's cousin) still stops the daemon, unless
    # the caller handles it (`ddp-ops local` stops its pods first); a SIGKILL stops it too
    # (`_start_private`'s parent-death signal)
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield Engine(cli, env, private=True)
    finally:
        _stop_private(daemon)
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m operator_scripts.image.engine -- COMMAND...")
    try:
        with engine() as docker:
            where = "a private dockerd, stopped after" if docker.private else "the engine that answers"
            print(f"docker_engine: {' '.join(argv)} with {where}", flush=True)
            code = subprocess.run(argv, env={**docker.env, "DDP_DOCKER_CLI": docker.cli}).returncode
    except EngineError as error:
        raise SystemExit(f"docker_engine: error: {error}") from None
    raise SystemExit(code)


if __name__ == "__main__":
    main()
