"""A sharded dataset in S3 (moto over HTTP) trained by the chart's job under `ddp-ops local`:
two pods, each with its own shard cache in its /tmp, as two nodes would have. A job resized
from 2 pods to 1 and back reads every sample of the epoch once. (A pod lost mid-epoch on S3
shards is tests/test_local.py's lost node, whose PyTorchJob trains on them.)"""

from __future__ import annotations

import os

import pytest
from conftest import (
    HELPERS,
    REPO,
    S3Bucket,
    cpu_chart_on_s3,
    free_port,
    process_env,
    s3_secrets,
)

from operator_scripts.chart.render import render
from operator_scripts.local.run import run
from trainer.config import load_config
from trainer.data.shards import build_shards


def chart_values(s3_bucket: S3Bucket, data: str, *sets: str) -> dict:
    """The CPU chart on the bucket: its endpoint and keys (one Secret) serve the dataset too."""
    return cpu_chart_on_s3(
        s3_bucket.name, "run", s3_bucket.pod_endpoint,
        f"metrics.port={free_port()}",
        f"trainer.config.data.name=plugins:seen_shards,trainer.config.data.path={data},"
        "trainer.config.checkpoint.every_steps=1000,trainer.config.log.every_steps=10",
        *sets,
    )  # fmt: skip


def host_env() -> dict[str, str]:
    return process_env({"PYTHONPATH": os.pathsep.join([str(REPO), str(HELPERS)])})


@pytest.mark.slow
def test_a_job_resized_from_two_pods_to_one_and_back_reads_the_epoch_once(s3_bucket, shards_in_s3, tmp_path):
    """One epoch of 1257 samples, batch 32 a rank: 2 pods stop at step 5 (320 samples), 1 pod
    goes on to step 12 (224 more), 2 pods finish the epoch (11 steps each, 704 more, the tail
    of 9 dropped): 1248 distinct samples, the first 1248 of the epoch's order."""
    phases = [(2, 5), (1, 12), (2, 0)]
    for number, (pods, max_steps) in enumerate(phases):
        values = chart_values(
            s3_bucket, shards_in_s3,
            f"cpuNodes={pods},trainer.config.train.epochs=1,trainer.config.train.max_steps={max_steps},"
            "trainer.config.data.options.record_dir=/tmp/reads",  # in each pod's own /tmp
        )  # fmt: skip
        objects = render(values, release="ddp-run", namespace="training").objects
        outcome = run(
            objects, tmp_path / f"pods-{number}", timeout=200, host_env=host_env(),
            secrets=s3_secrets(tmp_path / "secret"),
        )  # fmt: skip
        logs = "".join(path.read_text() for path in outcome.logs.values())
        assert outcome.status == "Succeeded", logs[-3000:]
    records = sorted(tmp_path.glob("pods-*/*/volumes/tmp/reads/rank*.txt"))
    assert len(records) == 5  # 2 + 1 + 2 ranks
    reads = [int(line) for path in records for line in path.read_text().split()]
    assert len(reads) == len(set(reads)) == 1248
    config = load_config("digits", [f"data.name=shards,data.path={shards_in_s3}"]).data
    config.shards.cache_dir = str(tmp_path / "cache")
    order = build_shards(config, 0).train.epoch_order(0)
    assert set(reads) == set(order[:1248])
    assert s3_bucket.load("run")["progress"]["step"] == 5 + 7 + 11
