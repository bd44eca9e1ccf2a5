"""The damage matrix: a pointer or a step broken in each way a crash, an operator or a
storage fault can break it, on a real directory and on moto's S3 server. Every case resumes
from the newest intact step, naming what it skipped, or refuses in one line; none goes back
to step 0 over intact steps."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import subprocess
import sys

import pytest
import torch
from conftest import AWS_TEST_ENV, free_port, node_env, process_env, run_torchrun, s3_env, torchrun_command

from benchmarks.fault_proxy import FaultProxy
from trainer.checkpoint.location import open_store
from trainer.checkpoint.manager import Checkpointer, CheckpointError
from trainer.checkpoint.store import LocalStore
from trainer.config import CheckpointConfig, ConfigError, load_config
from trainer.run.ownership import refuse_overwrite


class Files:
    """Raw access to a store's files, behind the checkpointer's back."""

    def __init__(self, checkpointer: Checkpointer, bucket=None, prefix: str = "") -> None:
        self.checkpointer, self.bucket, self.prefix = checkpointer, bucket, prefix

    def write(self, name: str, data: bytes) -> None:
        if self.bucket is None:
            (self.checkpointer.store.root / name).write_bytes(data)
        else:
            self.bucket.client.put_object(Bucket=self.bucket.name, Key=f"{self.prefix}/{name}", Body=data)

    def read(self, name: str) -> bytes:
        return self.checkpointer.store.get(name)

    def delete(self, name: str) -> None:
        if self.bucket is None:
            (self.checkpointer.store.root / name).unlink()
        else:
            self.bucket.client.delete_object(Bucket=self.bucket.name, Key=f"{self.prefix}/{name}")


@pytest.fixture(params=["local", "s3"])
def saved(request, tmp_path) -> Files:
    """Steps 2, 4 and 6 saved and named in latest.json."""
    if request.param == "local":
        checkpointer = Checkpointer(LocalStore(tmp_path / "store"), keep_last=0, cache=tmp_path / "cache")
        files = Files(checkpointer)
    else:
        bucket = request.getfixturevalue("s3_bucket")
        store = open_store(CheckpointConfig(uri=bucket.uri("damage")))
        checkpointer = Checkpointer(store, keep_last=0, cache=tmp_path / "cache")
        files = Files(checkpointer, bucket, "damage")
    checkpointer.store.prepare()
    for step in (2, 4, 6):
        state = {"model": {"weight": torch.full((64,), float(step))}, "progress": {"step": step}}
        checkpointer.save(state, step=step, epoch=0, world_size=1)
    return files


def garbage_vouched_for(files: Files) -> None:
    """Bytes that match the manifest's digests but are no checkpoint (one piece: the whole)."""
    junk = b"not a checkpoint " * 64
    manifest = json.loads(files.read("step-6/manifest.json"))
    manifest.update(sha256_pieces=[hashlib.sha256(junk).hexdigest()], bytes=len(junk))
    files.write("step-6/checkpoint.pt", junk)
    files.write("step-6/manifest.json", json.dumps(manifest).encode())


DAMAGE = {
    "latest.json deleted": (lambda f: f.delete("latest.json"), 6, ""),
    "latest.json garbled": (lambda f: f.write("latest.json", b"{not json"), 6, "latest.json is unreadable"),
    "latest.json names a missing step": (
        lambda f: f.write("latest.json", b'{"step": 99, "path": "step-99"}'), 6,
        "names step 99, which is not there",
    ),
    "latest.json stale": (
        lambda f: f.write("latest.json", b'{"step": 2, "path": "step-2"}'), 6, "latest.json names step 2"
    ),
    "newest manifest garbled": (
        lambda f: f.write("step-6/manifest.json", b"\x00garbled"), 4, "step 6 in .* has a damaged manifest"
    ),
    "newest object truncated": (
        lambda f: f.write("step-6/checkpoint.pt", f.read("step-6/checkpoint.pt")[:100]), 4,
        "step 6 in .* fails its sha256 check",
    ),
    "newest object vouched-for garbage": (garbage_vouched_for, 4, "step 6 does not load"),
}  # fmt: skip


@pytest.mark.parametrize("case", DAMAGE)
def test_resume_from_the_newest_intact_step(saved, case, caplog):
    damage, expected, warning = DAMAGE[case]
    damage(saved)
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        step = saved.checkpointer.find_resumable()
    assert step == expected
    assert torch.equal(saved.checkpointer.load(step)["model"]["weight"], torch.full((64,), float(expected)))
    if warning:
        assert re.search(warning, caplog.text), caplog.text


def test_nothing_intact_is_refused_rather_than_overwritten_from_step_0(saved):
    for step in (2, 4, 6):
        saved.write(f"step-{step}/manifest.json", b"garbled")
    with pytest.raises(CheckpointError) as refused:
        saved.checkpointer.find_resumable()
    message = str(refused.value)
    assert "holds steps 2, 4, 6 but none is intact" in message and "\n" not in message
    assert "refusing to train from step 0 over them" in message


@pytest.mark.slow
def test_a_run_on_a_store_with_nothing_intact_exits_2_in_one_line_and_leaves_it_as_it_was(workdir):
    """The process, not the exception: a 5-step run saves steps; every manifest is then
    damaged. A second run exits 2 with one line naming the steps, and every file is as it was."""
    store = workdir / "store"
    quick = ["--config", "digits", "--set", f"checkpoint.uri={store},checkpoint.every_steps=2,metrics.port=0"]
    first = subprocess.run(
        [sys.executable, "-m", "trainer", *quick, "--set", "train.max_steps=5"],
        cwd=workdir, env=process_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    for manifest in store.glob("step-*/manifest.json"):
        manifest.write_bytes(b"garbled")
    before = {path: path.read_bytes() for path in store.rglob("*") if path.is_file()}
    second = subprocess.run(
        [sys.executable, "-m", "trainer", *quick, "--set", "train.max_steps=10"],
        cwd=workdir, env=process_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert second.returncode == 2, second.stdout + second.stderr[-3000:]
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"trainer: error: checkpoint.uri='{store}': "), lines
    saved = sorted(
        int(folder.name.split("-")[1]) for folder in store.glob("step-*")
    )  # 4 may be replaced by 5
    assert (
        saved[0] == 2
        and saved[-1] == 5
        and f"holds steps {', '.join(map(str, saved))} but none is intact" in lines[0]
    )
    assert {path: path.read_bytes() for path in store.rglob("*") if path.is_file()} == before


def test_latest_json_is_read_back_after_writing(tmp_path):
    class LosesWrites(LocalStore):
        def put(self, name: str, data: bytes) -> None:
            super().put(name, data.replace(b'"step": 3', b'"step": 2'))

    checkpointer = Checkpointer(LosesWrites(tmp_path), keep_last=0, cache=tmp_path / "cache")
    checkpointer.store.prepare()
    checkpointer.save({"model": {}}, step=2, epoch=0, world_size=1)
    with pytest.raises(OSError, match="does not read back as written"):
        checkpointer.save({"model": {}}, step=3, epoch=0, world_size=1)


def test_a_loaded_state_is_not_read_twice(tmp_path):
    checkpointer = Checkpointer(LocalStore(tmp_path), keep_last=0, cache=tmp_path / "cache")
    checkpointer.store.prepare()
    checkpointer.save({"model": {"w": torch.ones(2)}}, step=1, epoch=0, world_size=1)
    assert checkpointer.find_resumable() == 1
    (tmp_path / "step-1" / "checkpoint.pt").unlink()  # what find_resumable loaded is kept
    assert torch.equal(checkpointer.load(1)["model"]["w"], torch.ones(2))
    with pytest.raises(CheckpointError, match="not readable on this node"):
        checkpointer.load(1)


def test_a_fresh_start_refuses_a_location_with_steps_even_without_latest_json(saved):
    saved.delete("latest.json")
    uri = saved.checkpointer.store.uri
    config = load_config(None, [f"checkpoint.uri={uri},checkpoint.resume=false"])
    with pytest.raises(ConfigError, match=r"holds checkpoints up to step 6; set checkpoint.resume=true"):
        refuse_overwrite(config, saved.checkpointer)


@pytest.mark.slow
def test_a_node_that_cannot_read_the_resume_step_fails_every_rank_in_one_line(s3_bucket, workdir):
    """Two 'nodes' (torchrun agents); every read of a step on the second one is refused
    (503, no retries). Whichever rank that costs, every rank stops with the same one-line
    error, instead of one raising while its peers wait in a collective."""
    quick = ["--config", "digits", "--set", f"checkpoint.uri={s3_bucket.uri('nodes')},log.every_steps=5"]
    first = run_torchrun([*quick, "--set", "train.max_steps=5"], workdir, env=s3_env(s3_bucket.endpoint))
    assert first.returncode == 0, first.stderr[-3000:]
    pet = {
        "PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_RDZV_BACKEND": "c10d", "AWS_MAX_ATTEMPTS": "1",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}", "PET_RDZV_ID": "unreadable", "PET_MAX_RESTARTS": "0",
    }  # fmt: skip
    args = [*quick, "--set", "train.max_steps=10"]
    command = [c for c in torchrun_command(args, launcher=[]) if not c.startswith("--nproc")]
    refused = lambda method, path: method == "GET" and "/step-" in path  # noqa: E731
    with FaultProxy(s3_bucket.endpoint, every=1, faults=("503",), matches=refused) as proxy:
        nodes = []
        for index, endpoint in enumerate([s3_bucket.endpoint, proxy.url]):
            env = node_env(workdir, str(index), {**AWS_TEST_ENV, "AWS_ENDPOINT_URL": endpoint, **pet})
            nodes.append(
                subprocess.Popen(
                    command, cwd=workdir, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True
                )
            )
        outputs = [node.communicate(timeout=180) for node in nodes]
    errors = [line for _, err in outputs for line in err.splitlines() if "trainer: error:" in line]
    assert all(node.returncode != 0 for node in nodes)
    assert len(errors) == 2 and len({line.split("trainer: error: ")[1] for line in errors}) == 1, errors
    assert "finding the resume step failed" in errors[0] or "cannot be resumed: rank 1" in errors[0]
