"""Rank 0's progress posted to Kubeflow Trainer's status server (trainer/telemetry/job_status.py),
against the emulated server `ddp-ops local` runs (operator_scripts/local/status_server.py) over
real HTTPS with its token check; what is posted, checked against the TrainJob CRD's schema and
the Kubeflow SDK's own models (`kubeflow_trainer_api`, which `kubeflow` 0.5.0 pins)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import jsonschema
import pytest
from kubeflow_trainer_api.models import TrainerV1alpha1UpdateTrainJobStatusRequest
from trainer_v2_rules import crd_schema

from operator_scripts.local.status_server import audience, invalid, issue_credentials, make_server
from trainer.telemetry.checkpoint_stats import CheckpointStats
from trainer.telemetry.job_status import JobStatusPost, StatusServer
from trainer.telemetry.trainer_status import trainer_status

ROUTE = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/training/trainjobs/run/status"
NOW = datetime(2026, 12, 7, 4, 0, tzinfo=timezone.utc)


@pytest.fixture
def status_server(tmp_path):
    """The emulated server on 127.0.0.1, for TrainJob training/run: (its folder, its URL)."""
    folder = tmp_path / "server"
    issue_credentials(folder, [audience("training", "run")])
    server = make_server(folder, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield folder, f"https://127.0.0.1:{server.server_address[1]}{ROUTE}"
    server.shutdown()
    server.server_close()


def token_file(folder: Path, token: str | None = None) -> str:
    path = folder.parent / "token"
    path.write_text(token or json.loads((folder / "tokens.json").read_text())[audience("training", "run")])
    return str(path)


def requests_seen(folder: Path) -> list[int]:
    journal = folder / "requests.log"
    return [json.loads(line)["code"] for line in journal.read_text().splitlines()] if journal.exists() else []


def test_what_the_trainer_posts_is_what_the_crd_and_the_sdk_models_take():
    figures = {"step": 270, "total_steps": 600, "eta_seconds": 3599.6, "loss": 0.23471234,
               "samples_per_second": 812.44, "durable_step": 250, "val_loss": float("nan")}  # fmt: skip
    body = trainer_status(figures, NOW)
    status = body["trainerStatus"]
    assert status["progressPercentage"] == 45 and status["estimatedRemainingSeconds"] == 3600
    assert status["lastUpdatedTime"] == "2026-12-07T04:00:00Z"
    assert {m["name"]: m["value"] for m in status["metrics"]} == {
        "loss": "0.234712",
        "samples_per_second": "812.4",
        "step": "270",
        "total_steps": "600",
        "durable_step": "250",
    }  # fmt: skip  (a NaN validation loss is left out: the status holds no such value)
    schema = crd_schema("TrainJob")["properties"]["status"]["properties"]["trainerStatus"]
    jsonschema.validate(status, schema)
    parsed = TrainerV1alpha1UpdateTrainJobStatusRequest.from_dict(body).trainer_status
    assert parsed.progress_percentage == 45 and parsed.metrics[0].name == "loss"
    assert (
        trainer_status({"step": 600, "total_steps": 600, "eta_seconds": 0}, NOW)["trainerStatus"][
            "progressPercentage"
        ]
        == 100
    )
    assert trainer_status({"step": 599, "total_steps": 600}, NOW)["trainerStatus"]["progressPercentage"] == 99


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({}, False),
        ({"progressPercentage": 101}, True),
        ({"progressPercentage": -1}, True),
        ({"estimatedRemainingSeconds": 2**31}, True),
        ({"metrics": [{"name": "x" * 65, "value": "1"}]}, True),
        ({"metrics": [{"name": "loss", "value": ""}]}, True),
        ({"metrics": [{"name": f"m{i}", "value": "1"} for i in range(257)]}, True),
        ({"lastUpdatedTime": "yesterday"}, True),
    ],
)
def test_the_emulated_server_refuses_what_the_crd_refuses(change, refused):
    """Its verdict and the CRD schema's agree, but for the formats jsonschema does not check:
    int32 (the server's Go decoder refuses 2^31 as it reads the body) and date-time."""
    status = {**trainer_status({"step": 1, "total_steps": 2, "loss": 1.0}, NOW)["trainerStatus"], **change}
    assert (invalid(status) is not None) == refused, invalid(status)
    if not {"lastUpdatedTime", "estimatedRemainingSeconds"} & set(change):
        schema = crd_schema("TrainJob")["properties"]["status"]["properties"]["trainerStatus"]
        errors = list(jsonschema.Draft7Validator(schema).iter_errors(status))
        assert bool(errors) == refused, errors


def test_the_crds_rule_that_a_status_has_a_time_holds_in_the_emulation():
    """The CRD's CEL rule `has(self.lastUpdatedTime)` (x-kubernetes-validations)."""
    schema = crd_schema("TrainJob")["properties"]["status"]["properties"]["trainerStatus"]
    rules = [rule["rule"] for rule in schema.get("x-kubernetes-validations", [])]
    assert rules == ["has(self.lastUpdatedTime)"], rules
    assert "lastUpdatedTime is required" in invalid({"progressPercentage": 3})


def test_progress_reaches_the_trainjobs_status_at_a_bounded_rate_and_the_last_post_says_done(status_server):
    folder, url = status_server
    poster = JobStatusPost(
        StatusServer(url, str(folder / "ca.crt"), token_file(folder)), 0.2, logging.getLogger()
    )
    started = time.monotonic()
    for step in range(1, 101):  # a progress line every step, far faster than the rate
        poster.progress({"step": step, "total_steps": 100, "eta_seconds": 100 - step, "loss": 1 / step})
        if step == 50:
            poster.checkpoints(CheckpointStats(last_success_step=50), 50)
        time.sleep(0.004)
    poster.close()
    elapsed = time.monotonic() - started
    codes = requests_seen(folder)
    assert codes and set(codes) == {200}, codes
    assert len(codes) <= elapsed / 0.2 + 2, (len(codes), elapsed)  # one per interval, and the last
    applied = json.loads((folder / "training" / "run.json").read_text())
    assert applied["progressPercentage"] == 100 and applied["estimatedRemainingSeconds"] == 0
    figures = {m["name"]: m["value"] for m in applied["metrics"]}
    assert figures["step"] == "100" and figures["durable_step"] == "50" and figures["loss"] == "0.01"


def test_a_server_that_refuses_costs_three_posts_and_one_line_then_nothing(status_server, caplog):
    folder, url = status_server
    server = StatusServer(url, str(folder / "ca.crt"), token_file(folder, "a-token-for-another-job"))
    poster = JobStatusPost(server, 0.01, logging.getLogger("refused"))
    for step in range(1, 40):
        poster.progress({"step": step, "total_steps": 40})
        time.sleep(0.02)
    poster.close()
    assert requests_seen(folder) == [403, 403, 403]
    said = [r.getMessage() for r in caplog.records if r.name == "refused"]
    assert len(said) == 1 and "3 posts in a row" in said[0] and "HTTP 403: Forbidden" in said[0], said
    assert not (folder / "training" / "run.json").exists()


def test_a_server_that_never_answers_holds_no_step_and_is_given_up_after_three_timeouts(tmp_path, caplog):
    """A listener that takes connections and never answers (TLS included): the loop's calls
    return while the posts wait, and posting stops after three timeouts."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        token = tmp_path / "token"
        token.write_text("t")
        issue_credentials(tmp_path / "ca", [])
        url = f"https://127.0.0.1:{silent.getsockname()[1]}{ROUTE}"
        server = StatusServer(url, str(tmp_path / "ca" / "ca.crt"), str(token), timeout_s=0.3)
        poster = JobStatusPost(server, 0.01, logging.getLogger("silent"))
        calls = []
        for step in range(1, 60):
            began = time.monotonic()
            poster.progress({"step": step, "total_steps": 60})
            calls.append(time.monotonic() - began)
            time.sleep(0.02)
        poster.close()
    assert max(calls) < server.timeout_s, max(calls)  # no call waited for a post
    said = [r.getMessage() for r in caplog.records if r.name == "silent"]
    assert len(said) == 1 and "3 posts in a row" in said[0] and "timed out" in said[0], said
