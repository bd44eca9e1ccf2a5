"""Talking to a cluster: apply rendered objects, read a job's status, find and follow rank
0's log, delete a release. Configuration is found as kubectl finds it (the first file in
KUBECONFIG, else ~/.kube/config, else the pod's service account); failures become one-line
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
# every kind the chart renders: (apiVersion, kind) -> the API's plural
KINDS = {
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "ConfigMap"): "configmaps",
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjobs",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrules",
}
RELEASE_LABEL = "app.kubernetes.io/instance"  # on every object the chart renders (ddp.labels)
FIELD_MANAGER = "ddp-ops"
BANNER = "rank 0 on host"


class ClusterError(RuntimeError):
    """Something about the cluster, said in one line."""


class MissingApiError(ClusterError):
    """The cluster does not serve a kind: its CRD is not installed."""


def collection_path(api_version: str, plural: str, namespace: str) -> str:
    """`/api/v1/namespaces/NS/configmaps` or `/apis/GROUP/VERSION/namespaces/NS/PLURAL`."""
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}"


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

        named = os.environ.get("KUBECONFIG", "")
        candidates = (named or "~/.kube/config").split(os.pathsep)
        kubeconfig = next(
            (Path(p).expanduser() for p in candidates if p and Path(p).expanduser().is_file()), None
        )
        if named and kubeconfig is None:
            raise ClusterError(f"KUBECONFIG={named}: no such file; point it at your cluster's kubeconfig")
        try:
            if kubeconfig is not None:
                config.load_kube_config(config_file=str(kubeconfig))
            else:
                config.load_incluster_config()
        except ConfigException as error:
            raise ClusterError(f"no cluster configured: {error} (set KUBECONFIG or run in a pod)") from None
        self.client = client.ApiClient()
        self.core = client.CoreV1Api(self.client)
        self.custom = client.CustomObjectsApi(self.client)

    def _call(self, what: str, action: Callable[[], Any]) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return action()
        except ApiException as error:
            if error.status == 404 and "the server could not find the requested resource" in str(error.body):
                operator = "PyTorchJob" in what or "pytorchjobs" in what
                hint = (
                    "is the Kubeflow training operator v1.9.4 installed (kubectl get crd "
                    "pytorchjobs.kubeflow.org)?"
                    if operator
                    else "is its CRD installed?"
                )
                raise MissingApiError(f"{what}: the cluster has no such API; {hint}") from None
            reason = _api_message(error)
            raise ClusterError(f"{what}: {error.status} {reason}") from None
        except HTTPError as error:
            raise ClusterError(f"{what}: the cluster does not answer ({error.__class__.__name__})") from None

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        content_type: str | None = None,
        body: Any = None,
    ):
        """One API request by path: (body, HTTP status, headers)."""
        headers = {"Accept": "application/json"} | ({"Content-Type": content_type} if content_type else {})
        return self.client.call_api(
            path,
            method,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
            response_type="object",
            _return_http_data_only=False,
        )

    def apply(self, item: dict[str, Any], namespace: str) -> str:
        """Create `item` or update it to match, by server-side apply (as `kubectl apply
        --server-side --force-conflicts`): submitting the same release twice updates it."""
        kind, api_version, name = item["kind"], item["apiVersion"], item["metadata"]["name"]
        what = f"apply {kind} {namespace}/{name}"
        plural = KINDS.get((api_version, kind))
        if plural is None:
            raise ClusterError(f"{what}: no handler for {api_version} {kind}")
        path = f"{collection_path(api_version, plural, namespace)}/{name}"
        _, status, _ = self._call(
            what,
            lambda: self._request(
                "PATCH",
                path,
                query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
                content_type="application/apply-patch+yaml",
                body=item,
            ),
        )
        return f"{kind.lower()}/{name} {'created' if status == 201 else 'configured'}"

    def uninstall(self, release: str, namespace: str) -> list[str]:
        """Delete every object of the chart's kinds labelled with `release`, as `helm
        uninstall` does; the operator then deletes the job's pods. A kind whose CRD is not
        installed has nothing to delete."""
        deleted = []
        for (api_version, kind), plural in KINDS.items():
            path = collection_path(api_version, plural, namespace)
            try:
                found, _, _ = self._call(
                    f"list {kind} in {namespace}",
                    lambda path=path: self._request(
                        "GET", path, query=[("labelSelector", f"{RELEASE_LABEL}={release}")]
                    ),
                )
            except MissingApiError:
                continue
            for item in found.get("items", []):
                name = item["metadata"]["name"]
                self._call(
                    f"delete {kind} {namespace}/{name}",
                    lambda name=name, path=path: self._request("DELETE", f"{path}/{name}"),
                )
                deleted.append(f"{kind.lower()}/{name} deleted")
        if not deleted:
            raise ClusterError(f"release {release} has no objects in namespace {namespace}")
        return deleted

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


def _api_message(error: Any) -> str:
    try:
        return json.loads(error.body).get("message", error.reason)
    except (TypeError, ValueError):
        return str(error.reason)
