"""`ddp-ops local` takes its pods with it, whatever ends it: SIGTERM, a terminal's SIGINT,
or a SIGKILL that leaves it no say, a frozen node's pod included. Each run is the command a
user types, as a process; what is left is counted from outside, as every process whose
command line holds the run's work folder."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import CPU_VALUES, process_env

from operator_scripts.local.leftovers import check_no_leftovers
from operator_scripts.local.pods import LocalError

GRACE_S = 10  # the pods' terminationGracePeriodSeconds in these runs
PODS = ("ddp-run-ddp-trainer-worker-0", "ddp-run-ddp-trainer-worker-1")


class LocalRun:
    """`ddp-ops local` on the chart's two CPU pods, in a session of its own (as a terminal's
    foreground job is a process group of its own), its output in files."""

    def __init__(self, folder: Path, *options: str) -> None:
        folder.mkdir(parents=True)
        self.workdir, self.out, self.err = folder / "pods", folder / "stdout", folder / "stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "operator_scripts.cli", "local", "-f", str(CPU_VALUES),
                 "--workdir", str(self.workdir), "--set", f"terminationGracePeriodSeconds={GRACE_S}",
                 *options],
                env=process_env(),
                stdout=out,
                stderr=err,
                start_new_session=True,
            )  # fmt: skip

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.out.read_text() + self.err.read_text():
            assert self.process.poll() is None, f"ended before {text!r}: {self.err.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"no {text!r} in {timeout}s: {self.err.read_text()[-2000:]}"
            time.sleep(0.2)

    def pod_processes(self) -> list[psutil.Process]:
        """Every process whose command line holds the work folder (its pods' files)."""
        inside = f"{self.workdir}/"
        found = []
        for process in psutil.process_iter(["cmdline"]):
            if inside in " ".join(process.info["cmdline"] or []):
                found.append(process)
        return found

    def seconds_until_none_left(self, limit: float) -> float:
        started = time.monotonic()
        while left := self.pod_processes():
            waited = time.monotonic() - started
            assert waited < limit, f"{len(left)} pod processes still there after {waited:.1f}s: {left}"
            time.sleep(0.1)
        return time.monotonic() - started

    def ended(self) -> tuple[int, str, str]:
        code = self.process.wait(timeout=60)
        return code, self.out.read_text(), self.err.read_text()


@pytest.mark.slow
def test_sigterm_two_seconds_into_the_first_step_stops_every_pod_within_its_grace(tmp_path):
    """SIGTERM, as `timeout` and CI runners send it: every pod gets SIGTERM at once and
    none outlives its grace period; one line per pod, the job's state last, exit 143."""
    local = LocalRun(tmp_path / "run")
    local.wait_for("start-up")  # rank 0's line, printed at its first step
    time.sleep(2)
    assert len(local.pod_processes()) >= 6, local.pod_processes()  # 2 x (launcher, torchrun, rank, ...)
    local.process.send_signal(signal.SIGTERM)
    local.seconds_until_none_left(GRACE_S + 5)
    code, out, err = local.ended()
    assert code == 128 + signal.SIGTERM, err[-3000:]
    for pod in PODS:
        assert f"pod {pod} stopped (SIGTERM" in err, err[-3000:]
    assert (
        out.strip()
        .splitlines()[-1]
        .startswith("job ddp-run-ddp-trainer: stopped by SIGTERM while Running, every pod with it")
    ), out[-500:]


@pytest.mark.slow
def test_a_sigkill_with_a_frozen_node_leaves_nothing_and_the_next_run_starts_cleanly(tmp_path):
    """SIGKILL leaves `ddp-ops local` no say: its pods still end with it, the frozen
    node's stopped processes too. The next run, on the same pod subnet, reaches its first
    step, and a terminal's Ctrl-C (SIGINT to its process group) stops it; a second Ctrl-C
    cuts the pods' grace short (they take seconds to save and leave on a SIGTERM)."""
    local = LocalRun(tmp_path / "killed", "--freeze-node", "worker-1=3")
    local.wait_for("froze")
    time.sleep(1)
    stopped = [p for p in local.pod_processes() if p.status() == psutil.STATUS_STOPPED]
    assert stopped, "no process of the frozen node's pod is stopped"
    local.process.send_signal(signal.SIGKILL)
    local.seconds_until_none_left(5)

    after = LocalRun(tmp_path / "after")
    after.wait_for("start-up")
    os.killpg(after.process.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    after.wait_for("got SIGINT")
    os.killpg(after.process.pid, signal.SIGINT)
    after.seconds_until_none_left(5)
    code, out, err = after.ended()
    assert code == 128 + signal.SIGINT, err[-3000:]
    cut_short = r"stopped \(SIGTERM, SIGKILL [0-9.]+s in: a second signal cut its grace short\)"
    for pod in PODS:
        assert re.search(f"pod {pod} {cut_short}", err), err[-3000:]
    assert "stopped by SIGINT while Running" in out.strip().splitlines()[-1], out[-500:]


def test_an_orphaned_pod_process_is_named_with_the_command_that_ends_it(tmp_path):
    """A process of an earlier run's pod (its command line in that run's work folder, its
    run gone: re-parented to init) stops the next run before any pod starts, in one line."""
    workdir = tmp_path / "pods"
    marker = workdir / "worker-0" / "volumes"
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", str(marker)]
    subprocess.run(["setsid", "-f", *sleeper], check=True)  # setsid -f: orphaned at once
    (orphan,) = [
        p for p in psutil.process_iter(["cmdline"]) if str(marker) in " ".join(p.info["cmdline"] or [])
    ]
    try:
        with pytest.raises(LocalError, match=rf"left 1 processes .*`kill -KILL {orphan.pid}`"):
            check_no_leftovers(workdir)
    finally:
        orphan.kill()
        orphan.wait(5)
    check_no_leftovers(workdir)  # nothing left: no error


def test_the_keeper_runs_its_clean_up_when_its_run_is_killed_and_not_after_a_clean_end(tmp_path):
    """The docker runtime's containers are the engine's: a keeper removes them when the run
    that made them is SIGKILLed. Here its clean-up makes a file, from a run killed or not."""
    program = (
        "import sys; from operator_scripts.local.keeper import Keeper; "
        "keeper = Keeper(['touch', sys.argv[1]], dict(__import__('os').environ)); "
        "print('ready', flush=True); "
        "keeper.done() if sys.argv[2] == 'clean' else __import__('time').sleep(60)"
    )
    for how in ("killed", "clean"):
        made = tmp_path / how
        run = subprocess.Popen(
            [sys.executable, "-c", program, str(made), how],
            env=process_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert run.stdout.readline() == "ready\n"
        if how == "killed":
            run.kill()
        run.wait(10)
        deadline = time.monotonic() + 10
        while how == "killed" and not made.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert made.exists() == (how == "killed"), how
