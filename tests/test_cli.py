"""`ddp-ops`: pure status parsing, rendering and dry-run offline, and the cluster commands
against hand-built API responses (no API server runs on this machine: tests/helpers/replay_api
serves them over real HTTP; keep such tests few). `tests/hand-built/` holds them, written by
hand in the shape the API server and the operator give: one condition per type, Running and
Restarting never both (the operator's setCondition and filterOutCondition, pkg/util/status.go)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone

import pytest
import yaml
from conftest import REPO, free_port, process_env
from k8s_rules import configmap_admission
from loopback_api import status
from object_api import ObjectApi
from replay_api import ReplayApi
from trainer_v2_rules import trainer_admission

from operator_scripts.cli import build_parser, main
from operator_scripts.cluster.status import format_status, summarize

HAND_BUILT = REPO / "tests" / "hand-built"
JOB = json.loads((HAND_BUILT / "pytorchjob-running.json").read_text())
PODS = json.loads((HAND_BUILT / "pods.json").read_text())
BASE = "/apis/kubeflow.org/v1/namespaces/training/pytorchjobs"


# rank 0's series as its pod serves them (names as trainer/telemetry/metrics.py declares
# them, which test_metrics.py reads from a real run); rank 1's are its own, never set
def metrics_page(first_rank: int, figures: list[tuple[str, float]]) -> str:
    """A pod's page: its first rank's series at `figures`, its second's never set."""
    return "".join(
        f'# TYPE {name} gauge\n{name}{{local_rank="0",node_rank="0",rank="{first_rank}"}} {value}\n'
        f'{name}{{local_rank="1",node_rank="0",rank="{first_rank + 1}"}} 0.0\n'
        for name, value in figures
    )


FIGURES = [
    ("ddp_train_step", 270.0), ("ddp_train_total_steps", 600.0), ("ddp_train_eta_seconds", 3600.4),
    ("ddp_train_loss", 0.2347), ("ddp_train_global_samples_per_second", 812.43),
    ("ddp_checkpoint_last_success_step", 250.0),
]  # fmt: skip
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
    """Every command has its help, and the top-level help shows each command's usage."""
    commands = ["render", "submit", "status", "logs", "delete", "local", "estimate"]
    for command in ([], *([name] for name in commands)):
        completed = subprocess.run(
            [sys.executable, "-m", "operator_scripts.cli", *command, "--help"],
            cwd=REPO,
            env=process_env(),
            capture_output=True,
            text=True,
        )
        assert completed.returncode == 0 and "usage: " in completed.stdout
        if not command:
            lines = completed.stdout.splitlines()
            assert [
                name for name in commands if not any(line.startswith(f"ddp-ops {name} ") for line in lines)
            ] == []


WAVES = str(REPO / "docs" / "examples" / "own-model" / "wave_classifier")
MISSING_VALUES = "argument -f/--values: 'missing.yaml': no such file"
# (arguments, environment, the one line it must print); the trainer's own are in test_config.py
BAD_INPUTS = [
    (["render", "-f", "missing.yaml"], {}, f"ddp-ops render: error: {MISSING_VALUES}"),
    (["submit", "-f", "missing.yaml"], {}, f"ddp-ops submit: error: {MISSING_VALUES}"),
    (["local", "-f", "missing.yaml"], {}, f"ddp-ops local: error: {MISSING_VALUES}"),
    (["local", "--delay", "worker-0"], {}, "'worker-0': expected POD=SECONDS, e.g. worker-0=75"),
    (["local", "--pod-subnet", "10.1.2.0/30"], {}, "'10.1.2.0/30': too small for the pods"),
    (["local", "--pod-subnet", "10.1.2.3/24"], {}, "'10.1.2.3/24': 10.1.2.3/24 has host bits set"),
    (["estimate", "--step-ms", "50", "--grad-mb", "100", "--devices", "0"], {},
     "ddp-ops estimate: error: argument --devices: '0': must be a whole number greater than 0"),
    (["estimate", "--step-ms", "-5", "--grad-mb", "100"], {},
     "ddp-ops estimate: error: argument --step-ms: '-5': must be greater than 0"),
    (["status", "job"], {"KUBECONFIG": "/nonexistent"},
     "ddp-ops status: error: KUBECONFIG=/nonexistent: no such file; point it at your cluster's kubeconfig"),
    (["render", "--set", "gpus=12"], {}, "ddp-ops render: error: gpus=12 does not split into whole nodes"),
    (["frobnicate"], {}, "ddp-ops: error: argument command: invalid choice: 'frobnicate'"),
    # a plug-in shipped with --code is read where render runs, not imported: no torch needed
    (["render", "--code", WAVES, "--set", "trainer.config.model.name=wave_classifier.model:biuld_model"], {},
     "wave_classifier.model has no callable 'biuld_model'; did you mean wave_classifier.model:build_model?"),
    (["render", "--code", WAVES, "--set", "trainer.config.data.name=wave_classifier.dta:build_dataset"], {},
     "wave_classifier has no module 'dta'; did you mean wave_classifier.data:build_dataset?"),
    (["render", "--code", WAVES, "--set", "trainer.config.data.name=wave_clasifier.data:build_dataset"], {},
     "wave_clasifier is not shipped with the job; did you mean wave_classifier.data:build_dataset?"),
    (["render", "--set", "trainer.config.model.name=json:dumps"], {},  # found by this Python
     "trainer.config.model.name='json:dumps': cannot be called as dumps(config, spec): its def, line "),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "env", "line"), BAD_INPUTS, ids=[" ".join(c[0]) for c in BAD_INPUTS])
def test_every_bad_input_is_one_line_and_exit_2(argv, env, line, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's own exit
        code = exit.code
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert line in captured.err


def test_an_options_old_name_is_honoured_with_a_line_naming_the_new_one(capsys):
    """`ddp-ops local --timeout` became `--timeout-s` (the config's unit suffix): the old
    name still works for one release and says which to use."""
    assert build_parser().parse_args(["local", "--timeout", "120"]).timeout_s == 120.0
    said = capsys.readouterr().err
    assert said == "ddp-ops local: --timeout is deprecated: use --timeout-s (the same value)\n"
    assert build_parser().parse_args(["local", "--timeout-s", "90"]).timeout_s == 90.0
    assert build_parser().parse_args(["local"]).timeout_s == 3600.0 and capsys.readouterr().err == ""


def test_without_the_ops_extra_status_reaches_the_cluster_and_render_says_what_to_install(
    capsys, monkeypatch, tmp_path
):
    monkeypatch.setitem(sys.modules, "helm_python", None)  # as after `pip install .`: absent
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    assert main(["status", "job"]) == 2
    assert "KUBECONFIG=" in capsys.readouterr().err
    assert main(["render"]) == 2
    err = capsys.readouterr().err
    hint = "ddp-ops render: error: needs Helm's engine (the 'ops' extra): run `make ops` in a checkout"
    assert err.startswith(hint)
    assert len(err.splitlines()) == 1


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
    assert f"KUBECONFIG={tmp_path / 'absent'}: no such file" in capsys.readouterr().err
    monkeypatch.delenv("KUBECONFIG")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config either
    assert main(["status", "ddp-run-ddp-trainer", "-n", "training"]) == 2
    assert "no cluster configured" in capsys.readouterr().err
    closed = ReplayApi({})
    closed.server.server_close()  # a kubeconfig naming a port where nothing listens
    monkeypatch.setenv("KUBECONFIG", str(closed.kubeconfig(tmp_path)))
    assert main(["status", "ddp-run-ddp-trainer", "-n", "training"]) == 2
    err = capsys.readouterr().err
    assert "the cluster does not answer" in err and "Traceback" not in err


def status_then_logs(routes: dict, capsys, monkeypatch, tmp_path) -> tuple[str, object, ReplayApi]:
    """`ddp-ops status` then `logs` of ddp-run-ddp-trainer against `routes`: status's output,
    logs' captured output, and the server (its requests)."""
    with ReplayApi(routes) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        assert main(["status", "ddp-run-ddp-trainer", "-n", "training"]) == 0
        out = capsys.readouterr().out
        assert main(["logs", "ddp-run-ddp-trainer", "-n", "training"]) == 0
        return out, capsys.readouterr(), api


def test_status_and_logs_against_hand_built_responses(capsys, monkeypatch, tmp_path):
    pods = proxy = "/api/v1/namespaces/training/pods"
    routes = {
        ("GET", f"{BASE}/ddp-run-ddp-trainer"): (200, JOB),
        ("GET", f"{pods}?labelSelector=training.kubeflow.org%2Fjob-name%3Dddp-run-ddp-trainer"): (200, PODS),
        ("GET", f"{pods}?labelSelector=training.kubeflow.org%2Fjob-name%3Dddp-run-ddp-trainer%2C"): (
            200, {**PODS, "items": PODS["items"][:1]},
        ),
        # rendezvous put rank 0 on worker-1: the labelled pod's log lacks the banner
        ("GET", f"{pods}/ddp-run-ddp-trainer-worker-0/log"): (200, "[rank 8] WARNING: slow disk\n"),
        ("GET", f"{pods}/ddp-run-ddp-trainer-worker-1/log"): (200, BANNER_LOG),
        # rank 0's metrics, through the API server's pod proxy (a PyTorchJob has no progress field)
        # (the pod name's ':' as the client escapes it), the labelled pod's first: it runs ranks 8-9
        ("GET", f"{proxy}/ddp-run-ddp-trainer-worker-0%3A9401/proxy/metrics"): (
            200, metrics_page(8, FIGURES)
        ),
        ("GET", f"{proxy}/ddp-run-ddp-trainer-worker-1%3A9401/proxy/metrics"): (
            200, metrics_page(0, FIGURES)
        ),
    }  # fmt: skip
    out, captured, api = status_then_logs(routes, capsys, monkeypatch, tmp_path)
    assert (
        "  progress: 45% (step 270 of 600), ETA 1h00m; rank 0's metrics, pod ddp-run-ddp-trainer-worker-1"
        in out
    )
    assert "  loss 0.2347, 812.4 samples/s, newest checkpoint step 250" in out
    assert (
        "Running" in out
        and "container restarts 1" in out
        and "rank 0 pod: ddp-run-ddp-trainer-worker-0" in out
    )
    assert "# rank 0: pod ddp-run-ddp-trainer-worker-1" in captured.err
    assert captured.out.splitlines() == [
        "2026-11-29T10:00:09Z rank 0 on host ddp-run-ddp-trainer-worker-1: world size 16",
        "step 10/100",
    ]
    assert all(path.startswith(("/apis/", "/api/")) for _, path in api.requests)


CHART_KINDS = {
    "networkpolicies",
    "serviceaccounts",
    "configmaps",
    "pytorchjobs",
    "podmonitors",
    "prometheusrules",
}


def test_submit_without_the_crd_says_what_is_missing(capsys, monkeypatch, tmp_path):
    with ObjectApi(served=CHART_KINDS - {"pytorchjobs"}) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        code = main(["submit", "-n", "training"])
    err = capsys.readouterr().err
    assert code == 2 and "training operator v1.9.4 installed" in err and "Traceback" not in err
    assert api.requests[-1] == ("PATCH", f"{BASE}/ddp-run-ddp-trainer", 404)


def test_submit_twice_updates_and_delete_removes_every_object_of_the_release(capsys, monkeypatch, tmp_path):
    """Against a model of the API's apply, list and delete (tests/helpers/object_api.py: no
    API server can run here): create, then update, then the release's objects all gone, and
    another release's untouched, and another chart's object of the same release name too."""
    with ObjectApi(served=CHART_KINDS) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        assert main(["submit", "-n", "training", "--release", "other"]) == 0
        foreign = {"app.kubernetes.io/instance": "ddp-run", "app.kubernetes.io/part-of": "someone-else"}
        api.objects[("training", "configmaps", "not-ours")] = {
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "not-ours", "labels": foreign},
        }  # fmt: skip
        others = set(api.objects)
        assert main(["submit", "-n", "training"]) == 0
        created = capsys.readouterr().out.splitlines()[len(others) - 1 :]
        assert len(created) == len(others) - 1 == 7 and all(line.endswith(" created") for line in created)
        assert "pytorchjob/ddp-run-ddp-trainer created" in created

        job_key = ("training", "pytorchjobs", "ddp-run-ddp-trainer")
        install_id = api.objects[job_key]["metadata"]["annotations"]["ddp-trainer/install-id"]
        assert main(["submit", "-n", "training", "--set", "trainer.config.train.epochs=3"]) == 0
        updated = capsys.readouterr().out.splitlines()
        assert updated == [line.replace(" created", " configured") for line in created]
        # the same job: the id its checkpoint lease knows (TRAINER_JOB_ID) is kept, as on upgrade
        job = api.objects[job_key]
        assert job["metadata"]["annotations"]["ddp-trainer/install-id"] == install_id
        assert f"ddp-run-ddp-trainer/{install_id}" in json.dumps(job["spec"])
        config = api.objects[("training", "configmaps", "ddp-run-ddp-trainer-config")]
        assert config["metadata"]["resourceVersion"] == "2" and "epochs: 3" in json.dumps(config["data"])

        assert main(["delete", "ddp-run", "-n", "training"]) == 0
        deleted = capsys.readouterr().out.splitlines()
        assert sorted(deleted) == sorted(line.replace(" created", " deleted") for line in created)
        assert set(api.objects) == others
        assert main(["delete", "ddp-run", "-n", "training"]) == 2
        assert "release ddp-run has no objects in namespace training" in capsys.readouterr().err


TRAINJOB = json.loads((HAND_BUILT / "trainjob-restarted.json").read_text())
JOBSET = json.loads((HAND_BUILT / "jobset-restarted.json").read_text())
TRAINJOB_PODS = json.loads((HAND_BUILT / "trainjob-pods.json").read_text())


def test_status_and_logs_of_a_trainjob_against_hand_built_responses(capsys, monkeypatch, tmp_path):
    """A job's name, whichever kind: no PyTorchJob of that name, so the TrainJob; its state
    from its pods (a TrainJob has no Running condition), the JobSet's restarts and
    conditions, rank 0 on completion index 0, read from container `node`."""
    pods = "/api/v1/namespaces/training/pods"
    trainjobs = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/training/trainjobs"
    selector = "labelSelector=jobset.sigs.k8s.io%2Fjobset-name%3Dddp-run-ddp-trainer"
    jobsets = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/training/jobsets"
    not_found = status(404, "NotFound", 'pytorchjobs.kubeflow.org "ddp-run-ddp-trainer" not found')
    routes = {
        ("GET", f"{BASE}/ddp-run-ddp-trainer"): (404, not_found),
        ("GET", f"{trainjobs}/ddp-run-ddp-trainer"): (200, TRAINJOB),
        ("GET", f"{jobsets}/ddp-run-ddp-trainer"): (200, JOBSET),
        ("GET", f"{pods}?{selector}"): (200, TRAINJOB_PODS),
        ("GET", f"{pods}?{selector}%2C"): (200, {**TRAINJOB_PODS, "items": TRAINJOB_PODS["items"][:1]}),
        ("GET", f"{pods}/ddp-run-ddp-trainer-node-0-0-x7k2p/log?container=node"): (200, BANNER_LOG),
    }  # fmt: skip
    out, captured, _ = status_then_logs(routes, capsys, monkeypatch, tmp_path)
    assert out.splitlines()[0].startswith("TrainJob ddp-run-ddp-trainer: Running (age ")
    assert "container restarts 2, JobSet restarts 1" in out and "job node: active 2, failed 0" in out
    assert "condition JobSet StartupPolicyCompleted=True InOrderStartupPolicyCompleted" in out
    assert "rank 0 pod: ddp-run-ddp-trainer-node-0-0-x7k2p" in out
    start = (
        "  start of pod ddp-run-ddp-trainer-node-0-0-x7k2p: scheduled in 4s, its container started 47s later"
    )
    assert start in out
    assert "  progress: 45% (step 270 of 600), ETA 1h00m; status.trainerStatus, 2026-11-29T10:05:00Z" in out
    assert "  loss 0.2347, 812.4 samples/s, newest checkpoint step 250" in out
    assert "# rank 0: pod ddp-run-ddp-trainer-node-0-0-x7k2p" in captured.err
    assert captured.out.splitlines()[-1] == "step 10/100"


V2_KINDS = CHART_KINDS - {"pytorchjobs"} | {"trainjobs", "trainingruntimes"}


def test_submit_a_trainjob_runtime_first_an_immutable_change_is_one_line_and_delete_removes_both(
    capsys, monkeypatch, tmp_path
):
    """Against the object model with Trainer's admission (tests/helpers/trainer_v2_rules.py):
    the runtime is applied before the TrainJob, whose first create the webhook's stale cache
    refuses and a retry passes; a second submit that changes the image (spec.trainer,
    immutable) is one line saying to delete and submit again, not the API's 422; delete
    removes the TrainJob and its runtime."""
    with ObjectApi(served=V2_KINDS, admit=trainer_admission(cache_lag=1)) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        assert main(["submit", "-n", "training", "--set", "jobKind=TrainJob"]) == 0
        created = capsys.readouterr().out.splitlines()
        assert created[0] == "trainingruntime/ddp-run-ddp-trainer created"
        assert created[-1] == "trainjob/ddp-run-ddp-trainer created"
        patches = [
            (path.rsplit("/", 2)[-2], code) for method, path, code in api.requests if method == "PATCH"
        ]
        assert patches[0] == ("trainingruntimes", 201) and patches[-2:] == [
            ("trainjobs", 422),
            ("trainjobs", 201),
        ]

        assert main(["submit", "-n", "training", "--set", "jobKind=TrainJob,image.tag=0.2.0"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "cannot change (Trainer v2 makes them immutable)" in err[0]
        assert "ddp-ops delete ddp-run -n training, then submit again" in err[0] and "422" not in err[0]
        stored = api.objects[("training", "trainjobs", "ddp-run-ddp-trainer")]
        assert stored["spec"]["trainer"]["image"].endswith(":0.1.0")

        assert main(["delete", "ddp-run", "-n", "training"]) == 0
        deleted = capsys.readouterr().out.splitlines()
        assert {"trainjob/ddp-run-ddp-trainer deleted", "trainingruntime/ddp-run-ddp-trainer deleted"} <= set(
            deleted
        )
        assert deleted.index("trainjob/ddp-run-ddp-trainer deleted") < deleted.index(
            "trainingruntime/ddp-run-ddp-trainer deleted"
        )
        assert not api.objects


def test_submit_with_code_creates_its_configmap_and_other_code_is_one_line_to_delete_first(
    capsys, monkeypatch, tmp_path
):
    """`submit --code DIR` against the object model with the core API's rule for immutable
    ConfigMaps: the code's ConfigMap is created with the job; the same code again is a
    no-op; other code under the running job is one line saying to delete and submit again."""
    package = tmp_path / "my_models"
    package.mkdir()
    (package / "__init__.py").write_text("VERSION = 1\n")
    with ObjectApi(served=CHART_KINDS, admit=configmap_admission()) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        assert main(["submit", "-n", "training", "--code", str(package)]) == 0
        assert "configmap/ddp-run-ddp-trainer-code created" in capsys.readouterr().out.splitlines()
        assert main(["submit", "-n", "training", "--code", str(package)]) == 0
        assert "configmap/ddp-run-ddp-trainer-code configured" in capsys.readouterr().out.splitlines()
        (package / "__init__.py").write_text("VERSION = 2\n")
        assert main(["submit", "-n", "training", "--code", str(package)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            "ddp-ops submit: error: apply ConfigMap training/ddp-run-ddp-trainer-code: ConfigMap "
            "ddp-run-ddp-trainer-code exists, and the code shipped with --code cannot change under "
            "running pods: ddp-ops delete ddp-run -n training, then submit again; it resumes from the "
            "same checkpoints"
        ]
        stored = api.objects[("training", "configmaps", "ddp-run-ddp-trainer-code")]
        assert stored["data"] == {"f0000": "VERSION = 1\n"}


def test_submit_a_trainjob_without_trainer_installed_says_what_to_install(capsys, monkeypatch, tmp_path):
    with ObjectApi(served=CHART_KINDS) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        assert main(["submit", "-n", "training", "--set", "jobKind=TrainJob"]) == 2
    err = capsys.readouterr().err
    assert "is Kubeflow Trainer v2.3 installed (kubectl get crd trainjobs.trainer.kubeflow.org" in err
    assert "Traceback" not in err


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
            f"trainer.config.train.max_steps=20,metrics.port={free_port()}",
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
