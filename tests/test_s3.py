"""S3 checkpoints against moto's S3 server over real HTTP, with faults injected on the wire."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import subprocess
import threading
import urllib.request

import pytest
import torch
from conftest import (
    kill_rank_when,
    run_torchrun,
    run_trainer,
    s3_env,
    torchrun_command,
    uploading,
)

from benchmarks.fault_proxy import FaultProxy
from trainer.checkpoint.location import open_store
from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.writer import CheckpointWriter
from trainer.config import CheckpointConfig

QUICK = ["--config", "digits", "--set", "log.every_steps=10"]


def s3_checkpointer(bucket, prefix: str, tmp_path, **config) -> Checkpointer:
    store = open_store(CheckpointConfig(uri=bucket.uri(prefix), multipart_chunk_mb=5, **config))
    store.prepare()
    return Checkpointer(store, keep_last=2, cache=tmp_path / "cache")


def big_state(megabytes: int, value: float) -> dict:
    return {
        "model": {"weight": torch.full((megabytes * 2**18,), float(value))},
        "progress": {"step": int(value)},
    }


def test_commit_protocol_multipart_and_retention_on_s3(s3_bucket, tmp_path, monkeypatch):
    with FaultProxy(s3_bucket.endpoint, every=0) as recorder:
        monkeypatch.setenv("AWS_ENDPOINT_URL", recorder.url)
        checkpointer = s3_checkpointer(s3_bucket, "unit/run", tmp_path)
        for step in (1, 2, 3):
            checkpointer.save(big_state(12, step), step=step, epoch=0, world_size=2)
    parts = [
        path for method, path in recorder.requests if method == "PUT" and "step-3/checkpoint.pt?" in path
    ]
    assert len(parts) == 3 and all("partNumber=" in path for path in parts)  # 12 MiB in 5 MiB parts
    order = [
        path.split("?")[0].rsplit("/", 1)[1]
        for method, path in recorder.requests
        if method in {"PUT", "POST"} and ("step-3/" in path or "latest.json" in path)
    ]
    assert order.index("manifest.json") > max(i for i, name in enumerate(order) if name == "checkpoint.pt")
    assert order[-1] == "latest.json"
    assert checkpointer.store.steps() == [2, 3]
    assert s3_bucket.latest_step("unit/run") == 3
    head = s3_bucket.client.head_object(
        Bucket=s3_bucket.name, Key="unit/run/step-3/checkpoint.pt", ChecksumMode="ENABLED"
    )
    assert head["ChecksumCRC32"]  # what S3 verified on receipt
    manifest = json.loads(checkpointer.store.get("step-3/manifest.json"))
    assert manifest["bytes"] == head["ContentLength"] and manifest["world_size"] == 2

    assert checkpointer.find_resumable() == 3
    cached = checkpointer.store.local_path("step-3/checkpoint.pt", checkpointer.cache)
    assert pieces_of(cached.read_bytes(), manifest["piece_bytes"]) == manifest["sha256_pieces"]
    assert torch.equal(checkpointer.load(3)["model"]["weight"], torch.full((12 * 2**18,), 3.0))
    checkpointer.release(3)
    assert not cached.exists()


def pieces_of(data: bytes, piece_bytes: int) -> list[str]:
    """Each piece's sha256, as the manifest should list them (hashlib, not the trainer's code)."""
    return [
        hashlib.sha256(data[at : at + piece_bytes]).hexdigest() for at in range(0, len(data), piece_bytes)
    ]


def test_a_corrupted_object_is_caught_by_its_sha256(s3_bucket, tmp_path, caplog):
    checkpointer = s3_checkpointer(s3_bucket, "corrupt", tmp_path)
    checkpointer.save(big_state(1, 1), step=1, epoch=0, world_size=1)
    checkpointer.save(big_state(1, 2), step=2, epoch=0, world_size=1)
    key = "corrupt/step-2/checkpoint.pt"
    data = bytearray(s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key, Body=bytes(data))
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        assert checkpointer.find_resumable() == 1
    assert "step 2" in caplog.text and "sha256" in caplog.text


def background_writer(checkpointer: Checkpointer, attempts: int) -> CheckpointWriter:
    """The writer process, as rank 0 starts it (it reads the endpoint from the environment)."""
    uri = checkpointer.store.uri
    config = CheckpointConfig(uri=uri, multipart_chunk_mb=5, attempts=attempts, keep_last=2)
    writer = CheckpointWriter(checkpointer, config, logging.getLogger("trainer"), cache=checkpointer.cache)
    writer.start(None)
    return writer


def test_a_failing_write_is_retried_then_reported_and_latest_is_untouched(
    s3_bucket, tmp_path, caplog, monkeypatch
):
    failing = threading.Event()
    proxy = FaultProxy(
        s3_bucket.endpoint, every=1, faults=("503",), matches=lambda method, path: failing.is_set()
    )
    with proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("AWS_RETRY_MODE", "standard")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        checkpointer = s3_checkpointer(s3_bucket, "failing", tmp_path)
        writer = background_writer(checkpointer, attempts=2)
        writer.save(big_state(1, 1), step=1, epoch=0, world_size=1, durable=True)
        assert writer.wait(timeout=60)
        failing.set()  # every later request to S3 fails, in the writer process too
        with caplog.at_level(logging.WARNING, logger="trainer"):
            writer.save(big_state(1, 2), step=2, epoch=0, world_size=1, durable=True)
            assert writer.wait(timeout=60)
        writer.close(60)
    assert "attempt 1/2 failed" in caplog.text and "CHECKPOINT FAILED: step 2" in caplog.text
    stats = writer.stats
    assert (stats.saves_total, stats.failures_total, stats.last_success_step) == (1, 1, 1)
    assert s3_bucket.latest_step("failing") == 1


def test_a_background_write_does_not_see_later_changes(s3_bucket, tmp_path):
    checkpointer = s3_checkpointer(s3_bucket, "snapshot", tmp_path)
    writer = background_writer(checkpointer, attempts=1)
    live = big_state(8, 5)
    writer.save(live, step=5, epoch=0, world_size=1, durable=True)
    live["model"]["weight"].fill_(-1.0)  # training goes on and mutates parameters in place
    writer.close(timeout=60)
    assert torch.equal(s3_bucket.load("snapshot")["model"]["weight"], torch.full((8 * 2**18,), 5.0))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing-bucket", "bucket 'no-such-bucket-here' does not exist"),
        ("bad-endpoint", "cannot reach the S3 endpoint"),
        ("denied", "access denied (InvalidAccessKeyId)"),
        # the chart's Secret without its key: the optional volume is empty
        (
            "no-credentials-file",
            "no AWS credentials: AWS_SHARED_CREDENTIALS_FILE=/nonexistent/credentials does",
        ),
    ],
)
def test_unusable_s3_stops_the_run_before_training(case, message, s3_bucket, workdir, moto_server):
    bucket = "no-such-bucket-here" if case == "missing-bucket" else s3_bucket.name
    env = s3_env(
        "http://127.0.0.1:9" if case == "bad-endpoint" else moto_server,
        AWS_MAX_ATTEMPTS="2",
        AWS_RETRY_MODE="standard",
    )
    if case == "no-credentials-file":
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.pop(key)
        env.update(AWS_SHARED_CREDENTIALS_FILE="/nonexistent/credentials", AWS_EC2_METADATA_DISABLED="true")
    if case == "denied":
        _moto_auth(moto_server, "0")  # from now on moto checks credentials against its IAM
    try:
        completed = run_trainer([*QUICK, "--set", f"checkpoint.uri=s3://{bucket}/run"], workdir, env=env)
    finally:
        if case == "denied":
            _moto_auth(moto_server, "inf")
    assert completed.returncode == 2
    assert message in completed.stderr and f"checkpoint.uri='s3://{bucket}/run'" in completed.stderr
    assert "validation" not in completed.stdout and "step" not in completed.stdout
    assert "Traceback" not in completed.stderr


def _moto_auth(endpoint: str, count: str) -> None:
    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth",
        data=count.encode(),
        method="POST",
        headers={"Content-Type": "text/plain"},
    )
    urllib.request.urlopen(request, timeout=10).read()


@pytest.mark.slow
def test_two_ranks_checkpoint_to_s3_and_a_second_run_resumes_with_one_download(s3_bucket, workdir):
    with FaultProxy(s3_bucket.endpoint, every=0) as counter:
        env = s3_env(counter.url, TMPDIR=str(workdir))
        uri = f"checkpoint.uri={s3_bucket.uri('two-ranks')},checkpoint.every_steps=10"
        first = run_torchrun([*QUICK, "--set", f"{uri},train.max_steps=30"], workdir, env=env)
        assert first.returncode == 0, first.stderr[-3000:]
        assert s3_bucket.latest_step("two-ranks") == 30
        counter.requests.clear()
        second = run_torchrun([*QUICK, "--set", f"{uri},train.max_steps=45"], workdir, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 30" in second.stdout
    downloads = [r for r in counter.requests if r[0] == "GET" and "step-30/checkpoint.pt" in r[1]]
    assert len(downloads) == 1  # rank 0 fetched it once for the node; rank 1 read the cache
    assert s3_bucket.load("two-ranks")["progress"]["step"] == 45
    assert not any(path.name == "checkpoint.pt" for path in (workdir / "ddp-trainer-cache").rglob("*"))


@pytest.mark.slow
def test_uploads_through_dropped_connections_503s_and_truncation(s3_bucket, workdir):
    """Every other upload request fails one way or another; the run still finishes, at every
    moment latest.json names a step whose bytes match its manifest, and every step the run
    says it published is in the store."""
    prefix, violations, polls = "faulty", [], [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            step = s3_bucket.latest_step(prefix)
            if step is not None:
                polls[0] += 1
                key = f"{prefix}/step-{step}"
                manifest = json.loads(
                    s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=f"{key}/manifest.json")[
                        "Body"
                    ].read()
                )
                data = s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=f"{key}/checkpoint.pt")[
                    "Body"
                ].read()
                if pieces_of(data, manifest["piece_bytes"]) != manifest["sha256_pieces"]:
                    violations.append(step)
            done.wait(0.05)

    uploads = lambda method, path: method in {"PUT", "POST"} and "/step-" in path  # noqa: E731
    # every other upload request: a checkpoint staged during an upload waits and a newer one
    # replaces it (latest wins), so fewer of the eight go up than were saved
    with FaultProxy(s3_bucket.endpoint, every=2, matches=uploads) as proxy:
        watcher = threading.Thread(target=watch)
        watcher.start()
        overrides = (
            f"checkpoint.uri={s3_bucket.uri(prefix)},checkpoint.every_steps=5,"
            "checkpoint.keep_last=0,train.max_steps=40"
        )
        env = s3_env(proxy.url, TMPDIR=str(workdir), AWS_MAX_ATTEMPTS="4")
        completed = run_torchrun([*QUICK, "--set", overrides], workdir, env=env)
        done.set()
        watcher.join()
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert all(count > 0 for count in proxy.injected.values()), proxy.injected
    assert violations == [] and polls[0] > 0
    assert s3_bucket.latest_step(prefix) == 40
    published = {int(m) for m in re.findall(r"checkpoint step (\d+) -> s3://", completed.stdout)}
    stored = {int(p.split("-")[1]) for p in _step_prefixes(s3_bucket, prefix)}
    assert 40 in published and published <= stored <= set(range(5, 41, 5)), (published, stored)


def _step_prefixes(bucket, prefix: str) -> list[str]:
    pages = bucket.client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket.name, Prefix=f"{prefix}/step-", Delimiter="/"
    )
    found = [
        c["Prefix"].rstrip("/").rsplit("/", 1)[1] for page in pages for c in page.get("CommonPrefixes", [])
    ]
    return sorted(found, key=lambda name: int(name.split("-")[1]))


@pytest.mark.slow
def test_sigkill_during_an_upload_loses_nothing_the_upload_finishes_first(s3_bucket, workdir):
    """Uploads are slowed on the wire; rank 0 (the uploader) is killed while a checkpoint
    newer than step 10 is on its way (snapshots off: the store is the only copy). Its writer
    process finishes the upload (and the newer one it holds, if any); torchrun restarts both
    workers, and the new rank 0 waits for that writer before it takes the lease and looks,
    so the run resumes from that step or later, not 10, and the writer is neither fenced
    out nor robbed of its staging folder (no traceback)."""
    prefix = "killed"
    slow_uploads = lambda method, path: method == "PUT" and "/step-" in path  # noqa: E731
    with FaultProxy(s3_bucket.endpoint, every=0, matches=slow_uploads, delay_s=1.5) as proxy:
        overrides = (
            f"checkpoint.uri={s3_bucket.uri(prefix)},checkpoint.every_steps=10,"
            "checkpoint.snapshot_every_steps=0,train.max_steps=60,"
            "data.name=plugins:slow_digits,data.options.delay_s=0.002"
        )
        env = s3_env(proxy.url, TMPDIR=str(workdir), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        agent = subprocess.Popen(
            torchrun_command([*QUICK, "--set", overrides], launcher=["--standalone", "--max-restarts=1"]),
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        newer = lambda: [step for step in uploading(proxy) if step > 10]  # noqa: E731
        kill_rank_when(agent, 0, lambda: s3_bucket.latest_step(prefix) == 10 and newer())
        in_flight = max(newer())
        stdout, stderr = agent.communicate(timeout=300)
    assert agent.returncode == 0, stderr[-3000:]
    resumed = re.search(
        rf"resumed from step (\d+) \({re.escape(s3_bucket.uri(prefix))}, steps lost unknown\)", stdout
    )
    assert "restart 1" in stdout and resumed and int(resumed[1]) >= in_flight, stdout[-3000:]
    assert "latest.json names step 10" not in stdout and "Traceback" not in stderr, stderr[-3000:]
    assert s3_bucket.latest_step(prefix) == 60
