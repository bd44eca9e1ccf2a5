"""Talking to a cluster: submit rendered objects, read a job's status, find and follow rank
0's log, delete. Configuration is found as kubectl finds it (the first file in KUBECONFIG,
else ~/.kube/config, else the pod's service account); failures become one-line
ClusterErrors instead of stack traces."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from operator_scripts.operator_env import LABEL, rank0_selector

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
CUSTOM_PLURALS = {
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjobs",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrules",
}
BANNER = "rank 0 on host"


class ClusterError(RuntimeError):
    """Something about the cluster, said in one line."""


@dataclass(frozen=True)
class JobStatus:
    """What `status` prints."""

    name: str
    state: str
    conditions: list[tuple[str, str, str]]  # (type, status, reason or message)
    replicas: dict[str, dict[str, int]]
    restarts: int
    age_seconds: float | None
    rank0_pod: str | None


def summarize(job: dict[str, Any], pods: list[dict[str, Any]], now: datetime | None = None) -> JobStatus:
    """A job's state from its conditions (the newest true one), replica counts, container
    restarts and the pod labelled as rank 0's."""
    status = job.get("status", {})
    conditions = status.get("conditions", [])
    true = [c for c in conditions if c.get("status") == "True"]
    state = true[-1]["type"] if true else "Pending"
    created = job["metadata"].get("creationTimestamp")
    now = now or datetime.now(timezone.utc)
    age = (now - datetime.fromisoformat(created.replace("Z", "+00:00"))).total_seconds() if created else None
    restarts = sum(
        cs.get("restartCount", 0) for pod in pods for cs in pod.get("status", {}).get("containerStatuses", [])
    )
    rank0 = [
        p["metadata"]["name"]
        for p in pods
        if p["metadata"].get("labels", {}).get(f"{LABEL}/job-role") == "master"
    ]
    return JobStatus(
        name=job["metadata"]["name"],
        state=state,
        conditions=[
            (c["type"], c.get("status", ""), c.get("reason") or c.get("message", "")) for c in conditions
        ],
        replicas={kind: dict(counts) for kind, counts in status.get("replicaStatuses", {}).items()},
        restarts=restarts,
        age_seconds=age,
        rank0_pod=rank0[0] if rank0 else None,
    )


def format_status(summary: JobStatus) -> str:
    age = (
        "unknown"
        if summary.age_seconds is None
        else f"{int(summary.age_seconds // 60)}m{int(summary.age_seconds % 60)}s"
    )
    lines = [f"PyTorchJob {summary.name}: {summary.state} (age {age}, container restarts {summary.restarts})"]
    for kind, counts in summary.replicas.items():
        lines.append(f"  {kind}: " + ", ".join(f"{key} {value}" for key, value in sorted(counts.items())))
    for kind, flag, why in summary.conditions:
        lines.append(f"  condition {kind}={flag} {why}".rstrip())
    lines.append(f"  rank 0 pod: {summary.rank0_pod or 'not scheduled yet'}")
    return "\n".join(lines)


class Cluster:
    """A connection to the cluster the kubeconfig (or the pod's service account) names."""

    def __init__(self) -> None:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException

        candidates = os.environ.get("KUBECONFIG", "~/.kube/config").split(os.pathsep)
        kubeconfig = next(
            (Path(p).expanduser() for p in candidates if p and Path(p).expanduser().is_file()), None
        )
        try:
            if kubeconfig is not None:
                config.load_kube_config(config_file=str(kubeconfig))
            else:
                config.load_incluster_config()
        except ConfigException as error:
            raise ClusterError(f"no cluster configured: {error} (set KUBECONFIG or run in a pod)") from None
        self.core = client.CoreV1Api()
        self.custom = client.CustomObjectsApi()

    def _call(self, what: str, action: Callable[[], Any]) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return action()
        except ApiException as error:
            if error.status == 404 and "the server could not find the requested resource" in str(error.body):
                raise ClusterError(
                    f"{what}: the cluster has no such API; is the Kubeflow training operator v1.9.4 "
                    "installed (kubectl get crd pytorchjobs.kubeflow.org)?"
                ) from None
            reason = _api_message(error)
            raise ClusterError(f"{what}: {error.status} {reason}") from None
        except HTTPError as error:
            raise ClusterError(f"{what}: the cluster does not answer ({error.__class__.__name__})") from None

    def create(self, item: dict[str, Any], namespace: str) -> str:
        kind, api_version = item["kind"], item["apiVersion"]
        name = item["metadata"]["name"]
        what = f"create {kind} {namespace}/{name}"
        plural = CUSTOM_PLURALS.get((api_version, kind))
        if plural:
            group, version = api_version.split("/")
            self._call(
                what,
                lambda: self.custom.create_namespaced_custom_object(group, version, namespace, plural, item),
            )
        elif kind == "ConfigMap":
            self._call(what, lambda: self.core.create_namespaced_config_map(namespace, item))
        elif kind == "ServiceAccount":
            self._call(what, lambda: self.core.create_namespaced_service_account(namespace, item))
        else:
            raise ClusterError(f"{what}: no handler for {api_version} {kind}")
        return f"{kind.lower()}/{name} created"

    def job(self, name: str, namespace: str) -> dict[str, Any]:
        return self._call(
            f"get PyTorchJob {namespace}/{name}",
            lambda: self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name),
        )

    def pods(self, name: str, namespace: str) -> list[dict[str, Any]]:
        from kubernetes import client

        found = self._call(
            f"list pods of {namespace}/{name}",
            lambda: self.core.list_namespaced_pod(namespace, label_selector=f"{LABEL}/job-name={name}"),
        )
        return [client.ApiClient().sanitize_for_serialization(pod) for pod in found.items]

    def status(self, name: str, namespace: str) -> JobStatus:
        return summarize(self.job(name, namespace), self.pods(name, namespace))

    def log(self, pod: str, namespace: str, *, follow: bool) -> Iterator[str]:
        if not follow:
            text = self._call(
                f"log of {namespace}/{pod}",
                lambda: self.core.read_namespaced_pod_log(pod, namespace, container="pytorch"),
            )
            yield from text.splitlines()
            return
        stream = self._call(
            f"log of {namespace}/{pod}",
            lambda: self.core.read_namespaced_pod_log(
                pod, namespace, container="pytorch", follow=True, _preload_content=False
            ),
        )
        for line in stream:
            yield line.decode(errors="replace").rstrip("\n")

    def rank0_pod(self, name: str, namespace: str) -> str:
        """The pod whose log carries the trainer's rank-0 banner: the job-role=master pod
        if it does, else whichever of the job's pods does (node ranks follow rendezvous
        order, not pod names)."""
        labelled = self._call(
            f"find rank 0 of {namespace}/{name}",
            lambda: self.core.list_namespaced_pod(namespace, label_selector=rank0_selector(name)),
        ).items
        candidates = [pod.metadata.name for pod in labelled]
        candidates += [
            p["metadata"]["name"]
            for p in self.pods(name, namespace)
            if p["metadata"]["name"] not in candidates
        ]
        if not candidates:
            raise ClusterError(f"PyTorchJob {namespace}/{name} has no pods yet")
        for pod in candidates:
            if any(BANNER in line for line in self.log(pod, namespace, follow=False)):
                return pod
        return candidates[0]

    def delete(self, name: str, namespace: str) -> str:
        self._call(
            f"delete PyTorchJob {namespace}/{name}",
            lambda: self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name),
        )
        return f"pytorchjob/{name} deleted"


def _api_message(error: Any) -> str:
    try:
        return json.loads(error.body).get("message", error.reason)
    except (TypeError, ValueError):
        return str(error.reason)
