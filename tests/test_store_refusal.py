"""A store that starts refusing writes mid-run (a bucket policy changed, a quota, a full
disk) crashes nothing, so the run must not end as if it had saved: it exits non-zero with
one line naming the store's newest step and where the newer state is, and a later run
resumes from the snapshots and saves it. Real torchrun runs against moto's S3 server,
through a proxy that answers every checkpoint write with 503 once told to."""

from __future__ import annotations

import subprocess
import threading

import pytest
from conftest import json_records, s3_env, snapshot_steps, torchrun_command

from benchmarks.fault_proxy import FaultProxy

RUN = (
    "train.max_steps=80,log.format=json,log.every_steps=5,metrics.port=0,checkpoint.every_steps=20,"
    "checkpoint.snapshot_every_steps=5,checkpoint.attempts=2"
)


def run(workdir, overrides: str, env: dict, on_record=None) -> tuple[int, list[dict], str]:
    agent = subprocess.Popen(
        torchrun_command(["--set", overrides], nproc=2),
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    records, stderr = json_records(agent, on_record)
    return agent.returncode, records, stderr


def stored_steps(bucket, prefix: str) -> list[int]:
    """The steps whose manifest is in the store (a step is complete once its manifest is),
    as the harness lists them, not as the trainer says."""
    listed = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix=f"{prefix}/step-")
    keys = [item["Key"] for item in listed.get("Contents", [])]
    return sorted(int(key.split("/step-")[1].split("/")[0]) for key in keys if key.endswith("/manifest.json"))


def messages(records: list[dict], level: str) -> list[str]:
    return [record["message"] for record in records if record.get("level") == level]


@pytest.mark.slow
def test_a_store_that_refuses_writes_ends_non_zero_and_a_later_run_saves_from_the_snapshots(
    s3_bucket, workdir
):
    refusing = threading.Event()
    # a full disk, a quota: the probe and the lease (small) go in, checkpoints do not
    writes = lambda method, path: refusing.is_set() and method in {"PUT", "POST"} and "/step-" in path  # noqa: E731
    with FaultProxy(s3_bucket.endpoint, every=1, faults=("503",), matches=writes) as proxy:
        env = s3_env(proxy.url, TMPDIR=str(workdir), AWS_RETRY_MODE="standard", AWS_MAX_ATTEMPTS="1")
        overrides = f"{RUN},checkpoint.uri={s3_bucket.uri('full')},checkpoint.snapshot_dir={workdir / 'shm'}"

        def refuse_after_the_first_checkpoint(record: dict) -> None:
            if record.get("event") == "checkpoint":
                refusing.set()

        code, first, stderr = run(workdir, overrides, env, refuse_after_the_first_checkpoint)
        assert code == 1, stderr[-3000:]  # what failures.md says: torchrun's exit for a worker's 1
        held = stored_steps(s3_bucket, "full")  # the harness's own listing of what the store holds
        assert held and held[-1] == s3_bucket.latest_step("full") < 80, held
        (not_saved,) = [line for line in messages(first, "error") if "is NOT saved" in line]
        assert not_saved.startswith(f"step 80 is NOT saved: {s3_bucket.uri('full')} holds step {held[-1]}")
        assert "the newer state is in the snapshots on " in not_saved and "(step 80)" in not_saved
        assert max(snapshot_steps(workdir / "shm")) == 80  # where the line says the newer state is
        assert all(f"still step {held[-1]}" in line for line in messages(first, "error") if "FAILED" in line)
        assert "summary" not in [record.get("event") for record in first]  # no "done" line

        # still refused: the retry resumes from the snapshot and knows the store's real newest step
        code, second, stderr = run(workdir, overrides, env)
        assert code == 1, stderr[-3000:]
        assert stored_steps(s3_bucket, "full") == held
        failed = [line for line in messages(second, "error") if "CHECKPOINT FAILED" in line]
        assert failed and f"the newest checkpoint is still step {held[-1]}" in failed[0]

        refusing.clear()  # the store takes writes again
        code, third, stderr = run(workdir, overrides, env)
    assert code == 0, stderr[-3000:]
    assert any("run already complete at step 80" in record["message"] for record in third)
    assert s3_bucket.latest_step("full") == 80
    assert third[-1]["event"] == "summary"
