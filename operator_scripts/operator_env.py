"""What the Kubeflow Training Operator v1.9.4 makes of a PyTorchJob: its pods' names,
labels and injected environment (shared/reference/FACTS.md), as pure functions."""

from __future__ import annotations

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
    template: dict[str, Any] = field(repr=False)

    @property
    def container(self) -> dict[str, Any]:
        (container,) = [c for c in self.template["spec"]["containers"] if c["name"] == "pytorch"]
        return container


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
    """The environment the operator adds to a replica's containers."""
    spec, name = job["spec"], job["metadata"]["name"]
    replicas = spec["pytorchReplicaSpecs"]
    has_master = "Master" in replicas
    port = job_port(job)
    env = {"PYTHONUNBUFFERED": "1"}
    nproc = spec.get("nprocPerNode")
    if nproc is not None:
        env["PET_NPROC_PER_NODE"] = str(nproc)
    total = sum(int(r.get("replicas", 1)) for r in replicas.values())
    elastic = spec.get("elasticPolicy")
    if has_master:
        master = f"{name}-master-0"
        node_rank = 0 if replica_type == "master" else index + 1
        env.update(
            MASTER_ADDR=master, PET_MASTER_ADDR=master, MASTER_PORT=str(port), PET_MASTER_PORT=str(port),
            RANK=str(node_rank), PET_NODE_RANK=str(node_rank),
        )  # fmt: skip
        if nproc is not None and str(nproc).isdigit():
            env["WORLD_SIZE"] = str(total * int(nproc))
        if elastic is None:
            env["PET_NNODES"] = str(total)
    if elastic is not None:
        host = elastic.get("rdzvHost") or f"{name}-worker-0"
        env["PET_RDZV_ENDPOINT"] = f"{host}:{elastic.get('rdzvPort') or port}"
        env["PET_RDZV_BACKEND"] = elastic.get("rdzvBackend") or "c10d"
        if replica_type == "worker":
            workers = int(replicas["Worker"].get("replicas", 1))
            low, high = elastic.get("minReplicas", workers), elastic.get("maxReplicas", workers)
            env["PET_NNODES"] = f"{low}:{high}"
        if elastic.get("maxRestarts") is not None:
            env["PET_MAX_RESTARTS"] = str(elastic["maxRestarts"])
        if elastic.get("rdzvId"):
            env["PET_RDZV_ID"] = str(elastic["rdzvId"])
        if elastic.get("rdzvConf"):
            env["PET_RDZV_CONF"] = ",".join(f"{kv['key']}={kv['value']}" for kv in elastic["rdzvConf"])
    return env


def plan_pods(job: dict[str, Any]) -> list[PodPlan]:
    """Every pod of the job, Master first, named `<job>-<type>-<index>`."""
    name, replicas = job["metadata"]["name"], job["spec"]["pytorchReplicaSpecs"]
    has_master = "Master" in replicas
    pods = []
    for kind in ("Master", "Worker"):
        if kind not in replicas:
            continue
        replica_type = kind.lower()
        for index in range(int(replicas[kind].get("replicas", 1))):
            pods.append(
                PodPlan(
                    name=f"{name}-{replica_type}-{index}",
                    replica_type=replica_type,
                    index=index,
                    labels=pod_labels(name, replica_type, index, has_master),
                    env=injected_env(job, replica_type, index),
                    template=replicas[kind]["template"],
                )
            )
    return pods


def job_outcome(job: dict[str, Any], exits: dict[str, int | None]) -> str:
    """Running, Succeeded or Failed from each pod's last exit code (None: still running),
    as the operator decides it: with a Master, the Master's result is the job's."""
    name = job["metadata"]["name"]
    has_master = "Master" in job["spec"]["pytorchReplicaSpecs"]
    if has_master:
        decisive = [exits[f"{name}-master-0"]]
    else:
        decisive = [code for pod, code in exits.items() if "-worker-" in pod]
    if any(code not in (None, 0) for code in decisive):
        return "Failed"
    return "Succeeded" if all(code == 0 for code in decisive) else "Running"
