"""A frozen pod is restarted by Kubernetes: ddp-launch's /healthz, the kubelet's liveness
probe as `ddp-ops local` runs it, and a chart job whose pod is frozen whole (every process
of it SIGSTOPped: the process runtime's stand-in for a frozen node or `docker pause`)."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import (
    CPU_VALUES,
    HELPERS,
    REPO,
    assert_bits_of_an_uninterrupted_run,
    assert_lost_within,
    free_port,
    freeze_pod_1_once_snapshotted,
    load_checkpoint,
    process_env,
    resumes_after_a_fault,
)

from operator_scripts.chart.render import merge_values, render
from operator_scripts.local.kubelet_probe import ContainerProber, ProbeSpec
from operator_scripts.local.run import run
from trainer.config import WatchdogConfig
from trainer.distributed.heartbeat import Heartbeat
from trainer.distributed.liveness import serve_health
from trainer.distributed.watchdog import VERDICTS_FILE, pod_health


def test_a_pod_is_unhealthy_once_a_rank_is_silent_twice_its_limit_unless_it_waits_for_a_peer(tmp_path):
    generation = tmp_path / "restart-0"
    heartbeat = Heartbeat(generation, 1, WatchdogConfig(timeout_s=1))
    heartbeat.beat(1)
    heartbeat.beat(2)
    assert pod_health(tmp_path) == (True, "ok")
    later = time.monotonic() + 2.5
    healthy, reason = pod_health(tmp_path, later)
    assert not healthy and reason.startswith(
        "rank 1 made no progress for 3s in step after step 2 (limit 1.0s)"
    )
    (generation / VERDICTS_FILE).write_text(json.dumps({"at": later, "states": {"1": "waiting"}}))
    assert pod_health(tmp_path, later) == (True, "ok")  # the watchdog found it waiting
    assert not pod_health(tmp_path, later + 30)[0]  # ... but the watchdog has gone quiet since
    heartbeat.close()
    assert pod_health(tmp_path, later + 30) == (True, "ok")


def test_healthz_answers_what_the_records_say(tmp_path):
    port = free_port()
    server = serve_health(("127.0.0.1", port), tmp_path)
    try:
        prober = ProbeSpec(path="/healthz", port=port, period_s=0.1, failure_threshold=2)
        healthy = ContainerProber(None, prober, "127.0.0.1")
        time.sleep(0.5)
        assert healthy.failed is None
        healthy.stop()
        heartbeat = Heartbeat(tmp_path / "restart-0", 0, WatchdogConfig(timeout_s=0.1))
        heartbeat.beat(1)
        heartbeat.beat(2)
        failing = ContainerProber(None, prober, "127.0.0.1")
        time.sleep(1)
        assert failing.failed == "2 liveness probes failed in a row, the last: HTTP 503"
        heartbeat.close()
    finally:
        server.shutdown()


def test_a_container_that_never_answers_fails_its_startup_probe():
    class Frozen(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            time.sleep(3)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Frozen)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        spec = ProbeSpec(path="/healthz", port=server.server_address[1], period_s=0.1, failure_threshold=2)
        prober = ContainerProber(spec, spec, "127.0.0.1")
        deadline = time.monotonic() + 10
        while prober.failed is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert prober.failed.startswith("2 startup probes failed in a row, the last: no answer within 1s")
    finally:
        server.shutdown()


def test_the_chart_probes_ddp_launch_and_can_turn_it_off():
    rendered = render(merge_values(sets=["gpus=8"]), release="ddp-run", namespace="training")
    (container,) = rendered.one("PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"][
        "containers"
    ]
    assert ProbeSpec.of(container) == ProbeSpec("/healthz", 9402, 10, 5, 3, 0, grace_s=10)
    assert ProbeSpec.of(container, "startupProbe") == ProbeSpec("/healthz", 9402, 10, 5, 30, 0, grace_s=10)
    assert container["args"][container["args"].index("--health-port") + 1] == "9402"
    (job_id,) = [variable["value"] for variable in container["env"] if variable["name"] == "TRAINER_JOB_ID"]
    assert re.fullmatch(r"training/ddp-run-ddp-trainer/i[0-9a-f]{7}", job_id), job_id
    off = render(merge_values(sets=["gpus=8,liveness.port=0"]), release="ddp-run", namespace="training")
    (bare,) = off.one("PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert "livenessProbe" not in bare and "--health-port" not in bare["args"]


@pytest.mark.slow
def test_a_frozen_pod_fails_its_liveness_probe_and_is_recreated_and_the_job_resumes(tmp_path, references):
    """Two CPU pods from the chart; once both hold a snapshot of step 20 or later, every
    process of pod 1 is SIGSTOPped. Its /healthz cannot answer: after three failed probes the
    kubelet kills it (SIGTERM, which a stopped process cannot take, then SIGKILL after the
    probe's grace period), the operator re-creates it (137), and the job resumes from pod 0's
    snapshot, losing at most the snapshot interval (5 steps) by the snapshots the harness saw
    at the freeze, and ends with the bits of an uninterrupted run. Pod 0, whose rank only
    waited meanwhile, stays healthy: no restart."""
    values = merge_values(
        files=[CPU_VALUES],
        sets=[
            f"metrics.port={free_port()},liveness.periodSeconds=2,liveness.timeoutSeconds=2,"
            "liveness.failureThreshold=3,liveness.terminationGracePeriodSeconds=2",
            "trainer.config.data.name=plugins:slow_digits,trainer.config.data.options.delay_s=0.002,"
            "trainer.config.train.max_steps=60,trainer.config.checkpoint.every_steps=1000,"
            "trainer.config.log.every_steps=10,trainer.config.log.format=json,checkpoint.existingClaim=ckpt",
        ],
    )
    rendered = render(values, release="ddp-run", namespace="training")
    host_env = process_env({"PYTHONPATH": os.pathsep.join([str(REPO), str(HELPERS)])})
    frozen: list[str] = []
    held: dict[str, int] = {}
    notes: list[str] = []
    outcome = run(
        rendered.objects,
        tmp_path / "pods",
        timeout=240,
        stream=None,
        notify=notes.append,
        on_tick=freeze_pod_1_once_snapshotted(20, frozen, held),
        host_env=host_env,
    )
    logs = {name: path.read_text() for name, path in outcome.logs.items()}
    assert outcome.status == "Succeeded", (notes, {k: v[-2000:] for k, v in logs.items()})
    assert frozen == ["ddp-run-ddp-trainer-worker-1"] and (outcome.recreations, outcome.restarts) == (1, 0)
    (killed,) = [note for note in notes if "liveness probes failed" in note]
    assert killed.startswith("pod ddp-run-ddp-trainer-worker-1: 3 liveness probes failed in a row")
    (resumed,) = resumes_after_a_fault(list(logs.values()))
    assert_lost_within(held, "ddp-run-ddp-trainer-worker-0", *resumed, bound=5)
    assert "watchdog" not in logs["ddp-run-ddp-trainer-worker-0"]  # its waiting rank was not blamed
    recovered = load_checkpoint(tmp_path / "pods" / "pvc" / "ckpt" / "ddp-run")
    assert_bits_of_an_uninterrupted_run(rendered, recovered, references)
