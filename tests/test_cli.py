"""`ddp-ops`: pure status parsing, rendering and dry-run offline, and the cluster commands
against recorded API responses (no API server runs on this machine: tests/helpers/replay_api
serves responses shaped like the API's own over real HTTP; keep such tests few)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone

import pytest
import yaml
from conftest import REPO, process_env
from replay_api import ReplayApi

from operator_scripts.cli import main
from operator_scripts.cluster import format_status, summarize

RECORDED = REPO / "tests" / "recorded"
JOB = json.loads((RECORDED / "pytorchjob-running.json").read_text())
PODS = json.loads((RECORDED / "pods.json").read_text())
BASE = "/apis/kubeflow.org/v1/namespaces/training/pytorchjobs"
BANNER_LOG = "2026-11-29T10:00:09Z rank 0 on host ddp-run-ddp-trainer-worker-1: world size 16\nstep 10/100\n"


def test_status_summary_from_conditions_pods_and_labels():
    summary = summarize(JOB, PODS["items"], now=datetime(2026, 11, 29, 10, 5, 30, tzinfo=timezone.utc))
    assert summary.state == "Running" and summary.restarts == 1 and summary.age_seconds == 330
    assert summary.rank0_pod == "ddp-run-ddp-trainer-worker-0"
    assert summary.replicas == {
        "Worker": {"active": 2, "selector": JOB["status"]["replicaStatuses"]["Worker"]["selector"]}
    }
    text = format_status(summary)
    assert "PyTorchJob ddp-run-ddp-trainer: Running (age 5m30s, container restarts 1)" in text
    assert summarize({"metadata": {"name": "x"}}, []).state == "Pending"


def test_help_everywhere():
    for command in ([], ["render"], ["submit"], ["status"], ["logs"], ["delete"], ["local"], ["estimate"]):
        completed = subprocess.run(
            [sys.executable, "-m", "operator_scripts.cli", *command, "--help"],
            cwd=REPO,
            env=process_env(),
            capture_output=True,
            text=True,
        )
        assert completed.returncode == 0 and "usage: " in completed.stdout


def test_render_and_dry_run_need_no_cluster(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    assert main(["render", "--set", "gpus=16", "-n", "training"]) == 0
    out, err = capsys.readouterr()
    kinds = [item["kind"] for item in yaml.safe_load_all(out) if item]
    assert "PyTorchJob" in kinds and "world size 16" in err
    assert main(["submit", "--dry-run", "-f", str(REPO / "helm" / "ci" / "cpu-values.yaml")]) == 0
    dry = [item for item in yaml.safe_load_all(capsys.readouterr().out) if item]
    assert [item["kind"] for item in dry if item["kind"] == "PyTorchJob"] == ["PyTorchJob"]
    assert main(["render", "--set", "gpus=12"]) == 2
    assert "does not split into whole nodes" in capsys.readouterr().err


def test_no_cluster_is_a_clear_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["status", "ddp-run-ddp-trainer", "-n", "training"]) == 2
    assert "no cluster configured" in capsys.readouterr().err
    closed = ReplayApi({})
    closed.server.server_close()  # a kubeconfig naming a port where nothing listens
    monkeypatch.setenv("KUBECONFIG", str(closed.kubeconfig(tmp_path)))
    assert main(["status", "ddp-run-ddp-trainer", "-n", "training"]) == 2
    err = capsys.readouterr().err
    assert "the cluster does not answer" in err and "Traceback" not in err


def test_status_and_logs_against_recorded_responses(capsys, monkeypatch, tmp_path):
    pods = "/api/v1/namespaces/training/pods"
    routes = {
        ("GET", f"{BASE}/ddp-run-ddp-trainer"): (200, JOB),
        ("GET", f"{pods}?labelSelector=training.kubeflow.org%2Fjob-name%3Dddp-run-ddp-trainer"): (200, PODS),
        ("GET", f"{pods}?labelSelector=training.kubeflow.org%2Fjob-name%3Dddp-run-ddp-trainer%2C"): (
            200, {**PODS, "items": PODS["items"][:1]},
        ),
        # rendezvous put rank 0 on worker-1: the labelled pod's log lacks the banner
        ("GET", f"{pods}/ddp-run-ddp-trainer-worker-0/log"): (200, "[rank 8] WARNING: slow disk\n"),
        ("GET", f"{pods}/ddp-run-ddp-trainer-worker-1/log"): (200, BANNER_LOG),
    }  # fmt: skip
    with ReplayApi(routes) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        assert main(["status", "ddp-run-ddp-trainer", "-n", "training"]) == 0
        out = capsys.readouterr().out
        assert (
            "Running" in out
            and "container restarts 1" in out
            and "rank 0 pod: ddp-run-ddp-trainer-worker-0" in out
        )
        assert main(["logs", "ddp-run-ddp-trainer", "-n", "training"]) == 0
        captured = capsys.readouterr()
    assert "# rank 0: pod ddp-run-ddp-trainer-worker-1" in captured.err
    assert captured.out.splitlines() == [
        "2026-11-29T10:00:09Z rank 0 on host ddp-run-ddp-trainer-worker-1: world size 16",
        "step 10/100",
    ]
    assert all(path.startswith(("/apis/", "/api/")) for _, path in api.requests)


def test_submit_without_the_crd_says_what_is_missing(capsys, monkeypatch, tmp_path):
    routes = {("POST", "/api/v1/namespaces/training/"): (201, {"kind": "Status", "status": "Success"})}
    with ReplayApi(routes) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        code = main(
            [
                "submit",
                "-n",
                "training",
                "--set",
                "metrics.podMonitor.enabled=false",
                "--set",
                "metrics.prometheusRule.enabled=false",
            ]
        )
    err = capsys.readouterr().err
    assert code == 2 and "training operator v1.9.4 installed" in err and "Traceback" not in err
    posted = [path for method, path in api.requests if method == "POST"]
    assert posted[-1] == f"{BASE}"


@pytest.mark.slow
def test_local_command_runs_the_cpu_scenario(tmp_path):
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "operator_scripts.cli",
            "local",
            "-f",
            str(REPO / "helm" / "ci" / "cpu-values.yaml"),
            "--set",
            "trainer.config.train.max_steps=20,metrics.port=9412",
            "--workdir",
            str(tmp_path / "pods"),
        ],
        cwd=REPO,
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.splitlines()[-1] == (
        "job ddp-run-ddp-trainer: Succeeded; 0 restarts counted (backoffLimit 6)"
    )
    assert "world size 2 (2 nodes x 1 process)" in completed.stdout  # rank 0's log, streamed
