"""The job's network under `ddp-ops local` as root: each pod a network namespace of its own
on the job's pod network, the chart's NetworkPolicy enforced there as a CNI enforces it.
Checked from processes placed beside the pods (guests: a pod of another install, a pod of
another namespace, Prometheus), with the same job run with and without the policy."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch
from conftest import CPU_VALUES, HELPERS, REPO, S3_SECRET, cpu_chart_on_s3, process_env, s3_secrets

from operator_scripts.chart.render import merge_values, render
from operator_scripts.local.pod_network import Attachment, pod_networks_available
from operator_scripts.local.run import run
from operator_scripts.local.runtimes.process import ProcessRuntime

needs_root = pytest.mark.skipif(
    not pod_networks_available(), reason="needs root: pod network namespaces and iptables (CI runs as root)"
)
STORE_PORT, METRICS_PORT = 23456, 9401
JOB_LABELS = {"app.kubernetes.io/name": "ddp-trainer", "app.kubernetes.io/component": "trainer"}
OTHER_INSTALL = {**JOB_LABELS, "app.kubernetes.io/instance": "other"}
# a TCP connect from a guest, timed out where a policy drops it, as every common CNI does
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5).close()
    print("open")
except OSError as error:
    print(f"closed ({error})")
"""
SCRAPE = """
import sys, urllib.request
try:
    print(urllib.request.urlopen(f"http://{sys.argv[1]}:{sys.argv[2]}/metrics", timeout=3).read().decode())
except OSError as error:
    print(f"closed ({error})")
"""


def from_guest(guest: Attachment, program: str, address: str, port: int) -> str:
    done = subprocess.run(
        [*guest.prefix, sys.executable, "-c", program, address, str(port)], capture_output=True, text=True
    )
    return done.stdout.strip() or done.stderr.strip()


def secret_values_in_environments(pods, secrets: list[str]) -> tuple[list[str], list[str]]:
    """Each process of the pods (ddp-launch, torchrun, the ranks, their writer and fork
    server), as `name pid`, and those whose environment holds any of `secrets`."""
    seen, leaked = [], []
    for pod in pods:
        if pod.process is None:
            continue
        root = psutil.Process(pod.process.pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                environ = Path(f"/proc/{process.pid}/environ").read_bytes().decode(errors="replace")
                name = " ".join(process.cmdline()[1:4])
            except (OSError, psutil.Error):
                continue
            seen.append(f"{pod.name}: {name}")
            if any(secret in environ for secret in secrets):
                leaked.append(f"{pod.name}: {name}")
    return seen, leaked


def job(prefix: str, endpoint: str, bucket: str, *sets: str):
    values = cpu_chart_on_s3(
        bucket, prefix, endpoint,
        "trainer.config.data.name=plugins:slow_digits,trainer.config.data.options.delay_s=0.004,"
        "trainer.config.train.max_steps=60,trainer.config.checkpoint.every_steps=1000,"
        "trainer.config.log.every_steps=5",
        *sets,
    )  # fmt: skip
    return render(values, release="ddp-run", namespace="training")


def run_with_guests(rendered, workdir, secrets, probe) -> tuple[object, dict]:
    """Run the job; once rank 0 trains, `probe(runtime, pods, seen)` runs on a thread of its
    own (the kubelet's loop goes on), its findings in `seen`."""
    runtime = ProcessRuntime()
    seen: dict = {}
    started: list[threading.Thread] = []

    def tick(pods) -> None:
        if not started and "step 10/" in pods[0].log_path.read_text():
            started.append(threading.Thread(target=probe, args=(runtime, pods, seen)))
            started[0].start()

    host_env = process_env({"PYTHONPATH": os.pathsep.join([str(REPO), str(HELPERS)])})
    outcome = run(
        rendered.objects, workdir, timeout=200, stream=None, on_tick=tick, host_env=host_env,
        secrets=secrets, runtime=runtime,
    )  # fmt: skip
    assert started, "rank 0 never trained"
    started[0].join(timeout=60)
    logs = {name: path.read_text()[-2000:] for name, path in outcome.logs.items()}
    assert outcome.status == "Succeeded", logs
    return outcome, seen


@pytest.mark.slow
@needs_root
def test_the_policy_refuses_other_installs_and_namespaces_admits_prometheus_and_the_job_trains_bit_exact(
    s3_bucket, tmp_path
):
    key_id, secret_key = f"AKIA{uuid.uuid4().hex[:16].upper()}", uuid.uuid4().hex
    secrets = s3_secrets(tmp_path / "secret", key_id, secret_key)

    def probe_open(runtime, pods, seen) -> None:
        guest = runtime.network.guest("other-worker-0", "training", OTHER_INSTALL)
        seen["store"] = from_guest(guest, CONNECT, pods[0].address, STORE_PORT)

    off, seen_off = run_with_guests(
        job("open", s3_bucket.pod_endpoint, s3_bucket.name, "networkPolicy.enabled=false"),
        tmp_path / "open", secrets, probe_open,
    )  # fmt: skip
    assert seen_off["store"] == "open"  # without the policy another install reaches the store

    def probe_closed(runtime, pods, seen) -> None:
        network, worker = runtime.network, pods[0].address
        other_install = network.guest("other-worker-0", "training", OTHER_INSTALL)
        same_labels_elsewhere = network.guest("lookalike", "elsewhere", pods[0].labels)
        prometheus = network.guest("prometheus-0", "monitoring", {"app.kubernetes.io/name": "prometheus"})
        with socket.create_server(("0.0.0.0", 0)) as listener:  # the node, on a port no rule names
            probes = {
                "prometheus: scrape": (prometheus, SCRAPE, worker, METRICS_PORT),
                "other install: store": (other_install, CONNECT, worker, STORE_PORT),
                "other install: metrics": (other_install, CONNECT, worker, METRICS_PORT),
                "other namespace: store": (same_labels_elsewhere, CONNECT, worker, STORE_PORT),
                "prometheus: store": (prometheus, CONNECT, worker, STORE_PORT),
                "pod to node: other port": (
                    network.attached[pods[0].name],
                    CONNECT,
                    network.gateway,
                    listener.getsockname()[1],
                ),
            }
            with ThreadPoolExecutor(len(probes)) as pool:  # at once, while rank 0 trains
                answers = {who: pool.submit(from_guest, *probe) for who, probe in probes.items()}
                seen["environments"] = secret_values_in_environments(pods, [key_id, secret_key])
                seen.update({who: answer.result() for who, answer in answers.items()})

    on, seen_on = run_with_guests(
        job("closed", s3_bucket.pod_endpoint, s3_bucket.name), tmp_path / "closed", secrets, probe_closed
    )
    print(*[f"{who}: {what[:80]}" for who, what in seen_on.items() if who != "environments"], sep="\n")
    refused = [who for who in seen_on if who.endswith(("store", "metrics", "other port"))]
    assert len(refused) == 5 and all(seen_on[who].startswith("closed (timed out") for who in refused), seen_on
    assert "ddp_train_steps_total{" in seen_on["prometheus: scrape"], seen_on["prometheus: scrape"][:300]
    processes, leaked = seen_on["environments"]
    assert leaked == [] and len(processes) >= 6, processes  # ddp-launch, torchrun and a rank per pod at least
    closed, opened = s3_bucket.load("closed"), s3_bucket.load("open")
    assert closed["progress"] == opened["progress"] and closed["progress"]["step"] == 60
    for name, tensor in opened["model"].items():
        assert torch.equal(tensor, closed["model"][name]), name
    assert on.restarts == off.restarts == 0


def test_a_secret_volume_is_written_as_the_kubelet_projects_it(tmp_path):
    """The chart's S3 Secret as a file of the pod's folder, mode 0440, the environment naming
    its path and holding no key; a Secret not given fails before any pod starts, in one line."""
    from operator_scripts.local.pods import LocalError, prepare

    values = merge_values(
        files=[CPU_VALUES], sets=[f"checkpoint.s3.bucket=b,checkpoint.s3.existingSecret={S3_SECRET}"]
    )
    objects = render(values).objects
    secrets = s3_secrets(tmp_path / "secret", "AKIAEXAMPLE", "s3cr3t")
    pods = prepare(objects, tmp_path / "pods", ProcessRuntime(isolate=False), host_env={}, secrets=secrets)
    credentials = pods[0].env["AWS_SHARED_CREDENTIALS_FILE"]
    assert credentials.startswith(str(pods[0].folder)) and "s3cr3t" in Path(credentials).read_text()
    assert oct(os.stat(credentials).st_mode & 0o777) == "0o440"
    assert not [value for value in pods[0].env.values() if "s3cr3t" in value or "AKIAEXAMPLE" in value]
    # the chart's volume is optional: without the Secret the pod starts with no file, and the
    # trainer's probe of the location says which (tests/test_s3.py); a required one is refused
    unsent = prepare(objects, tmp_path / "unsent", ProcessRuntime(isolate=False), host_env={})
    assert not os.path.exists(unsent[0].env["AWS_SHARED_CREDENTIALS_FILE"])
    (job_object,) = [item for item in objects if item["kind"] == "PyTorchJob"]
    for volume in job_object["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"]:
        volume.get("secret", {}).pop("optional", None)
    with pytest.raises(LocalError, match=f"secret {S3_SECRET} not found \\(give it: ddp-ops local --secret"):
        prepare(objects, tmp_path / "again", ProcessRuntime(isolate=False), host_env={})


def test_an_s3_endpoint_on_loopback_is_refused_before_any_pod_starts_naming_the_address_to_give(tmp_path):
    """Each pod's loopback is its own on the pod network: a store on this machine's 127.0.0.1
    would be unreachable from every pod, and the trainer would fail at its probe, pod by pod."""
    from operator_scripts.local.pods import LocalError, prepare
    from operator_scripts.local.runtimes.process import check_reachable_endpoints

    values = merge_values(
        files=[CPU_VALUES], sets=["checkpoint.s3.bucket=b,checkpoint.s3.endpoint=http://127.0.0.1:9555"]
    )
    pods = prepare(render(values).objects, tmp_path, ProcessRuntime(isolate=False), host_env={})
    with pytest.raises(
        LocalError, match=r"AWS_ENDPOINT_URL_S3=http://127.0.0.1:9555: .* give http://10.9.0.1:9555"
    ):
        check_reachable_endpoints(pods, "10.9.0.1")
    check_reachable_endpoints(prepare(render(merge_values(files=[CPU_VALUES])).objects, tmp_path / "b",
                                      ProcessRuntime(isolate=False), host_env={}), "10.9.0.1")  # fmt: skip
