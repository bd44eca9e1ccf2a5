"""`ddp-launch`, what each pod runs: the config checked before torchrun, the rendezvous host
waited for, and the pods' name resolution that `ddp-ops local` gives them."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import free_port, process_env

from operator_scripts.local.pods import HostsTable, LocalError
from operator_scripts.local.runtimes.process import check_sandbox, sandbox_command
from trainer.distributed.recurrence import CRASH_DIR_ENV, Crash, RecurringCrash, check_recurrence
from trainer.launcher.launch import RendezvousWaitLine, nnodes, parse_args, trainer_arguments
from trainer.launcher.rendezvous_host import StoreProbe, rendezvous_host, store_address
from trainer.launcher.torchrun_output import relay
from trainer.termination_message import MESSAGE_PATH_ENV

TRAINER = ["-m", "trainer", "--config", "digits", "--set", "train.epochs=1"]


def test_options_and_the_trainers_arguments_are_split_at_the_double_dash():
    options, torchrun = parse_args(["--rendezvous-wait", "30", "--", "--nnodes=2", *TRAINER])
    assert (options.rendezvous_wait, options.relaunches) == (30, 3)
    assert trainer_arguments(torchrun) == TRAINER[2:]
    assert trainer_arguments(["--standalone", "script.py"]) == []


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        ([], {"PET_RDZV_ENDPOINT": "job-worker-0:23456"}, ("job-worker-0", "23456")),
        (["--rdzv-endpoint=other:1"], {"PET_RDZV_ENDPOINT": "job-worker-0:23456"}, ("other", "1")),
        (["--rdzv_endpoint", "other"], {}, ("other", "29400")),
        (["--standalone"], {"PET_RDZV_ENDPOINT": "job-worker-0:23456"}, None),
        ([], {"PET_RDZV_ENDPOINT": "localhost:23456"}, None),
        ([], {"PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456", "PET_NODE_RANK": "1"},
         ("job-master-0", "23456")),
        ([], {"PET_MASTER_ADDR": "job-master-0", "PET_NODE_RANK": "0"}, None),
    ],
)  # fmt: skip
def test_the_host_a_pod_waits_for(args, env, expected):
    assert rendezvous_host(args, env) == expected


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        ([], {"PET_RDZV_ENDPOINT": "localhost:23456"}, ("localhost", "23456")),  # this host's, still asked
        ([], {"PET_MASTER_ADDR": "job-master-0", "PET_NODE_RANK": "0"}, ("job-master-0", "29500")),
        (["--standalone"], {"PET_RDZV_ENDPOINT": "job-worker-0:23456"}, None),
    ],
)  # fmt: skip
def test_the_store_a_lost_host_is_waited_for_at(args, env, expected):
    assert store_address(args, env) == expected


@pytest.mark.slow
def test_a_store_probe_answers_while_its_server_runs_and_not_while_it_is_stopped(tmp_path):
    """A real TCPStore server in a process of its own, stopped as a frozen node's would be: a
    call to it would block for good, so the probe says no within its bound, holds one thread
    however often it is asked, and says yes once the server runs again."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, datetime, torch.distributed as d; "
         "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, wait_for_workers=False, "
         "timeout=datetime.timedelta(seconds=60)); print('up', flush=True); time.sleep(600)", str(port)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout.readline().strip() == "up"
        probe = StoreProbe("127.0.0.1", str(port), within_s=2.0)
        assert probe.answers()
        os.kill(server.pid, signal.SIGSTOP)
        time.sleep(0.3)
        started = time.monotonic()
        assert not probe.answers() and not probe.answers()
        assert 4.0 <= time.monotonic() - started < 8.0  # each look waits its bound, no more
        blocked = probe.pending
        assert blocked.is_alive()
        assert not probe.answers() and probe.pending is blocked  # no second thread meanwhile
        os.kill(server.pid, signal.SIGCONT)
        blocked.join(10)
        assert probe.answers()
        server.kill()
        server.wait()
        assert not probe.answers()  # nothing listens: refused
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [(["--nnodes=1:2"], {"PET_NNODES": "4"}, "1:2"), (["--nnodes", "2"], {}, "2"),
     ([], {"PET_NNODES": "2:3"}, "2:3"), (["--standalone"], {}, "1")],
)  # fmt: skip
def test_the_node_bounds_ddp_launch_passes_on_are_torchruns(args, env, expected):
    assert nnodes(args, env) == expected


def test_a_wait_for_nodes_is_said_at_a_steady_interval_and_no_more_once_workers_run():
    waiting = RendezvousWaitLine(30.0, "2", "job-worker-0:23456")
    assert waiting.look(True, 0.0) is None
    seen = {at: waiting.look(False, at) for at in (10.0, 39.0, 40.0, 41.0, 69.0, 70.0)}
    assert [at for at, line in seen.items() if line] == [40.0, 70.0]
    assert seen[40.0] == (
        "torchrun has run no worker for 30s: it waits in its rendezvous at job-worker-0:23456 for at least "
        "2 nodes (--nnodes=2); a lost node counts again once it answers or its pod is replaced"
    )
    assert "for 60s" in seen[70.0]
    assert waiting.look(True, 80.0) is None and waiting.look(False, 100.0) is None  # a new wait starts
    assert "for 30s" in waiting.look(False, 130.0)
    assert RendezvousWaitLine(0.0, "2", "x").look(False, 1000.0) is None  # --waiting-line-s=0: never


def launch(*args: str, cwd, env: dict | None = None, prefix: list[str] = (), timeout: float = 60):
    return subprocess.run(
        [*prefix, sys.executable, "-m", "trainer.launcher.launch", *args],
        cwd=cwd,
        env=process_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_bad_config_exits_2_in_one_line_before_torchrun_starts(tmp_path):
    started = time.monotonic()
    done = launch("--", "--standalone", *TRAINER, "--set", "train.batch_size=0", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "trainer: error: train.batch_size=0: must be greater than 0"
    assert time.monotonic() - started < 30


def test_an_unwritable_checkpoint_folder_exits_2_in_one_line(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    done = launch("--", "--standalone", *TRAINER, "--set", f"checkpoint.uri={blocked}/run", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"trainer: error: checkpoint.uri='{blocked}/run': not writable")


@pytest.fixture
def hosts(tmp_path):
    table = HostsTable(tmp_path / "etc-hosts")
    try:
        check_sandbox(table)
    except LocalError as error:  # as test_local.py, which runs pods in the same sandboxes
        pytest.fail(str(error))
    return table


def resolves(hosts: HostsTable, name: str) -> bool:
    code = f"import socket; socket.getaddrinfo({name!r}, 1)"
    return subprocess.run([*sandbox_command("pod-a", hosts), sys.executable, "-c", code]).returncode == 0


def test_a_pods_name_resolves_only_while_it_is_in_the_table(hosts):
    """The sandbox's /etc/hosts is the job's table and nothing else is asked (no DNS)."""
    assert not resolves(hosts, "job-worker-0")
    hosts.set("job-worker-0", "127.0.0.2")
    assert resolves(hosts, "job-worker-0")
    hosts.set("job-worker-0", None)
    assert not resolves(hosts, "job-worker-0")
    hostname = subprocess.run(
        [*sandbox_command("job-worker-1", hosts), "hostname"], capture_output=True, text=True
    )
    assert hostname.stdout.strip() == "job-worker-1"


def test_a_host_whose_own_name_does_not_resolve_exits_2_in_one_line(hosts, tmp_path):
    """As a container run with --network none and no /etc/hosts entry: torchrun would retry
    its own name for 300 s; the launcher says so at once."""
    started = time.monotonic()
    done = launch(
        "--", "--standalone", *TRAINER, env={"HOME": str(tmp_path)},
        prefix=sandbox_command("nameless", hosts), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("ddp-launch: error: this host's name 'nameless' does not resolve")
    assert time.monotonic() - started < 30


def test_a_pod_waits_for_the_host_in_one_line_then_gives_up(hosts, tmp_path):
    hosts.set("job-worker-1", "127.0.0.3")  # its own name, as the kubelet's /etc/hosts has it
    done = launch(
        "--rendezvous-wait", "2", "--", *TRAINER,
        env={"PET_RDZV_ENDPOINT": "job-worker-0:23456", "PET_NNODES": "2:2", "HOME": str(tmp_path)},
        prefix=sandbox_command("job-worker-1", hosts), cwd=tmp_path,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert len(lines) == 2 and "waiting for the rendezvous host job-worker-0:23456" in lines[0]
    assert "did not resolve within 2s" in lines[1]


@pytest.mark.slow
def test_a_config_error_found_inside_the_workers_stops_torchrun_at_once(tmp_path):
    """A mistake only the trainer can see (the checkpoint holds another model) is reported
    by the workers; ddp-launch stops torchrun instead of letting it restart them, and exits 2."""
    said = tmp_path / "termination-log"  # as the kubelet mounts it, where the chart points ddp-launch
    message = {MESSAGE_PATH_ENV: str(said)}
    first = launch(
        "--", "--standalone", "--nproc_per_node=2", *TRAINER, "--set", "train.max_steps=2",
        cwd=tmp_path, env=message,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    summary = [line for line in first.stdout.splitlines() if " done: 2 steps" in line]
    assert summary and said.read_text() == summary[0].partition("Z ")[2] + "\n"  # rank 0's last line
    started = time.monotonic()
    args = [
        "--",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=3",
        *TRAINER,
        "--set",
        "model.width=16",
    ]
    second = launch(*args, cwd=tmp_path, timeout=120, env=message)
    assert second.returncode == 2 and time.monotonic() - started < 60
    errors = [line for line in second.stderr.splitlines() if line.startswith("trainer: error:")]
    assert errors == [
        "trainer: error: model.width=16: step 2 in checkpoints/digits-cnn was trained with model.width=32, "
        "which this run cannot change: resume with model.width=32, or start over in another checkpoint.uri"
    ]
    assert said.read_text() == errors[0] + "\n"  # what `kubectl describe pod` shows
    assert "restart 1" not in second.stdout and "Traceback" not in second.stderr


@pytest.mark.slow
def test_an_io_error_that_recurs_after_a_restart_is_permanent(tmp_path):
    """A sample that cannot be read fails the same step every time. Its OSError is worth a
    restart, and its line says so; torchrun restarts the workers once, the error comes back
    at the same step, and ddp-launch stops in one line, exit 2, with no second restart and
    no relaunch of torchrun. No traceback is shown: each is in the file its line names."""
    poisoned = "data.name=plugins:poisoned_digits,data.options.bad_index=100"
    args = ["--", "--standalone", "--nproc_per_node=2", "--max-restarts=3", *TRAINER, "--set", poisoned]
    done = launch(*args, cwd=tmp_path, timeout=180)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "trainer: error:" in line]
    where = r"OSError: sample 100 is unreadable at \S+/plugins\.py:\d+ in __getitem__"
    first, last = errors[0], errors[-1]
    assert len(errors) == 2, done.stderr[-3000:]
    assert re.search(rf"raised {where}; an I/O error, which the job's restarts retry", first), first
    assert re.fullmatch(
        rf"trainer: error: the run failed at step \d+ \(step\) with {where}, as in the attempt before "
        r"this restart: a restart cannot fix it; fix the code or data, then start the job again",
        last,
    ), last
    assert "relaunch" not in done.stderr and "restart 2" not in done.stdout and "restart 1" in done.stdout
    assert "Traceback" not in done.stderr


def test_a_crash_is_permanent_only_where_it_repeats_at_the_same_step(tmp_path, monkeypatch):
    monkeypatch.setenv(CRASH_DIR_ENV, str(tmp_path / "crashes"))
    first = Crash.of(ValueError("sample 100 is corrupt\nmore detail"), 12, "step")
    assert first == Crash(12, "step", "ValueError: sample 100 is corrupt")
    check_recurrence(0, first)
    check_recurrence(1, Crash(30, "step", first.error))  # another rank's record is its own
    check_recurrence(0, Crash(13, "step", first.error))  # a step further: bad luck, not a bug
    check_recurrence(0, first)  # the record now says step 13
    with pytest.raises(RecurringCrash, match="failed at step 12 \\(step\\) with ValueError"):
        check_recurrence(0, first)
    monkeypatch.delenv(CRASH_DIR_ENV)
    check_recurrence(0, first)  # without ddp-launch's folder nothing is remembered


ORPHANS = """
import os, subprocess, sys, time
import psutil
from trainer.launcher.process_tree import adopt_orphans, has_children, reap_orphans

adopt_orphans()
# a child that starts a grandchild and exits at once: the grandchild is an orphan
start = "import subprocess; print(subprocess.Popen(['sleep', '0.5']).pid)"
middle = subprocess.Popen([sys.executable, "-c", start], stdout=subprocess.PIPE, text=True)
orphan = int(middle.stdout.readline())
middle.wait()
time.sleep(0.2)
adopted = psutil.Process(orphan).ppid() == os.getpid()
time.sleep(0.6)  # the orphan has exited: a zombie until reaped
zombie = psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
reap_orphans(keep=-1)
# torchrun's own exit is its Popen's to collect: reaped here, its code would read 0
kept = subprocess.Popen(["false"])
time.sleep(0.3)
reap_orphans(keep=kept.pid)
sleeper = subprocess.Popen(["sleep", "1"])
print(adopted, zombie, psutil.pid_exists(orphan), kept.wait())
print(has_children(os.getpid()), has_children(sleeper.pid))
"""


@pytest.mark.slow
def test_ddp_launch_adopts_the_orphans_of_its_pod_and_reaps_them():
    """A process whose parent ended (the fork server after the worker that started it, a
    writer of a killed worker) is re-parented to ddp-launch, not the host's init, so the
    pod stays one tree, and its exit status is collected: no zombie is left, and torchrun's
    exit code is left to its Popen. Whether torchrun runs workers is read from its children."""
    completed = subprocess.run(
        [sys.executable, "-c", ORPHANS], env=process_env(), capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.split() == ["True", "True", "False", "1", "True", "False"]


SIGNAL_CHAIN = b"""Traceback (most recent call last):
  File "run.py", line 1, in main
torch.distributed.elastic.multiprocessing.api.SignalException: Process 7 got signal: 15

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "run.py", line 2, in main
torch.distributed.elastic.multiprocessing.api.SignalException: Process 7 got signal: 15
"""
CRASH = b"""Traceback (most recent call last):
  File "train.py", line 3, in step
ValueError: sample 100 is corrupt
"""


@pytest.mark.parametrize("stopping", [[15], []])
def test_a_stopping_pod_leaves_out_torchruns_chained_report_of_the_signal_only(stopping, capsysbinary):
    """torchrun's report of SIGTERM can be a chain of tracebacks; its separators used to slip
    through the filter ('During handling of the above exception...' in a deleted pod's log)."""
    said: list[bytes] = []
    relay(io.BytesIO(SIGNAL_CHAIN + b"a line\n" + CRASH), stopping, said)
    written = capsysbinary.readouterr().err
    if stopping:
        assert written == b"a line\n" + CRASH
    else:
        assert written == SIGNAL_CHAIN + b"a line\n" + CRASH
    assert said == []


def test_after_a_workers_permanent_error_only_error_lines_are_relayed(capsysbinary):
    """ddp-launch kills torchrun after a permanent error; meanwhile its agent may print a
    peer pod's store going away, with c10d's C++ stack: seen in a pod's log beside the line."""
    teardown = (
        b"[W1204 03:35:36.138621009 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on SocketImpl\n"
        b"frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7f7c20b7db8d in libc10.so)\n"
    )
    error = b"[rank 1] trainer: error: model.name='m': one batch fails\n"
    relay(io.BytesIO(b"a line\n" + error + teardown + error[9:]), [], said := [])
    assert capsysbinary.readouterr().err == b"a line\n" + error + error[9:]
    assert said == [error[9:]]


def test_torchruns_report_of_workers_that_left_on_purpose_is_left_out_once(capsysbinary, tmp_path):
    """A node whose peer was lost ends its ranks on purpose (its own line says why) and notes
    it; torchrun's `failed (exitcode: 1)` for that round read like a crash in the pod's log.
    The note is taken by the report it explains: the next round's failure is shown."""
    failed = (
        b"E1206 21:25:06.859000 27599 torch/distributed/elastic/multiprocessing/api.py:1002] "
        b"failed (exitcode: 1) local_rank: 0 (pid: 27607) of binary: /venv/bin/python\n"
    )
    left = tmp_path / "ddp-launch-7.left"
    left.write_text("its node left the group\n")
    relay(io.BytesIO(b"a line\n" + failed + failed), [], [], left)
    assert capsysbinary.readouterr().err == b"a line\n" + failed and not left.exists()
