"""The fork server (trainer/launcher/forkserver.py) with real processes: torchrun's
restarted workers are forked from it and end bit for bit as an uninterrupted run; signals
and exits pass through the small client torchrun watches, both ways; a killed client takes
its child with it; a worker it cannot serve starts cold; the server ends with its agent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import free_port, json_records, load_checkpoint, process_env, run_torchrun, torchrun_command

from benchmarks.trial_record import same_state
from trainer.launcher.fork_protocol import listening, socket_path
from trainer.launcher.process_tree import signal_tree

# the server imports at idle CPU priority: beside other tests it may not listen for minutes
pytestmark = pytest.mark.alone
SNAPSHOT_EVERY = 5
RUN = (
    "data.name=plugins:slow_digits,data.options.delay_s=0.002,model.dropout=0.3,train.max_steps=100,"
    f"checkpoint.every_steps=1000,checkpoint.snapshot_every_steps={SNAPSHOT_EVERY},log.every_steps=1,log.format=json,"
    "metrics.port=0"
)
FORKING = {"TRAINER_FORK_SERVER": "1"}  # the suite runs without one (conftest.process_env)


def arguments(uri: str, snapshots: Path) -> list[str]:
    return ["--config", "digits", "--set", f"{RUN},checkpoint.uri={uri},checkpoint.snapshot_dir={snapshots}"]


def servers(agent_pid: int) -> list[psutil.Process]:
    """The fork servers started for the torchrun agent `agent_pid` (their children, forks,
    show the same command line)."""
    found = {}
    for process in psutil.process_iter(["cmdline", "ppid"]):
        cmdline = process.info["cmdline"] or []
        if "trainer.launcher.forkserver" in cmdline and cmdline[-1] == str(agent_pid):
            found[process.pid] = process
    return [process for process in found.values() if process.info["ppid"] not in found]


def forked_workers(agent_pid: int) -> list[psutil.Process]:
    return [child for server in servers(agent_pid) for child in server.children()]


def gone_within(agent_pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not servers(agent_pid) and not listening(agent_pid):
            return True
        time.sleep(0.1)
    return False


def test_the_client_a_worker_runs_imports_no_torch():
    """A warm restart's worth is the imports the client skips: `python -m trainer`'s first
    import, the fork client, must leave torch unloaded (a fresh interpreter says so)."""
    check = (
        "import sys, trainer.launcher.fork_client; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'numpy'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, env=process_env(FORKING)
    )
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.strip() == "[]", loaded.stdout[:500]


@pytest.mark.slow
def test_restarted_workers_are_forked_and_a_killed_forked_worker_restarts_the_group_bit_exact(workdir):
    """Rank 1 is killed in the first round (cold workers), once the server listens: the
    second round's workers are the server's children. One of them is SIGKILLed: torchrun
    sees exit code -9 again and starts a third round, forked too. Each kill costs at most the
    snapshot interval, counted by the harness from the last step line it read before the
    kill (the trainer's own count agrees); the run ends with the uninterrupted run's weights
    and optimizer state; the server, about 350 MB resident once loaded (docs/checkpoints.md),
    ends with the agent."""
    reference = run_torchrun(arguments("reference", workdir / "r"), workdir)
    assert reference.returncode == 0, reference.stderr[-3000:]
    args = arguments("faulted", workdir / "s")
    agent = subprocess.Popen(
        torchrun_command(args, launcher=("--standalone", "--max-restarts=2")),
        cwd=workdir, env=process_env(FORKING), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    rounds: list[list[int]] = []  # the forked workers' pids, per restarted round
    kills: list[int] = []
    seen: list[int] = []  # the step of the last line the harness read before each kill
    resumes: list[dict] = []  # the plan each restarted round logged
    resident_mb: list[float] = []

    def act(record: dict) -> None:
        if record.get("event") == "plan" and record.get("resumed_from") is not None:
            resumes.append(record)
            rounds.append([worker.pid for worker in forked_workers(agent.pid)])
        progress = record.get("event") == "progress"
        if progress and not kills and record["step"] >= 10 and listening(agent.pid):
            resident_mb.extend(server.memory_info().rss / 2**20 for server in servers(agent.pid))
            worker = next(c for c in psutil.Process(agent.pid).children() if c.environ().get("RANK") == "1")
            seen.append(record["step"])
            kills.append(worker.pid)
            worker.kill()
        elif progress and len(kills) == 1 and len(rounds) == 1 and record["step"] >= 40:
            seen.append(record["step"])
            kills.append(rounds[0][0])
            os.kill(rounds[0][0], signal.SIGKILL)

    try:
        _, stderr = json_records(agent, act)
    finally:
        signal_tree(agent)
    assert agent.returncode == 0, stderr[-3000:]
    assert len(kills) == 2, f"the server never listened in time, or the run ended first: {kills}"
    assert len(rounds) == 2 and all(len(pids) == 2 for pids in rounds), rounds
    assert not set(rounds[0]) & set(rounds[1]), "the third round must be new children"
    assert stderr.count("(exitcode: -9)") == 2, stderr[-3000:]  # the client ended as its child
    for step, plan in zip(seen, resumes, strict=True):  # the harness's figures decide, the trainer's agree
        resumed = plan["resumed_from"]
        # the run may pass a snapshot between the line read and the kill: step - resumed < 0
        assert resumed % SNAPSHOT_EVERY == 0 and step - resumed <= SNAPSHOT_EVERY, (seen, resumes)
        assert max(step - resumed, 0) <= plan["lost_steps"] <= SNAPSHOT_EVERY, (seen, resumes)
    assert same_state(load_checkpoint(workdir / "faulted"), load_checkpoint(workdir / "reference"))
    assert len(resident_mb) == 1 and 150 <= resident_mb[0] <= 450, resident_mb
    assert gone_within(agent.pid, 5), "the server outlived its agent"


@pytest.mark.slow
def test_torchruns_sigterm_reaches_forked_workers_which_stop_together_and_save(workdir):
    """After a restart the workers are forked; torchrun's SIGTERM (sent to each client's
    group) is forwarded to them: they stop at one step and rank 0 saves it, as cold ones do."""
    args = arguments("stopped", workdir / "s")
    agent = subprocess.Popen(
        torchrun_command(args, launcher=("--standalone", "--max-restarts=1")),
        cwd=workdir, env=process_env(FORKING), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    phase: list[str] = []

    def act(record: dict) -> None:
        progress = record.get("event") == "progress"
        if progress and not phase and record["step"] >= 10 and listening(agent.pid):
            next(c for c in psutil.Process(agent.pid).children() if c.environ().get("RANK") == "1").kill()
            phase.append("killed")
        elif record.get("event") == "plan" and phase == ["killed"]:
            phase.append("forked" if len(forked_workers(agent.pid)) == 2 else "cold")
        elif progress and phase[-1:] == ["forked"] and record["step"] >= 30:
            agent.send_signal(signal.SIGTERM)
            phase.append("signalled")

    try:
        seen, _ = json_records(agent, act)
    finally:
        signal_tree(agent)
    assert phase == ["killed", "forked", "signalled"], phase
    (stop,) = [record for record in seen if record["event"] == "stopped"]
    step = stop["step"]
    assert stop["message"].startswith(f"stopped by SIGTERM at step {step} ")
    assert f"saved stopped/step-{step}" in stop["message"]
    assert load_checkpoint(workdir / "stopped", step)["progress"]["step"] == step
    assert agent.returncode != 0
    assert gone_within(agent.pid, 5), "the server outlived its agent"


def worker_env(**extra: str) -> dict[str, str]:
    """torchrun's variables for a world of one whose agent is this test process."""
    return process_env({
        **FORKING, "TORCHELASTIC_RUN_ID": "forkserver-test", "TORCHELASTIC_MAX_RESTARTS": "1",
        "TORCHELASTIC_RESTART_COUNT": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **extra,
    })  # fmt: skip


def start_listening_server(agent_pid: int) -> tuple[subprocess.Popen, Path]:
    """A fork server for the agent `agent_pid`, in a session of its own as a worker starts
    it, and its socket's path, once it listens."""
    env = worker_env()
    path = socket_path(env, agent_pid)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.with_suffix(".lock").touch()  # as the worker that started it left it
    server = subprocess.Popen(
        [sys.executable, "-u", "-m", "trainer.launcher.forkserver", str(path), str(agent_pid)],
        env=env, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not path.exists():
        assert server.poll() is None and time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.1)
    return server, path


@pytest.fixture
def own_server(workdir: Path):
    """A fork server whose agent is this test process, as torchrun's would be; listening."""
    server, _ = start_listening_server(os.getpid())
    yield psutil.Process(server.pid)
    server.terminate()
    server.wait(timeout=10)
    for child in psutil.Process(os.getpid()).children():
        if child.pid != server.pid and "trainer" in " ".join(child.cmdline()):
            child.kill()


def client(workdir: Path, overrides: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "trainer", "--config", "digits", "--set", overrides],
        cwd=workdir, env=worker_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_for_child(server: psutil.Process) -> psutil.Process:
    deadline = time.monotonic() + 30
    while not (children := server.children()):
        assert time.monotonic() < deadline, "the server forked no child"
        time.sleep(0.02)
    return children[0]


@pytest.mark.slow
def test_a_client_speaks_through_its_child_both_ways(own_server, workdir):
    """What the child prints reaches the client's own stdout and stderr; its exit code is
    the client's, a one-line configuration error included; a child killed by a signal ends
    its client by the same signal; a client killed (SIGKILL cannot be forwarded) takes its
    child with it within a second."""
    quick = f"train.max_steps=8,log.format=json,metrics.port=0,checkpoint.uri={workdir / 'quick'}"
    finished = client(workdir, quick)
    out, err = finished.communicate(timeout=120)
    assert finished.returncode == 0, err[-3000:]
    summary = [json.loads(line) for line in out.splitlines() if line.startswith("{")][-1]
    assert summary["event"] == "summary" and summary["message"].startswith("done: 8 steps")

    refused = client(workdir, "train.epochs=0")
    _, err = refused.communicate(timeout=120)
    assert refused.returncode == 2 and err.count("\n") == 1 and "train.epochs" in err, err

    slow = "data.name=plugins:slow_digits,data.options.delay_s=0.01,metrics.port=0,checkpoint.uri={}"
    killed_child = client(workdir, slow.format(workdir / "killed-child"))
    wait_for_child(own_server).kill()
    killed_child.communicate(timeout=60)
    assert killed_child.returncode == -signal.SIGKILL

    killed_client = client(workdir, slow.format(workdir / "killed-client"))
    child = wait_for_child(own_server)
    killed_client.kill()
    killed_client.communicate(timeout=60)
    child.wait(timeout=5)  # psutil raises TimeoutExpired if it outlives its client


@pytest.mark.slow
def test_a_worker_whose_import_time_environment_differs_starts_cold(own_server, workdir):
    """OMP_NUM_THREADS is read when torch loads: a child of a server loaded under another
    value would not honour the worker's, so that worker runs as itself."""
    overrides = f"train.max_steps=4,metrics.port=0,checkpoint.uri={workdir / 'cold'}"
    cold = client(workdir, overrides, OMP_NUM_THREADS="2")
    children = set()
    while cold.poll() is None:
        children.update(child.pid for child in own_server.children())
        time.sleep(0.05)
    _, err = cold.communicate()
    assert cold.returncode == 0, err[-3000:]
    assert not children, "a worker with another OMP_NUM_THREADS was forked"


@pytest.mark.slow
def test_the_server_ends_with_its_agent_and_leaves_nothing_behind(workdir):
    """Started for an agent that then ends (here a `sleep`), while it is still importing or
    after: it exits within a poll and removes its socket and lock."""
    agent = subprocess.Popen(["sleep", "600"])
    server, path = start_listening_server(agent.pid)
    agent.kill()
    agent.wait()
    assert server.wait(timeout=5) == 0
    assert not path.exists() and not path.with_suffix(".lock").exists()
