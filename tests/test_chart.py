"""The Helm chart, rendered by Helm's own engine (helm-python-sdk): lint, the values and what
they render to (the schemas that would admit it are `test_chart_schemas.py`'s)."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from chart_scenarios import K8S_VERSION, SCENARIOS, pod_templates, scenario, trainer_container
from helm_python import HelmError, lint
from trainer_v2_rules import node_container, node_job

from operator_scripts.chart.render import ValuesError, merge_values, render
from operator_scripts.generate.values_table import documented_keys
from operator_scripts.paths import CHART_DIR
from trainer.config import from_tree
from trainer.termination_message import MESSAGE_PATH_ENV

EVERY = "trainer.config.checkpoint.snapshot_every_steps"

# ----- render and lint --------------------------------------------------------------------


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.name for p in SCENARIOS])
def test_every_ci_scenario_renders_and_lints_clean(path):
    report = lint(
        str(CHART_DIR), yaml.safe_load(path.read_text()), strict=True, kube_version=f"v{K8S_VERSION}"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert problems == [], problems
    assert scenario(path).one("PyTorchJob")


@pytest.mark.parametrize(("gpus", "pods", "procs"), [(8, 1, 8), (16, 2, 8), (4, 1, 4), (1, 1, 1), (64, 8, 8)])
def test_gpu_math(gpus, pods, procs):
    rendered = render(merge_values(sets=[f"gpus={gpus}"]))
    job = rendered.one("PyTorchJob")
    assert job["spec"]["nprocPerNode"] == str(procs)
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == pods
    assert "Master" not in job["spec"]["pytorchReplicaSpecs"]
    template = pod_templates(job)["Worker"]
    resources = trainer_container(template)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == str(procs)
    # per GPU: 10 CPUs and 80Gi, and /dev/shm's limit on top
    (shm,) = [volume for volume in template["spec"]["volumes"] if volume["name"] == "dshm"]
    memory = f"{procs * 80 * 1024 + int(shm['emptyDir']['sizeLimit'].removesuffix('Mi'))}Mi"
    assert resources["requests"] == {"cpu": str(10 * procs), "memory": memory}
    assert resources["limits"]["memory"] == memory
    tolerated = {(toleration["key"], toleration["effect"]) for toleration in template["spec"]["tolerations"]}
    assert ("nvidia.com/gpu", "NoSchedule") in tolerated
    assert f"world size {pods * procs}" in rendered.notes
    ranks = f"{pods * procs} rank" + ("s" if pods * procs > 1 else "")
    assert f"x {ranks} x 1 accumulation = {32 * pods * procs}" in rendered.notes


def test_cpu_mode():
    job = render(merge_values(sets=["gpus=0,cpuNodes=3,cpuProcsPerNode=2"])).one("PyTorchJob")
    assert (
        job["spec"]["nprocPerNode"] == "2" and job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    )
    template = pod_templates(job)["Worker"]
    resources = trainer_container(template)["resources"]
    assert resources == {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "32Gi"}}
    assert "nvidia.com/gpu" not in json.dumps(template)
    env = {variable["name"] for variable in trainer_container(template)["env"]}
    assert not env & {"PYTORCH_CUDA_ALLOC_CONF", "TORCH_NCCL_TRACE_BUFFER_SIZE"}


def test_a_gpu_pod_takes_the_users_resources_over_the_sizing_and_its_gpus_from_gpus():
    sets = ["gpus=8", "resources.requests.cpu=32", "resources.limits.nvidia\\.com/gpu=2"]
    container = trainer_container(pod_templates(render(merge_values(sets=sets)).one("PyTorchJob"))["Worker"])
    assert str(container["resources"]["requests"]["cpu"]) == "32"
    assert container["resources"]["requests"]["memory"] == container["resources"]["limits"]["memory"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    env = {variable["name"]: variable["value"] for variable in container["env"]}
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def nccl_env(job: dict) -> dict[str, str]:
    container = trainer_container(pod_templates(job)["Worker"])
    return {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("NCCL_")}


def test_nccl_takes_sockets_by_default_and_rdma_when_asked():
    sockets = render(merge_values(sets=["gpus=16"])).one("PyTorchJob")
    assert nccl_env(sockets) == {"NCCL_DEBUG": "WARN", "NCCL_IB_DISABLE": "1"}
    rdma = scenario(CHART_DIR / "ci" / "rdma-values.yaml").one("PyTorchJob")
    assert nccl_env(rdma) == {
        "NCCL_DEBUG": "WARN",
        "NCCL_SOCKET_IFNAME": "=eth0",
        "NCCL_IB_HCA": "mlx5",
        "NCCL_NET_GDR_LEVEL": "PHB",
    }
    limits = trainer_container(pod_templates(rdma)["Worker"])["resources"]["limits"]
    assert limits["rdma/rdma_shared_device_a"] == "1" and limits["nvidia.com/gpu"] == "8"
    overridden = render(merge_values(sets=["gpus=8", "nccl.env.NCCL_IB_DISABLE=0", "nccl.debug=INFO"]))
    assert nccl_env(overridden.one("PyTorchJob")) == {"NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "0"}
    cpu = render(merge_values(sets=["gpus=0"])).one("PyTorchJob")
    assert nccl_env(cpu) == {}


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        (["nccl.rdma.gdrLevel=FAR"], "gdrLevel"),
        (["nccl.env.IB_HCA=mlx5"], "IB_HCA"),
        (["nccl.debug=LOUD"], "debug"),
    ],
)
def test_bad_nccl_values_are_refused_at_render(sets, named):
    with pytest.raises(HelmError, match=named):
        render(merge_values(sets=sets))


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (
            "trainer.config.train.epoch=3",
            "trainer.config.train.epoch=3: unknown key; did you mean train.epochs?",
        ),
        ("trainer.config.train.batch_size=0", "trainer.config.train.batch_size=0: must be greater than 0"),
        (
            "trainer.config.train.amp=fp8",
            "trainer.config.train.amp='fp8': did you mean 'fp16'? must be 'auto', 'off', 'bf16' or 'fp16'",
        ),
        (  # what DDP sends is the trainer's setting too, checked at render like every key
            "trainer.config.ddp.comm_hook=bf17",
            "trainer.config.ddp.comm_hook='bf17': did you mean 'bf16'? must be 'none', 'bf16', 'fp16' or "
            "'powersgd'",
        ),
        (  # a trainer key without its prefix: Helm's schema would only say `at ''`
            "model.name=mlp",
            "model: not a chart value; trainer settings go under trainer.config.* "
            "(--set trainer.config.model.…)",
        ),
        ("gpu=8", "gpu: not a chart value; did you mean gpus?"),
        ("image.tagg=1", "image.tagg: not a chart value; did you mean image.tag?"),
        (  # a credential in values: refused, and pointed at the Secret
            "checkpoint.s3.secretAccessKey=abc",
            "checkpoint.s3.secretAccessKey: not a chart value; credentials go in a Secret, named by "
            "checkpoint.s3.existingSecret",
        ),
        (  # under the deprecated name too
            "checkpoints.s3.secretAccessKey=abc",
            "checkpoints.s3.secretAccessKey: not a chart value; credentials go in a Secret, named by "
            "checkpoints.s3.existingSecret",
        ),
        ("metrics.podMonitor.enable=true", "metrics.podMonitor.enable: not a chart value; did you mean "),
        (  # a name only the registry knows, checked without torch
            "trainer.config.model.name=resnet50",
            "trainer.config.model.name='resnet50': unknown model; allowed: cnn, mlp, transformer or "
            "package.module:function",
        ),
        (
            "trainer.config.data.name=digit",
            "trainer.config.data.name='digit': unknown dataset; did you mean digits?",
        ),
        (  # one section against another: what JSON schema cannot say
            "trainer.config.checkpoint.drain_timeout_s=700",
            "trainer.config.checkpoint.drain_timeout_s=700.0: must be at most half of dist.timeout_s",
        ),
    ],
)
def test_trainer_values_get_the_trainers_own_line_at_render(sets, line):
    with pytest.raises(ValuesError) as refused:
        render(merge_values(sets=[sets]))
    assert str(refused.value).startswith(line)


def test_helm_set_floats_pass_the_schema_as_the_trainer_reads_them():
    """`--set` leaves 0.001 a string (Helm parses only integers and booleans); the schema lets
    numeric strings through and the trainer reads them as numbers."""
    values = merge_values(sets=["trainer.config.optim.lr=0.001,trainer.config.model.dropout=0.3"])
    assert values["trainer"]["config"]["optim"]["lr"] == "0.001"
    report = lint(str(CHART_DIR), values, strict=True, kube_version=f"v{K8S_VERSION}")
    assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] >= 2]
    (config_map,) = [
        c for c in render(values).of_kind("ConfigMap") if c["metadata"]["name"].endswith("-config")
    ]
    assert from_tree(yaml.safe_load(config_map["data"]["config.yaml"])).optim.lr == 0.001


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        ("trainer.config.train.epoch=3", "epoch"),
        ("trainer.config.train.batch_size=0", "batch_size"),
        ("checkpoint.s3.secretAccessKey=abc", "secretAccessKey"),  # `helm install` refuses it too
        ("trainer.config.model.name=resnet50", "/trainer/config/model/name"),  # not built in, no ':'
        ("trainer.config.data.name=my_data.build", "/trainer/config/data/name"),
    ],
)
def test_helms_own_schema_check_refuses_bad_trainer_values(sets, named):
    """`helm install` validates values.schema.json, whose trainer.config part is generated
    from the trainer's models (drift-checked in test_k8s.py)."""
    report = lint(str(CHART_DIR), merge_values(sets=[sets]), strict=True, kube_version=f"v{K8S_VERSION}")
    problems = json.dumps(report["errors"] + [m for m in report["messages"] if m["severity"] >= 2])
    assert "schema" in problems and named in problems, problems


def test_fixed_mode_has_one_master_and_the_rest_workers():
    job = scenario(CHART_DIR / "ci" / "fixed-mode-values.yaml").one("PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 3
    assert "elasticPolicy" not in job["spec"]
    single = render(merge_values(sets=["mode=fixed,gpus=8"])).one("PyTorchJob")
    assert list(single["spec"]["pytorchReplicaSpecs"]) == ["Master"]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ("gpus=12", "gpus=12 does not split into whole nodes of gpusPerNode=8: set gpus to a multiple of 8"),
        ("gpus=-1", "at '/gpus': minimum: got -1, want 0"),
        ("gpus=0,cpuProcsPerNode=0", "at '/cpuProcsPerNode': minimum: got 0, want 1"),
        ("gpus=0,cpuNodes=0", "at '/cpuNodes': minimum: got 0, want 1"),
        ("gpusPerNode=0", "at '/gpusPerNode': minimum: got 0, want 1"),
        ("gpus=16,elastic.minNodes=3", "elastic.minNodes=3 and elastic.maxNodes=2 must bracket the 2 pods"),
        ("mode=static", "at '/mode'"),
        ("shmSize=8G", "at '/shmSize'"),
        ("snapshots.stateSize=lots", "at '/snapshots/stateSize'"),
        ("snapshots.everySteps=-1", "at '/snapshots/everySteps'"),
        ("snapshots.everySteps=often", "at '/snapshots/everySteps'"),
    ],
)
def test_bad_values_fail_with_what_to_set(sets, message):
    with pytest.raises(HelmError) as failure:
        render(merge_values(sets=[sets]))
    assert message in str(failure.value)


DEPRECATED_NAMES = [  # (the previous release's name, this release's)
    ("checkpoints.existingClaim=claim-a", "checkpoint.existingClaim=claim-a"),
    (
        "checkpoints.s3.bucket=b,checkpoints.s3.existingSecret=keys",
        "checkpoint.s3.bucket=b,checkpoint.s3.existingSecret=keys",
    ),
    ("port=24000", "rendezvous.port=24000"),
    ("snapshots.everySteps=9", "trainer.config.checkpoint.snapshot_every_steps=9"),
]


@pytest.mark.parametrize(
    ("old", "new"), DEPRECATED_NAMES, ids=[old.split("=")[0] for old, _ in DEPRECATED_NAMES]
)
@pytest.mark.parametrize("kind", ["PyTorchJob", "TrainJob"])
def test_a_deprecated_name_renders_what_its_new_name_does_and_says_so(old, new, kind):
    """Values of the previous release keep working for this one: the same objects, and a
    DEPRECATED line in NOTES (which `helm install` and `ddp-ops` print) naming the new key."""
    base = ["gpus=8,installId=i1", f"jobKind={kind}"]
    before = render(merge_values(sets=[*base, old]), release="r", namespace="ns")
    after = render(merge_values(sets=[*base, new]), release="r", namespace="ns")
    assert before.manifest == after.manifest
    old_key = old.split("=")[0].split(".")[0] if not old.startswith("snapshots") else "snapshots.everySteps"
    deprecations = [line for line in before.notes.splitlines() if line.startswith("DEPRECATED: ")]
    assert len(deprecations) == 1 and deprecations[0].startswith(f"DEPRECATED: {old_key}")
    assert new.split("=")[0].rsplit(".", 1)[0].split(".")[0] in deprecations[0]
    assert not [line for line in after.notes.splitlines() if line.startswith("DEPRECATED")]


# ----- what the pods get --------------------------------------------------------------------


def test_trainer_config_is_a_valid_trainer_config_mounted_in_the_pods():
    rendered = scenario(CHART_DIR / "ci" / "gpu-16-s3-values.yaml")
    (config_map,) = [c for c in rendered.of_kind("ConfigMap") if c["metadata"]["name"].endswith("-config")]
    config = from_tree(yaml.safe_load(config_map["data"]["config.yaml"]))
    assert config.checkpoint.uri == "s3://ddp-checkpoints/runs/ddp-run"
    assert (config.metrics.port, config.metrics.address) == (9401, "0.0.0.0")
    container = trainer_container(pod_templates(rendered.one("PyTorchJob"))["Worker"])
    assert container["command"] == ["ddp-launch"]
    launcher, torchrun = (
        container["args"][: container["args"].index("--")],
        container["args"][container["args"].index("--") + 1 :],
    )
    assert launcher == ["--rendezvous-wait", "900", "--relaunches", "3", "--health-port", "9402"]
    assert torchrun[:4] == ["-m", "trainer", "--config", "/etc/ddp-trainer/config.yaml"]
    assert torchrun[4:] == ["--set", "train.amp=bf16"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/etc/ddp-trainer"]["readOnly"]


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (
            "metrics.port=9401,trainer.config.metrics.port=9000",
            "trainer.config.metrics.port=9000: the chart sets this key from metrics.port (now 9401)",
        ),
        (
            "trainer.config.checkpoint.uri=s3://mine/run",
            "trainer.config.checkpoint.uri=s3://mine/run: the chart sets this key from checkpoint.s3.bucket "
            "and checkpoint.s3.prefix, or checkpoint.existingClaim",
        ),
        (
            "trainer.config.checkpoint.snapshot_dir=/data/shm",
            "trainer.config.checkpoint.snapshot_dir=/data/shm: the chart sets this key to "
            "/dev/shm/ddp-trainer-snapshots (the pod's own path for it); leave it out",
        ),
    ],
)
def test_a_trainer_key_the_chart_sets_is_refused_at_render_naming_both_keys(sets, line):
    """The chart fills in the trainer's checkpoint location, metrics port and paths: the same
    trainer key with another value would be dropped, so it is refused."""
    with pytest.raises(HelmError, match=re.escape(line)):
        render(merge_values(sets=[f"gpus=8,{sets}"]), release="r", namespace="ns")


def test_a_trainer_key_equal_to_what_the_chart_sets_is_honoured():
    rendered = render(
        merge_values(sets=["gpus=8,metrics.port=9411,trainer.config.metrics.port=9411"]),
        release="r", namespace="ns",
    )  # fmt: skip
    (config_map,) = [
        c for c in rendered.objects if c["kind"] == "ConfigMap" and c["metadata"]["name"].endswith("-config")
    ]
    assert from_tree(yaml.safe_load(config_map["data"]["config.yaml"])).metrics.port == 9411


def test_elastic_policy_defaults():
    job = render(namespace="research").one("PyTorchJob")
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d" and policy["rdzvId"] == "research-ddp-run-ddp-trainer"
    assert (policy["minReplicas"], policy["maxReplicas"], policy["maxRestarts"]) == (1, 1, 3)
    env = {e["name"]: e.get("value") for e in trainer_container(pod_templates(job)["Worker"])["env"]}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_rendezvous_drops_a_lost_node_in_seconds_and_the_user_may_override():
    def conf(*sets: str) -> dict[str, str]:
        policy = render(merge_values(sets=list(sets))).one("PyTorchJob")["spec"]["elasticPolicy"]
        return {entry["key"]: entry["value"] for entry in policy["rdzvConf"]}

    assert conf() == {
        "join_timeout": "900", "keep_alive_interval": "2",
        "keep_alive_max_attempt": "3", "last_call_timeout": "5",
    }  # fmt: skip
    overridden = conf("elastic.rdzvConf.last_call_timeout=30,elastic.rdzvConf.read_timeout=120")
    assert overridden["last_call_timeout"] == "30" and overridden["read_timeout"] == "120"
    assert overridden["keep_alive_interval"] == "2"


@pytest.mark.parametrize(("grace", "deadline"), [(None, "585"), (120, "105"), (20, "10")])
def test_torchruns_shutdown_deadline_is_the_grace_period_less_15_s(grace, deadline):
    """The stop's checkpoint gets the grace period less 15 s for the kubelet's own SIGKILL,
    and never under 10 s."""
    sets = [] if grace is None else [f"terminationGracePeriodSeconds={grace}"]
    job = render(merge_values(sets=sets)).one("PyTorchJob")
    env = {e["name"]: e.get("value") for e in trainer_container(pod_templates(job)["Worker"])["env"]}
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == deadline


@pytest.mark.parametrize("kind", ["PyTorchJob", "TrainJob"])
def test_ddp_launch_writes_where_the_kubelet_reads_the_termination_message(kind):
    """The line that ends the container is `kubectl describe pod`'s Message: ddp-launch is
    told the path the kubelet mounts, and a container that wrote none shows its log's tail."""
    rendered = render(merge_values(sets=[f"jobKind={kind}"]))
    if kind == "PyTorchJob":
        container = trainer_container(pod_templates(rendered.one("PyTorchJob"))["Worker"])
    else:
        container = node_container(rendered.one("TrainingRuntime"))
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[MESSAGE_PATH_ENV] == container["terminationMessagePath"] == "/dev/termination-log"
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


LOSS_KEYS = ["node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"]


GPU = ("nvidia.com/gpu", None)  # GPU node pools' taint, tolerated on GPU pods


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        ([], [GPU, *((key, 20) for key in LOSS_KEYS)]),
        (["nodeLoss.tolerationSeconds=45"], [GPU, *((key, 45) for key in LOSS_KEYS)]),
        (["nodeLoss.tolerationSeconds=0"], [GPU]),
        (
            ["tolerations[0].key=nvidia.com/gpu,tolerations[0].operator=Exists"],
            [GPU, *((key, 20) for key in LOSS_KEYS)],
        ),
        (  # the user's own toleration of a key wins: no second one beside it
            [
                "tolerations[0].key=node.kubernetes.io/unreachable,tolerations[0].operator=Exists,"
                "tolerations[0].effect=NoExecute,tolerations[0].tolerationSeconds=600"
            ],
            [("node.kubernetes.io/unreachable", 600), GPU, ("node.kubernetes.io/not-ready", 20)],
        ),
        (["gpus=0"], [(key, 20) for key in LOSS_KEYS]),  # a CPU pod: no GPU node's taint to tolerate
    ],
    ids=["default", "own-seconds", "off", "merged-with-the-users", "the-users-key-wins", "cpu"],
)
def test_pods_leave_a_lost_node_after_tolerationseconds(sets, expected):
    """And a GPU pod tolerates GPU nodes' nvidia.com/gpu taint, once."""
    pytorchjob = render(merge_values(sets=sets)).one("PyTorchJob")
    runtime = render(merge_values(sets=["jobKind=TrainJob", *sets])).one("TrainingRuntime")
    pods = {
        "PyTorchJob": pod_templates(pytorchjob)["Worker"]["spec"],
        "TrainingRuntime": node_job(runtime)["template"]["spec"]["template"]["spec"],
    }
    for kind, pod in pods.items():
        tolerations = pod.get("tolerations", [])
        assert [(t["key"], t.get("tolerationSeconds")) for t in tolerations] == expected, kind
        assert all(t["effect"] == "NoExecute" for t in tolerations if t["key"] in LOSS_KEYS)


def test_security_defaults():
    rendered = render()
    template = pod_templates(rendered.one("PyTorchJob"))["Worker"]
    pod, container = template["spec"], trainer_container(template)
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert rendered.one("ServiceAccount")["automountServiceAccountToken"] is False
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert writable == {"/dev/shm", "/tmp", "/checkpoints"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert pod["terminationGracePeriodSeconds"] >= 300


def test_credentials_only_by_reference_and_only_as_a_file():
    """The Secret's keys reach the pods as a read-only file of its volume, which the standard
    chain reads (AWS_SHARED_CREDENTIALS_FILE), never as the value of a variable that every
    process of the pod would inherit."""
    rendered = scenario(CHART_DIR / "ci" / "gpu-16-s3-values.yaml")
    template = pod_templates(rendered.one("PyTorchJob"))["Worker"]
    container = trainer_container(template)
    assert [e["name"] for e in container["env"] if "valueFrom" in e] == []
    path = {e["name"]: e.get("value") for e in container["env"]}["AWS_SHARED_CREDENTIALS_FILE"]
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"] is True and path == f"{mount['mountPath']}/credentials"
    (volume,) = [v["secret"] for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume == {
        "secretName": "ddp-s3-credentials",
        "defaultMode": 0o440,  # the pod's group (fsGroup) reads it, no one else
        "optional": True,  # a missing key is the trainer's one line, not a pod stuck creating
        "items": [{"key": "credentials", "path": "credentials"}],
    }
    other_key = render(
        merge_values(
            sets=["checkpoint.s3.bucket=b,checkpoint.s3.existingSecret=s,checkpoint.s3.credentialsKey=aws"]
        )
    )
    spec = pod_templates(other_key.one("PyTorchJob"))["Worker"]["spec"]
    assert [v["secret"]["items"] for v in spec["volumes"] if "secret" in v] == [
        [{"key": "aws", "path": "credentials"}]
    ]
    assert not rendered.of_kind("Secret")
    sensitive = re.compile(r"(?i)secret|password|token|access_key|credential")
    for path in SCENARIOS:
        rendered = scenario(path)
        assert not re.search(r"AKIA[0-9A-Z]{16}", rendered.manifest)
        for template in pod_templates(rendered.one("PyTorchJob")).values():
            container = trainer_container(template)
            read_only = [m["mountPath"] + "/" for m in container["volumeMounts"] if m.get("readOnly")]
            for variable in container["env"]:
                if not (sensitive.search(variable["name"]) and "value" in variable):
                    continue
                # a sensitive name holds only the path of a file on a read-only volume
                assert variable["name"].endswith("_FILE"), (path.name, variable)
                assert variable["value"].startswith(tuple(read_only)), (path.name, variable)
        for config_map in rendered.of_kind("ConfigMap"):
            assert not re.search(
                r"(?im)^\s*(aws_\w+|\w*secret\w*|\w*password\w*)\s*:", str(config_map["data"])
            )


def test_irsa_kueue_gang_and_placement():
    rendered = scenario(CHART_DIR / "ci" / "irsa-kueue-gang-values.yaml")
    job = rendered.one("PyTorchJob")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    run_policy = job["spec"]["runPolicy"]
    assert run_policy["suspend"] is True
    assert run_policy["schedulingPolicy"] == {
        "minAvailable": 2,
        "queue": "training",
        "scheduleTimeoutSeconds": 600,
    }
    assert (run_policy["ttlSecondsAfterFinished"], run_policy["activeDeadlineSeconds"]) == (86400, 172800)
    assert run_policy["cleanPodPolicy"] == "Running" and run_policy["backoffLimit"] == 6  # 3 x 2 pods
    conf = {entry["key"]: entry["value"] for entry in job["spec"]["elasticPolicy"]["rdzvConf"]}
    assert conf["join_timeout"] == "1200" and conf["last_call_timeout"] == "5"  # the file's, then the chart's
    account = rendered.one("ServiceAccount")
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].endswith("role/ddp-checkpoints")
    pod = pod_templates(job)["Worker"]["spec"]
    assert (
        pod["automountServiceAccountToken"] is True
        and pod["serviceAccountName"] == account["metadata"]["name"]
    )
    assert pod["priorityClassName"] == "training-high" and pod["imagePullSecrets"] == [
        {"name": "registry-credentials"}
    ]
    assert pod["nodeSelector"] and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    env = {e["name"] for e in trainer_container(pod_templates(job)["Worker"])["env"]}
    assert "AWS_SECRET_ACCESS_KEY" not in env and "AWS_REGION" in env


def test_monitoring_objects_and_their_switches():
    rendered = render()
    monitor = rendered.one("PodMonitor")
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    labels = pod_templates(rendered.one("PyTorchJob"))["Worker"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (dashboard,) = [c for c in rendered.of_kind("ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["ddp-training.json"])["uid"] == "ddp-training"
    rules = rendered.one("PrometheusRule")["spec"]["groups"][0]["rules"]
    assert {rule["alert"] for rule in rules} >= {"DDPTrainingStalled", "DDPCheckpointStale"}

    minimal = scenario(CHART_DIR / "ci" / "minimal-values.yaml")
    assert sorted(o["kind"] for o in minimal.objects) == ["ConfigMap", "PyTorchJob"]
    container = trainer_container(pod_templates(minimal.one("PyTorchJob"))["Worker"])
    assert [p["name"] for p in container["ports"]] == ["pytorchjob-port", "health"]
    volumes = {v["name"]: v for v in pod_templates(minimal.one("PyTorchJob"))["Worker"]["spec"]["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "shared-checkpoints"


def test_notes_say_how_to_follow_rank_zero():
    notes = render(merge_values(sets=["gpus=8"]), namespace="training").notes
    assert "world size 8" in notes and "global batch 32 per rank x 8 ranks x 1 accumulation = 256" in notes
    assert (
        "kubectl logs -n training -f -c pytorch -l training.kubeflow.org/job-name=ddp-run-ddp-trainer,"
        "training.kubeflow.org/job-role=master" in notes
    )


@pytest.mark.parametrize(
    ("sets", "limit", "every", "costs"),
    [
        (
            "snapshots.stateSize=2Gi",
            "14336Mi",
            "auto",
            "at most the snapshot interval while any pod survives it",
        ),
        # stateSize unset: the digits CNN's own state, 2Mi, three times (the model's size, from
        # ddp-ops render; operator_scripts/chart/state_size.py)
        (f"{EVERY}=10", "8198Mi", 10, "at most 10 steps while any pod survives it"),
        (f"shmSize=1Ti,snapshots.stateSize=512Mi,{EVERY}=3", "1050112Mi", 3, "at most 3 steps"),
        (f"{EVERY}=0", "8Gi", 0, "up to 50 steps (the checkpoint"),
        (
            "snapshots.everySteps=4,snapshots.stateSize=1Gi",
            "11264Mi",
            4,
            "at most 4 steps",
        ),  # the deprecated name
        (  # 0 is a value, not "unset": NOTES must not show the default
            f"{EVERY}=0,trainer.config.checkpoint.every_steps=0",
            "8Gi",
            0,
            "the whole run (checkpoint.every_steps=0 saves only at the end) when every pod is lost",
        ),
    ],
)
def test_dev_shm_is_sized_for_the_snapshots_and_notes_say_what_a_failure_costs(sets, limit, every, costs):
    """The snapshot interval's home is the trainer's own key; the chart sizes /dev/shm by it."""
    rendered = render(merge_values(sets=["gpus=8", sets]))
    template = pod_templates(rendered.one("PyTorchJob"))["Worker"]
    (shm,) = [volume for volume in template["spec"]["volumes"] if volume["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": limit}
    (config_map,) = [c for c in rendered.of_kind("ConfigMap") if c["metadata"]["name"].endswith("-config")]
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config["checkpoint"]["snapshot_every_steps"] == every
    assert config["checkpoint"]["snapshot_dir"].startswith("/dev/shm/")
    assert costs in " ".join(rendered.notes.split())


def test_long_release_names_stay_within_kubernetes_limits():
    rendered = render(release="a-very-long-release-name-for-a-training-run-that-goes")
    for item in rendered.objects:
        assert len(item["metadata"]["name"]) <= 63
    assert len(rendered.one("PyTorchJob")["metadata"]["name"]) <= 52
    with pytest.raises(HelmError, match="must start with a letter"):
        render(release="7th-run")


def leaf_paths(tree: dict, prefix: str = "") -> list[str]:
    paths = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        paths += leaf_paths(value, path + ".") if isinstance(value, dict) and value else [path]
    return paths


def test_values_file_documents_every_key():
    text = (CHART_DIR / "values.yaml").read_text()
    documented = set(documented_keys(text))
    for path in leaf_paths(yaml.safe_load(text)):
        parts = path.split(".")
        ancestors = {".".join(parts[:n]) for n in range(1, len(parts) + 1)}
        assert ancestors & documented, f"values.yaml: {path} has no '# --' comment"


def job_ids(rendered) -> tuple[str, str]:
    """The job's install-id annotation and the TRAINER_JOB_ID its pods get."""
    job = rendered.one("PyTorchJob")
    container = trainer_container(job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"])
    (job_id,) = [variable["value"] for variable in container["env"] if variable["name"] == "TRAINER_JOB_ID"]
    return job["metadata"]["annotations"]["ddp-trainer/install-id"], job_id


def test_each_install_is_a_job_of_its_own_and_an_install_id_pins_it():
    """The checkpoint lease knows a job by TRAINER_JOB_ID: two installs of one name are two
    jobs (a superseded job's name may be installed again), `installId` keeps it (an upgrade,
    ddp-ops submit again), and the job's annotation says it for the next upgrade to read."""
    first, second = (render(merge_values(sets=["gpus=8"]), release="r", namespace="ns") for _ in range(2))
    (annotation, job_id), (other, _) = job_ids(first), job_ids(second)
    assert job_id == f"ns/r-ddp-trainer/{annotation}" and annotation != other
    # a drawn id starts with a letter: `--set installId=<it>` on the next upgrade stays a string
    assert re.fullmatch(r"[a-z][a-z0-9]{7}", annotation)
    pinned = render(merge_values(sets=["gpus=8,installId=abc123"]), release="r", namespace="ns")
    assert job_ids(pinned) == ("abc123", "ns/r-ddp-trainer/abc123")
    upgraded = render(merge_values(sets=[f"gpus=8,installId={annotation}"]), release="r", namespace="ns")
    assert job_ids(upgraded) == (annotation, job_id)
    for refused in ("Not/Valid", "1234abcd"):
        with pytest.raises(HelmError, match="installId"):
            render(merge_values(sets=[f"gpus=8,installId={refused}"]), release="r", namespace="ns")


def test_helm_itself_draws_one_install_id_per_render_and_asks_no_cluster_under_template():
    """`helm install` without installId: the chart draws one, once for the whole render (the
    annotation and every pod agree), and asks a cluster only where it serves the job's kind
    (helm template and a client dry run have none: lookup would fail to connect)."""
    from helm_python import Chart, Config

    result = Config().install(Chart.load(CHART_DIR), "r", {"gpus": 8}, namespace="ns", dry_run="client")
    objects = [item for item in yaml.safe_load_all(result["manifest"]) if item]
    (job,) = [item for item in objects if item["kind"] == "PyTorchJob"]
    annotation = job["metadata"]["annotations"]["ddp-trainer/install-id"]
    assert re.fullmatch(
        r"[a-z][a-z0-9]{7}", annotation
    ) and f"value: ns/r-ddp-trainer/{annotation}" in yaml.safe_dump(job)


# ----- Kueue's topology-aware scheduling ---------------------------------------------------

KUEUE = "kueue.queueName=team,kueue.topology.level=cloud.example.com/topology-rack"


@pytest.mark.parametrize(
    ("sets", "templates", "grouped"),
    [
        (f"{KUEUE},gpus=16", ["Worker"], False),  # elastic: one PodSet
        (f"{KUEUE},gpus=16,mode=fixed", ["Master", "Worker"], True),  # one domain for both
        (f"{KUEUE},gpus=8,mode=fixed", ["Master"], False),  # a group needs two PodSets
        (f"{KUEUE},jobKind=TrainJob,kueue.topology.mode=preferred", ["node"], False),
    ],
)
def test_a_topology_level_is_requested_on_every_podset_as_kueue_reads_it(sets, templates, grouped):
    """Kueue builds a PodSet per replica (a TrainJob's per replicated job of its runtime) and
    reads the request from its pod template's annotations (jobframework/tas.go:62-63); it
    admits at most one of required/preferred, a label name as the level, and groups of
    exactly two PodSets of which one has a single pod (tas_validation.go:34-95, 214-262)."""
    rendered = render(merge_values(sets=[sets]))
    if "TrainJob" in sets:
        found = {"node": node_job(rendered.one("TrainingRuntime"))["template"]["spec"]["template"]}
        mode = "preferred"
    else:
        found = {
            kind: spec["template"]
            for kind, spec in rendered.one("PyTorchJob")["spec"]["pytorchReplicaSpecs"].items()
        }
        mode = "required"
    assert sorted(found) == templates
    for template in found.values():
        notes = {
            k: v for k, v in template["metadata"]["annotations"].items() if k.startswith("kueue.x-k8s.io/")
        }
        expected = {f"kueue.x-k8s.io/podset-{mode}-topology": "cloud.example.com/topology-rack"}
        assert notes == expected | ({"kueue.x-k8s.io/podset-group-name": "trainer"} if grouped else {}), notes


@pytest.mark.parametrize(
    ("sets", "said"),
    [
        (
            "kueue.topology.level=kubernetes.io/hostname",
            "only Kueue reads it, and the job goes to no Kueue queue",
        ),
        ("kueue.queueName=q,kueue.topology.level=Rack_Label/x", "not a node label name, which Kueue refuses"),
        ("kueue.queueName=q,kueue.topology.level=a/b/c", "not a node label name"),
        (f"kueue.queueName=q,kueue.topology.level={'r' * 64}", "not a node label name"),
    ],
)
def test_a_topology_level_kueue_would_refuse_is_refused_at_render_in_one_line(sets, said):
    with pytest.raises(HelmError) as refused:
        render(merge_values(sets=[sets]))
    assert said in str(refused.value) and len(str(refused.value).strip().splitlines()) == 1


def test_a_topology_mode_other_than_required_or_preferred_is_refused_by_the_schema():
    with pytest.raises(HelmError) as refused:
        render(merge_values(sets=[f"{KUEUE},kueue.topology.mode=unconstrained"]))
    assert "'/kueue/topology/mode': value must be one of 'required', 'preferred'" in str(refused.value)
