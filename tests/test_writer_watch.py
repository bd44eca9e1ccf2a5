"""Training never waits on the durable write, and a stuck writer is replaced.

The writer process uploads one checkpoint at a time; one staged meanwhile waits, and a newer
one replaces it (latest wins). A save waits for the writer to have taken the state before
for at most `checkpoint.save_wait_s`, then it and the saves after it are skipped. A writer
with work that stays silent past its limit is named in one line, killed, its open uploads
aborted, and replaced; the new one writes what the old one held. Real torchrun runs against
moto's S3 server through a proxy slowed to a crawl; the times are the test's own clock."""

from __future__ import annotations

import threading

import pytest

from benchmarks.storage_trials import S3Target, writer_stop_trial
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


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_a_writer_stopped_mid_upload_costs_training_seconds_and_is_replaced(s3_bucket, workdir):
    """Rank 0's writer is SIGSTOPped while it uploads a checkpoint through a proxy slowed to
    20 KB/s. Training goes on (40 more steps within 20 s of the stop), the writer is named
    within 60 s, stopped for good and replaced, and the run ends exit 0 with the store at its
    final step and no upload left open (benchmarks.storage_trials, which the fault trials run)."""
    trial = writer_stop_trial(
        workdir, S3Target(s3_bucket.endpoint, s3_bucket.name, s3_bucket.env), floor_s=10
    )
    assert trial.stopped_step is not None, trial
    assert trial.steps_s is not None and trial.steps_s < 20, trial
    assert trial.named_s is not None and trial.named_s < 60, trial
    assert (
        "replacing it" in trial.named["message"] and trial.named["silent_s"] >= trial.named["limit_s"] >= 10
    )
    assert trial.old_writer_gone, trial
    assert trial.skip_lines == 1, trial  # one line for the streak, not one per skipped save
    assert trial.code == 0 and trial.store_step == trial.final_step == 400, trial
    assert trial.open_uploads == 0, trial
    assert trial.passed()
