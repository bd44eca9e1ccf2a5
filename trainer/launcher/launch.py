"""`ddp-launch [OPTIONS] -- TORCHRUN_ARGS`: what each pod runs instead of bare torchrun.

On a cluster three things go wrong with torchrun alone, and this wrapper owns them:
- A bad configuration would be retried: by torchrun (`maxRestarts` rounds, each waiting for
  a stuck peer) and then by the pod's restarts. So the trainer's configuration and its
  checkpoint location are checked here first; an error is one line and exit 2, which the
  chart's `restartPolicy: ExitCode` treats as permanent (1-127: pkg/util/train/train_util.go:24-26
  in training-operator v1.9.4). An error the trainer can only see later (a checkpoint of
  another model, say) is reported by the trainer in a file this wrapper watches: it stops
  torchrun at once and exits 2 as well. So does a crash that comes back: each rank notes
  where and how it crashed in a folder that outlives torchrun's restarts and relaunches,
  and the same error at the same step again is reported as permanent
  (trainer/distributed/recurrence.py).
- The rendezvous host (worker-0) has a DNS name only once its pod is Ready
  (common/service.go:229-244): while it pulls a 5 GB image or waits for a node, torchrun on
  the other pods cannot resolve it and exits after about 104 s, spending restarts. So a pod
  that is not the host first waits for the host's name, for up to `--rendezvous-wait`
  seconds, logging one line; waiting costs no restart.
- torchrun exits when the host's pod dies (the store lives there). Pods re-created under
  ExitCode do not count against backoffLimit (each new pod starts at restartCount 0), so the
  bound is here: after a failed torchrun the wrapper waits for the host again and starts a
  new torchrun, at most `--relaunches` times, then exits 1 (permanent).
- torchrun resolves this host's own name (it publishes it to the peers); where that name is
  in no table (a container run with `--network none` and no /etc/hosts entry) it retries
  for 300 s. That is checked first too: one line, exit 2.
SIGTERM and SIGINT go to torchrun once, as SIGTERM; it forwards it to the workers, which
stop together and save (trainer/loop/preemption.py). The exit code is then 128 + the signal
(143 after SIGTERM: retryable), and torchrun's own traceback about the signal is left out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint.location import open_store
from trainer.config import ConfigError
from trainer.config.argparsing import OneLineParser
from trainer.distributed.elastic_bounds import NNODES_ENV, PET_NNODES_ENV, node_bounds
from trainer.distributed.heartbeat import HEARTBEAT_DIR_ENV
from trainer.distributed.leaving import LEFT_FILE_ENV
from trainer.distributed.liveness import serve_health
from trainer.distributed.node_watch import STORE_LOST_FILE_ENV
from trainer.distributed.recurrence import CRASH_DIR_ENV
from trainer.launcher.process_tree import (
    adopt_orphans,
    container_exit_code,
    has_children,
    reap_orphans,
    signal_tree,
)
from trainer.launcher.rendezvous_host import (
    rendezvous_host,
    store_address,
    torchrun_option,
    wait_for_host,
)
from trainer.launcher.torchrun_output import ERROR_PREFIX, fatal_line, relay, say_error
from trainer.lines import write_line
from trainer.run.startup import EXIT_CONFIG_ERROR, FATAL_FILE_ENV, validate
from trainer.telemetry.startup import STARTED_AT_ENV, started_at
from trainer.termination_message import MESSAGE_PATH_ENV, RESULT_FILE_ENV, write_termination_message

EXIT_GAVE_UP = 1
POLL_S = 0.2
# set wherever this project starts torchrun: a restart then makes a fresh store instead of
# reusing the rendezvous one, which hung or refused connections in 3 of 7 local
# kill-and-restart trials (docs/facts.md, "the rendezvous store"; pytorch/pytorch#135712)
RDZV_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The wrapper's own options, and torchrun's arguments after `--`."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = OneLineParser(prog="ddp-launch", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rendezvous-wait", type=float, default=900, metavar="S",
        help="seconds to wait for the rendezvous host's name to resolve (default 900)",
    )  # fmt: skip
    parser.add_argument(
        "--relaunches", type=int, default=3, metavar="N",
        help="new torchrun runs after a failed one, each after waiting for the host (default 3)",
    )  # fmt: skip
    parser.add_argument(
        "--waiting-line-s", type=float, default=30, metavar="S",
        help="while torchrun runs no worker (it waits in its rendezvous for nodes), say so every S seconds "
        "(default 30; 0: never)",
    )  # fmt: skip
    parser.add_argument(
        "--health-port", type=int, default=0, metavar="PORT",
        help="serve the pod's liveness at GET /healthz on PORT (default 0: off)",
    )  # fmt: skip
    parser.add_argument(
        "--health-address", default="", metavar="ADDRESS",
        help="the address /healthz listens on (default: every address of the pod)",
    )  # fmt: skip
    options = parser.parse_args(argv[:split])
    if options.rendezvous_wait < 0 or options.relaunches < 0 or options.waiting_line_s < 0:
        parser.error("--rendezvous-wait, --relaunches and --waiting-line-s must not be negative")
    if not 0 <= options.health_port <= 65535:
        parser.error(f"--health-port {options.health_port}: must be 0 (off) to 65535")
    return options, argv[split + 1 :]


def trainer_arguments(torchrun_args: Sequence[str]) -> list[str]:
    """The trainer's own arguments: what follows `-m trainer` in torchrun's command line."""
    args = list(torchrun_args)
    for index in range(len(args) - 1):
        if args[index] in ("-m", "--module") and args[index + 1] == "trainer":
            return args[index + 2 :]
    return []


def nnodes(torchrun_args: Sequence[str], env: dict[str, str]) -> str:
    """torchrun's `--nnodes` (its default is 1)."""
    return torchrun_option(torchrun_args, ["--nnodes"]) or env.get(PET_NNODES_ENV) or "1"


@dataclass
class RendezvousWaitLine:
    """torchrun that runs no worker waits in its rendezvous: for the job's first nodes, or,
    after a lost node, for enough of them again. Silent otherwise, so it is said every
    `every_s` of such a wait (`look` returns the line when one is due)."""

    every_s: float
    nnodes: str
    endpoint: str
    idle_since: float | None = None
    said_at: float | None = None

    def look(self, has_workers: bool, now: float) -> str | None:
        if has_workers or not self.every_s:
            self.idle_since = self.said_at = None
            return None
        if self.idle_since is None:
            self.idle_since = now
        if now - (self.said_at or self.idle_since) < self.every_s:
            return None
        self.said_at = now
        bounds = node_bounds({NNODES_ENV: self.nnodes})
        low = bounds[0] if bounds else 1
        return (
            f"torchrun has run no worker for {now - self.idle_since:.0f}s: it waits in its rendezvous at "
            f"{self.endpoint} for at least {low} node{'s' * (low != 1)} (--nnodes={self.nnodes}); "
            "a lost node counts again once it answers or its pod is replaced"
        )


def own_name_problem() -> str | None:
    """Why torchrun could not resolve this host's name, or None when it can."""
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        return (
            f"this host's name {name!r} does not resolve (no /etc/hosts entry, no DNS) and torchrun "
            "needs it: give the container one (docker run --hostname trainer --add-host trainer:127.0.0.1)"
        )
    return None


SAID: list[str] = []  # this process's own lines, newest last: the last is its verdict, if any


def _say(line: str) -> None:
    SAID.append(f"ddp-launch: {line}")
    write_line(SAID[-1])


@dataclass(frozen=True)
class PodFiles:
    """What this pod's ranks tell the wrapper through files, each under the temp folder and
    named for this process: a fatal error (`fatal`), their heartbeat records
    (`heartbeats`, which `/healthz` reads), how each crashed last (`crashes`, which
    outlive torchrun's restarts and relaunches so that a crash that recurs is permanent),
    and that the rendezvous store's host was found lost (`store_lost`: the node watch's line)."""

    fatal: Path
    heartbeats: Path
    crashes: Path
    store_lost: Path
    left: Path
    result: Path

    @classmethod
    def of_this_process(cls) -> PodFiles:
        base = Path(tempfile.gettempdir()) / f"ddp-launch-{os.getpid()}"
        return cls(
            base.with_suffix(".fatal"), base.with_suffix(".heartbeats"), base.with_suffix(".crashes"),
            base.with_suffix(".store-lost"), base.with_suffix(".left"), base.with_suffix(".result"),
        )  # fmt: skip

    def env(self) -> dict[str, str]:
        return {
            FATAL_FILE_ENV: str(self.fatal),
            HEARTBEAT_DIR_ENV: str(self.heartbeats),
            CRASH_DIR_ENV: str(self.crashes),
            STORE_LOST_FILE_ENV: str(self.store_lost),
            LEFT_FILE_ENV: str(self.left),
            RESULT_FILE_ENV: str(self.result),
        }

    def verdict(self, code: int) -> str:
        """The line that ends this container with `code`: a worker's permanent error, else
        rank 0's last line (its summary, or where a stop left the state), else, for a
        failure, this wrapper's own last line; a success without rank 0 says nothing."""
        if line := fatal_line(self.fatal):
            return line
        with contextlib.suppress(OSError):
            if line := self.result.read_text().strip():
                return line
        return SAID[-1] if SAID and code != 0 else ""

    def take_store_lost(self) -> bool:
        """Whether the store's host was reported lost since the last look; the report is taken."""
        try:
            self.store_lost.unlink()
        except FileNotFoundError:
            return False
        return True

    def remove(self) -> None:
        self.fatal.unlink(missing_ok=True)
        self.store_lost.unlink(missing_ok=True)
        self.left.unlink(missing_ok=True)
        self.result.unlink(missing_ok=True)
        shutil.rmtree(self.heartbeats, ignore_errors=True)
        shutil.rmtree(self.crashes, ignore_errors=True)


def run_torchrun(
    torchrun_args: Sequence[str], files: PodFiles, stopping: list[int], waiting: RendezvousWaitLine
) -> int:
    """One torchrun, in a session of its own so that a terminal's Ctrl-C reaches it only
    through us, once, as SIGTERM; stopped at once when a worker reports a fatal error, or
    the rendezvous store's host lost (its agent would wait on that store for good); its waits
    for nodes said at a steady interval."""
    fatal_file = files.fatal
    files.left.unlink(missing_ok=True)  # a note the last torchrun's report did not take
    env = {**RDZV_ENV, **os.environ, **files.env(), NNODES_ENV: waiting.nnodes}
    env.pop(MESSAGE_PATH_ENV, None)  # the container's last word is this process's (PodFiles.verdict)
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *torchrun_args],
        env=env,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    said: list[bytes] = []
    relaying = threading.Thread(target=relay, args=(process.stderr, stopping, said, files.left), daemon=True)
    relaying.start()

    def forward(signum: int, frame: object) -> None:
        if not stopping:
            stopping.append(signum)
            process.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while (code := process.poll()) is None:
            reap_orphans(keep=process.pid)
            if line := waiting.look(has_children(process.pid), time.monotonic()):
                _say(line)
            if fatal_file.exists() and not stopping:
                signal_tree(process)
                process.wait()
                relaying.join(timeout=5)
                if not said:  # another rank was first, and rank 0 was stopped before its line
                    say_error(fatal_file)
                return EXIT_CONFIG_ERROR
            if files.store_lost.exists() and not stopping:
                signal_tree(process)
                return container_exit_code(process.wait())
            time.sleep(POLL_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        relaying.join(timeout=5)
    if stopping:  # what a container stopped by that signal reports: retryable, never 0
        return 128 + stopping[0]
    return container_exit_code(code)


def main(argv: Sequence[str] | None = None) -> int:
    # the start of the container, near enough: where the workers' start-up split begins
    os.environ.setdefault(STARTED_AT_ENV, f"{started_at(os.getpid()):.3f}")
    options, torchrun_args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        _, config = validate(trainer_arguments(torchrun_args))
        open_store(config.checkpoint).prepare()
    except ConfigError as error:
        write_line(f"{ERROR_PREFIX}{error}")
        write_termination_message(f"{ERROR_PREFIX}{error}")
        return EXIT_CONFIG_ERROR
    if problem := own_name_problem():
        _say(f"error: {problem}")
        write_termination_message(SAID[-1])
        return EXIT_CONFIG_ERROR
    adopt_orphans()
    for sig in (signal.SIGTERM, signal.SIGINT):  # while waiting: leave at once
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    target = rendezvous_host(torchrun_args, dict(os.environ))
    files = PodFiles.of_this_process()
    server = None
    if options.health_port:
        try:
            server = serve_health((options.health_address, options.health_port), files.heartbeats)
        except OSError as error:
            where = f"{options.health_address or '*'}:{options.health_port}"
            _say(f"error: --health-port {options.health_port}: cannot listen on {where} ({error.strerror})")
            write_termination_message(SAID[-1])
            return EXIT_CONFIG_ERROR
    try:
        code = _launch(options, torchrun_args, target, files)
        write_termination_message(files.verdict(code))
        return code
    finally:
        if server is not None:
            server.shutdown()
        files.remove()


def _launch(
    options: argparse.Namespace,
    torchrun_args: list[str],
    target: tuple[str, str] | None,
    files: PodFiles,
) -> int:
    """Wait for the host, run torchrun, and run it again after a failure, within the budget."""
    stopping: list[int] = []  # the signal this pod got, once it got one
    env = dict(os.environ)
    endpoint = torchrun_option(torchrun_args, ["--rdzv-endpoint"]) or env.get("PET_RDZV_ENDPOINT")
    endpoint = endpoint or "localhost"
    waiting = RendezvousWaitLine(options.waiting_line_s, nnodes(torchrun_args, env), endpoint)
    code, store_lost = 0, False
    for attempt in range(options.relaunches + 1):
        # after a lost store, wait for it to answer even where it is this host's own name (one
        # host's agents on loopback); without, for the host's name
        wait_for = store_address(torchrun_args, env) if store_lost else target
        if wait_for and not wait_for_host(*wait_for, options.rendezvous_wait, _say, store_lost):
            verb = "answer" if store_lost else "resolve"
            _say(
                f"error: rendezvous host {wait_for[0]} did not {verb} within {options.rendezvous_wait:.0f}s; "
                "check that its pod is scheduled and its node Ready (kubectl describe pod)"
            )
            return EXIT_GAVE_UP
        files.fatal.unlink(missing_ok=True)
        code = run_torchrun(torchrun_args, files, stopping, waiting)
        if code in (0, EXIT_CONFIG_ERROR) or stopping:
            return code
        store_lost = files.take_store_lost()
        if attempt < options.relaunches:
            why = (
                "stopped: the rendezvous store's host is lost and torchrun would wait on it for good"
                if store_lost
                else f"exited with code {code}"
            )
            _say(f"torchrun {why}; relaunch {attempt + 1} of {options.relaunches}")
    _say(f"error: torchrun failed {options.relaunches + 1} times (last exit code {code}); giving up")
    return EXIT_GAVE_UP


if __name__ == "__main__":
    raise SystemExit(main())
