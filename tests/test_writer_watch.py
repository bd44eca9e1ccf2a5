"""Training never waits on the durable write, and a stuck writer is replaced.

The writer process uploads one checkpoint at a time; one staged meanwhile waits, and a newer
one replaces it (latest wins). A save waits for the writer to have taken the state before
for at most `checkpoint.save_wait_s`, then it and the saves after it are skipped. A writer
with work that stays silent past its limit is named in one line, killed, its open uploads
aborted, and replaced; the new one writes what the old one held. Real torchrun runs against
moto's S3 server through a proxy slowed to a crawl; the times are the test's own clock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import psutil
import pytest
from conftest import json_records, s3_env, torchrun_command

from benchmarks.fault_proxy import FaultProxy
from trainer.checkpoint import Checkpointer, LocalStore
from trainer.checkpoint.location import open_store
from trainer.checkpoint.writer import WRITER_MULTIPLE, WRITER_START_S, WriterWatch
from trainer.checkpoint.writer_process import Uploads
from trainer.checkpoint.writing import Coalesced, Published, SaveRequest, SaveWork
from trainer.config import CheckpointConfig


def test_a_writers_silence_limit_is_derived_from_its_reports_with_a_floor():
    watch = WriterWatch(floor_s=30.0)
    assert watch.silent_s(100.0) == 0.0  # idle: silence is no fault
    watch.handed(100.0)
    for at in (101.0, 109.0, 110.0):  # a slow upload's reports, 8 s apart at most
        watch.heard(at, still_working=True)
    assert watch.longest_gap_s == 8.0 and watch.limit() == WRITER_MULTIPLE * 8.0
    assert watch.silent_s(150.0) == 40.0
    quick = WriterWatch(floor_s=30.0)
    quick.handed(0.0)
    quick.heard(0.5, still_working=False)
    assert quick.limit() == 30.0 and quick.silent_s(1000.0) == 0.0
    assert WriterWatch(floor_s=30.0, fixed_s=12.0).limit() == 12.0
    starting = WriterWatch(floor_s=30.0)
    starting.expect_start(0.0)  # a new interpreter imports torch first
    assert starting.silent_s(WRITER_START_S - 1) == 0.0 and starting.silent_s(WRITER_START_S + 31) > 30.0


class GatedStore(LocalStore):
    """A real directory store whose publishes wait for the test to open the gate."""

    def __init__(self, root):
        super().__init__(root)
        self.gate = threading.Event()

    def publish(self, step, staging, order, expected, progress=lambda done: None):
        self.gate.wait(30)
        super().publish(step, staging, order, expected, progress)


def test_of_the_checkpoints_staged_during_an_upload_only_the_newest_is_written(tmp_path):
    store = GatedStore(tmp_path / "store")
    durable = Checkpointer(store, keep_last=0, cache=tmp_path / "cache")
    events: list = []
    done = threading.Event()

    def report(happened) -> None:
        events.append(happened)
        if isinstance(happened, Published) and happened.step == 30:
            done.set()

    work = SaveWork(durable, None, attempts=1, report=report)
    uploads = Uploads(work, report)
    for step in (10, 20, 30):  # 10 uploads; 20 waits; 30 replaces it
        request = SaveRequest(step, 0, 1, snapshot=False, durable=True)
        uploads.offer(work.stage({"model": {}}, request), request)
    store.gate.set()
    assert done.wait(30)
    uploads.close()
    assert [e.step for e in events if isinstance(e, Published)] == [10, 30]
    assert [e for e in events if isinstance(e, Coalesced)] == [Coalesced(20, 30)]
    assert store.steps() == [10, 30] and not list((tmp_path / "cache").rglob("checkpoint.pt"))


def test_a_stopped_writers_open_multipart_uploads_are_aborted(s3_bucket):
    store = open_store(CheckpointConfig(uri=s3_bucket.uri("aborted")))
    for step in (40, 40, 80):
        s3_bucket.client.create_multipart_upload(
            Bucket=s3_bucket.name, Key=f"aborted/step-{step}/checkpoint.pt"
        )
    assert store.abort_uploads(40) == 2
    left = s3_bucket.client.list_multipart_uploads(Bucket=s3_bucket.name).get("Uploads", [])
    assert [upload["Key"] for upload in left] == ["aborted/step-80/checkpoint.pt"]


def writer_of(agent: subprocess.Popen) -> psutil.Process | None:
    """Rank 0's checkpoint writer: a child forked from its worker (the same command line;
    the fork server's differs)."""
    for child in psutil.Process(agent.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") != "0" or "trainer" not in child.cmdline():
                continue
            for grandchild in child.children():
                if grandchild.cmdline() == child.cmdline():
                    return grandchild
        except psutil.NoSuchProcess:
            continue
    return None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_writer_stopped_mid_upload_costs_training_seconds_and_is_replaced(s3_bucket, workdir):
    """Rank 0's writer is SIGSTOPped while it uploads a checkpoint through a proxy slowed to
    20 KB/s. Training goes on (40 more steps within 20 s of the stop), the writer is named
    within 60 s, stopped for good and replaced, and the run ends exit 0 with the store at its
    final step."""
    uploading = threading.Event()

    def checkpoint_bodies(method: str, path: str) -> bool:
        if method in {"PUT", "POST"} and "/step-" in path and "checkpoint.pt" in path:
            uploading.set()
            return True
        return False

    with FaultProxy(s3_bucket.endpoint, every=0, matches=checkpoint_bodies, rate_bps=20_000) as proxy:
        overrides = (
            "data.name=plugins:slow_digits,data.options.delay_s=0.002,train.max_steps=400,train.epochs=30,log.format=json,"
            "log.every_steps=5,metrics.port=0,checkpoint.every_steps=20,checkpoint.snapshot_every_steps=5,"
            f"checkpoint.writer_floor_s=10,checkpoint.save_wait_s=2,checkpoint.uri={s3_bucket.uri('stuck')},"
            f"checkpoint.snapshot_dir={workdir / 'shm'}"
        )
        agent = subprocess.Popen(
            torchrun_command(["--config", "digits", "--set", overrides]),
            cwd=workdir, env=s3_env(proxy.url, TMPDIR=str(workdir)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        seen: list[tuple[float, dict]] = []
        stopped: list[tuple[float, int, psutil.Process]] = []

        def on_record(record: dict) -> None:
            seen.append((time.monotonic(), record))
            if not stopped and uploading.is_set() and record.get("event") == "progress":
                writer = writer_of(agent)
                if writer is not None:
                    writer.send_signal(signal.SIGSTOP)
                    stopped.append((time.monotonic(), record["step"], writer))
            if record.get("event") == "writer_stuck":
                proxy.rate_bps = 0  # the link is fine again: the new writer catches up

        try:
            records, stderr = json_records(agent, on_record, timeout=240)
        finally:
            if stopped and psutil.pid_exists(stopped[0][2].pid):
                os.kill(stopped[0][2].pid, signal.SIGKILL)
    assert stopped, stderr[-3000:]
    stopped_at, step, old_writer = stopped[0]
    after = [at for at, r in seen if r.get("event") == "progress" and r["step"] >= step + 40]
    assert after and after[0] - stopped_at < 20, (
        step,
        [(round(at - stopped_at, 1), r) for at, r in seen[-30:]],
    )
    (stuck_at, stuck), *_ = [(at, r) for at, r in seen if r.get("event") == "writer_stuck"]
    assert stuck_at - stopped_at < 60 and "replacing it" in stuck["message"], stuck
    assert stuck["silent_s"] >= stuck["limit_s"] >= 10
    assert not psutil.pid_exists(old_writer.pid) or old_writer.status() == psutil.STATUS_ZOMBIE
    skipped = [r["message"] for r in records if "skipped: the writer has not taken" in r.get("message", "")]
    assert len(skipped) >= 1, records  # said once per streak, not at every save
    assert agent.returncode == 0, stderr[-3000:]
    summary = next(r for r in records if r.get("event") == "summary")
    assert s3_bucket.latest_step("stuck") == summary["steps"] == 400
    assert not s3_bucket.client.list_multipart_uploads(Bucket=s3_bucket.name).get("Uploads")
    latest = json.loads(
        s3_bucket.client.get_object(Bucket=s3_bucket.name, Key="stuck/latest.json")["Body"].read()
    )
    assert latest["lease_epoch"] >= 1
