"""Recovery from node-local snapshots with real torchrun processes: a killed rank costs at
most the snapshot interval and the run ends bit-identical; with every snapshot gone the
store's checkpoint is used, as before."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, process_env, run_torchrun, torchrun_command

from trainer.launch import signal_tree


@pytest.mark.slow
def test_seeded_fault_trials_lose_at_most_the_snapshot_interval_and_end_bit_identical():
    """`operator_scripts.fault_trials` (2 of its 10 trials): SIGKILL a random rank at a
    random step under `torchrun --max-restarts=1`, resume from the newest snapshot."""
    completed = subprocess.run(
        [sys.executable, "-m", "operator_scripts.fault_trials", "--trials", "2", "--seed", "7"],
        cwd=REPO,
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr[-3000:]
    trial = r"resumed from step (\d+) \(snapshot on [^)]+\), (\d+) lost; final state bit-identical"
    trials = re.findall(trial, completed.stdout)
    assert len(trials) == 2, completed.stdout
    assert all(int(step) % 5 == 0 and int(lost) <= 5 for step, lost in trials), trials


SLOW = (
    "data.name=plugins:slow_digits,data.options.delay_s=0.002,train.max_steps=40,"
    "checkpoint.every_steps=10,checkpoint.snapshot_every_steps=3,log.every_steps=5"
)


@pytest.mark.slow
def test_with_every_snapshot_gone_the_store_is_used_and_the_loss_is_unknown(workdir):
    """The whole node is lost (its process tree killed and its memory wiped): the restart
    resumes from the store's newest checkpoint and says it cannot know what was lost."""
    snapshots = workdir / "shm"
    overrides = f"{SLOW},checkpoint.uri=run,checkpoint.snapshot_dir={snapshots}"
    agent = subprocess.Popen(
        torchrun_command(["--config", "digits", "--set", overrides]),
        cwd=workdir,
        env=process_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in agent.stdout:
            if "checkpoint step 20 ->" in line:
                break
    finally:
        signal_tree(agent.pid)
        agent.wait()
    assert any(snapshots.rglob("step-*")), "no snapshot was written"
    shutil.rmtree(snapshots)
    stored = json.loads((workdir / "run" / "latest.json").read_text())["step"]
    resumed = run_torchrun(["--config", "digits", "--set", overrides], workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {stored} (run, steps lost unknown)" in resumed.stdout
    assert "done: 40 steps" in resumed.stdout
    assert not snapshots.exists() or not any(snapshots.rglob("step-*"))  # the end is durable: freed
