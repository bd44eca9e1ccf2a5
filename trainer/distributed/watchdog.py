"""`python -m trainer.distributed.watchdog`: one per node, outside the workers, it finds a
rank that has stopped making progress and removes it.

It reads this node's heartbeat records (`trainer.distributed.heartbeat`) every `poll_s`.
A rank past its phase's limit is judged:
- its process is stopped (state T: SIGSTOP, a debugger): it is the hung one;
- otherwise its Python stacks are asked for (SIGUSR1: faulthandler writes them from C,
  so a main thread blocked in native code still answers). A main thread inside a
  collective (torch.distributed, the DDP backward's all-reduce, `wait_for_peers`) is
  waiting for a peer: not blamed. Any other is the hung one. One that writes no stack is
  asked again at each look and blamed once it has answered none for `MUTE_S` (a process
  starved of CPU answers late; one in uninterruptible sleep never does).
- a rank that has waited longer than `wait_limit_s` (the config's `first_s`) is removed
  too: the peer it waits for is on another node whose watchdog did not act (a frozen pod,
  which the kubelet's liveness probe restarts). Shorter waits are a peer's slow phase
  (rank 0 writing a checkpoint alone), which other nodes cannot see.
The hung rank is named in one line (rank, host, phase, last step, silence, limit) with
its stack after it, then stopped for good: SIGCONT (a stopped process cannot run its
stack dump) and SIGKILL. torchrun sees a failed worker, restarts the group, and the run
resumes from the newest snapshot.

It reads from stdin only to notice its parent (the node's first rank) exit: end of input
ends it. It imports neither torch nor the trainer's config, so it starts in milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from trainer.distributed.flight_recorder import DUMP_WAIT_S, answered, recording, request_dumps
from trainer.distributed.heartbeat import (
    STACK_SIGNAL,
    Record,
    rank_alive,
    read_records,
    remove_generation,
    signal_rank,
    stack_file,
)
from trainer.lines import write_line

STACK_WAIT_S = 0.5
# a rank that writes no stack within STACK_WAIT_S is asked again at each look, and blamed
# only once it has answered none for this long: one starved of CPU on a busy node answers
# late (seen beside the test suite), one in uninterruptible sleep never does
MUTE_S = 5.0
VERDICTS_FILE = "verdicts.json"
VERDICTS_FRESH_S = 10.0  # a watchdog that wrote none for this long is not answering
LIVENESS_LIMITS = 2.0  # a pod is unhealthy once a rank is silent this many limits
RESTART_QUIET_S = 10.0  # after a removal, while torchrun restarts the group
REJUDGE_S = 5.0  # how long a rank found waiting, its record unchanged, stays so judged
OWN_FREEZE_S = 3.0  # a gap this long between two looks: the whole node was stopped, this watchdog too
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(?P<path>[^"]*)", line (?P<line>\d+) in (?P<function>\S+)')
WAITING_FUNCTIONS = {"wait_for_peers", "_engine_run_backward"}
# DDP's own code (buffer broadcasts, the reducer) and torch.distributed's wait for peers
WAITING_PATHS = ("/torch/distributed/", "/torch/nn/parallel/distributed.py")


@dataclass(frozen=True)
class Verdict:
    """What the watchdog made of an overdue rank."""

    state: str  # "stopped", "waiting", "hung", "mute" (no stack for MUTE_S) or "unanswered" (yet)
    stack: list[str]

    @property
    def blamed(self) -> bool:
        return self.state not in ("waiting", "unanswered")


def main_thread_stack(dump: str, thread: int) -> list[str]:
    """The frame lines of `thread` in a faulthandler dump, most recent call first."""
    frames: list[str] = []
    current = None
    for line in dump.splitlines():
        if match := _THREAD.match(line):
            current = int(match[1], 16)
        elif current == thread and _FRAME.match(line):
            frames.append(line.strip())
    return frames


def is_waiting(frames: Sequence[str]) -> bool:
    """Whether the innermost frame is a wait for peers: in torch.distributed or DDP's own
    code, the backward (whose all-reduce waits for every rank) or `wait_for_peers`."""
    match = _FRAME.match("  " + frames[0]) if frames else None
    return bool(match) and (
        any(part in match["path"] for part in WAITING_PATHS) or match["function"] in WAITING_FUNCTIONS
    )


class Watchdog:
    """Watches one node's records in `folder` and removes hung ranks."""

    def __init__(self, folder: Path, host: str, wait_limit_s: float, log_format: str = "text") -> None:
        self.folder, self.host, self.log_format = folder, host, log_format
        self.wait_limit_s = wait_limit_s
        self.removed: set[int] = set()  # pids already killed
        self.quiet_until = 0.0
        self.waiting: dict[int, tuple[Record, float]] = {}  # pid: the record judged waiting, when
        self.unanswered: dict[int, float] = {}  # pid: when it first left a request for its stack unanswered
        self.last_look: float | None = None

    def check(self, now: float | None = None) -> list[Record]:
        """One look at every record: the ranks removed by it. What it made of each overdue
        rank goes to `verdicts.json`, for the pod's liveness endpoint."""
        now = time.monotonic() if now is None else now
        removed, states = [], {}
        looked = time.monotonic()  # the real clock, whatever `now` a caller judges by
        if self.last_look is not None and looked - self.last_look > OWN_FREEZE_S:
            # the node was frozen (its kernel, a paused VM) and is thawed: every record is as
            # stale as the freeze was long, and no rank is to blame; the node's watcher of its
            # peers (trainer.distributed.node_watch) knows what the others did meanwhile
            self.quiet_until = now + RESTART_QUIET_S
        self.last_look = looked
        if now < self.quiet_until:
            return removed
        for record in read_records(self.folder):
            if record.pid in self.removed or not record.overdue(now):
                continue
            if not rank_alive(record):
                continue  # it exited (its pid may be another process's now): torchrun's business
            try:
                stopped = psutil.Process(record.pid).status() == psutil.STATUS_STOPPED
            except psutil.NoSuchProcess:
                continue
            verdict = Verdict("stopped", []) if stopped else self.judge(record, now)
            states[str(record.rank)] = verdict.state
            if verdict.blamed or record.silent_s(now) > self.wait_limit_s:
                self.remove(record, verdict, now)
                removed.append(record)
                # the group restarts now: a peer caught leaving its collective is no hung rank
                self.quiet_until = now + RESTART_QUIET_S
                break
        write_verdicts(self.folder, now, states)
        return removed

    def judge(self, record: Record, now: float) -> Verdict:
        """Waiting or hung, from its stack; a rank found waiting is asked again only after
        `REJUDGE_S` or once its record moves, not at every look (each ask interrupts it)."""
        judged = self.waiting.get(record.pid)
        if judged is not None and judged[0] == record and now - judged[1] < REJUDGE_S:
            return Verdict("waiting", [])
        frames = self.stack(record)
        if not frames:
            first = self.unanswered.setdefault(record.pid, now)
            return Verdict("mute" if now - first >= MUTE_S else "unanswered", [])
        self.unanswered.pop(record.pid, None)
        verdict = Verdict("waiting" if is_waiting(frames) else "hung", frames)
        if verdict.state == "waiting":
            self.waiting[record.pid] = (record, now)
        else:
            self.waiting.pop(record.pid, None)
        return verdict

    def stack(self, record: Record, *, resume: bool = False) -> list[str]:
        """The rank's main-thread stack, asked for by signal; [] when it does not answer.
        With `resume`, the stopped process is let run so that it can answer."""
        path = stack_file(self.folder, record.rank)
        try:
            path.write_bytes(b"")
        except OSError:
            return []
        if not signal_rank(record, STACK_SIGNAL) or (resume and not signal_rank(record, signal.SIGCONT)):
            return []
        deadline = time.monotonic() + STACK_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                frames = main_thread_stack(path.read_text(errors="replace"), record.main_thread)
            except OSError:  # the rank exited meanwhile and took its files
                return []
            if frames:
                return frames
        return []

    def remove(self, record: Record, verdict: Verdict, now: float) -> None:
        """One line naming the rank, its stack, then SIGCONT and SIGKILL."""
        frames = verdict.stack or self.stack(record, resume=verdict.state == "stopped")
        why = {
            "stopped": "its process is stopped (SIGSTOP, or a debugger)",
            "hung": "its main thread is not waiting for a peer",
            "mute": f"it has answered no request for its stack for {MUTE_S:.0f}s (uninterruptible sleep?)",
            "unanswered": f"it has been silent over {self.wait_limit_s:.0f}s and answers no stack request",
            "waiting": f"it has waited for a peer on another node over {self.wait_limit_s:.0f}s",
        }[verdict.state]
        silent = record.silent_s(now)
        message = (
            f"rank {record.rank} on {self.host} made no progress for {silent:.1f}s in {record.phase} "
            f"after step {record.step} (limit {record.limit_s:.1f}s); {why}: killing it (pid {record.pid}) "
            "so that torchrun restarts the group from the newest snapshot"
        )
        self.say(message, record, verdict.state, silent, frames)
        self.collect_dumps()
        for sig in (signal.SIGCONT, signal.SIGKILL):
            if not signal_rank(record, sig):
                break
        self.removed.add(record.pid)

    def collect_dumps(self) -> None:
        """Where collectives are recorded, every rank of the node stores its flight
        recorder's dump before the kill (`trainer.distributed.flight_recorder`); a rank that
        cannot answer (stopped, or the one hung with the GIL) costs `DUMP_WAIT_S`."""
        if not recording():
            return
        ranks = [record.rank for record in read_records(self.folder)]
        request_dumps(self.folder, ranks)
        deadline = time.monotonic() + DUMP_WAIT_S
        while time.monotonic() < deadline and not answered(self.folder, ranks):
            time.sleep(0.05)

    def say(self, message: str, record: Record, state: str, silent: float, frames: list[str]) -> None:
        if self.log_format == "json":
            document = {
                "time": round(time.time(), 3),
                "level": "error",
                "rank": record.rank,
                "event": "hang",
                "message": message,
                "host": self.host,
                "phase": record.phase,
                "step": record.step,
                "silent_s": round(silent, 2),
                "limit_s": round(record.limit_s, 2),
                "state": state,
                "stack": frames,
            }
            write_line(json.dumps(document), sys.stdout)
            return
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        lines = [f"{stamp} watchdog: {message}"]
        if frames:
            lines.append(f"watchdog: rank {record.rank}'s main thread, most recent call first:")
            lines += [f"    {frame}" for frame in frames]
        write_line("\n".join(lines))


def write_verdicts(folder: Path, now: float, states: dict[str, str]) -> None:
    with contextlib.suppress(OSError):  # the folder goes with the generation
        staging = folder / f".{VERDICTS_FILE}.tmp"
        staging.write_text(json.dumps({"at": now, "states": states}))
        staging.replace(folder / VERDICTS_FILE)


def pod_health(base: Path, now: float | None = None) -> tuple[bool, str]:
    """The liveness verdict of this pod's ranks (every generation's records under `base`):
    unhealthy once a live rank has been silent for twice its limit, when the watchdog,
    which acts at once its limit passes, has not found it merely waiting for a peer
    elsewhere (or has stopped answering itself)."""
    now = time.monotonic() if now is None else now
    for folder in sorted(base.glob("restart-*")):
        verdicts: dict[str, object] = {}
        with contextlib.suppress(OSError, ValueError):
            verdicts = json.loads((folder / VERDICTS_FILE).read_text())
        fresh = now - float(verdicts.get("at", -1e9)) < VERDICTS_FRESH_S
        states = verdicts.get("states", {}) if fresh else {}
        for record in read_records(folder):
            if record.silent_s(now) <= LIVENESS_LIMITS * record.limit_s or not rank_alive(record):
                continue
            if record.phase == "done" or states.get(str(record.rank)) == "waiting":
                continue
            return False, (
                f"rank {record.rank} made no progress for {record.silent_s(now):.0f}s in {record.phase} "
                f"after step {record.step} (limit {record.limit_s:.1f}s)"
            )
    return True, "ok"


def watch(watchdog: Watchdog, poll_s: float, running: threading.Event) -> None:
    """Check every `poll_s` while `running` is set."""
    while running.is_set():
        try:
            watchdog.check()
        except Exception as error:  # one bad look must not end the watching
            write_line(f"watchdog: a check failed ({error!r}); watching on")
        time.sleep(poll_s)


def start_watchdog(folder: Path, log_format: str, poll_s: float, wait_limit_s: float) -> subprocess.Popen:
    """This node's watchdog, a child of the node's first rank that outlives its freezing
    (its own session: torchrun's kill of the workers' groups does not reach it) and ends
    with its exit (its stdin closes)."""
    return subprocess.Popen(
        [sys.executable, "-m", "trainer.distributed.watchdog", str(folder), "--format", log_format,
         "--poll-s", str(poll_s), "--wait-limit-s", str(wait_limit_s)],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.distributed.watchdog", description=__doc__)
    parser.add_argument("folder", type=Path, help="this node's heartbeat records")
    parser.add_argument("--poll-s", type=float, default=0.5)
    parser.add_argument("--wait-limit-s", type=float, default=600.0)
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--host", default=socket.gethostname())
    args = parser.parse_args(argv)
    running = threading.Event()
    running.set()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the trainer
    watchdog = Watchdog(args.folder, args.host, args.wait_limit_s, args.format)
    watcher = threading.Thread(target=watch, args=(watchdog, args.poll_s, running), daemon=True)
    watcher.start()
    sys.stdin.buffer.read()  # until the parent exits
    running.clear()
    watcher.join()
    remove_generation(args.folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
