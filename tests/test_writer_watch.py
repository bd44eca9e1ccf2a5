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
from trainer.checkpoint.location import open_store
from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.store import LocalStore
from trainer.checkpoint.writer_process import Uploads
from trainer.checkpoint.writer_watch import STALL_FLOOR_S, WRITER_MULTIPLE, WRITER_START_S, WriterWatch
from trainer.checkpoint.writing import Coalesced, Progress, Published, SaveRequest, SaveWork
from trainer.config import CheckpointConfig


def test_a_writers_silence_limit_is_derived_from_its_reports_with_a_floor():
    watch = WriterWatch(floor_s=30.0)
    assert watch.stuck(100.0) is None  # idle: silence is no fault
    watch.handed(100.0)
    for at, done in ((101.0, 1), (109.0, 2), (110.0, 3)):  # a slow upload's reports, 8 s apart at most
        watch.heard(at, Progress(5, "upload", done, 0, 1), still_working=True)
    assert watch.longest_gap_s == 8.0 and watch.limit() == WRITER_MULTIPLE * 8.0
    assert watch.stuck(149.0) is None
    assert watch.stuck(150.5) == ("silent", 40.5, 40.0)  # frozen: not a word
    quick = WriterWatch(floor_s=30.0)
    quick.handed(0.0)
    quick.heard(0.5, None, still_working=False)  # published: idle again
    assert quick.limit() == 30.0 and quick.stuck(1000.0) is None
    assert WriterWatch(floor_s=30.0, fixed_s=12.0).limit() == 12.0
    starting = WriterWatch(floor_s=30.0)
    starting.expect_start(0.0)  # a new interpreter imports torch first
    assert starting.stuck(WRITER_START_S - 1) is None and starting.stuck(WRITER_START_S + 31)[0] == "silent"


def test_a_writer_that_is_alive_but_makes_no_progress_is_stuck_only_past_botocores_own_patience():
    """The same report every second (a request the server holds, a kernel wait): not stuck
    while botocore itself would still wait for the answer, stuck past STALL_FLOOR_S."""
    watch = WriterWatch(floor_s=30.0)
    watch.handed(0.0)
    waiting = Progress(5, "upload", 700_000, 0, 1)
    for second in range(1, 200):
        watch.heard(float(second), waiting, still_working=True)
        verdict = watch.stuck(second + 0.5)
        if verdict is not None:
            break
    assert verdict == ("alive but with no progress", STALL_FLOOR_S + 0.5, STALL_FLOOR_S)
    assert second == STALL_FLOOR_S + 1
    watch.heard(200.0, Progress(5, "upload", 700_000, 0, 2), still_working=True)  # a retry: progress
    assert watch.stuck(200.5) is None


class GatedStore(LocalStore):
    """A real directory store whose publishes wait for the test to open the gate."""

    def __init__(self, root):
        super().__init__(root)
        self.gate, self.entered = threading.Event(), threading.Event()

    def publish(self, step, staging, order, expected, progress=lambda done: None):
        self.entered.set()
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
        assert store.entered.wait(30)  # the upload of 10 is under way before the others come
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
    assert "replacing it" in trial.named["message"] and trial.named["stuck_s"] >= trial.named["limit_s"] >= 10
    assert trial.old_writer_gone, trial
    assert trial.skip_lines == 1, trial  # one line for the streak, not one per skipped save
    assert trial.code == 0 and trial.store_step == trial.final_step == 400, trial
    assert trial.open_uploads == 0, trial
    assert trial.passed()
