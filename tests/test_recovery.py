"""Recovery from node-local snapshots with real torchrun processes: with every snapshot gone
the store's checkpoint is used, as before; a damaged snapshot on one node is skipped for
another node's. (A killed rank's cost, at most the snapshot interval and bit-identical, is
measured by tests/test_forkserver.py, whose restarts are the warm ones a job gets.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time

import pytest
import torch
from conftest import free_port, load_checkpoint, node_env, process_env, run_torchrun, torchrun_command
from snapshot_folders import snapshot_steps

from trainer.launcher.process_tree import signal_tree

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
        signal_tree(agent)
        agent.wait()
    assert any(snapshots.rglob("step-*")), "no snapshot was written"
    shutil.rmtree(snapshots)
    stored = json.loads((workdir / "run" / "latest.json").read_text())["step"]
    resumed = run_torchrun(["--config", "digits", "--set", overrides], workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {stored} (run, steps lost unknown)" in resumed.stdout
    assert "done: 40 steps" in resumed.stdout
    assert not snapshots.exists() or not any(snapshots.rglob("step-*"))  # the end is durable: freed


def two_nodes(workdir, overrides: str, port: int) -> list[subprocess.Popen]:
    """Two torchrun agents as two nodes on loopback (the operator's PET_* variables), each
    with a snapshot directory and a temporary folder of its own, as two pods have."""
    pet = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
        "PET_RDZV_ID": "damaged-snapshot",
        "PET_MAX_RESTARTS": "0",
    }
    nodes = []
    for name in ("a", "b"):
        shm = workdir / f"shm-{name}"
        args = ["--config", "digits", "--set", f"{overrides},checkpoint.snapshot_dir={shm}"]
        command = [c for c in torchrun_command(args, launcher=[]) if not c.startswith("--nproc_per_node")]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        nodes.append(subprocess.Popen(command, cwd=workdir, env=node_env(workdir, name, pet), **pipes))
    return nodes


@pytest.mark.slow
def test_a_damaged_snapshot_on_one_node_is_skipped_for_the_other_nodes(workdir):
    """Both nodes lose their processes (not their memory); node a's newest snapshot is
    damaged. The restart skips it (a warning on node a) and resumes from the newest intact
    snapshot anywhere, node b's, and ends bit-identical to an uninterrupted run."""
    no_checkpoints = SLOW.replace("checkpoint.every_steps=10", "checkpoint.every_steps=1000")
    overrides = f"{no_checkpoints},checkpoint.uri=run"
    first = two_nodes(workdir, overrides, free_port())
    shm_a, shm_b = workdir / "shm-a", workdir / "shm-b"
    deadline = time.monotonic() + 120
    while min(max(snapshot_steps(shm, complete=True), default=0) for shm in (shm_a, shm_b)) < 15:
        assert time.monotonic() < deadline and all(node.poll() is None for node in first), "no snapshots"
        time.sleep(0.05)
    for node in first:
        signal_tree(node)
        node.communicate()
    newest_a, *older_a = reversed(snapshot_steps(shm_a, complete=True))
    damaged = next(shm_a.rglob(f"step-{newest_a}")) / "checkpoint.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    expected = max(max(snapshot_steps(shm_b, complete=True)), *older_a[:1])

    second = two_nodes(workdir, overrides, free_port())
    outputs = [node.communicate(timeout=240) for node in second]
    assert [node.returncode for node in second] == [0, 0], [err[-2000:] for _, err in outputs]
    text = "".join(out + err for out, err in outputs)
    assert f"checkpoint step {newest_a} in {damaged.parents[1]} fails its xxh3 check" in text
    resumed = rf"resumed from step {expected} \(snapshot on [^,]+, \d+ steps? lost\)"
    assert re.search(resumed, text), text[-3000:]

    reference_run = ["--config", "digits", "--set", f"{overrides},checkpoint.uri=reference"]
    reference = run_torchrun(reference_run, workdir)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected_state, resumed_state = load_checkpoint(workdir / "reference"), load_checkpoint(workdir / "run")
    assert expected_state["progress"] == resumed_state["progress"]
    for name, tensor in expected_state["model"].items():
        assert torch.equal(tensor, resumed_state["model"][name]), name
