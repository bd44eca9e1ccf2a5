"""The operator's view of a PyTorchJob as pure functions, and the chart's job run locally
as the operator would run it: pods as process groups on loopback, restarts, outcome."""

from __future__ import annotations

import os

import pytest
from conftest import HELPERS, REPO, process_env

from operator_scripts.chart import merge_values, render
from operator_scripts.local import kill_pod, run
from operator_scripts.operator_env import injected_env, job_outcome, plan_pods, rank0_selector

CPU_VALUES = REPO / "helm" / "ci" / "cpu-values.yaml"


def job(sets: list[str]) -> dict:
    return render(merge_values(sets=sets), release="ddp-run", namespace="training").one("PyTorchJob")


def test_elastic_worker_only_environment():
    elastic = job(["gpus=16,elastic.minNodes=1,elastic.maxNodes=3,elastic.rdzvConf.join_timeout=900"])
    env = injected_env(elastic, "worker", 1)
    assert env == {
        "PYTHONUNBUFFERED": "1",
        "PET_NPROC_PER_NODE": "8",
        "PET_RDZV_ENDPOINT": "ddp-run-ddp-trainer-worker-0:23456",
        "PET_RDZV_BACKEND": "c10d",
        "PET_NNODES": "1:3",
        "PET_MAX_RESTARTS": "3",
        "PET_RDZV_ID": "training-ddp-run-ddp-trainer",
        "PET_RDZV_CONF": "join_timeout=900",
    }


def test_master_and_workers_environment():
    fixed = job(["mode=fixed,gpus=24"])
    master, worker = injected_env(fixed, "master", 0), injected_env(fixed, "worker", 1)
    assert master["MASTER_ADDR"] == master["PET_MASTER_ADDR"] == "ddp-run-ddp-trainer-master-0"
    assert master["MASTER_PORT"] == "23456" and master["PET_NNODES"] == "3"
    assert (master["RANK"], worker["RANK"], worker["PET_NODE_RANK"]) == ("0", "2", "2")
    assert worker["WORLD_SIZE"] == "24" and "PET_RDZV_ENDPOINT" not in worker


def test_pod_names_labels_and_rank0_selector():
    pods = plan_pods(job(["gpus=16"]))
    assert [p.name for p in pods] == ["ddp-run-ddp-trainer-worker-0", "ddp-run-ddp-trainer-worker-1"]
    role = "training.kubeflow.org/job-role"
    assert pods[0].labels[role] == "master" and role not in pods[1].labels
    with_master = plan_pods(job(["mode=fixed,gpus=16"]))
    assert [p.name for p in with_master if role in p.labels] == ["ddp-run-ddp-trainer-master-0"]
    selector = dict(part.split("=") for part in rank0_selector("ddp-run-ddp-trainer").split(","))
    assert selector.items() <= pods[0].labels.items()


def test_job_outcome_follows_the_operator():
    elastic, fixed = job(["gpus=16"]), job(["mode=fixed,gpus=16"])
    workers = {"ddp-run-ddp-trainer-worker-0": 0, "ddp-run-ddp-trainer-worker-1": None}
    assert job_outcome(elastic, workers) == "Running"
    assert job_outcome(elastic, {**workers, "ddp-run-ddp-trainer-worker-1": 0}) == "Succeeded"
    assert job_outcome(elastic, {**workers, "ddp-run-ddp-trainer-worker-1": 1}) == "Failed"
    master = {"ddp-run-ddp-trainer-master-0": 0, "ddp-run-ddp-trainer-worker-0": None}
    assert job_outcome(fixed, master) == "Succeeded"


@pytest.mark.slow
def test_the_charts_cpu_job_runs_locally_survives_a_pod_kill_and_checkpoints_to_s3(s3_bucket, tmp_path):
    """Two CPU pods from the chart, checkpoints on the moto S3 server, metrics on: a pod
    killed mid-run is restarted (OnFailure), the elastic agents re-rendezvous, training
    resumes from the checkpoint and the job succeeds."""
    prefix = "local-e2e"
    values = merge_values(
        files=[CPU_VALUES],
        sets=[
            f"checkpoints.s3.bucket={s3_bucket.name},checkpoints.s3.prefix={prefix},"
            f"checkpoints.s3.endpoint={s3_bucket.endpoint},checkpoints.s3.region=us-east-1,"
            "checkpoints.s3.existingSecret=s3-keys,metrics.port=9411,runPolicy.backoffLimit=3",
            "trainer.config.data.name=plugins:slow_digits,trainer.config.data.options.delay_s=0.002,"
            "trainer.config.train.max_steps=60,trainer.config.checkpoint.every_steps=10,"
            "trainer.config.log.every_steps=10",
        ],
    )
    rendered = render(values, release="ddp-run", namespace="training")
    host_env = process_env({"PYTHONPATH": os.pathsep.join([str(REPO), str(HELPERS)])})
    host_env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    host_env.pop("AWS_ENDPOINT_URL", None)  # only what the chart sets reaches the pods
    killed = []

    def kill_worker_1_after_step_20(pods):
        if not killed and (s3_bucket.latest_step(prefix) or 0) >= 20:
            kill_pod(pods[1])
            killed.append(pods[1].plan.name)

    lines: list[str] = []
    outcome = run(
        rendered.objects,
        tmp_path / "pods",
        timeout=200,
        stream=lines.append,
        on_tick=kill_worker_1_after_step_20,
        host_env=host_env,
    )
    logs = {name: path.read_text() for name, path in outcome.logs.items()}
    assert outcome.status == "Succeeded", {k: v[-2000:] for k, v in logs.items()}
    assert killed == ["ddp-run-ddp-trainer-worker-1"] and outcome.restarts == 1
    assert s3_bucket.latest_step(prefix) == 60
    assert any("resumed from step" in text for text in logs.values())
    assert any("world size 2 (2 nodes x 1 process)" in line for line in lines)  # rank 0 streamed
    assert any("checkpoint step 10 -> s3://" in line for line in lines)


@pytest.mark.slow
def test_a_job_whose_pods_keep_failing_ends_failed_after_its_backoff_limit(tmp_path):
    values = merge_values(
        files=[CPU_VALUES], sets=["runPolicy.backoffLimit=1,trainer.config.train.batch_size=0"]
    )
    rendered = render(values, release="bad-run", namespace="training")
    outcome = run(rendered.objects, tmp_path / "pods", timeout=120, stream=None, host_env=process_env())
    assert outcome.status == "Failed" and outcome.restarts == 1
    text = next(iter(outcome.logs.values())).read_text()
    assert "train.batch_size=0: must be greater than 0" in text


@pytest.mark.slow
def test_master_and_worker_mode_runs_locally(tmp_path):
    values = merge_values(
        files=[CPU_VALUES], sets=["mode=fixed,metrics.port=9413,trainer.config.train.max_steps=15"]
    )
    rendered = render(values, release="fixed-run", namespace="training")
    assert list(rendered.one("PyTorchJob")["spec"]["pytorchReplicaSpecs"]) == ["Master", "Worker"]
    lines: list[str] = []
    outcome = run(
        rendered.objects, tmp_path / "pods", timeout=200, stream=lines.append, host_env=process_env()
    )
    assert outcome.status == "Succeeded", {k: v.read_text()[-2000:] for k, v in outcome.logs.items()}
    assert list(outcome.exit_codes) == ["fixed-run-ddp-trainer-master-0", "fixed-run-ddp-trainer-worker-0"]
    assert any("world size 2 (2 nodes x 1 process)" in line for line in lines)
