"""The operator's view of a PyTorchJob as pure functions, and the chart's job run locally
as its controllers would run it, as a PyTorchJob (training-operator v1) and as a TrainJob
(Trainer v2, JobSet, the Job controller): pods as process groups on loopback, restarts,
outcome."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from contextlib import closing

import pytest
from conftest import (
    CPU_VALUES,
    HELPERS,
    REPO,
    assert_bits_of_an_uninterrupted_run,
    assert_lost_within,
    free_port,
    pod_snapshot_steps,
    process_env,
    s3_env,
    s3_secrets,
)

from operator_scripts.chart.render import merge_values, render
from operator_scripts.controllers.pytorchjob_env import injected_env, plan_pods, rank0_selector
from operator_scripts.image.engine import Engine
from operator_scripts.local.kubelet import kill_pod
from operator_scripts.local.pod_network import PodNetwork, pod_networks_available
from operator_scripts.local.pods import HostsTable, LocalError, prepare
from operator_scripts.local.run import run
from operator_scripts.local.runtimes.docker import DockerRuntime
from operator_scripts.local.runtimes.process import ProcessRuntime, claim_host_ports

KINDS = ["PyTorchJob", "TrainJob"]
DONE = {"PyTorchJob": "Succeeded", "TrainJob": "Complete"}  # the condition each kind shows


def pod_name(kind: str, release: str, index: int) -> str:
    """Pod `index` of the chart's job: v1's `<job>-worker-<i>`, v2's `<tj>-node-0-<i>`
    (named by its host name locally)."""
    return f"{release}-ddp-trainer-" + (f"worker-{index}" if kind == "PyTorchJob" else f"node-0-{index}")


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
        "PET_RDZV_CONF": "join_timeout=900,keep_alive_interval=2,keep_alive_max_attempt=3,last_call_timeout=5",  # noqa: E501
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


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_lost_node_costs_a_few_steps_the_job_resumes_from_the_survivors_snapshot_bit_exact(
    s3_bucket, tmp_path, references, kind, request
):
    """Two CPU pods from the chart, snapshots every 5 steps, S3 checkpoints only at the end,
    metrics on; the PyTorchJob trains on shards in S3 (each pod with its shard cache in its
    /tmp), the TrainJob on bundled data. Mid-epoch 2, one pod's process tree is SIGKILLed: it
    is re-created with an empty /dev/shm (a node lost; a TrainJob's Job replaces it after its
    10 s back-off), the agents re-rendezvous, and training resumes from the other pod's
    snapshot, sent over the process group, losing at most the snapshot interval as the
    harness counts it; the job succeeds with the same final bits as an uninterrupted run of
    the same config."""
    prefix = f"local-e2e-{kind}"
    data = (
        f"trainer.config.data.name=plugins:seen_shards,trainer.config.data.path={request.getfixturevalue('shards_in_s3')}"
        if kind == "PyTorchJob"
        else "trainer.config.data.name=plugins:slow_digits"
    )
    values = merge_values(
        files=[CPU_VALUES],
        sets=[
            f"jobKind={kind}",
            f"checkpoint.s3.bucket={s3_bucket.name},checkpoint.s3.prefix={prefix},"
            f"checkpoint.s3.endpoint={s3_bucket.pod_endpoint},checkpoint.s3.region=us-east-1,"
            f"checkpoint.s3.existingSecret=s3-keys,metrics.port={free_port()}",
            f"{data},trainer.config.data.options.delay_s=0.002,"
            "trainer.config.train.max_steps=60,trainer.config.checkpoint.every_steps=1000,"
            "trainer.config.model.dropout=0.3,trainer.config.log.every_steps=10",
        ],
    )
    rendered = render(values, release="ddp-run", namespace="training")
    host_env = process_env({"PYTHONPATH": os.pathsep.join([str(REPO), str(HELPERS)])})
    killed = []

    held: dict[str, int] = {}

    def kill_worker_1_after_step_25(pods):  # epoch 2 of 3: 19 steps an epoch at 2 ranks
        if not killed and max(pod_snapshot_steps(pods[1].folder), default=0) >= 25:
            held.update({pod.name: max(pod_snapshot_steps(pod.folder), default=0) for pod in pods})
            kill_pod(pods[1])
            killed.append(pods[1].plan.name)

    lines: list[str] = []
    outcome = run(
        rendered.objects,
        tmp_path / "pods",
        timeout=200,
        stream=lines.append,
        on_tick=kill_worker_1_after_step_25,
        host_env=host_env,
        secrets=s3_secrets(tmp_path / "secret"),
    )
    logs = {name: path.read_text() for name, path in outcome.logs.items()}
    assert outcome.status == DONE[kind], {k: v[-2000:] for k, v in logs.items()}
    # ExitCode: the SIGKILLed pod (137, retryable) is re-created; v1's backoffLimit counts
    # nothing (a new pod), a Job counts the failed pod (1 of its backoffLimit)
    assert killed == [pod_name(kind, "ddp-run", 1)]
    assert (outcome.recreations, outcome.restarts) == (1, 0 if kind == "PyTorchJob" else 1)
    assert outcome.jobset_restarts == 0
    survivor_name = pod_name(kind, "ddp-run", 0)
    resumed = re.findall(
        rf"resumed from step (\d+) \(snapshot on {survivor_name}, (\d+) steps? lost\)", "".join(logs.values())
    )
    assert len(resumed) == 1, resumed
    assert_lost_within(held, survivor_name, int(resumed[0][0]), int(resumed[0][1]), bound=5)
    assert int(resumed[0][0]) > 19, "the kill was not mid-epoch 2"
    survivor = logs[survivor_name]  # one line for the lost peer, no traceback
    assert survivor.count("rank 0 lost a peer (") == 1 and "Traceback" not in survivor, survivor[-3000:]
    assert any("world size 2 (2 nodes x 1 process)" in line for line in lines)  # rank 0 streamed
    assert s3_bucket.latest_step(prefix) == 60
    if kind == "TrainJob":  # rank 0's progress in the status, through Trainer's status server
        status = outcome.trainer_status or {}
        figures = {metric["name"]: metric["value"] for metric in status.get("metrics", [])}
        assert status.get("progressPercentage") == 100 and status.get("estimatedRemainingSeconds") == 0, (
            status
        )
        assert (figures.get("step"), figures.get("durable_step")) == ("60", "60"), status

    recovered = s3_bucket.load(prefix)
    assert_bits_of_an_uninterrupted_run(rendered, recovered, references, s3_env(s3_bucket.endpoint))


@pytest.mark.slow
def test_a_trainjob_resumes_the_checkpoints_a_pytorchjob_left(s3_bucket, tmp_path):
    """Moving a project from v1 to v2: the same release, bucket and prefix, so the same
    checkpoint location (and the same job for its lease); the TrainJob resumes where the
    PyTorchJob stopped, not from step 0."""
    secrets = s3_secrets(tmp_path / "secret")
    common = (
        f"cpuNodes=1,checkpoint.s3.bucket={s3_bucket.name},checkpoint.s3.prefix=moved,"
        f"checkpoint.s3.endpoint={s3_bucket.pod_endpoint},checkpoint.s3.region=us-east-1,"
        "checkpoint.s3.existingSecret=s3-keys,trainer.config.checkpoint.every_steps=10"
    )
    logs = {}
    for kind, steps in (("PyTorchJob", 20), ("TrainJob", 30)):
        values = merge_values(
            files=[CPU_VALUES], sets=[f"jobKind={kind},{common},trainer.config.train.max_steps={steps}"]
        )
        rendered = render(values, release="ddp-run", namespace="training")
        outcome = run(rendered.objects, tmp_path / kind, timeout=200, stream=None, secrets=secrets)
        logs[kind] = outcome.logs[pod_name(kind, "ddp-run", 0)].read_text()
        assert outcome.status == DONE[kind], logs[kind][-3000:]
    assert "resumed from step" not in logs["PyTorchJob"] and s3_bucket.latest_step("moved") == 30
    assert f"resumed from step 20 ({s3_bucket.uri('moved')}" in logs["TrainJob"], logs["TrainJob"][-3000:]


@pytest.mark.slow
def test_a_trainjob_past_its_backoff_limit_restarts_whole_and_resumes_from_the_store(s3_bucket, tmp_path):
    """backoffLimit 0, trainJob.maxRestarts 1: one killed pod fails the node Job, and the JobSet
    re-creates every pod (snapshots gone with their /dev/shm); the job resumes from the
    store's newest checkpoint and completes, one JobSet restart counted."""
    host_env = process_env({"PYTHONPATH": os.pathsep.join([str(REPO), str(HELPERS)])})
    values = merge_values(
        files=[CPU_VALUES],
        sets=[
            "jobKind=TrainJob,runPolicy.backoffLimit=0,trainJob.maxRestarts=1",
            f"checkpoint.s3.bucket={s3_bucket.name},checkpoint.s3.prefix=whole,"
            f"checkpoint.s3.endpoint={s3_bucket.pod_endpoint},checkpoint.s3.region=us-east-1,"
            "checkpoint.s3.existingSecret=s3-keys",
            "trainer.config.data.name=plugins:slow_digits,trainer.config.data.options.delay_s=0.002,"
            "trainer.config.train.max_steps=50,trainer.config.checkpoint.every_steps=10",
        ],
    )
    rendered = render(values, release="ddp-run", namespace="training")
    killed: list[int] = []

    def kill_once_stored(pods):
        if not killed and (s3_bucket.latest_step("whole") or 0) >= 20:
            killed.append(s3_bucket.latest_step("whole"))
            kill_pod(pods[1])

    outcome = run(
        rendered.objects,
        tmp_path / "pods",
        timeout=240,
        stream=None,
        on_tick=kill_once_stored,
        host_env=host_env,
        secrets=s3_secrets(tmp_path / "secret"),
    )
    logs = {name: path.read_text() for name, path in outcome.logs.items()}
    assert outcome.status == "Complete", {k: v[-2000:] for k, v in logs.items()}
    assert (outcome.jobset_restarts, outcome.recreations) == (1, 2)  # every pod, once
    resumed = re.findall(r"resumed from step (\d+) \(s3://", logs[pod_name("TrainJob", "ddp-run", 0)])
    assert resumed and int(resumed[-1]) >= killed[0], (resumed, killed)
    assert s3_bucket.latest_step("whole") == 50


def outside_paths() -> dict[str, object]:
    """What a local run must leave alone: the container paths the chart's config names, and
    the trainer's default cache and metrics folders in the host's /tmp, as entries."""
    watched = ["/checkpoints", "/tmp/metrics", "/tmp/checkpoint-cache", "/tmp/ddp-trainer-cache"]
    return {path: sorted(os.listdir(path)) if os.path.isdir(path) else None for path in watched}


def delayed_start(tmp_path, kind: str, pods: int, delay_s: float, lines: list[tuple[float, str]]):
    """The job with its rendezvous host `delay_s` late; rank 0's lines, each with the time it
    was streamed."""
    values = merge_values(
        files=[CPU_VALUES],
        sets=[
            f"jobKind={kind},cpuNodes={pods},trainer.config.train.max_steps=20,trainer.config.log.every_steps=10"
        ],
    )
    rendered = render(values, release="slow-start", namespace="training")
    host = pod_name(kind, "slow-start", 0)
    return run(
        rendered.objects,
        tmp_path / "pods",
        timeout=400,
        delays={host: delay_s},
        stream=lambda line: lines.append((time.time(), line)),
        host_env=process_env(),
    )


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "pods", "delay_s"), [("PyTorchJob", 2, 75), ("TrainJob", 4, 30)])
def test_a_slow_rendezvous_host_costs_no_restart(tmp_path, kind, pods, delay_s):
    """The rendezvous host (worker-0; a TrainJob's node-0-0) starts late (an image pull; 75 s
    is past torchrun's own 60 s store timeout): the others wait for its name, one line each,
    and the job succeeds with no restart and no re-created pod. Writes stay in the work
    folder. Each kind waits through the same ddp-launch path, so the TrainJob case is the
    four-pod one, with a shorter delay: every waiting pod says so once. Rank 0's start-up
    split (on the late host) adds up, within 5 %, to the time from its container's start,
    as the emulated kubelet saw it, to the split's line as this test saw it streamed."""
    before = outside_paths()
    streamed: list[tuple[float, str]] = []
    outcome = delayed_start(tmp_path, kind, pods, delay_s, streamed)
    lines = [line for _, line in streamed]
    logs = {name: path.read_text() for name, path in outcome.logs.items()}
    assert outcome.status == DONE[kind], {k: v[-2000:] for k, v in logs.items()}
    assert (outcome.restarts, outcome.recreations, outcome.jobset_restarts) == (0, 0, 0)
    waiting = [name for name, text in logs.items() if text.count("waiting for the rendezvous host") == 1]
    assert waiting == [pod_name(kind, "slow-start", i) for i in range(1, pods)]
    assert any(f"world size {pods} ({pods} nodes x 1 process)" in line for line in lines)
    created, started = outcome.starts[outcome.rank0]
    assert outcome.rank0 == pod_name(kind, "slow-start", 0) and started - created >= delay_s
    split = [(at, re.search(r"start-up ([\d.]+)s to the first step: (.*)", line)) for at, line in streamed]
    ((arrived, said),) = [(at, found) for at, found in split if found]
    assert said[2].startswith("launch and rendezvous ") and "first step " in said[2], said[0]
    assert float(said[1]) == pytest.approx(arrived - started, rel=0.05), (said[0], arrived - started)
    checkpoints = tmp_path / "pods" / pod_name(kind, "slow-start", 0) / "volumes" / "checkpoints"
    assert (checkpoints / "slow-start" / "latest.json").is_file()
    assert outside_paths() == before


# a value the chart's checks cannot see: only the image knows which plug-ins it can import
NOT_IN_THE_IMAGE = "trainer.config.model.name=not_in_the_image:build"


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_trainer_value_fails_the_job_in_seconds_without_a_restart(tmp_path, kind):
    """Exit 2 is permanent: v1's restartPolicy ExitCode; a TrainJob's podFailurePolicy FailJob,
    which its JobSet's rule turns into FailJobSet, no JobSet restart."""
    values = merge_values(files=[CPU_VALUES], sets=[f"jobKind={kind}", NOT_IN_THE_IMAGE])
    rendered = render(values, release="bad-run", namespace="training")
    started = time.monotonic()
    outcome = run(rendered.objects, tmp_path / "pods", timeout=120, stream=None, host_env=process_env())
    assert time.monotonic() - started < 30
    permanent = {
        "PyTorchJob": "exited with code 2, not retryable",
        "TrainJob": "exited with code 2 (podFailurePolicy: FailJob)",
    }
    assert outcome.status == "Failed" and permanent[kind] in outcome.reason
    assert (outcome.restarts, outcome.recreations, outcome.jobset_restarts) == (0, 0, 0)
    rank0 = outcome.logs[pod_name(kind, "bad-run", 0)].read_text()
    assert rank0.strip().startswith("trainer: error: model.name='not_in_the_image:build': cannot import")
    verdict = {
        "PyTorchJob": "job bad-run-ddp-trainer: Failed (pod bad-run-ddp-trainer-worker-",
        "TrainJob": "trainjob bad-run-ddp-trainer: Failed (FailJobSetFailurePolicyAction: pod bad-run-",
    }
    assert outcome.summary().startswith(verdict[kind]), outcome.summary()


@pytest.mark.slow
def test_ddp_ops_local_exits_1_on_a_failed_job_and_its_last_line_says_why(tmp_path):
    """The command a user types, as a process: its exit status and its last line are the
    operator's verdict (`job NAME: Failed (reason)`), exit 0 being kept for Succeeded."""
    completed = subprocess.run(
        [sys.executable, "-m", "operator_scripts.cli", "local", "-f", str(CPU_VALUES),
         "--set", NOT_IN_THE_IMAGE, "--release", "bad-run", "--workdir", str(tmp_path / "pods"),
         "--timeout-s", "120"],
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert completed.returncode == 1, completed.stdout + completed.stderr[-3000:]
    last = completed.stdout.strip().splitlines()[-1]
    assert last.startswith("job bad-run-ddp-trainer: Failed (pod bad-run-ddp-trainer-worker-"), last
    assert "exited with code 2, not retryable" in last


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "stopped"), [("Running", True), ("None", False)])
def test_a_job_that_keeps_failing_ends_after_exactly_its_backoff_limit(tmp_path, policy, stopped):
    """Under OnFailure every failure restarts the container in place and counts; the job is
    Failed when the sum over pods reaches backoffLimit. Its pods are then deleted, or kept
    (and would keep restarting) under cleanPodPolicy None."""
    values = merge_values(
        files=[CPU_VALUES],
        sets=[
            f"restartPolicy=OnFailure,runPolicy.backoffLimit=3,runPolicy.cleanPodPolicy={policy}",
            NOT_IN_THE_IMAGE,
        ],
    )
    rendered = render(values, release="crash-run", namespace="training")
    outcome = run(rendered.objects, tmp_path / "pods", timeout=120, stream=None, host_env=process_env())
    assert (outcome.status, outcome.reason, outcome.restarts) == ("Failed", "BackoffLimitExceeded", 3)
    assert outcome.summary().endswith("Failed (BackoffLimitExceeded); 3 restarts counted (backoffLimit 3)")
    pods = ["crash-run-ddp-trainer-worker-0", "crash-run-ddp-trainer-worker-1"]
    assert (outcome.deleted, outcome.kept_running) == ((pods, []) if stopped else ([], pods))


@pytest.mark.slow
def test_master_and_worker_mode_runs_locally(tmp_path):
    """Once no other local run holds what it needs: the host's ports for pods on loopback, the
    pod network's subnet for pods with networks of their own (as root). While another run
    holds it, this run is refused in one line before any pod starts."""
    values = merge_values(
        files=[CPU_VALUES], sets=[f"mode=fixed,metrics.port={free_port()},trainer.config.train.max_steps=15"]
    )
    rendered = render(values, release="fixed-run", namespace="training")
    assert list(rendered.one("PyTorchJob")["spec"]["pytorchReplicaSpecs"]) == ["Master", "Worker"]
    with (
        closing(claim_host_ports()),
        pytest.raises(LocalError, match="another `ddp-ops local` run on this host"),
    ):
        run(
            rendered.objects,
            tmp_path / "refused",
            host_env=process_env(),
            runtime=ProcessRuntime(isolate=False),
        )
    if pod_networks_available():
        held = PodNetwork()
        held.open()
        try:
            with pytest.raises(LocalError, match=r"--pod-subnet 10.213.0.0/24 overlaps .*: give another"):
                run(rendered.objects, tmp_path / "refused", host_env=process_env())
        finally:
            held.close()
    assert not list((tmp_path / "refused").glob("*/*.log")), "a pod started"
    lines: list[str] = []
    outcome = run(
        rendered.objects, tmp_path / "pods", timeout=200, stream=lines.append, host_env=process_env()
    )
    assert outcome.status == "Succeeded", {k: v.read_text()[-2000:] for k, v in outcome.logs.items()}
    assert list(outcome.exit_codes) == ["fixed-run-ddp-trainer-master-0", "fixed-run-ddp-trainer-worker-0"]
    assert any("world size 2 (2 nodes x 1 process)" in line for line in lines)


def test_the_docker_runtime_runs_each_pod_as_its_manifest_says(tmp_path):
    """The `docker create` of a pod, composed from the rendered manifest (only composed here:
    tests/test_image_e2e.py runs it): the pod's name, its sandbox's network (which holds the
    pod's name and address), user, groups, read-only root, capabilities, limits and volumes;
    a variable's Secret value reaches it by name, never as text; the S3 Secret as a folder."""
    values = merge_values(
        files=[CPU_VALUES],
        sets=[
            "checkpoint.s3.bucket=b,checkpoint.s3.existingSecret=s3-keys",
            "trainer.extraEnv[0].name=TOKEN,trainer.extraEnv[0].valueFrom.secretKeyRef.name=tokens,"
            "trainer.extraEnv[0].valueFrom.secretKeyRef.key=hub",
        ],
    )
    rendered = render(values, release="ddp-run", namespace="training")
    runtime = DockerRuntime(Engine("docker", {}, private=False), "ddp-run-ddp-trainer")
    secrets = s3_secrets(tmp_path / "s3")
    (tmp_path / "tokens").mkdir()
    (tmp_path / "tokens" / "hub").write_text("s3cr3t")
    secrets["tokens"] = tmp_path / "tokens"
    pods = prepare(rendered.objects, tmp_path, host_env={}, runtime=runtime, secrets=secrets)
    hosts = HostsTable(tmp_path / "etc-hosts")
    argv = runtime.docker_create(pods[1], hosts)
    container = pods[1].plan.container
    image_at = argv.index(container["image"])
    options, command = argv[1:image_at], argv[image_at + 1 :]

    def values_of(flag: str) -> list[str]:
        return [options[i + 1] for i, option in enumerate(options) if option == flag]

    assert values_of("--name") == [pods[1].name] and not values_of("--hostname") and not values_of("--ip")
    assert values_of("--network") == [f"container:{pods[1].name}-sandbox"] and pods[1].address == "10.213.0.3"
    assert values_of("--user") == ["10001:10001"] and values_of("--group-add") == ["10001"]
    assert "--read-only" in options and values_of("--cap-drop") == ["ALL"] and not values_of("--cap-add")
    assert values_of("--security-opt") == ["no-new-privileges"]
    assert values_of("--memory") == [str(4 * 2**30)]
    mounts = {}
    for spec in values_of("--mount"):
        fields = dict(part.split("=") for part in spec.split(",") if "=" in part)
        mounts[fields["target"]] = spec
    secret_mount = "/var/run/secrets/ddp-trainer/s3"
    read_only = {"/etc/hosts", "/etc/nsswitch.conf", "/etc/ddp-trainer", secret_mount}
    # writable where the kubelet mounts it too: the termination message file
    assert set(mounts) == {*read_only, "/dev/shm", "/tmp", "/dev/termination-log"}
    assert {target for target, spec in mounts.items() if spec.endswith(",readonly")} == read_only
    assert f"source={hosts.path}," in mounts["/etc/hosts"] and f"source={pods[1].folder}/" in mounts["/tmp"]
    assert values_of("--entrypoint") == container["command"][:1]
    assert command == [*container["command"][1:], *container["args"]]  # the manifest's, unchanged
    assert "TOKEN" in values_of("--env") and "s3cr3t" not in " ".join(argv)
    assert pods[1].env["TOKEN"] == "s3cr3t" and pods[1].env["PET_NNODES"] == "2:2"
    assert pods[1].env["AWS_SHARED_CREDENTIALS_FILE"] == f"{secret_mount}/credentials"  # a container path
    config = (pods[1].folder / "volumes" / "config" / "config.yaml").read_text()
    assert "snapshot_dir: /dev/shm/" in config  # container paths stay as they are in a container
