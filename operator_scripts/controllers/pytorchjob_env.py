"""What the Kubeflow Training Operator v1.9.4 makes of a PyTorchJob: the defaults it applies,
its pods' names, labels and injected environment (docs/facts.md, with the operator's files), as pure
functions. File and line references are to kubeflow/trainer at tag v1.9.4."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PORT = 23456
LABEL = "training.kubeflow.org"


@dataclass(frozen=True)
class PodPlan:
    """One pod the operator would create for a replica."""

    name: str
    replica_type: str  # "master" or "worker"
    index: int
    labels: dict[str, str]
    env: dict[str, str]  # injected by the operator, applied after the container's own env
    restart_policy: str  # OnFailure, Always, Never or ExitCode
    template: dict[str, Any] = field(repr=False)
    container_name: str = "pytorch"  # the trainer's container: v1's name; Trainer v2's is `node`
    aliases: tuple[str, ...] = ()  # further names that resolve to the pod while it runs
    is_rank0: bool = False  # the pod that holds rank 0 in practice, whose log `local` streams

    @property
    def container(self) -> dict[str, Any]:
        (container,) = [c for c in self.template["spec"]["containers"] if c["name"] == self.container_name]
        return container


def with_defaults(job: dict[str, Any]) -> dict[str, Any]:
    """The job as the controller sees it after defaulting, which happens in its memory only
    (pkg/apis/kubeflow.org/v1/pytorch_defaults.go:77-96): cleanPodPolicy None, replicas 1,
    restartPolicy OnFailure, nprocPerNode "auto" (:68-75), and elastic bounds copied from
    each other or from the Worker replicas (:38-56)."""
    job = copy.deepcopy(job)
    spec = job["spec"]
    spec.setdefault("runPolicy", {}).setdefault("cleanPodPolicy", "None")
    for replica in spec["pytorchReplicaSpecs"].values():
        replica.setdefault("replicas", 1)
        replica.setdefault("restartPolicy", "OnFailure")
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        low, high = elastic.get("minReplicas"), elastic.get("maxReplicas")
        workers = spec["pytorchReplicaSpecs"]["Worker"]["replicas"]
        elastic["minReplicas"] = low if low is not None else high if high is not None else workers
        elastic["maxReplicas"] = high if high is not None else elastic["minReplicas"]
    if elastic is None or elastic.get("nProcPerNode") is None:
        spec.setdefault("nprocPerNode", "auto")
    return job


def job_port(job: dict[str, Any]) -> int:
    """The `pytorchjob-port` of the first replica's pytorch container, else 23456."""
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        for container in spec["template"]["spec"]["containers"]:
            for port in container.get("ports", []):
                if container["name"] == "pytorch" and port.get("name") == "pytorchjob-port":
                    return int(port["containerPort"])
    return DEFAULT_PORT


def pod_labels(job_name: str, replica_type: str, index: int, has_master: bool) -> dict[str, str]:
    """Labels of a replica pod; `job-role=master` marks master-0, or worker-0 without a Master."""
    labels = {
        f"{LABEL}/job-name": job_name,
        f"{LABEL}/replica-type": replica_type,
        f"{LABEL}/replica-index": str(index),
        f"{LABEL}/operator-name": "pytorchjob-controller",
    }
    if index == 0 and replica_type == ("master" if has_master else "worker"):
        labels[f"{LABEL}/job-role"] = "master"
    return labels


def rank0_selector(job_name: str) -> str:
    """The label selector of the pod that holds rank 0 in practice."""
    return f"{LABEL}/job-name={job_name},{LABEL}/job-role=master"


def injected_env(job: dict[str, Any], replica_type: str, index: int) -> dict[str, str]:
    """The environment the operator appends to a replica's containers
    (pkg/controller.v1/pytorch/envvar.go:50-121, elastic.go:87-183)."""
    job = with_defaults(job)
    spec, name = job["spec"], job["metadata"]["name"]
    replicas = spec["pytorchReplicaSpecs"]
    port = job_port(job)
    env = {"PYTHONUNBUFFERED": "1"}
    nproc = spec.get("nprocPerNode")
    total = sum(int(r["replicas"]) for r in replicas.values())
    elastic = spec.get("elasticPolicy")
    if "Master" in replicas:
        master = f"{name}-master-0"
        node_rank = 0 if replica_type == "master" else index + 1
        # envvar.go:62-64,132-140: a non-integer nprocPerNode ("auto", "gpu") counts as 1
        per_node = int(nproc) if nproc is not None and str(nproc).isdigit() else 1
        env.update(
            MASTER_ADDR=master, PET_MASTER_ADDR=master, MASTER_PORT=str(port), PET_MASTER_PORT=str(port),
            WORLD_SIZE=str(total * per_node), RANK=str(node_rank), PET_NODE_RANK=str(node_rank),
        )  # fmt: skip
    if nproc is not None:
        env["PET_NPROC_PER_NODE"] = str(nproc)
    if elastic is None:
        env["PET_NNODES"] = str(total)
        return env
    host = elastic.get("rdzvHost") or f"{name}-worker-0"
    env["PET_RDZV_ENDPOINT"] = f"{host}:{elastic.get('rdzvPort') or port}"
    env["PET_RDZV_BACKEND"] = elastic.get("rdzvBackend") or "c10d"
    env["PET_NNODES"] = f"{elastic['minReplicas']}:{elastic['maxReplicas']}"  # every replica type
    if elastic.get("maxRestarts") is not None:
        env["PET_MAX_RESTARTS"] = str(elastic["maxRestarts"])
    if elastic.get("rdzvId"):
        env["PET_RDZV_ID"] = str(elastic["rdzvId"])
    if elastic.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{kv['key']}={kv['value']}" for kv in elastic["rdzvConf"])
    if elastic.get("nProcPerNode") is not None:
        env["PET_NPROC_PER_NODE"] = str(elastic["nProcPerNode"])
    return env


def plan_pods(job: dict[str, Any]) -> list[PodPlan]:
    """Every pod of the job, Master first, named `<job>-<type>-<index>`."""
    job = with_defaults(job)
    name, replicas = job["metadata"]["name"], job["spec"]["pytorchReplicaSpecs"]
    has_master = "Master" in replicas
    pods = []
    for kind in ("Master", "Worker"):
        if kind not in replicas:
            continue
        replica_type = kind.lower()
        for index in range(int(replicas[kind]["replicas"])):
            pods.append(
                PodPlan(
                    name=f"{name}-{replica_type}-{index}",
                    replica_type=replica_type,
                    index=index,
                    labels=pod_labels(name, replica_type, index, has_master),
                    env=injected_env(job, replica_type, index),
                    restart_policy=replicas[kind]["restartPolicy"],
                    template=replicas[kind]["template"],
                    is_rank0=f"{LABEL}/job-role" in pod_labels(name, replica_type, index, has_master),
                )
            )
    return pods
