"""The real image, run as the chart's pods (`make image-e2e`, after `make image`).

Marked `image`: `make test` leaves them out; `make image-e2e` runs them with a Docker engine
(the one that answers, or a private dockerd it starts and stops). Nothing here is mocked:
real containers of the built image on an internal Docker network, moto's S3 on the
machine's address on that network, the trainer's metrics scraped over HTTP.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.request

import boto3
import pytest
from conftest import (
    REPO,
    S3Bucket,
    assert_lost_within,
    cpu_chart_on_s3,
    freeze_pod_1_once_snapshotted,
    pod_snapshot_steps,
    s3_secrets,
    serve_moto,
)

from benchmarks.trial_record import same_state
from operator_scripts.chart.render import render
from operator_scripts.image import lock as image_lock
from operator_scripts.image.build import REPO as IMAGE_CONTEXT
from operator_scripts.image.build import build, build_derived, choose_base, default_ca, default_tag, history
from operator_scripts.image.engine import Engine, building_cli
from operator_scripts.local.kubelet import kill_pod
from operator_scripts.local.pods import LocalPod
from operator_scripts.local.run import run
from operator_scripts.local.runtimes.docker import DockerRuntime

pytestmark = pytest.mark.image

SECRETS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


def bucket(endpoint: str):
    """The bucket `e2e` on moto, and a client for the test's own looks."""
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **{
        "aws_access_key_id": SECRETS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": SECRETS["AWS_SECRET_ACCESS_KEY"],
    })  # fmt: skip
    client.create_bucket(Bucket="e2e")
    return client


def chart_values(endpoint: str, prefix: str, max_steps: int, *sets: str) -> dict:
    """The chart's CPU values with checkpoints in `e2e/PREFIX` on moto, `max_steps` steps
    and no durable checkpoint before the end."""
    return cpu_chart_on_s3(
        "e2e", prefix, endpoint,
        f"trainer.config.train.max_steps={max_steps},trainer.config.checkpoint.every_steps=1000,"
        "trainer.config.log.every_steps=10",
        *sets,
    )  # fmt: skip


@pytest.fixture(scope="module")
def docker() -> Engine:
    """The engine `make image-e2e` started or found, holding the image `make image` built."""
    engine = Engine(os.environ.get("DDP_DOCKER_CLI") or building_cli(), dict(os.environ), private=False)
    if engine.run("version", check=False).returncode != 0:
        pytest.fail("no Docker engine answers: run these with `make image-e2e`")
    if engine.run("image", "inspect", default_tag(), check=False).returncode != 0:
        pytest.fail(f"{default_tag()} is not in the engine: run `make image` first")
    return engine


@pytest.mark.parametrize("kind", ["PyTorchJob", "TrainJob"])
def test_the_chart_job_runs_as_containers_survives_a_killed_pod_and_serves_metrics(docker, tmp_path, kind):
    """The CPU job of helm/ci/cpu-values.yaml, as a PyTorchJob and as a TrainJob: two pods as
    containers of the image with the manifest's user, read-only root, dropped capabilities
    and volumes; checkpoints to S3. The second pod's container is SIGKILLed mid-run: the
    operator (a TrainJob's Job) re-creates the pod, the job resumes from the first pod's
    snapshot and succeeds. Metrics are scraped from a container and rank 0's log is read
    with `docker logs`."""
    release, prefix, max_steps = "e2e", f"image-e2e-{kind.lower()}", 150  # 8 of the chart's 10 epochs
    job_name = f"{release}-ddp-trainer"
    pod_names = [
        f"{job_name}-worker-{i}" if kind == "PyTorchJob" else f"{job_name}-node-0-{i}" for i in (0, 1)
    ]
    with DockerRuntime(docker, job_name) as runtime, serve_moto(runtime.gateway) as endpoint:
        client = bucket(endpoint)
        values = chart_values(endpoint, prefix, max_steps, f"jobKind={kind}")
        rendered = render(values, release=release, namespace="training")
        scraped: list[str] = []
        killed: list[str] = []
        refused: list[str] = []

        held: dict[str, int] = {}

        def kill_then_scrape(pods: list[LocalPod]) -> None:
            worker_1, step = pods[1], max(pod_snapshot_steps(pods[1].folder), default=0)
            if not killed and step >= 40:
                held.update({pod.name: max(pod_snapshot_steps(pod.folder), default=0) for pod in pods})
                kill_pod(worker_1)
                killed.append(worker_1.name)
            elif killed and not scraped and step >= 60:  # resumed, and past a progress line
                with urllib.request.urlopen(f"http://{pods[0].address}:9401/metrics", timeout=5) as reply:
                    scraped.append(reply.read().decode())
                refused.append(from_a_foreign_container(docker, runtime, pods[0].address))

        lines: list[str] = []
        outcome = run(
            rendered.objects,
            tmp_path / "pods",
            timeout=420,
            stream=lines.append,
            on_tick=kill_then_scrape,
            secrets=s3_secrets(tmp_path / "secret", *SECRETS.values()),
            runtime=runtime,
        )
        rank0_log = runtime.logs(pod_names[0])
        latest = client.get_object(Bucket="e2e", Key=f"{prefix}/latest.json")["Body"].read().decode()

    print(f"\n{outcome.summary()}")
    logs = {name: path.read_text() for name, path in outcome.logs.items()}
    assert outcome.status == {"PyTorchJob": "Succeeded", "TrainJob": "Complete"}[kind], {
        name: text[-2000:] for name, text in logs.items()
    }
    # v1 re-creates the pod with no restart counted; the Job counts 1 failed pod
    counted = 0 if kind == "PyTorchJob" else 1
    assert killed == pod_names[1:] and (outcome.recreations, outcome.restarts) == (1, counted)

    resumed = re.findall(r"resumed from step (\d+) \(snapshot on [\w-]+, (\d+) steps? lost\)", rank0_log)
    print("rank 0 after the kill:", *[f"resumed from step {step} ({lost} lost)" for step, lost in resumed])
    assert len(resumed) == 1, resumed
    assert_lost_within(held, pod_names[0], int(resumed[0][0]), int(resumed[0][1]), bound=5)
    assert f'"step": {max_steps}' in latest, latest

    # the sandbox holds the job's NetworkPolicy: this machine (the node) scrapes, another
    # container on the pod network reaches neither the store nor the metrics port
    assert refused == ["23456 closed (timed out); 9401 closed (timed out)"], refused
    (metrics,) = scraped
    samples = [line for line in metrics.splitlines() if line.startswith("ddp_train_steps_total")]
    print("scraped from the rank-0 container:", *samples)
    # a counter of the process that resumed: the steps it ran since
    assert len(samples) == 1 and 'rank="0"' in samples[0] and float(samples[0].split()[-1]) > 0

    print("docker logs of the rank-0 pod (last lines):", *rank0_log.strip().splitlines()[-4:], sep="\n  ")
    assert "done: " in rank0_log and "world size 2 (2 nodes x 1 process)" in rank0_log
    # the survivor's side of the kill: one line, no traceback
    assert rank0_log.count("rank 0 lost a peer (") == 1 and "Traceback" not in rank0_log
    assert "world size 2 (2 nodes x 1 process)" in "\n".join(lines)  # the same log, streamed
    assert runtime.left_behind() == []  # every container of the run, and its network, removed


def test_a_paused_container_fails_its_liveness_probe_and_the_pod_is_recreated(docker, tmp_path):
    """`docker pause` of worker-1's container once both pods hold a snapshot of step 20:
    the cgroup freezer stops every process in it at once, its watchdog included, as a
    frozen node does. Its /healthz cannot answer: after three failed probes the kubelet
    kills the container, the operator re-creates the pod, and the job resumes from
    worker-0's snapshot and succeeds, losing at most the snapshot interval (5 steps) by the
    snapshots the harness saw at the freeze, with the final bits of the same job run without
    a fault in the same image. worker-0, whose rank only waited, is not restarted."""
    release, prefix, max_steps = "frozen", "image-e2e-frozen", 150
    job_name = f"{release}-ddp-trainer"
    with DockerRuntime(docker, job_name) as runtime, serve_moto(runtime.gateway) as endpoint:
        client = bucket(endpoint)
        probes = (
            "liveness.periodSeconds=2,liveness.timeoutSeconds=2,liveness.failureThreshold=3,"
            "liveness.terminationGracePeriodSeconds=2"
        )
        values = chart_values(endpoint, prefix, max_steps, probes)
        rendered = render(values, release=release, namespace="training")
        frozen: list[str] = []
        held: dict[str, int] = {}
        notes: list[str] = []
        secrets = s3_secrets(tmp_path / "secret", *SECRETS.values())
        outcome = run(
            rendered.objects,
            tmp_path / "pods",
            timeout=420,
            stream=None,
            notify=notes.append,
            on_tick=freeze_pod_1_once_snapshotted(20, frozen, held),
            secrets=secrets,
            runtime=runtime,
        )
        latest = client.get_object(Bucket="e2e", Key=f"{prefix}/latest.json")["Body"].read().decode()
        stored = S3Bucket("e2e", endpoint, {}, client)
        recovered = stored.load(prefix)
        # the same job without the fault, in the same image (its torch build, not this host's)
        unfaulted_values = chart_values(endpoint, f"{prefix}-unfaulted", max_steps, probes)
        unfaulted = render(unfaulted_values, release=release, namespace="training")
        reference = run(unfaulted.objects, tmp_path / "unfaulted", timeout=420, stream=None,
                        secrets=secrets, runtime=runtime)  # fmt: skip
        assert reference.status == "Succeeded", reference.summary()
        expected = stored.load(f"{prefix}-unfaulted")

    print(f"\n{outcome.summary()}", *notes, sep="\n  ")
    logs = {name: path.read_text() for name, path in outcome.logs.items()}
    assert outcome.status == "Succeeded", (notes, {name: text[-2000:] for name, text in logs.items()})
    assert frozen == [f"{job_name}-worker-1"] and (outcome.recreations, outcome.restarts) == (1, 0)
    (killed,) = [note for note in notes if "liveness probes failed" in note]
    assert killed.startswith(f"pod {job_name}-worker-1: 3 liveness probes failed in a row"), killed
    resumes = rf"resumed from step (\d+) \(snapshot on {job_name}-worker-0, (\d+) steps? lost\)"
    resumed = re.findall(resumes, "".join(logs.values()))
    assert len(resumed) == 1, resumed
    assert_lost_within(held, f"{job_name}-worker-0", int(resumed[0][0]), int(resumed[0][1]), bound=5)
    assert "watchdog" not in logs[f"{job_name}-worker-0"]  # its waiting rank was not blamed
    assert f'"step": {max_steps}' in latest, latest
    assert same_state(recovered, expected), (recovered["progress"], expected["progress"])
    assert runtime.left_behind() == []


FOREIGN_PROBE = """
import socket, sys
answers = []
for port in (23456, 9401):
    try:
        socket.create_connection((sys.argv[1], port), timeout=1.5).close()
        answers.append(f"{port} open")
    except OSError as error:
        answers.append(f"{port} closed ({error})")
print("; ".join(answers))
"""


def from_a_foreign_container(docker: Engine, runtime: DockerRuntime, address: str) -> str:
    """A container of the same image on the job's network that is none of its pods: what it
    reaches of a pod's rendezvous store and metrics port."""
    probe = docker.run(
        "run", "--rm", "--network", runtime.network, "--label", f"ddp-ops-local={runtime.network}",
        "--entrypoint", "python", default_tag(), "-c", FOREIGN_PROBE, address, check=False,
    )  # fmt: skip
    return probe.stdout.strip() or probe.stderr.strip()[-300:]


INVENTORY = """
import importlib.metadata as metadata, json, os
print(json.dumps({
    "uid": os.getuid(),
    "ca_secret": os.path.exists("/run/secrets/pip_ca"),
    "packages": sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()),
}))
"""


def test_the_image_holds_exactly_the_lock_runs_as_10001_and_kept_no_secret(docker):
    """What the build left: the venv's packages are the lock's, version for version, plus the
    project; the user is the chart's; the CA bundle the build was given is nowhere."""
    shown = docker.run("run", "--rm", "--entrypoint", "/opt/venv/bin/python", default_tag(), "-c", INVENTORY)
    inventory = json.loads(shown.stdout)
    installed = image_lock.pins("\n".join(inventory["packages"]))
    assert installed.pop("ddp-trainer") == "0.1.0"
    assert installed == image_lock.pins(image_lock.LOCK.read_text())
    assert inventory["uid"] == 10001 and inventory["ca_secret"] is False
    print(f"\nthe image's venv: {len(installed)} packages, each the lock's version; uid 10001; no CA secret")


def test_a_compiled_step_runs_in_the_image_as_the_chart_runs_it(docker):
    """train.compile=model on the CPU: inductor's C++ kernels built by the image's g++, as
    uid 10001 on a read-only root filesystem with /tmp its only writable path (the chart's pod)."""
    overrides = "train.compile=model,train.max_steps=2,metrics.port=0,checkpoint.uri=/tmp/checkpoints"
    done = docker.run(
        "run", "--rm", "--read-only", "--tmpfs", "/tmp:exec,size=1g", "--entrypoint", "/opt/venv/bin/python",
        default_tag(), "-m", "trainer", "--set", overrides, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [
        line for line in done.stderr.splitlines() + done.stdout.splitlines() if "train.compile=model" in line
    ]
    assert compiled and "1 graph" in compiled[0], done.stderr[-3000:]
    print(f"\n{compiled[0]}")


def test_a_code_change_rebuilds_under_5_mb_of_layers(docker, tmp_path):
    """A line changed in trainer/ rebuilds only the project's layer: the 5 GB of packages
    and the base are reused, as pushing and pulling onto every node would."""
    context = tmp_path / "context"
    context.mkdir()
    let_in = [
        line[1:].rstrip("/")
        for line in (IMAGE_CONTEXT / ".dockerignore").read_text().split()
        if line[0] == "!"
    ]
    for name in ["Dockerfile", ".dockerignore", *let_in]:  # what .dockerignore lets into the context
        source = IMAGE_CONTEXT / name
        if source.is_dir():
            shutil.copytree(source, context / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, context / name)
    with open(context / "trainer" / "__init__.py", "a") as handle:
        handle.write("# a one-line change\n")
    tag = "ddp-trainer:code-change"
    build(docker, tag, choose_base(docker, None), default_ca(), context=context)
    try:
        before, after = history(docker, default_tag()), history(docker, tag)
        assert len(before) == len(after)
        rebuilt = [new for new, old in zip(after, before, strict=True) if new.created != old.created]
        new_bytes = sum(entry.size for entry in rebuilt)
        print(f"\nrebuilt after a code change: {new_bytes / 1e6:.2f} MB in {len(rebuilt)} history entries")
        assert new_bytes < 5e6, rebuilt
        layers_before, layers_after = layer_ids(docker, default_tag()), layer_ids(docker, tag)
        assert layers_before[:3] == layers_after[:3]  # base, user, packages: shared
        assert layers_before != layers_after  # and the project's layer did change
    finally:
        docker.run("rmi", tag, check=False)


def layer_ids(docker: Engine, tag: str) -> list[str]:
    return docker.run("image", "inspect", "--format", '{{join .RootFS.Layers " "}}', tag).stdout.split()


def test_a_derived_image_of_the_example_plugin_runs_the_chart_job(docker, tmp_path):
    """The example package (docs/examples/own-model) built on the image by its Dockerfile
    pattern: one layer of kilobytes on top, the image's user kept. The chart's CPU job on that
    image trains the example's model on the example's data, as containers, to Succeeded."""
    tag = "ddp-trainer-example:e2e"
    build_derived(docker, tag, default_tag(), REPO / "docs" / "examples" / "own-model")
    try:
        base_layers, layers = layer_ids(docker, default_tag()), layer_ids(docker, tag)
        added = history(docker, tag)[len(history(docker, default_tag())) :]
        added_bytes = sum(entry.size for entry in added)
        print(f"\nthe example package on the image: {added_bytes / 1e3:.0f} kB in {len(added)} steps")
        assert layers[: len(base_layers)] == base_layers and added_bytes < 1e6
        assert (
            docker.run("image", "inspect", "--format", "{{.Config.User}}", tag).stdout.strip()
            == "10001:10001"
        )
        job_name = "example-ddp-trainer"
        with DockerRuntime(docker, job_name) as runtime, serve_moto(runtime.gateway) as endpoint:
            bucket(endpoint)
            values = chart_values(
                endpoint, "example", 40, "image.repository=ddp-trainer-example,image.tag=e2e",
                "trainer.config.data.name=wave_classifier.data:build_dataset,"
                "trainer.config.model.name=wave_classifier.model:build_model",
            )  # fmt: skip
            rendered = render(values, release="example", namespace="training")
            secrets = s3_secrets(tmp_path / "secret", *SECRETS.values())
            outcome = run(rendered.objects, tmp_path / "pods", timeout=300, secrets=secrets, runtime=runtime)
            rank0_log = runtime.logs(f"{job_name}-worker-0")
        print(outcome.summary())
        assert outcome.status == "Succeeded", rank0_log[-3000:]
        assert "wave_classifier.model:build_model" in rank0_log and "done: 40 steps" in rank0_log
    finally:
        docker.run("rmi", tag, check=False)
