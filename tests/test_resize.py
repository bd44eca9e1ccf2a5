"""Elastic resize: a run stopped at one world size and resumed at another covers every
sample of the interrupted epoch once, trains at the LR of its new global batch, and ends
after its configured epochs at the step its banner announced."""

from __future__ import annotations

import json

import pytest
from conftest import S3Bucket, load_checkpoint, run_torchrun, s3_env

TRAIN_SAMPLES, PER_RANK_BATCH, EPOCHS = 1257, 32, 2  # the digits split's training samples


def epoch_samples(world: int) -> int:
    """Samples one epoch deals out at `world` ranks (DistributedSampler drops the tail)."""
    return TRAIN_SAMPLES // world * world


def steps_left(world: int, position: int) -> int:
    return (max(0, epoch_samples(world) - position) // world) // PER_RANK_BATCH


def run_phase(workdir, record, nproc: int, max_steps: int, store: S3Bucket | None):
    """One run at `nproc` ranks to `max_steps` (0: the end), its checkpoints in the bucket's
    `resharded` prefix if given, else in the working folder."""
    record.mkdir()
    overrides = (
        f"data.name=plugins:recording_digits,data.options.record_dir={record},train.epochs={EPOCHS},"
        f"train.max_steps={max_steps},optim.schedule=constant,optim.warmup_steps=0,log.format=json,"
        "log.every_steps=1,checkpoint.every_steps=1000"
    ) + (f",checkpoint.uri={store.uri('resharded')}" if store else "")
    env = s3_env(store.endpoint, TMPDIR=str(workdir)) if store else None
    done = run_torchrun(["--config", "digits", "--set", overrides], workdir, nproc=nproc, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def reads(record, world: int) -> list[list[int]]:
    return [[int(x) for x in (record / f"rank{rank}.txt").read_text().split()] for rank in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("before", "after", "stop_at", "on_s3"),
    [(2, 1, 25, True), (1, 2, 20, False), (1, 2, 37, False), (1, 2, 38, False), (2, 3, 10, False)],
    ids=["2-to-1-mid-epoch-2-on-s3", "1-to-2-mid-epoch", "1-to-2-two-steps-before-the-end",
         "1-to-2-no-full-batch-left", "2-to-3-mid-epoch"],
)  # fmt: skip
def test_resize(workdir, before, after, stop_at, on_s3, request):
    """The 2-to-1 resize stops in epoch 2 and resumes from S3 (moto over HTTP), as an
    elastic job that lost a pod does; the others keep their checkpoints in a folder."""
    store = request.getfixturevalue("s3_bucket") if on_s3 else None
    run_phase(workdir, workdir / "first", before, stop_at, store)
    records = run_phase(workdir, workdir / "second", after, 0, store)

    done_epochs, in_epoch = divmod(stop_at, steps_left(before, 0))  # where the first run stopped
    position = in_epoch * PER_RANK_BATCH * before  # samples of the interrupted epoch dealt out
    left = steps_left(after, position)
    skip = done_epochs * steps_left(before, 0) * PER_RANK_BATCH  # each rank's reads of whole epochs
    first = [i for rank in reads(workdir / "first", before) for i in rank[skip:]]
    rest = [i for rank in reads(workdir / "second", after) for i in rank[: left * PER_RANK_BATCH]]
    assert len(first + rest) == len(set(first + rest)) == position + left * PER_RANK_BATCH * after

    planned = stop_at + left + steps_left(after, 0) * (EPOCHS - 1 - done_epochs)
    start = next(r for r in records if r["event"] == "start")
    summary = next(r for r in records if r["event"] == "summary")
    assert start["total_steps"] == summary["steps"] == planned
    assert summary["epochs_completed"] == EPOCHS
    lr = 0.002 * PER_RANK_BATCH * after / 64
    assert start["lr"] == lr and {r["lr"] for r in records if r["event"] == "progress"} == {lr}
    resized = [r["message"] for r in records if r["event"] == "resume_change"]
    assert resized[-1] == (
        f"step {stop_at} was saved at world size {before}, global batch {PER_RANK_BATCH * before}, lr "
        f"{0.002 * PER_RANK_BATCH * before / 64:g}; this run trains at world size {after}, global batch "
        f"{PER_RANK_BATCH * after}, lr {lr:g}; the rest of the run is counted in steps of this global "
        "batch, so its total steps change"
    )
    assert next(r for r in records if r["event"] == "plan")["resumed_from"] == stop_at
    saved = store.load("resharded") if store else load_checkpoint(workdir / "checkpoints" / "digits-cnn")
    assert saved["progress"] == {
        "step": planned,
        "epoch": EPOCHS,
        "epoch_position": 0,
        "stopped_early": False,
        "samples": stop_at * PER_RANK_BATCH * before + (planned - stop_at) * PER_RANK_BATCH * after,
    }
