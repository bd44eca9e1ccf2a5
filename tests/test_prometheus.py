"""A real Prometheus scrapes a 2-process run: every dashboard query and alert signal returns
sane data, the exposition passes `promtool check metrics`, the rules pass `promtool test`."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import REPO, process_env
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard as DashboardModel

from operator_scripts.generate.monitoring import ALERTS, DASHBOARD_FILE, PANELS, dashboard_json

JOB = "ddp-test"


def concrete(expr: str) -> str:
    """A dashboard query as Grafana would send it for this job."""
    return expr.replace("$job", JOB).replace("$__rate_interval", "5s")


def values(result: list[dict]) -> list[float]:
    return [float(sample["value"][1]) for sample in result]


def missing_from(read: object, written: object, path: str = "") -> list[str]:
    """The paths of `written` that `read` lacks or holds differently (defaults it adds are fine)."""
    if isinstance(written, dict) and isinstance(read, dict):
        return [gap for key in written for gap in missing_from(read.get(key), written[key], f"{path}.{key}")]
    if isinstance(written, list) and isinstance(read, list) and len(read) == len(written):
        return [
            gap
            for n, (a, b) in enumerate(zip(read, written, strict=True))
            for gap in missing_from(a, b, f"{path}[{n}]")
        ]
    return [] if read == written else [path or "."]


def test_the_alert_rules_import_without_the_dashboards_dev_only_sdk():
    """grafana-foundation-sdk is in the dev extra only: a fresh interpreter that cannot find
    it still imports the monitoring module and builds the alert rules."""
    script = (
        "import sys\n"
        "class NoSdk:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'grafana_foundation_sdk':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, NoSdk())\n"
        "from operator_scripts.generate.monitoring import rules\n"
        "print(len(rules()['groups'][0]['rules']))\n"
    )
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, capture_output=True, text=True, env=process_env(), cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) == len(ALERTS)


def test_the_dashboard_is_grafana_11_6_json_as_the_sdk_types_read_it():
    """Read back into the SDK's typed model (Grafana 11.6's dashboard schema), the committed
    file loses nothing and changes nothing: no field it holds is unknown or mistyped."""
    committed = json.loads(DASHBOARD_FILE.read_text())
    register_default_plugins()  # the time-series panel and Prometheus query types
    model = DashboardModel.from_json(committed)
    assert missing_from(json.loads(dashboard_json(model)), committed) == []
    assert model.schema_version == 41 and len(model.panels) == len(PANELS)


def test_dashboard_has_a_datasource_variable_a_job_selector_and_only_job_scoped_queries():
    board = json.loads(DASHBOARD_FILE.read_text())
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["job"]["includeAll"]
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            metrics = re.findall(r"(ddp_\w+)(\{[^}]*\})?", target["expr"])
            assert metrics and all('job=~"$job"' in selector for _, selector in metrics), target["expr"]


def test_alert_rules_pass_their_promtool_unit_tests():
    completed = subprocess.run(
        ["promtool", "test", "rules", "tests/promtool/alerts_test.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "SUCCESS" in completed.stdout


def rank0_rates(log: str, since: float) -> list[float]:
    """samples/s that rank 0 logged at or after `since` (unix time)."""
    found = []
    for line in log.splitlines():
        match = re.match(r"(\S+Z) epoch .* ([\d,]+) samples/s", line)
        if match and time.mktime(time.strptime(match[1], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone >= since:
            found.append(float(match[2].replace(",", "")))
    return found


def scrapes_in_last(server, seconds: int) -> list[float]:
    """How many scrapes of each rank's step counter Prometheus holds from the last `seconds`."""
    return values(server.query(f'count_over_time(ddp_train_steps_total{{job="{JOB}"}}[{seconds}s])'))


@pytest.mark.slow
@pytest.mark.alone  # Prometheus's rate and rank 0's logged ones within 20%: beside the suite, 598 against 835
def test_prometheus_scrapes_a_two_rank_run(prometheus_server, workdir):
    """The run trains until the test has queried everything (then SIGTERM), so no query
    depends on how fast two loaded cores train: once both ranks are scraped and a checkpoint
    is committed, the test waits for Prometheus itself to hold ten more scrapes of both,
    which fills every 5 s and 10 s rate window with steady training."""
    overrides = (
        f"metrics.port={prometheus_server.metrics_port},metrics.peak_flops_per_device=1e11,"
        "train.epochs=1000,checkpoint.every_steps=50,log.every_steps=10,checkpoint.uri=ckpt"
    )
    output = workdir / "rank0.log"
    launcher = [
        sys.executable,
        "-m",
        "trainer.launcher.launch",
        "--",
        "--standalone",
        "--nproc_per_node=2",
    ]
    with open(output, "w") as sink:
        trainer = subprocess.Popen(
            [*launcher, "-m", "trainer", "--config", "tokens", "--set", overrides],
            cwd=workdir,
            env=process_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            deadline = time.monotonic() + 180

            def wait_for(ready) -> None:
                while not ready():
                    assert trainer.poll() is None and time.monotonic() < deadline, output.read_text()[-3000:]
                    time.sleep(0.5)

            checkpoint = f'ddp_checkpoint_last_success_timestamp_seconds{{job="{JOB}"}}'
            steps = f'ddp_train_steps_total{{job="{JOB}"}}'
            wait_for(
                lambda: (
                    len(values(prometheus_server.query(steps))) == 2
                    and values(prometheus_server.query(checkpoint))
                )
            )
            since = time.time()  # training is steady: now ten more scrapes of both ranks
            wait_for(
                lambda: min(scrapes_in_last(prometheus_server, math.ceil(time.time() - since)) or [0]) >= 10
            )
            now = time.time()
            exposition = urllib.request.urlopen(
                f"http://127.0.0.1:{prometheus_server.metrics_port}/metrics"
            ).read()
            results = {
                target_expr: prometheus_server.query(concrete(target_expr), at=now)
                for panel in PANELS
                for target_expr, _ in panel.targets
            }
            signals = {alert.name: prometheus_server.query(alert.signal, at=now) for alert in ALERTS}
            alerts = {alert.name: prometheus_server.query(alert.expr, at=now) for alert in ALERTS}
            global_rate = values(
                prometheus_server.query(f'sum(rate(ddp_train_samples_total{{job="{JOB}"}}[10s]))', at=now)
            )
            step_seconds = values(
                prometheus_server.query(
                    f'sum(rate(ddp_train_step_seconds_sum{{job="{JOB}"}}[5s])) '
                    f'/ sum(rate(ddp_train_steps_total{{job="{JOB}"}}[5s]))',
                    at=now,
                )
            )
            rules = prometheus_server.get("/api/v1/rules")
            trainer.send_signal(signal.SIGTERM)  # done querying: stop, save, leave
        finally:
            if trainer.poll() is None:
                trainer.send_signal(signal.SIGTERM)
            trainer.wait(timeout=180)
    assert trainer.returncode == 143, output.read_text()[-3000:]
    assert "stopped by SIGTERM at step" in output.read_text()

    for panel in PANELS:
        for target_expr, _ in panel.targets:
            found = values(results[target_expr])
            if panel.cuda_only:
                assert found == [], f"{panel.title}: CUDA series on a CPU run"  # no GPU in CI
                continue
            assert found, f"{panel.title}: no data for {concrete(target_expr)}"
            assert all(math.isfinite(v) and v >= 0 for v in found), (panel.title, found)
    by_title = {panel.title: values(results[panel.targets[0][0]]) for panel in PANELS}
    for share in ("Scaling efficiency", "Data-wait share", "Validation accuracy", "MFU"):
        assert all(0 <= v <= 1 for v in by_title[share]), (share, by_title[share])
    assert by_title["MFU"][0] > 0
    assert len(by_title["Samples/s per rank"]) == 2
    assert by_title["Restarts"] == [0.0]
    assert by_title["Checkpoint age"][0] < 60
    split = sum(
        values(results[expr])[0]
        for expr, _ in next(p for p in PANELS if p.title == "Step time split").targets
    )
    assert 0.5 * step_seconds[0] < split < 1.05 * step_seconds[0], (split, step_seconds)  # parts of a step

    logged = rank0_rates(output.read_text(), since=now - 10)
    assert logged, "rank 0 logged no throughput in the last 10 s"
    median_logged = sorted(logged)[len(logged) // 2]
    assert abs(global_rate[0] - median_logged) / median_logged < 0.2, (global_rate, logged)

    for alert in ALERTS:
        found = values(signals[alert.name])
        assert found and all(math.isfinite(v) for v in found), (alert.name, found)
    assert alerts["DDPTrainingStalled"] == [] and alerts["DDPRestartsRising"] == []
    assert alerts["DDPCheckpointStale"] == []
    states = {rule["name"]: rule["health"] for group in rules["data"]["groups"] for rule in group["rules"]}
    assert states == {alert.name: "ok" for alert in ALERTS}

    checked = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True)
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()
