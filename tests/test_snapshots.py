"""Node-local snapshots and the writer process, piece by piece: the shared-memory hand-over,
double buffering, damage, lineage, the recovery decision, a writer that outlives its
parent, and a snapshot directory too small for two."""

from __future__ import annotations

import io
import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, process_env

from trainer.checkpoint import rng
from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.recovery import ResumePoint, _decide, _Report
from trainer.checkpoint.shared_state import SharedStateBuffer, SharedStateReader
from trainer.checkpoint.snapshots import SnapshotDir
from trainer.checkpoint.store import LocalStore
from trainer.checkpoint.writing import SaveRequest, SaveWork, Staged
from trainer.config import CheckpointConfig
from trainer.distributed.process_group import DistContext
from trainer.process_identity import process_start


def state(value: float) -> dict:
    return {
        "model": {"weight": torch.full((4, 3), value), "mask": torch.tensor([True, False])},
        "optimizer": {"state": {0: {"step": torch.tensor(value), "exp_avg": torch.full((4, 3), -value)}}},
        "rng": [torch.arange(8, dtype=torch.uint8)],
        "progress": {"step": int(value)},
    }


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_the_shared_copy_carries_every_dtype_and_shape_and_is_its_own_storage(tmp_path):
    original = {
        **state(3.0),
        "half": torch.randn(5, 7).bfloat16(),
        "transposed": torch.randn(4, 6).t(),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "nested": [{"x": torch.arange(3)}, ("text", 7)],
    }
    me, started = os.getpid(), process_start(os.getpid())
    orphans = [
        tmp_path / "ddp-trainer-state-4194303-0-0badcafe",  # a dead process's (pid_max - 1)
        tmp_path / f"ddp-trainer-state-{me}-{started - 1}-0badcafe",  # its pid is another's now
    ]
    kept = [tmp_path / f"ddp-trainer-state-{me}-{started}-0badcafe", tmp_path / "ddp-trainer-state-notes"]
    for path in orphans + kept:
        path.write_bytes(b"left by a run")
    buffer = SharedStateBuffer(tmp_path)
    shared = buffer.fill(original)
    assert not any(path.exists() for path in orphans) and all(path.exists() for path in kept)
    read = SharedStateReader().open(shared)
    assert not Path(shared.path).exists()  # mapped on both sides: the name is not needed
    assert equal(read, original)
    # each tensor saves alone: the reader's tensors do not drag the whole buffer along
    assert read["model"]["weight"].untyped_storage().nbytes() == 4 * 3 * 4
    original["model"]["weight"].fill_(-1.0)  # training goes on; the copy does not follow
    assert torch.equal(read["model"]["weight"], torch.full((4, 3), 3.0))
    grown = buffer.fill({**original, "extra": torch.zeros(10)})  # a new layout, a new file
    assert grown.path != shared.path and Path(grown.path).exists()
    buffer.close()
    assert not Path(grown.path).exists()


def test_an_empty_tensor_beside_another_dtype_saves_from_the_shared_copy(tmp_path):
    """PowerSGD's error feedback is empty until it starts, and its generator keys follow."""
    buffer = SharedStateBuffer(tmp_path)
    read = SharedStateReader().open(buffer.fill({"errors": torch.zeros(1, 0), "keys": torch.arange(624)}))
    torch.save(read, io.BytesIO())  # refused when the empty view shared the keys' address
    assert read["errors"].shape == (1, 0) and torch.equal(read["keys"], torch.arange(624))
    buffer.close()


def snapshot_work(folder: Path, events: list) -> SaveWork:
    snapshots = Checkpointer(LocalStore(folder), keep_last=2, cache=folder)
    return SaveWork(None, snapshots, attempts=1, report=events.append)


def request(step: int) -> SaveRequest:
    return SaveRequest(step, epoch=0, world_size=2, snapshot=True, durable=False)


def test_two_snapshots_at_most_and_a_failed_one_never_costs_the_newest_intact(tmp_path):
    events: list = []
    work = snapshot_work(tmp_path, events)
    for step in (5, 10):
        work.stage(state(step), request(step))
    assert LocalStore(tmp_path).steps() == [5, 10]
    unpicklable = {**state(15.0), "bad": lambda: None}
    work.stage(unpicklable, request(15))
    failed = events[-1]
    assert isinstance(failed, Staged) and failed.step == 15 and failed.snapshot_error
    assert LocalStore(tmp_path).steps() == [10]  # the older one made room; the newest stayed
    assert equal(Checkpointer(LocalStore(tmp_path), 2, tmp_path).load(10)["model"], state(10)["model"])
    work.stage(state(20), request(20))
    assert LocalStore(tmp_path).steps() == [10, 20]
    assert [e.snapshot_bytes > 0 for e in events if isinstance(e, Staged)] == [True, True, False, True]


def test_a_damaged_snapshot_is_skipped_for_the_one_before_it(tmp_path, caplog):
    snapshots = SnapshotDir(CheckpointConfig(uri="s3://bucket/run", snapshot_dir=str(tmp_path)), "lineage-a")
    work = SaveWork(None, snapshots.checkpointer(), attempts=1, report=lambda event: None)
    for step in (5, 10):
        work.stage(state(step), request(step))
    newest = snapshots.folder / "step-10" / "checkpoint.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        step, loaded = snapshots.newest()
    assert step == 5 and equal(loaded["model"], state(5)["model"])
    assert "step 10" in caplog.text and "fails its xxh3 check" in caplog.text


def test_a_run_that_starts_over_gets_a_new_lineage_and_old_snapshots_go(tmp_path):
    checkpointer = Checkpointer(LocalStore(tmp_path / "store"), keep_last=2, cache=tmp_path)
    checkpointer.store.prepare()
    first = checkpointer.lineage(fresh=False)
    assert checkpointer.lineage(fresh=False) == first  # a restart: the same history
    config = CheckpointConfig(uri=str(tmp_path / "store"), snapshot_dir=str(tmp_path / "shm"))
    old = SnapshotDir(config, first)
    old.mark(42)
    assert old.reached() == 42
    fresh = checkpointer.lineage(fresh=True)  # checkpoint.resume=false
    assert fresh != first
    SnapshotDir(config, fresh).remove_other_lineages()
    assert not old.folder.exists() and old.reached() is None


def context(rank: int = 0) -> DistContext:
    return DistContext(rank, 0, 2, 1, rank, 2, 0, "run", "host-a", True)


@pytest.mark.parametrize(
    ("stored", "reports", "expected"),
    [
        # the newest snapshot wins over an older store step, from the node that holds it
        ([10, 20], [(25, 27, "pod-0"), (None, None, "pod-1")], ResumePoint(25, "snapshot on pod-0", 0, 2)),
        ([10, 20], [(20, 23, "pod-0"), (25, 26, "pod-1")], ResumePoint(25, "snapshot on pod-1", 1, 1)),
        # a newer store step wins; a tie goes to the snapshot (no download)
        ([30], [(25, 31, "pod-0"), (25, 31, "pod-1")], ResumePoint(30, "STORE", None, 1)),
        ([25], [(25, 26, "pod-0"), (None, None, "pod-1")], ResumePoint(25, "snapshot on pod-0", 0, 1)),
        # every node lost its memory: the store, and what was lost is unknown
        ([20], [(None, None, "pod-0"), (None, None, "pod-1")], ResumePoint(20, "STORE", None, None)),
        ([], [(None, None, "pod-0"), (None, None, "pod-1")], None),
    ],
)
def test_the_resume_point_is_the_newest_step_anywhere(tmp_path, stored, reports, expected):
    checkpointer = Checkpointer(LocalStore(tmp_path / "store"), keep_last=0, cache=tmp_path)
    checkpointer.store.prepare()
    for step in stored:
        checkpointer.save(state(step), step=step, epoch=0, world_size=2)
    point = _decide(checkpointer, [_Report(*report) for report in reports], context(), budget_s=60)
    if expected is not None and expected.origin == "STORE":
        expected = ResumePoint(expected.step, checkpointer.store.uri, None, expected.lost_steps)
    assert point == expected


KILLED_AFTER_SAVE = """
import logging, os, signal, sys, torch
from pathlib import Path
from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.writer import CheckpointWriter
from trainer.checkpoint.store import LocalStore
from trainer.checkpoint.snapshots import SnapshotDir
from trainer.config import CheckpointConfig
root = Path(sys.argv[1])
config = CheckpointConfig(uri=str(root / "store"), snapshot_dir=str(root / "shm"))
durable = Checkpointer(LocalStore(root / "store"), keep_last=2, cache=root / "cache")
durable.store.prepare()
writer = CheckpointWriter(durable, config, logging.getLogger("t"), cache=root / "cache", snapshots=True)
writer.start(SnapshotDir(config, "lineage"))
state = {"model": {"w": torch.full((2**20,), 7.0)}, "progress": {"step": 3}}
writer.save(state, step=3, epoch=0, world_size=1, durable=True)
os.kill(os.getpid(), signal.SIGKILL)  # a rank killed right after the step boundary
"""


@pytest.mark.alone  # the writer finishes at its lower CPU priority: a busy machine starves it
def test_a_save_handed_over_survives_the_rank_that_made_it_being_killed(tmp_path):
    """The writer process finishes the snapshot and the upload it was given after its parent
    is SIGKILLed (stdin closes), then exits: a killed rank loses nothing it had handed over."""
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER_SAVE, str(tmp_path)], cwd=REPO, env=process_env(), timeout=120
    )
    assert killed.returncode == -9
    deadline = time.monotonic() + 60
    latest = tmp_path / "store" / "latest.json"
    while not latest.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert json.loads(latest.read_text())["step"] == 3
    durable = Checkpointer(LocalStore(tmp_path / "store"), keep_last=2, cache=tmp_path)
    assert torch.equal(durable.load(3)["model"]["w"], torch.full((2**20,), 7.0))
    config = CheckpointConfig(uri=str(tmp_path / "store"), snapshot_dir=str(tmp_path / "shm"))
    snapshots = SnapshotDir(config, "lineage")
    assert snapshots.newest()[0] == 3


def unshare_mount() -> list[str]:
    """A private mount namespace for a tmpfs of our own: in a user namespace when not root."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--mount", "--propagation", "private"]


def test_a_snapshot_dir_without_room_for_two_is_one_line_and_the_run_goes_on(workdir):
    """A real 1 MiB tmpfs (in a private mount namespace) as the snapshot directory: the
    digits state needs more than two fit, so the run says so once and trains without."""
    shm = workdir / "small-shm"
    shm.mkdir()
    script = (
        f"mount -t tmpfs -o size=1m tmpfs {shm} && exec {sys.executable} -m trainer --config digits "
        f"--set train.max_steps=12,checkpoint.snapshot_every_steps=5,checkpoint.snapshot_dir={shm}/snapshots"
    )
    completed = subprocess.run(
        [*unshare_mount(), "sh", "-c", script],
        cwd=workdir,
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    warnings = [line for line in completed.stdout.splitlines() if "snapshots off" in line]
    assert len(warnings) == 1, completed.stdout
    assert "MiB free" in warnings[0] and "checkpoint.snapshot_dir" in warnings[0]
    assert "done: 12 steps" in completed.stdout


def draws() -> tuple:
    return torch.rand(4), random.random(), random.gauss(0, 1), np.random.rand(3).tolist()


def test_rng_streams_pack_to_a_fixed_size_and_restore_exactly():
    rng.seed_everything(3)
    random.gauss(0, 1)  # python's gauss keeps a second value: part of the state
    packed = rng.pack()
    assert packed.dtype == torch.uint8 and packed.shape == (rng.PACKED_BYTES,)
    expected = draws()
    rng.seed_everything(99)
    rng.restore(packed)
    assert equal(list(draws()), list(expected))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_current_cuda_devices_stream_packs_and_restores():
    torch.cuda.init()
    rng.seed_everything(4)
    packed = rng.pack()
    expected = torch.rand(4, device="cuda").cpu()
    rng.seed_everything(98)
    rng.restore(packed)
    assert torch.equal(torch.rand(4, device="cuda").cpu(), expected)


def test_the_dict_form_of_older_checkpoints_still_restores():
    rng.seed_everything(5)
    numpy_state = np.random.get_state(legacy=False)
    old_form = {
        "torch": torch.get_rng_state(),
        "cuda": [torch.zeros(16, dtype=torch.uint8)] * 8,  # saved on 8 GPUs, more than this host has
        "python": random.getstate(),
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": numpy_state["state"]["key"].tolist(),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
    }
    expected = draws()
    rng.restore(old_form)
    assert equal(list(draws()), list(expected))
