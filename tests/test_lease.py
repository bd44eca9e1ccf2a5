"""One owner per checkpoint location: the lease's protocol on a real directory and on
moto's S3 server (which checks If-None-Match / If-Match on PutObject and DeleteObject,
moto 5.2.5 s3/responses.py put_object; it checks and writes without a lock, so two
truly simultaneous creates can both pass there, where S3 answers one of them 409: the
race is tested on the directory store), and whole runs: a second job refused in one line,
a run whose lease was taken over stops without publishing."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import process_env, s3_env, torchrun_command

from trainer.checkpoint.lease import LEASE_FILE, Lease, LeaseLost
from trainer.checkpoint.location import open_store
from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.store import LocalStore, StaleWrite
from trainer.checkpoint.writing import AttemptFailed, PublishFailed, SaveRequest, SaveWork
from trainer.config import CheckpointConfig, ConfigError


@pytest.fixture(params=["directory", "s3"])
def store(request, tmp_path):
    if request.param == "directory":
        return LocalStore(tmp_path / "checkpoints")
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(CheckpointConfig(uri=bucket.uri("leased")))


def holder(store) -> dict:
    return json.loads(store.get(LEASE_FILE))


def test_a_conditional_write_needs_the_version_it_names(store):
    first = store.put_if("x.json", b"1", None)
    assert first is not None and store.put_if("x.json", b"2", None) is None  # exists: no create
    second = store.put_if("x.json", b"2", first)
    assert second is not None and store.put_if("x.json", b"3", first) is None  # stale version
    assert store.get_versioned("x.json") == (b"2", second)
    assert not store.delete_if("x.json", first) and store.delete_if("x.json", second)
    assert store.get("x.json") is None


def test_a_second_job_is_refused_naming_the_owner_and_its_lease_is_untouched(store):
    started = time.monotonic()
    owner = Lease(store, "job-a", "run-a", interval_s=10)
    owner.acquire()
    before = store.get(LEASE_FILE)
    with pytest.raises(ConfigError) as refused:
        Lease(store, "job-b", "run-b", interval_s=10).acquire()
    elapsed = time.monotonic() - started  # the lease's age can be no more (moto is slow on a busy host)
    said = str(refused.value)
    assert "is in use by job job-a (pod " in said
    age, wait = map(
        int, re.search(r"heartbeat (\d+)s ago; .* or wait (\d+)s for its lease to expire", said).groups()
    )
    assert age <= round(elapsed) and age + wait in (29, 30, 31), said  # 3 intervals: 30 s from the heartbeat
    assert store.get(LEASE_FILE) == before


def test_the_same_job_takes_its_lease_back_and_fences_out_the_old_attempt(store):
    old = Lease(store, "job-a", "run-a", interval_s=10)
    old.acquire()
    new = Lease(store, "job-a", "run-a", interval_s=10)  # a torchrun restart, a re-created pod
    new.acquire()
    assert holder(store)["token"] == new.fence.token
    with pytest.raises(LeaseLost, match="no longer this run's: job job-a"):
        old.fence.check(store)
    new.fence.check(store)
    assert not old.renew() and old.lost_to.startswith("job job-a")
    old.release()  # lost: removes nothing of the new owner's
    assert holder(store)["token"] == new.fence.token
    assert new.renew()
    new.release()
    released = holder(store)
    assert (
        released["released_at"] >= released["heartbeat_at"] - 1 and released["epoch"] == new.fence.epoch == 1
    )
    Lease(store, "job-b", "run-b", interval_s=10).acquire()  # released: free for the next job, at once
    assert (
        holder(store)["job"] == "job-b" and holder(store)["epoch"] == 2 and holder(store)["superseded"] == []
    )


def stale(store, job: str, epoch: int = 1) -> None:
    """A lease whose owner stopped renewing 31 s ago (3 intervals of 10 s and a second)."""
    dead = {"token": "t", "job": job, "pod": "p", "host": "h", "pid": 1, "interval_s": 10, "epoch": epoch}
    store.put_if(LEASE_FILE, json.dumps({**dead, "heartbeat_at": time.time() - 31}).encode(), None)


def test_a_job_whose_stale_lease_was_taken_over_is_refused_even_after_the_new_owner_released_it(store):
    stale(store, "job-a", epoch=4)
    owner = Lease(store, "job-b", "run-b", interval_s=10)
    owner.acquire()
    assert owner.fence.epoch == 5 and holder(store)["superseded"] == ["job-a"]
    owner.release()
    for _attempt in range(2):  # its torchrun's restart, its re-created pod: the same job id
        with pytest.raises(ConfigError) as refused:
            Lease(store, "job-a", "run-a", interval_s=10).acquire()
        assert (
            "job job-a was superseded here (another job took over its stale lease, now at epoch 5, "
            in str(refused.value)
        )
        assert "released by job job-b" in str(refused.value) and "a new install is a new job" in str(
            refused.value
        )
    fresh = Lease(store, "job-c", "run-c", interval_s=10)  # a new install on purpose
    fresh.acquire()
    assert fresh.fence.epoch == 6 and holder(store)["superseded"] == ["job-a"]  # remembered on


def test_a_lease_whose_owner_died_is_taken_over_with_a_warning(store, caplog):
    stale(store, "job-a")
    with caplog.at_level("WARNING", logger="trainer.checkpoint"):
        Lease(store, "job-b", "run-b", interval_s=10).acquire()
    assert holder(store)["job"] == "job-b"
    assert "took over the checkpoint lease" in caplog.text and "its owner died" in caplog.text
    assert "that job may write here no more (lease epoch 2)" in caplog.text


def test_the_store_refuses_a_superseded_runs_late_write_of_latest_json(store, tmp_path):
    """Job A commits step 10, then stops (paused, cut off) with its next latest.json write
    in flight; job B takes the stale lease over and fences latest.json. A's write, made
    against the version A last wrote, is refused by the store itself: no check of A's own
    could stop a request already sent."""
    a = Lease(store, "job-a", "run-a", interval_s=10)
    a.acquire()
    writer_a = Checkpointer(store, keep_last=3, cache=tmp_path / "a", fence=a.fence)
    writer_a.save({"model": {}}, step=10, epoch=0, world_size=1)
    stale_version = writer_a.latest_version
    document = json.loads(store.get(LEASE_FILE))
    store.put(LEASE_FILE, json.dumps({**document, "heartbeat_at": time.time() - 31}).encode())
    b = Lease(store, "job-b", "run-b", interval_s=10)
    b.acquire()
    writer_b = Checkpointer(store, keep_last=3, cache=tmp_path / "b", fence=b.fence)
    writer_b.fence_latest()
    assert json.loads(store.get("latest.json")) == {"step": 10, "path": "step-10", "lease_epoch": 2}
    late = b'{"step": 12, "path": "step-12", "lease_epoch": 1}'
    assert store.put_if("latest.json", late, stale_version) is None  # A's request, as it arrives
    assert json.loads(store.get("latest.json"))["step"] == 10
    writer_b.save({"model": {}}, step=20, epoch=0, world_size=1)
    assert json.loads(store.get("latest.json")) == {"step": 20, "path": "step-20", "lease_epoch": 2}


def test_a_superseded_runs_late_step_is_never_resumed_from(tmp_path, caplog):
    """A step newer than latest.json's, written under an older lease epoch, is a superseded
    run's late write: a resume skips it in a warning and takes the owner's newest."""
    store = LocalStore(tmp_path / "checkpoints")
    old, new = Lease(store, "job-a", "r", 10), Lease(store, "job-b", "r", 10)
    old.acquire()
    Checkpointer(store, 3, tmp_path / "c", fence=old.fence).save(
        {"model": {}}, step=50, epoch=0, world_size=1
    )
    new.store.put(LEASE_FILE, store.get(LEASE_FILE).replace(b'"heartbeat_at": ', b'"heartbeat_at": -9'))
    new.acquire()
    owner = Checkpointer(store, 3, tmp_path / "c", fence=new.fence)
    owner.save({"model": {}}, step=30, epoch=0, world_size=1)  # B resumed earlier, and trains on
    with caplog.at_level("WARNING", logger="trainer.checkpoint"):
        assert Checkpointer(store, 3, tmp_path / "d").find_resumable() == 30
    assert (
        "checkpoint step 50 in" in caplog.text and "superseded run's late write (lease epoch 1" in caplog.text
    )


def test_a_step_replaced_since_it_was_read_is_neither_overwritten_nor_deleted(store, tmp_path):
    """A step's manifest is written and deleted only at the version read before the lease
    check: a pause between the two (or a writer that came between) is refused."""
    writer = Checkpointer(store, keep_last=1, cache=tmp_path / "cache")
    staging = writer.stage({"model": {}}, step=7, epoch=0, world_size=1)
    writer.save({"model": {}}, step=7, epoch=0, world_size=1)  # someone else published step 7 meanwhile
    with pytest.raises(StaleWrite):
        store.publish(7, staging, ["checkpoint.pt", "manifest.json"], None)
    manifest = store.get_versioned("step-7/manifest.json")
    store.put_if("step-7/manifest.json", manifest[0] + b" ", manifest[1])  # replaced
    assert not store.delete_step(7, manifest[1]) and store.steps() == [7]


def test_a_commit_without_the_lease_publishes_nothing(tmp_path):
    store = LocalStore(tmp_path / "checkpoints")
    lost = Lease(store, "job-a", "run-a", interval_s=10)
    lost.acquire()
    checkpointer = Checkpointer(store, keep_last=3, cache=tmp_path / "cache", fence=lost.fence)
    checkpointer.save({"model": {}}, step=1, epoch=0, world_size=1)
    Lease(store, "job-b", "run-b", interval_s=10).store.put(LEASE_FILE, b'{"token": "other", "job": "b"}')
    with pytest.raises(LeaseLost):
        checkpointer.save({"model": {}}, step=2, epoch=0, world_size=1)
    assert store.steps() == [1] and json.loads(store.get("latest.json"))["step"] == 1
    assert not list(store.root.glob(".step-*"))  # the staging folder went too


def test_a_publish_that_lost_the_lease_is_not_retried(tmp_path):
    """Attempts are for a store that may take the write later; a lease another run holds
    will not come back, so the first refusal ends the save, with no back-off slept."""
    store = LocalStore(tmp_path / "checkpoints")
    lost = Lease(store, "job-a", "run-a", interval_s=10)
    lost.acquire()
    store.put(LEASE_FILE, b'{"token": "other", "job": "b"}')
    durable = Checkpointer(store, keep_last=3, cache=tmp_path / "cache", fence=lost.fence)
    events, slept = [], []
    work = SaveWork(durable, None, attempts=3, report=events.append, sleep=slept.append)
    request = SaveRequest(step=5, epoch=0, world_size=1, snapshot=False, durable=True)
    staged = work.stage({"model": {}}, request)
    work.publish(staged, request)
    failures = [event for event in events if isinstance(event, AttemptFailed)]
    assert len(failures) == 1 and "no longer this run's" in failures[0].error
    assert events[-1] == PublishFailed(5, 1) and slept == []
    assert store.steps() == [] and not staged.exists()


def test_a_publish_whose_staged_files_vanished_reports_its_failed_attempts(tmp_path):
    """A staging folder removed under a publish (a cleanup that did not wait for this
    writer) fails each attempt as a reported event, not as a traceback of the upload thread."""
    store = LocalStore(tmp_path / "checkpoints")
    durable = Checkpointer(store, keep_last=3, cache=tmp_path / "cache")
    events: list = []
    work = SaveWork(durable, None, attempts=2, report=events.append, sleep=lambda seconds: None)
    request = SaveRequest(step=5, epoch=0, world_size=1, snapshot=False, durable=True)
    staged = work.stage({"model": {}}, request)
    shutil.rmtree(staged)
    work.publish(staged, request)
    failures = [event for event in events if isinstance(event, AttemptFailed)]
    assert [failure.attempt for failure in failures] == [1, 2] and events[-1] == PublishFailed(5, 2)
    assert store.steps() == []


def test_of_many_racing_jobs_exactly_one_takes_the_lease(tmp_path):
    store = LocalStore(tmp_path / "checkpoints")

    def take(index: int) -> bool:
        try:
            Lease(store, f"job-{index}", f"run-{index}", interval_s=10).acquire()
            return True
        except ConfigError:
            return False

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(take, range(8))) == 1


# ------------------------------------------------------------------------ whole runs


def launch(workdir: Path, overrides: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer.launcher.launch",
            "--",
            *torchrun_command(["--set", overrides])[3:],
        ],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_a_second_run_on_the_same_location_is_refused_in_one_line_and_writes_nothing(workdir):
    uri = workdir / "checkpoints"
    # 0.64 s a step, ~60 s in all (sleeping, not computing): longer than the second run's
    # start-up on a busy machine, which took over 15 s with the suite's workers side by side
    slow = "data.name=plugins:slow_digits,data.options.delay_s=0.02"
    overrides = f"{slow},checkpoint.uri={uri},metrics.port=0,train.epochs=5,checkpoint.snapshot_dir="
    overrides += f"{workdir}/a"
    first = launch(workdir, overrides, process_env())
    deadline = time.monotonic() + 120
    while not (uri / "lineage.json").exists():  # the first run holds the location
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    owner, lineage = json.loads((uri / LEASE_FILE).read_text())["token"], (uri / "lineage.json").read_text()
    second = launch(workdir, overrides.replace(f"{workdir}/a", f"{workdir}/b"), process_env())
    out, err = second.communicate(timeout=120)
    assert second.returncode == 2, out[-3000:] + err[-3000:]
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert line.startswith(f"trainer: error: checkpoint.uri='{uri}': is in use by job ")
    assert first.poll() is None  # the owner trains on, its lease and lineage untouched
    assert json.loads((uri / LEASE_FILE).read_text())["token"] == owner
    assert (uri / "lineage.json").read_text() == lineage
    out, err = first.communicate(timeout=240)
    assert first.returncode == 0, err[-3000:]
    assert "done: 95 steps" in out and json.loads((uri / "latest.json").read_text())["step"] == 95
    assert json.loads((uri / LEASE_FILE).read_text())["released_at"]  # released at the end


@pytest.mark.slow
def test_a_run_whose_lease_is_taken_over_stops_and_publishes_nothing_more(s3_bucket, workdir):
    prefix = "taken"
    overrides = (
        f"checkpoint.uri={s3_bucket.uri(prefix)},metrics.port=0,train.epochs=200,checkpoint.every_steps=20,"
        f"checkpoint.lease_s=1,log.format=json,checkpoint.snapshot_dir={workdir / 'shm'}"
    )
    run = launch(workdir, overrides, s3_env(s3_bucket.endpoint, TMPDIR=str(workdir)))
    lines: list[str] = []  # parsed once read: a broken line fails the test, not only its thread
    reader = threading.Thread(target=lambda: lines.extend(run.stdout))
    reader.start()
    key = f"{prefix}/{LEASE_FILE}"
    deadline = time.monotonic() + 120
    while s3_bucket.latest_step(prefix) is None:
        assert run.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    # another job takes the location over (as it would once this one's heartbeat went stale)
    usurper = {"token": "usurper", "job": "job-b", "pod": "pod-b", "host": "b", "pid": 1, "interval_s": 1}
    s3_bucket.client.put_object(
        Bucket=s3_bucket.name, Key=key, Body=json.dumps({**usurper, "heartbeat_at": time.time()}).encode()
    )
    taken_at = s3_bucket.latest_step(prefix)
    _, err = run.communicate(timeout=120)
    reader.join(timeout=10)
    assert run.returncode == 2, err[-3000:]
    (stop,) = [line for line in err.splitlines() if line.startswith("trainer: error: ")]
    assert (
        f"checkpoint.uri='{s3_bucket.uri(prefix)}': another run holds its lease now (job job-b (pod pod-b"
        in stop
    )
    assert stop.endswith("and publishes nothing more")
    seen = [json.loads(line) for line in lines if line[0] == "{"]
    assert "summary" not in [record.get("event") for record in seen]
    assert s3_bucket.latest_step(prefix) <= taken_at + 20  # at most the save already past its fence
    body = s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read()
    assert json.loads(body)["token"] == "usurper"  # not released over the new owner
