"""Metrics plumbing: straggler arithmetic, MFU peaks, per-attempt folders, the scrape
endpoint of a real run, and the run report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import free_port, process_env, run_trainer

from operator_scripts.cluster.status import progress_from_metrics, rank0_figures
from trainer.config import MetricsConfig
from trainer.distributed.process_group import read_env
from trainer.telemetry.metrics import attempt_dir, peak_flops, prepare_multiprocess_dir
from trainer.telemetry.step_split import straggler_lag


def test_straggler_lag_is_the_slowest_over_the_median():
    assert straggler_lag([1.0, 1.0, 1.5]) == pytest.approx((0.5, 2))
    assert straggler_lag([2.0, 1.0]) == pytest.approx((2.0 / 1.5 - 1, 0))
    assert straggler_lag([0.0, 0.0]) == (0.0, 0)


def test_peak_flops_from_config_then_device_table():
    assert peak_flops(MetricsConfig(peak_flops_per_device=5e12), "NVIDIA H100 80GB HBM3") == 5e12
    assert peak_flops(MetricsConfig(), "NVIDIA H200") == 989e12
    assert peak_flops(MetricsConfig(), "NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops(MetricsConfig(), "cpu") == 0.0


def test_each_restart_attempt_gets_a_clean_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    config = MetricsConfig(multiproc_dir=str(tmp_path))
    env = {"TORCHELASTIC_RUN_ID": "job-1", "LOCAL_RANK": "0", "RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}
    first = prepare_multiprocess_dir(config, read_env(env))
    (first / "counter_123.db").write_bytes(b"old")
    second = prepare_multiprocess_dir(config, read_env({**env, "TORCHELASTIC_RESTART_COUNT": "1"}))
    assert second == tmp_path / "job-1" / "attempt-1" and os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(
        second
    )
    assert not first.exists()
    assert attempt_dir(config, read_env(env)) == first
    assert prepare_multiprocess_dir(MetricsConfig(port=0), read_env(env)) is None


def test_a_run_serves_labelled_series_on_its_port(workdir):
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer",
            "--set",
            f"metrics.port={port},train.epochs=200,checkpoint.every_steps=20,log.every_steps=5",
        ],
        cwd=workdir,
        env=process_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline, body = time.monotonic() + 60, ""
        while "ddp_train_steps_total{" not in body or progress_from_metrics(rank0_figures(body)) is None:
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-2000:]
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                time.sleep(0.2)
    finally:
        process.terminate()
        process.communicate(timeout=60)
    steps = next(line for line in body.splitlines() if line.startswith("ddp_train_steps_total{"))
    assert 'rank="0"' in steps and 'local_rank="0"' in steps and 'node_rank="0"' in steps
    assert 'ddp_run_info{dataset="digits"' in body and 'model="cnn"' in body
    # where `ddp-ops status` finds a PyTorchJob's progress (through the API server's pod proxy)
    progress = progress_from_metrics(rank0_figures(body))
    figures = {metric["name"]: float(metric["value"]) for metric in progress["metrics"]}
    assert 0 < figures["step"] < figures["total_steps"] and progress["estimatedRemainingSeconds"] > 0, (
        progress
    )
    # no rendezvous id: it names the key of torchrun's state in the (unauthenticated) store
    assert "run_id" not in body and "torch.rendezvous" not in body


def test_metrics_port_zero_serves_nothing(workdir):
    port = free_port()
    completed = run_trainer(
        ["--set", "metrics.port=0,train.max_steps=3,metrics.history_file=h.jsonl"], workdir
    )
    assert completed.returncode == 0 and "metrics on" not in completed.stdout
    history = [json.loads(line) for line in (workdir / "h.jsonl").read_text().splitlines()]
    assert [(record.get("event", "progress"), record["step"]) for record in history] == [
        ("progress", 3),
        ("validation", 3),
    ]
    assert "samples_per_second" in history[0] and 0 <= history[1]["val_accuracy"] <= 1
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1)


def test_run_report_draws_a_png_from_the_runs_own_log(workdir):
    completed = run_trainer(
        ["--set", "train.max_steps=40,log.every_steps=5,log.format=json,metrics.port=0"], workdir
    )
    assert completed.returncode == 0
    log = workdir / "run.jsonl"
    log.write_text(completed.stdout)
    report = subprocess.run(
        [
            sys.executable,
            "-m",
            "operator_scripts.reports.report",
            str(log),
            "--out",
            str(workdir / "run.png"),
        ],
        cwd=workdir,
        env=process_env(),
        capture_output=True,
        text=True,
    )
    assert report.returncode == 0, report.stderr
    validations = [line for line in completed.stdout.splitlines() if '"event": "validation"' in line]
    assert f"8 points, steps 5-40; {len(validations)} validations" in report.stdout and validations
    assert (workdir / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (workdir / "run.png").stat().st_size > 20_000

    (workdir / "empty.jsonl").write_text(json.dumps({"event": "start"}) + "\n")
    empty = subprocess.run(
        [sys.executable, "-m", "operator_scripts.reports.report", str(workdir / "empty.jsonl")],
        cwd=workdir,
        env=process_env(),
        capture_output=True,
        text=True,
    )
    assert empty.returncode == 2 and "no progress records" in empty.stderr


@pytest.mark.parametrize(
    ("device", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),  # SXM5, the lent machine's
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA A10G", 0.0),  # not an A10: unknown, so MFU is n/a rather than wrong
        ("NVIDIA L40S", 362e12),
        ("cpu", 0.0),
    ],
)
def test_the_peak_is_the_devices_by_its_whole_name(device, peak):
    assert peak_flops(MetricsConfig(), device) == peak
    assert peak_flops(MetricsConfig(peak_flops_per_device=1e12), device) == 1e12
