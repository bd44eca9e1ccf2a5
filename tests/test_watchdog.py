"""A rank that stops making progress: found from its heartbeat record by the node's
watchdog, named with its stack, killed, and the run resumes bit-exact. Real processes
throughout: the watchdog's own tests judge real stopped, sleeping and waiting processes;
the runs are real torchrun jobs, a rank stopped with SIGSTOP or stalled in its forward."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import json_records, process_env, s3_env, torchrun_command

from benchmarks.fault_proxy import FaultProxy
from benchmarks.trial_record import final_state, same_state
from operator_scripts.reports.flight_recorder import main as flight_recorder
from trainer.config import WatchdogConfig
from trainer.distributed.heartbeat import CHECKPOINT, STEP, VALIDATION, Heartbeat, PhaseLimits, read_records
from trainer.distributed.watchdog import (
    MUTE_S,
    OWN_FREEZE_S,
    REJUDGE_S,
    RESTART_QUIET_S,
    VERDICTS_FILE,
    Watchdog,
)

# ------------------------------------------------------------------ limits and records


def test_a_phase_may_take_a_multiple_of_its_longest_recent_time_and_at_least_the_floor():
    limits = PhaseLimits(WatchdogConfig(multiple=5, floor_s=2, first_s=300))
    assert limits.limit(STEP) == 300  # not seen yet
    for seconds in (0.1, 0.9, 0.2):
        limits.observe(STEP, seconds)
    assert limits.limit(STEP) == pytest.approx(4.5)
    for _ in range(200):  # two buckets of steps later the slow one is forgotten
        limits.observe(STEP, 0.1)
    assert limits.limit(STEP) == 2  # the floor
    limits.observe(VALIDATION, 3.0)
    assert limits.limit(VALIDATION) == 15
    fixed = PhaseLimits(WatchdogConfig(timeout_s=42))
    fixed.observe(STEP, 0.1)
    assert fixed.limit(STEP) == 42


def test_a_record_reads_back_what_the_rank_wrote(tmp_path):
    heartbeat = Heartbeat(tmp_path, 3, WatchdogConfig(floor_s=1))
    heartbeat.beat(7)
    heartbeat.beat(8)
    (record,) = read_records(tmp_path)
    assert (record.pid, record.rank, record.step, record.phase) == (os.getpid(), 3, 8, STEP)
    assert record.limit_s == 1 and not record.overdue(time.monotonic())
    with heartbeat.phase(VALIDATION, limit_s=0.01):
        time.sleep(0.05)
        (inside,) = read_records(tmp_path)
        assert inside.phase == VALIDATION and inside.overdue(time.monotonic())
    heartbeat.close()
    assert read_records(tmp_path) == []


def test_a_phase_inside_another_gives_it_back_its_limit(tmp_path):
    heartbeat = Heartbeat(tmp_path, 0, WatchdogConfig(floor_s=1))
    heartbeat.enter("finish", limit_s=600)  # a stop's long wait for its upload
    with heartbeat.phase(CHECKPOINT):
        (inside,) = read_records(tmp_path)
        assert inside.phase == CHECKPOINT
    (after,) = read_records(tmp_path)
    assert (after.phase, after.limit_s) == ("finish", 600)
    heartbeat.close()


# ------------------------------------------------------------- the watchdog's judgement

RANK_PROCESS = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    from trainer.config import WatchdogConfig
    from trainer.distributed.heartbeat import Heartbeat

    def wait_for_peers():  # what a rank blocked in a collective shows
        time.sleep(600)

    def deadlock():  # what a hung rank shows
        time.sleep(600)

    heartbeat = Heartbeat(Path(sys.argv[1]), int(sys.argv[2]), WatchdogConfig(timeout_s=0.5))
    heartbeat.beat(1)
    heartbeat.beat(2)  # step 2 seen, so its limit is the fixed 0.5 s
    print("ready", flush=True)
    def mute():  # what a rank in uninterruptible sleep shows: it answers no signal it can catch
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        time.sleep(600)

    {"wait": wait_for_peers, "hang": deadlock, "spin": lambda: time.sleep(600), "mute": mute}[sys.argv[3]]()
    """
)


def start_rank(folder: Path, rank: int, behaviour: str) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", RANK_PROCESS, str(folder), str(rank), behaviour],
        env=process_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().strip() == "ready"
    return process


PID_REUSED = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path
    from trainer.config import WatchdogConfig
    from trainer.distributed.heartbeat import Heartbeat, rank_alive, read_records, signal_rank
    from trainer.distributed.watchdog import Watchdog

    folder = Path(sys.argv[1])
    rank = os.fork()
    if rank == 0:
        heartbeat = Heartbeat(folder, 1, WatchdogConfig(timeout_s=0.1))
        heartbeat.beat(1)
        heartbeat.beat(2)
        os._exit(0)  # gone without saying so, as a SIGKILLed rank goes
    os.waitpid(rank, 0)
    time.sleep(0.05)  # a start is counted in clock ticks of 10 ms: the next one starts later
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(rank - 1))  # the next fork gets its pid
    stranger = os.fork()
    if stranger == 0:
        time.sleep(60)
        os._exit(0)
    time.sleep(0.3)  # the dead rank's step is overdue
    (record,) = read_records(folder)
    removed = Watchdog(folder, "node-a", wait_limit_s=60).check()
    signalled = signal_rank(record, signal.SIGKILL)
    print(json.dumps({
        "same_pid": record.pid == stranger, "alive": rank_alive(record), "removed": len(removed),
        "signalled": signalled, "stranger_runs": os.waitpid(stranger, os.WNOHANG) == (0, 0),
    }))
    os.kill(stranger, signal.SIGKILL)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a pid namespace whose next pid it sets")
def test_a_dead_ranks_pid_taken_by_another_process_is_never_signalled(tmp_path):
    """A rank that died leaves its record, and its pid soon goes to another process (pid_max
    is 32768 here, and a busy node goes through it in minutes: the suite's unrelated ranks
    were SIGKILLed so once). In a pid namespace of its own the test hands the dead rank's
    pid to a new process on purpose: the watchdog does not judge it, nothing signals it."""
    command = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", PID_REUSED, str(tmp_path)]
    done = subprocess.run(command, env=process_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["same_pid"], seen  # the pid was handed on, as it is on a busy node
    assert seen == {"same_pid": True, "alive": False, "removed": 0, "signalled": False, "stranger_runs": True}
    assert "made no progress" not in done.stderr, done.stderr


def test_a_stopped_rank_is_named_with_its_stack_and_killed(tmp_path, capsys):
    rank = start_rank(tmp_path, 1, "spin")
    try:
        rank.send_signal(signal.SIGSTOP)
        watchdog = Watchdog(tmp_path, "node-a", wait_limit_s=60)
        assert watchdog.check() == []  # within its limit
        time.sleep(0.6)
        (removed,) = watchdog.check()
        assert rank.wait(timeout=10) == -signal.SIGKILL
    finally:
        rank.kill()
    line, *stack = capsys.readouterr().err.splitlines()
    assert removed.rank == 1
    assert "rank 1 on node-a made no progress for" in line
    assert "in step after step 2 (limit 0.5s); its process is stopped" in line
    assert any('File "<string>"' in frame for frame in stack), stack  # answered once let run


def test_a_rank_that_answers_no_stack_request_is_asked_again_and_blamed_only_after_mute_s(tmp_path, capsys):
    """A rank starved of CPU writes its stack late: one unanswered request blames no one
    (beside the busy suite a waiting rank was killed so); a rank that answers none for
    MUTE_S, as one in uninterruptible sleep, is named and killed."""
    rank = start_rank(tmp_path, 1, "mute")
    try:
        time.sleep(0.6)
        watchdog = Watchdog(tmp_path, "node-a", wait_limit_s=60)
        now = time.monotonic()
        assert watchdog.check(now) == [] and watchdog.check(now + MUTE_S - 1) == []
        assert json.loads((tmp_path / VERDICTS_FILE).read_text())["states"] == {"1": "unanswered"}
        assert rank.poll() is None
        (removed,) = watchdog.check(now + MUTE_S)
        assert removed.rank == 1 and rank.wait(timeout=10) == -signal.SIGKILL
    finally:
        rank.kill()
    line = capsys.readouterr().err.splitlines()[0]
    assert f"it has answered no request for its stack for {MUTE_S:.0f}s" in line, line


def test_a_watchdog_that_was_frozen_with_its_node_blames_no_rank_when_thawed(tmp_path, capsys):
    rank = start_rank(tmp_path, 1, "spin")
    try:
        rank.send_signal(signal.SIGSTOP)
        time.sleep(0.6)  # past its limit, as every rank of a node that was frozen is
        watchdog = Watchdog(tmp_path, "node-a", wait_limit_s=60)
        watchdog.last_look = time.monotonic() - 2 * OWN_FREEZE_S  # its last look, before the freeze
        assert watchdog.check() == []
        assert watchdog.check(time.monotonic() + RESTART_QUIET_S - 1) == []
        (removed,) = watchdog.check(time.monotonic() + RESTART_QUIET_S)  # quiet only for a while
        assert removed.rank == 1
    finally:
        rank.kill()
    assert "rank 1 on node-a" in capsys.readouterr().err


def test_a_rank_waiting_for_peers_is_not_blamed_and_the_hung_one_is(tmp_path, capsys):
    waiting, hung = start_rank(tmp_path, 0, "wait"), start_rank(tmp_path, 1, "hang")
    try:
        time.sleep(0.6)
        watchdog = Watchdog(tmp_path, "node-a", wait_limit_s=3)
        assert [record.rank for record in watchdog.check()] == [1]
        assert hung.wait(timeout=10) == -signal.SIGKILL
        assert waiting.poll() is None
        line = capsys.readouterr().err.splitlines()[0]
        assert "rank 1 on node-a" in line and "its main thread is not waiting for a peer" in line
        assert watchdog.check(time.monotonic() + RESTART_QUIET_S - 1) == []  # the group restarts meanwhile
        # past the wait limit: the peer it waits for will not come
        assert [record.rank for record in watchdog.check(time.monotonic() + RESTART_QUIET_S)] == [0]
        assert waiting.wait(timeout=10) == -signal.SIGKILL
        assert "it has waited for a peer on another node over 3s" in capsys.readouterr().err
    finally:
        waiting.kill()
        hung.kill()


def test_a_rank_found_waiting_is_asked_again_only_after_rejudge_s(tmp_path):
    """Each ask for a stack interrupts the rank (SIGUSR1): one found waiting, its record
    unchanged, keeps that verdict for REJUDGE_S, and the pod's liveness still reads it."""
    waiting = start_rank(tmp_path, 0, "wait")
    try:
        time.sleep(0.6)
        watchdog = Watchdog(tmp_path, "node-a", wait_limit_s=60)
        asked, ask = [], watchdog.stack
        watchdog.stack = lambda record, **options: asked.append(record.rank) or ask(record, **options)
        now = time.monotonic()
        for later in (0.0, 1.0, 2.0, REJUDGE_S - 0.5):
            assert watchdog.check(now + later) == []
            assert json.loads((tmp_path / VERDICTS_FILE).read_text())["states"] == {"0": "waiting"}
        assert asked == [0]
        assert watchdog.check(now + REJUDGE_S) == [] and asked == [0, 0]
        assert waiting.poll() is None
    finally:
        waiting.kill()


# ------------------------------------------------------------------------ whole runs

RUN = (
    "model.name=plugins:stalling_model,model.dropout=0.3,train.epochs=4,log.every_steps=1,"
    "log.format=json,metrics.port=0,checkpoint.every_steps=1000,checkpoint.snapshot_every_steps=5"
)


def launch(workdir: Path, overrides: str, *, restarts: int = 1, env: dict | None = None) -> subprocess.Popen:
    command = torchrun_command(["--set", overrides], nproc=2)
    command.insert(command.index("--standalone") + 1, f"--max-restarts={restarts}")
    return subprocess.Popen(
        command,
        cwd=workdir,
        env=env or process_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def worker_of(agent: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(agent.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "trainer" in child.cmdline():
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no worker of rank {rank}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One uninterrupted run of the job the fault runs repeat."""
    workdir = tmp_path_factory.mktemp("reference")
    uri = workdir / "checkpoints"
    overrides = f"{RUN},checkpoint.uri={uri},checkpoint.snapshot_dir={workdir / 'snapshots'}"
    seen, stderr = json_records(launch(workdir, overrides, restarts=0))
    assert seen[-1]["event"] == "summary", stderr[-3000:]
    return final_state(uri)


def resumed_from(seen: list[dict]) -> dict:
    (plan,) = [record for record in seen if record.get("event") == "plan" and record.get("resumed_from")]
    return plan


@pytest.mark.slow
@pytest.mark.alone
def test_a_stopped_rank_is_found_within_seconds_and_the_run_ends_bit_exact(workdir, reference):
    uri = workdir / "checkpoints"
    overrides = f"{RUN},checkpoint.uri={uri},checkpoint.snapshot_dir={workdir / 'snapshots'}"
    agent = launch(workdir, overrides)
    stopped: dict = {}

    def stop_rank_1(record: dict) -> None:
        if not stopped and record.get("event") == "progress" and record["step"] >= 30:
            worker_of(agent, 1).send_signal(signal.SIGSTOP)
            stopped.update(step=record["step"], at=time.monotonic())
        if record.get("event") == "hang":
            stopped["found_after_s"] = time.monotonic() - stopped["at"]

    seen, stderr = json_records(agent, stop_rank_1)
    assert agent.returncode == 0, stderr[-3000:]
    (hang,) = [record for record in seen if record.get("event") == "hang"]
    assert (hang["rank"], hang["state"]) == (1, "stopped")
    assert hang["step"] >= stopped["step"] - 1 and hang["phase"] in {"step", "checkpoint"}
    assert stopped["found_after_s"] < 10  # the harness's clock, from the SIGSTOP to the line
    plan = resumed_from(seen)
    assert plan["resume_origin"].startswith("snapshot on")
    assert stopped["step"] - plan["resumed_from"] <= 5  # at most one snapshot interval seen lost
    assert same_state(final_state(uri), reference)


@pytest.mark.slow
@pytest.mark.alone  # its step limits, as the stopped rank's: beside the suite the run ended otherwise
def test_a_rank_stalled_in_its_forward_is_blamed_not_the_one_waiting_for_it(workdir, reference, capsys):
    """With the flight recorder on, both ranks' collectives are kept beside the checkpoints
    before the kill, and `ddp-ops flight-recorder` names rank 1 as the one that never
    reached the all-reduce rank 0 waits in."""
    uri = workdir / "checkpoints"
    stall = "model.options.rank=1,model.options.stall_at=40,model.options.stall_s=600"
    overrides = f"{RUN},{stall},checkpoint.uri={uri},checkpoint.snapshot_dir={workdir / 'snapshots'}"
    seen, stderr = json_records(
        launch(workdir, overrides, env={**process_env(), "TORCH_FR_BUFFER_SIZE": "200"})
    )
    assert seen[-1]["event"] == "summary", stderr[-3000:]
    (hang,) = [record for record in seen if record.get("event") == "hang"]
    assert (hang["rank"], hang["state"], hang["step"]) == (1, "hung", 39)
    assert "its main thread is not waiting for a peer" in hang["message"]
    assert "plugins.py" in hang["stack"][0] and "in forward" in hang["stack"][0]
    assert 39 - resumed_from(seen)["resumed_from"] <= 5
    assert same_state(final_state(uri), reference)

    assert flight_recorder([str(uri), "--out", str(workdir / "dumps")]) == 0
    report = capsys.readouterr().out
    assert "/restart-0: ranks 0, 1" in report, report
    assert re.search(r"collective #\d+ \(gloo:all_reduce.* never reached by rank 1 at #\d+", report), report


@pytest.mark.slow
@pytest.mark.alone  # a 0.5 s floor: a busy machine alone can stretch a step past it
def test_slow_validation_checkpoint_and_resume_download_are_no_hang(s3_bucket, workdir):
    """Each of them takes over 20 steps' time and longer than a step's limit (a floor of
    0.5 s): they are phases of their own. While rank 0 uploads alone, rank 1 waits in its
    next step past that step's limit: waiting, it is not blamed."""
    slow_objects = lambda method, path: "checkpoint.pt" in path  # noqa: E731
    with FaultProxy(s3_bucket.endpoint, every=0, matches=slow_objects, delay_s=1.5) as proxy:
        env = s3_env(proxy.url, TMPDIR=str(workdir))
        overrides = (
            f"{RUN},model.options.eval_delay_s=0.5,watchdog.floor_s=0.5,checkpoint.async_save=false,"
            f"checkpoint.snapshot_every_steps=0,checkpoint.every_steps=10,checkpoint.uri={s3_bucket.uri('slow')}"
        )
        started = time.monotonic()
        first, stderr = json_records(launch(workdir, f"{overrides},train.max_steps=30", restarts=0, env=env))
        assert first[-1]["event"] == "summary", stderr[-3000:]
        second, stderr = json_records(launch(workdir, f"{overrides},train.max_steps=40", restarts=0, env=env))
        assert second[-1]["event"] == "summary", stderr[-3000:]
    assert time.monotonic() - started > 10  # the delays were real: 4 uploads, a download, validations
    assert resumed_from(second)["resumed_from"] == 30
    assert [record for record in first + second if record.get("event") == "hang"] == []
    assert s3_bucket.latest_step("slow") == 40
