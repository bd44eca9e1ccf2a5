"""Grafana dashboard and Prometheus alert rules for the trainer's metrics, built in code: the
dashboard with Grafana's Foundation SDK (dev extra), the rules as plain rule groups.

    python -m operator_scripts.generate write   # regenerate them, with every generated file
    python -m operator_scripts.generate check   # exit 1 if a committed file is stale

The chart ships the dashboard as a ConfigMap for Grafana's sidecar and the rules as a
PrometheusRule; both are importable as they are. Every query selects `job=~"$job"`; the
dashboard has a datasource variable and a job selector.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from operator_scripts.paths import REPO
from trainer.telemetry.metrics import PART_COUNTERS

if TYPE_CHECKING:  # the SDK is a dev tool (the dev extra): only the dashboard's generation needs it
    from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
    from grafana_foundation_sdk.models.dashboard import Dashboard as DashboardModel
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

DASHBOARD_FILE = REPO / "helm" / "files" / "dashboards" / "ddp-training.json"
RULES_FILE = REPO / "helm" / "files" / "alerts" / "ddp-training.rules.yaml"
JOB = 'job=~"$job"'
SPLIT_LABELS = {
    "data": "waiting for data",
    "compute": "compute",
    "communication": "communication left exposed",
    "checkpoint": "checkpoint pause",
    "logging": "loop bookkeeping",
}
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Panel:
    """One time-series panel: queries with legends, a unit, and what it tells."""

    title: str
    targets: tuple[tuple[str, str], ...]
    unit: str
    description: str
    cuda_only: bool = False


def _rate(metric: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{JOB}}}[{RATE}]))"


PANELS: tuple[Panel, ...] = (
    Panel(
        "Global samples/s",
        ((_rate("ddp_train_samples_total"), "samples/s"),),
        "short",
        "Samples per second over all ranks.",
    ),
    Panel(
        "Global tokens/s",
        ((_rate("ddp_train_tokens_total"), "tokens/s"),),
        "short",
        "Tokens per second over all ranks (samples for image models).",
    ),
    Panel(
        "Samples/s per rank",
        ((_rate("ddp_train_samples_total", "rank"), "rank {{rank}}"),),
        "short",
        "Each rank's own throughput; a lower line is a slower rank.",
    ),
    Panel(
        "Tokens/s per rank",
        ((_rate("ddp_train_tokens_total", "rank"), "rank {{rank}}"),),
        "short",
        "Each rank's token throughput.",
    ),
    Panel(
        "Step time split",
        tuple(
            (f"{_rate(PART_COUNTERS[part][0])} / {_rate('ddp_train_steps_total')}", label)
            for part, label in SPLIT_LABELS.items()
        ),
        "s",
        "Seconds per step and rank, averaged over ranks: where a step goes, every second in one "
        "part (device time on GPUs). Communication is the wait for the gradient all-reduce after "
        "the rank's own backward, slower peers included.",
    ),
    Panel(
        "Scaling efficiency",
        (
            (
                f"{_rate('ddp_train_compute_seconds_total')} / {_rate('ddp_train_step_seconds_sum')}",
                "compute share",
            ),
        ),
        "percentunit",
        "Share of step time spent computing rather than loading data or waiting on gradient "
        "all-reduce: the ceiling on N-device speedup over one device.",
    ),
    Panel(
        "Step time quantiles",
        tuple(
            (
                f"histogram_quantile({q}, {_rate('ddp_train_step_seconds_bucket', 'le')})",
                f"p{int(q * 100)}",
            )
            for q in (0.5, 0.9, 0.99)
        ),
        "s",
        "Wall time of one optimizer step, all ranks pooled.",
    ),
    Panel(
        "Data-wait share",
        (
            (
                f"{_rate('ddp_train_data_wait_seconds_total')} / {_rate('ddp_train_step_seconds_sum')}",
                "waiting for data",
            ),
        ),
        "percentunit",
        "Share of step time ranks spend waiting for the next batch; high means the input pipeline limits.",
    ),
    Panel(
        "Loss",
        ((f"max(ddp_train_loss{{{JOB}}})", "train"), (f"max(ddp_val_loss{{{JOB}}})", "validation")),
        "short",
        "Training loss (mean over ranks since the last log) and the latest validation loss.",
    ),
    Panel(
        "Learning rate",
        ((f"max(ddp_train_learning_rate{{{JOB}}})", "lr"),),
        "short",
        "After warmup, schedule and global-batch scaling.",
    ),
    Panel(
        "Validation accuracy",
        ((f"max(ddp_val_accuracy{{{JOB}}})", "accuracy"),),
        "percentunit",
        "Exact distributed accuracy after each epoch.",
    ),
    Panel(
        "MFU",
        ((f"max(ddp_train_mfu_ratio{{{JOB}}})", "MFU"),),
        "percentunit",
        "Model FLOPs utilisation, for models that declare their FLOPs per sample.",
    ),
    Panel(
        "GPU memory",
        (
            (f"max by (rank) (ddp_cuda_memory_allocated_bytes{{{JOB}}})", "allocated rank {{rank}}"),
            (f"max by (rank) (ddp_cuda_memory_reserved_bytes{{{JOB}}})", "reserved rank {{rank}}"),
            (f"max by (rank) (ddp_cuda_memory_peak_bytes{{{JOB}}})", "peak rank {{rank}}"),
        ),
        "bytes",
        "CUDA memory per rank.",
        cuda_only=True,
    ),
    Panel(
        "Checkpoint age",
        ((f"time() - max(ddp_checkpoint_last_success_timestamp_seconds{{{JOB}}})", "seconds since commit"),),
        "s",
        "Time since the newest checkpoint was committed (latest.json written).",
    ),
    Panel(
        "Checkpoint failures and writes",
        (
            (f"sum(increase(ddp_checkpoint_failures_total{{{JOB}}}[1h]))", "failed (1h)"),
            (f"max(ddp_checkpoint_write_seconds{{{JOB}}})", "write seconds"),
            (f"max(ddp_checkpoint_stall_seconds{{{JOB}}})", "training paused seconds"),
        ),
        "short",
        "Checkpoints given up on, and what the newest one cost.",
    ),
    Panel(
        "Start-up to the first step, by phase",
        ((f'max by (phase) (ddp_startup_seconds{{{JOB},rank="0"}})', "{{phase}}"),),
        "s",
        "Where rank 0's latest start went, from its container's start to its first step's end: "
        "launch and rendezvous, imports, data and model, process group, resume, first step (with "
        "train.compile, the compile). Scheduling and the image pull are in the pod's status "
        "(ddp-ops status).",
    ),
    Panel(
        "Restarts",
        ((f"max(ddp_elastic_restarts{{{JOB}}})", "torchrun restarts"),),
        "short",
        "Worker restarts of the elastic agent (per node; the max over nodes).",
    ),
    Panel(
        "Stragglers",
        (
            (f"max(ddp_train_straggler_lag_ratio{{{JOB}}})", "slowest vs median"),
            (
                f"{_rate('ddp_train_compute_seconds_total', 'rank')} + "
                f"{_rate('ddp_train_data_wait_seconds_total', 'rank')}",
                "busy s/s rank {{rank}}",
            ),
        ),
        "short",
        "How far the slowest rank's own work (data + compute, before the all-reduce) trails the median.",
    ),
)


def _timeseries(panel: Panel, index: int, datasource: DataSourceRef) -> Timeseries:
    """Two panels a row, each 12 of the grid's 24 columns wide and 8 rows high."""
    from grafana_foundation_sdk.builders.common import VizLegendOptions
    from grafana_foundation_sdk.builders.prometheus import Dataquery as PrometheusQuery
    from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
    from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement
    from grafana_foundation_sdk.models.dashboard import GridPos

    builder = (
        Timeseries()
        .id(index + 1)
        .title(panel.title)
        .description(panel.description)
        .datasource(datasource)
        .grid_pos(GridPos(h=8, w=12, x=12 * (index % 2), y=8 * (index // 2)))
        .unit(panel.unit)
        .legend(VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM))
    )
    for n, (expr, legend) in enumerate(panel.targets):
        builder = builder.with_target(
            PrometheusQuery()
            .ref_id(chr(ord("A") + n))
            .datasource(datasource)
            .expr(expr)
            .legend_format(legend)
        )
    return builder


def dashboard() -> DashboardModel:
    """The throughput dashboard, built with Grafana's Foundation SDK (its Grafana 11.6 types):
    a data source variable, a job selector, and one time-series panel per `PANELS` entry."""
    from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, QueryVariable
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

    datasource = DataSourceRef(type_val="prometheus", uid="${datasource}")
    builder = (
        Dashboard("DDP training")
        .uid("ddp-training")
        .tags(["ddp", "pytorch", "training"])
        .timezone("utc")
        .version(1)
        .refresh("30s")
        .time("now-6h", "now")
        .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            QueryVariable("job")
            .label("Job")
            .datasource(datasource)
            .query({"query": "label_values(ddp_run_info, job)", "refId": "jobs"})
            .include_all(True)
            .multi(True)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        )
    )
    for index, panel in enumerate(PANELS):
        builder = builder.with_panel(_timeseries(panel, index, datasource))
    return builder.build()


def dashboard_json(model: DashboardModel) -> str:
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    return json.dumps(model, cls=JSONEncoder, indent=2) + "\n"


@dataclass(frozen=True)
class Alert:
    """An alert as `signal op threshold`, so tests can evaluate the signal on its own."""

    name: str
    signal: str
    op: str
    threshold: float
    duration: str
    severity: str
    summary: str

    @property
    def expr(self) -> str:
        return f"{self.signal} {self.op} {self.threshold:g}"


STEP_SECONDS = (
    "(sum by (job) (rate(ddp_train_step_seconds_sum[15m]))"
    " / sum by (job) (rate(ddp_train_step_seconds_count[15m])))"
)
SAMPLES_RATE = "sum by (job) (rate(ddp_train_samples_total[5m]))"
ALERTS: tuple[Alert, ...] = (
    Alert(
        "DDPTrainingStalled",
        SAMPLES_RATE,
        "==",
        0,
        "10m",
        "critical",
        "{{ $labels.job }} has trained on no samples for 10 minutes.",
    ),
    Alert(
        "DDPThroughputDropped",
        f"{SAMPLES_RATE} / quantile_over_time(0.5, ({SAMPLES_RATE})[1h:])",
        "<",
        0.7,
        "15m",
        "warning",
        "{{ $labels.job }} runs {{ $value | humanizePercentage }} of its 1-hour median throughput.",
    ),
    Alert(
        "DDPCheckpointStale",
        "(time() - max by (job) (ddp_checkpoint_last_success_timestamp_seconds))"
        f" / (max by (job) (ddp_checkpoint_every_steps > 0) * {STEP_SECONDS})",
        ">",
        3,
        "5m",
        "critical",
        "{{ $labels.job }}'s newest checkpoint is {{ $value | humanize }} checkpoint intervals old.",
    ),
    Alert(
        "DDPCheckpointsFallingBehind",
        "max by (job) (ddp_checkpoint_durable_lag_steps) / max by (job) (ddp_checkpoint_every_steps > 0)",
        ">",
        3,
        "10m",
        "warning",
        "{{ $labels.job }}'s store is {{ $value | humanize }} checkpoint intervals behind training: "
        "saves are skipped or replaced by newer ones (a slow or stuck store).",
    ),
    Alert(
        "DDPCheckpointWriterStuck",
        "max by (job) (increase(ddp_checkpoint_writer_replacements_total[30m]))",
        ">",
        0,
        "0m",
        "warning",
        "{{ $labels.job }} replaced a stuck checkpoint writer {{ $value | humanize }} times in 30 minutes.",
    ),
    Alert(
        "DDPRestartsRising",
        "max by (job) (changes(ddp_elastic_restarts[30m]))",
        ">",
        0,
        "0m",
        "warning",
        "{{ $labels.job }}'s workers restarted {{ $value }} times in 30 minutes.",
    ),
    Alert(
        "DDPStragglerRank",
        "max by (job) (ddp_train_straggler_lag_ratio)",
        ">",
        0.25,
        "10m",
        "warning",
        "{{ $labels.job }}'s slowest rank does {{ $value | humanizePercentage }} more work than the median.",
    ),
)


def rules() -> dict:
    """Prometheus rule groups (the `spec` of a PrometheusRule, or a rule file as it is)."""
    return {
        "groups": [
            {
                "name": "ddp-training",
                "rules": [
                    {
                        "alert": alert.name,
                        "expr": alert.expr,
                        "for": alert.duration,
                        "labels": {"severity": alert.severity},
                        "annotations": {"summary": alert.summary},
                    }
                    for alert in ALERTS
                ],
            }
        ]
    }


def monitoring_files() -> dict[Path, str]:
    return {
        DASHBOARD_FILE: dashboard_json(dashboard()),
        RULES_FILE: "# Generated by `python -m operator_scripts.generate write`; do not edit.\n"
        + yaml.safe_dump(rules(), sort_keys=False, width=1000),
    }
