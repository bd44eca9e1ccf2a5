"""What Kubeflow Trainer v2.3.0 and JobSet v0.12.0 make of a TrainJob and its runtime: the one
Indexed Job of the runtime's trainer step, its pods' names, host names, labels and injected
environment, as pure functions (docs/facts.md). References are to kubeflow/trainer at tag
v2.3.0 and kubernetes-sigs/jobset at tag v0.12.0."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from operator_scripts.controllers.pytorchjob_env import PodPlan

ANCESTOR_LABEL, NODE = "trainer.kubeflow.org/trainjob-ancestor-step", "node"  # constants.go:41, 69
MASTER_PORT = 29500  # constants.go:72
JOBSET_LABEL = "jobset.sigs.k8s.io"
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"


@dataclass(frozen=True)
class NodeJob:
    """The runtime's trainer Job as the JobSet runs it: its pod template (with the TrainJob's
    trainer applied), the number of nodes, and the failure handling of the Job and JobSet."""

    name: str  # the TrainJob's, which the JobSet and its Service take (jobset.go:425-445)
    replicated_job: str
    nodes: int
    procs: str
    template: dict[str, Any]
    backoff_limit: int
    pod_failure_policy: dict[str, Any] | None
    failure_policy: dict[str, Any] | None

    @property
    def restart_policy(self) -> str:
        return self.template["spec"].get("restartPolicy", "OnFailure")  # jobset_webhook.go:124-127


def node_job(trainjob: dict[str, Any], runtime: dict[str, Any]) -> NodeJob:
    """The trainer step of `runtime` with `trainjob`'s trainer applied: numNodes as Indexed
    completions (jobset.go:314-335), image, command and args replacing the node
    container's and env upserted into it (plugins/jobset/builder.go:113-160), resourcesPerNode
    merged into its resources (runtime/core/trainingruntime.go:199-231)."""
    spec = runtime["spec"]
    jobset = spec["template"]["spec"]
    (replicated,) = [job for job in jobset["replicatedJobs"] if ancestor(job) == "trainer"]
    trainer = trainjob["spec"].get("trainer") or {}
    nodes = int(trainer.get("numNodes", spec.get("mlPolicy", {}).get("numNodes", 1)))
    job_spec = replicated["template"]["spec"]
    template = copy.deepcopy(job_spec["template"])
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == NODE]
    for field in ("image", "command", "args"):
        if field in trainer:
            container[field] = copy.deepcopy(trainer[field])
    container["env"] = upsert(container.get("env", []), trainer.get("env", []))
    if "resourcesPerNode" in trainer:
        resources = container.setdefault("resources", {})
        for kind in ("requests", "limits"):
            if kind in trainer["resourcesPerNode"]:
                resources[kind] = {**resources.get(kind, {}), **trainer["resourcesPerNode"][kind]}
    return NodeJob(
        name=trainjob["metadata"]["name"],
        replicated_job=replicated["name"],
        nodes=nodes,
        procs=str(trainer.get("numProcPerNode", "auto")),
        template=template,
        backoff_limit=int(job_spec.get("backoffLimit", 6)),  # the Job API's default
        pod_failure_policy=job_spec.get("podFailurePolicy"),
        failure_policy=jobset.get("failurePolicy"),
    )


def ancestor(replicated_job: dict[str, Any]) -> str | None:
    """The Trainer step a replicated job runs (its ancestor label)."""
    return replicated_job["template"].get("metadata", {}).get("labels", {}).get(ANCESTOR_LABEL)


def upsert(env: list[dict[str, Any]], updates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trainer's apply.UpsertEnvVars: a variable of the same name is replaced in place, a new
    one appended."""
    merged = copy.deepcopy(env)
    for update in updates:
        names = [variable["name"] for variable in merged]
        if update["name"] in names:
            merged[names.index(update["name"])] = copy.deepcopy(update)
        else:
            merged.append(copy.deepcopy(update))
    return merged


def host_name(job: NodeJob, index: int) -> str:
    """A node pod's host name, `<tj>-<rjob>-0-<index>` (JobSet's placement.GenPodName without
    the random suffix; jobset.go:302), and the name it resolves by in its namespace."""
    return f"{job.name}-{job.replicated_job}-0-{index}"


def dns_name(job: NodeJob, index: int) -> str:
    """`<host>.<tj>`: JobSet's headless Service `<tj>` publishes not-ready addresses
    (jobset_webhook.go:130-139), so the name resolves once the pod has its address."""
    return f"{host_name(job, index)}.{job.name}"


def injected_env(job: NodeJob, index: int) -> dict[str, str]:
    """PET_* from the torch plugin (torch.go:146-167; PET_NODE_RANK is a fieldRef to the
    completion index) and JOB_COMPLETION_INDEX from the Job controller for Indexed Jobs."""
    return {
        "PET_NNODES": str(job.nodes),
        "PET_NPROC_PER_NODE": job.procs,
        "PET_NODE_RANK": str(index),
        "PET_MASTER_ADDR": dns_name(job, 0),
        "PET_MASTER_PORT": str(MASTER_PORT),
        "JOB_COMPLETION_INDEX": str(index),
    }


def plan_pods(trainjob: dict[str, Any], runtime: dict[str, Any]) -> list[PodPlan]:
    """One pod per completion index, named by its host name; rank 0's pod is index 0."""
    job = node_job(trainjob, runtime)
    pods = []
    for index in range(job.nodes):
        labels = {
            f"{JOBSET_LABEL}/jobset-name": job.name,
            f"{JOBSET_LABEL}/replicatedjob-name": job.replicated_job,
            INDEX_LABEL: str(index),
        }
        pods.append(
            PodPlan(
                name=host_name(job, index),
                replica_type=NODE,
                index=index,
                labels=labels,
                env=injected_env(job, index),
                restart_policy=job.restart_policy,
                template=job.template,
                container_name=NODE,
                aliases=(dns_name(job, index),),
                is_rank0=index == 0,  # torchrun's c10d ranks the sorted host names (docs/facts.md)
            )
        )
    return pods


STATUS_MOUNT = "/var/run/secrets/kubeflow/trainer"  # trainjobstatus.go:48
STATUS_VOLUME = "kubeflow-trainer-token"  # trainjobstatus.go:51
STATUS_TOKEN_EXPIRY_S = 3600  # trainjobstatus.go:54


def tls_config_map_name(trainjob: dict[str, Any]) -> str:
    """`<tj>-tls-config` (trainjobstatus.go:147, 177)."""
    return f"{trainjob['metadata']['name']}-tls-config"


def tls_config_map(trainjob: dict[str, Any], ca_pem: str) -> dict[str, Any]:
    """The ConfigMap the plugin builds with the status server's CA (trainjobstatus.go:175-211)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": tls_config_map_name(trainjob),
            "namespace": trainjob["metadata"].get("namespace", "default"),
        },
        "data": {"ca.crt": ca_pem},
    }


def with_status_server(
    template: dict[str, Any], trainjob: dict[str, Any], url: str, audience: str
) -> dict[str, Any]:
    """The pod template as the TrainJobStatus plugin enforces it (feature gate on,
    trainjobstatus.go:79-173): the server's URL, CA and token files in every trainer
    container's environment (upserted), and the projected volume of a token for the
    TrainJob's audience and the CA, mounted read-only."""
    template = copy.deepcopy(template)
    env = [
        {"name": "KUBEFLOW_TRAINER_SERVER_URL", "value": url},
        {"name": "KUBEFLOW_TRAINER_SERVER_CA_CERT", "value": f"{STATUS_MOUNT}/ca.crt"},
        {"name": "KUBEFLOW_TRAINER_SERVER_TOKEN", "value": f"{STATUS_MOUNT}/token"},
    ]
    mount = {"name": STATUS_VOLUME, "mountPath": STATUS_MOUNT, "readOnly": True}
    for container in template["spec"]["containers"]:
        container["env"] = upsert(container.get("env", []), env)
        mounts = [m for m in container.get("volumeMounts", []) if m["name"] != STATUS_VOLUME]
        container["volumeMounts"] = [*mounts, mount]
    token = {"audience": audience, "expirationSeconds": STATUS_TOKEN_EXPIRY_S, "path": "token"}
    config_map = {
        "name": tls_config_map_name(trainjob),
        "items": [{"key": "ca.crt", "path": "ca.crt"}],
    }
    volume = {
        "name": STATUS_VOLUME,
        "projected": {"sources": [{"serviceAccountToken": token}, {"configMap": config_map}]},
    }
    volumes = [v for v in template["spec"].get("volumes", []) if v["name"] != STATUS_VOLUME]
    template["spec"]["volumes"] = [*volumes, volume]
    return template
