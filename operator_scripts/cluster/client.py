"""Talking to a cluster: apply rendered objects, read a job's status, find and follow rank
0's log, delete a release. Configuration is found as kubectl finds it (the first file in
KUBECONFIG, else ~/.kube/config, else the pod's service account); failures become one-line
ClusterErrors instead of stack traces."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from operator_scripts.cluster.status import (
    JobStatus,
    progress_from_metrics,
    rank0_figures,
    summarize,
    summarize_trainjob,
)
from operator_scripts.controllers.pytorchjob_env import LABEL, rank0_selector
from operator_scripts.controllers.trainjob_env import INDEX_LABEL, JOBSET_LABEL, NODE

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
TRAINER_API, JOBSET_API = "trainer.kubeflow.org/v1alpha1", "jobset.x-k8s.io/v1alpha2"
# every kind the chart renders: (apiVersion, kind) -> the API's plural, in the order a
# release's objects are deleted (a TrainJob before the runtime it names)
KINDS = {
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "ConfigMap"): "configmaps",
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjobs",
    (TRAINER_API, "TrainJob"): "trainjobs",
    (TRAINER_API, "TrainingRuntime"): "trainingruntimes",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrules",
}
# Trainer's webhook reads runtimes through its controller's cache, which a runtime created a
# moment before may not have reached (docs/facts.md): such a refusal is retried this long
RUNTIME_CACHE_WAIT_S = 10.0
RUNTIME_NOT_YET = "must be created before the TrainJob is created"
RELEASE_LABEL = "app.kubernetes.io/instance"  # on every object the chart renders (ddp.labels)
# and this one too, whatever nameOverride says: `delete` takes only the chart's objects of the
# release, not another chart's that the same release name labels
CHART_LABEL = "app.kubernetes.io/part-of=ddp-trainer"
# what cannot change in place, by kind: an update is refused with "field is immutable"
IMMUTABLE = {
    "TrainJob": "its trainer, runtimeRef and initializer cannot change (Trainer v2 makes them immutable)",
    # the chart's code ConfigMap (immutable: true; ValidateConfigMapUpdate in kubernetes
    # pkg/apis/core/validation/validation.go: "field is immutable when `immutable` is set")
    "ConfigMap": "the code shipped with --code cannot change under running pods",
}
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
                raise MissingApiError(f"{what}: the cluster has no such API; {_install_hint(what)}") from None
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
        --server-side --force-conflicts`): submitting the same release twice updates it. A
        TrainJob refused because Trainer's cache lacks its new runtime yet is retried for
        RUNTIME_CACHE_WAIT_S; one whose immutable fields would change is one line saying to
        delete and submit again."""
        kind, api_version, name = item["kind"], item["apiVersion"], item["metadata"]["name"]
        what = f"apply {kind} {namespace}/{name}"
        plural = KINDS.get((api_version, kind))
        if plural is None:
            raise ClusterError(f"{what}: no handler for {api_version} {kind}")
        path = f"{collection_path(api_version, plural, namespace)}/{name}"

        def patch():
            return self._request(
                "PATCH",
                path,
                query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
                content_type="application/apply-patch+yaml",
                body=item,
            )

        deadline = time.monotonic() + RUNTIME_CACHE_WAIT_S
        while True:
            try:
                _, status, _ = self._call(what, patch)
                break
            except MissingApiError:
                raise
            except ClusterError as error:
                if kind == "TrainJob" and RUNTIME_NOT_YET in str(error) and time.monotonic() < deadline:
                    time.sleep(0.5)
                    continue
                if kind in IMMUTABLE and "field is immutable" in str(error):
                    release = item["metadata"].get("labels", {}).get(RELEASE_LABEL, "RELEASE")
                    raise ClusterError(
                        f"{what}: {kind} {name} exists, and {IMMUTABLE[kind]}: ddp-ops delete {release} "
                        f"-n {namespace}, then submit again; it resumes from the same checkpoints"
                    ) from None
                raise
        return f"{kind.lower()}/{name} {'created' if status == 201 else 'configured'}"

    def annotation(self, item: dict[str, Any], namespace: str, key: str) -> str | None:
        """An annotation of the object `item` names, as the cluster holds it now; None where
        the object (or its kind) is not there."""
        kind, api_version, name = item["kind"], item["apiVersion"], item["metadata"]["name"]
        plural = KINDS.get((api_version, kind))
        if plural is None:
            return None
        path = f"{collection_path(api_version, plural, namespace)}/{name}"
        try:
            found, _, _ = self._call(f"get {kind} {namespace}/{name}", lambda: self._request("GET", path))
        except ClusterError:  # not found, or no such API yet: apply says which
            return None
        return ((found or {}).get("metadata", {}).get("annotations") or {}).get(key)

    def uninstall(self, release: str, namespace: str) -> list[str]:
        """Delete every object of the chart's kinds labelled as the chart's and `release`'s,
        as `helm uninstall` does; the operator then deletes the job's pods. A kind whose CRD
        is not installed has nothing to delete."""
        deleted = []
        for (api_version, kind), plural in KINDS.items():
            path = collection_path(api_version, plural, namespace)
            try:
                found, _, _ = self._call(
                    f"list {kind} in {namespace}",
                    lambda path=path: self._request(
                        "GET", path, query=[("labelSelector", f"{RELEASE_LABEL}={release},{CHART_LABEL}")]
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

    def _get(self, api_version: str, plural: str, name: str, namespace: str, kind: str) -> dict[str, Any]:
        group, version = api_version.split("/")
        return self._call(
            f"get {kind} {namespace}/{name}",
            lambda: self.custom.get_namespaced_custom_object(group, version, namespace, plural, name),
        )

    def job(self, name: str, namespace: str) -> tuple[str, dict[str, Any]]:
        """The PyTorchJob or, failing that, the TrainJob `name`, and which it is: ddp-ops's
        commands take a job's name, whichever kind it was submitted as."""
        try:
            return "PyTorchJob", self._get(f"{GROUP}/{VERSION}", PLURAL, name, namespace, "PyTorchJob")
        except ClusterError as v1_error:
            try:
                return "TrainJob", self._get(TRAINER_API, "trainjobs", name, namespace, "TrainJob")
            except MissingApiError:
                raise v1_error from None
            except ClusterError as v2_error:
                if isinstance(v1_error, MissingApiError):
                    raise v2_error from None
                raise v1_error from None

    def pods(self, name: str, namespace: str, kind: str = "PyTorchJob") -> list[dict[str, Any]]:
        from kubernetes import client

        selector = (
            f"{LABEL}/job-name={name}" if kind == "PyTorchJob" else f"{JOBSET_LABEL}/jobset-name={name}"
        )
        found = self._call(
            f"list pods of {namespace}/{name}",
            lambda: self.core.list_namespaced_pod(namespace, label_selector=selector),
        )
        return [client.ApiClient().sanitize_for_serialization(pod) for pod in found.items]

    def status(self, name: str, namespace: str) -> JobStatus:
        kind, job = self.job(name, namespace)
        if kind == "PyTorchJob":
            pods = self.pods(name, namespace)
            summary = summarize(job, pods)
            progress, source = self.metrics_progress(pods, summary.rank0_pod, namespace)
            return dataclasses.replace(summary, progress=progress, progress_from=source)
        try:
            jobset = self._get(JOBSET_API, "jobsets", name, namespace, "JobSet")
        except ClusterError:  # not created yet (suspended), or JobSet's API not served
            jobset = None
        return summarize_trainjob(job, jobset, self.pods(name, namespace, "TrainJob"))

    def metrics_progress(
        self, pods: list[dict[str, Any]], first: str | None, namespace: str
    ) -> tuple[dict[str, Any] | None, str]:
        """A PyTorchJob's progress, which it has no status field for: rank 0's series read
        from a pod's metrics port through the API server's pod proxy
        (`/api/v1/namespaces/NS/pods/POD:PORT/proxy/metrics`), the labelled rank 0 pod's
        first (rendezvous may have put rank 0 elsewhere); and where it came from, or why
        there is none."""
        for pod in sorted(pods, key=lambda pod: pod["metadata"]["name"] != first):
            name = pod["metadata"]["name"]
            ports = [
                port["containerPort"]
                for container in pod["spec"]["containers"]
                for port in container.get("ports") or []
                if port.get("name") == "metrics"
            ]
            if not ports:
                return None, f"pod {name} serves no metrics (metrics.port=0): no progress to read"
            try:
                text = self._call(
                    f"read {namespace}/{name}'s metrics through the API server's pod proxy",
                    lambda name=name, port=ports[0]: self.core.connect_get_namespaced_pod_proxy_with_path(
                        f"{name}:{port}", namespace, "metrics"
                    ),
                )
            except ClusterError as error:
                return (
                    None,
                    f"{error} (the job's NetworkPolicy admits the API server as networkPolicy.apiServer)",
                )
            if figures := rank0_figures(text):
                source = f"rank 0's metrics, pod {name} port {ports[0]}"
                progress = progress_from_metrics(figures)
                return progress, source if progress else f"{source}: no progress line yet"
        return None, "no pod serves rank 0's metrics yet"

    def log(self, pod: str, namespace: str, *, follow: bool, container: str = "pytorch") -> Iterator[str]:
        if not follow:
            text = self._call(
                f"log of {namespace}/{pod}",
                lambda: self.core.read_namespaced_pod_log(pod, namespace, container=container),
            )
            yield from text.splitlines()
            return
        stream = self._call(
            f"log of {namespace}/{pod}",
            lambda: self.core.read_namespaced_pod_log(
                pod, namespace, container=container, follow=True, _preload_content=False
            ),
        )
        for line in stream:
            yield line.decode(errors="replace").rstrip("\n")

    def rank0_pod(self, name: str, namespace: str) -> tuple[str, str]:
        """The pod whose log carries the trainer's rank-0 banner, and its trainer container:
        the job-role=master pod (a TrainJob's completion index 0) if it does, else whichever
        of the job's pods does (node ranks follow rendezvous order, not pod names)."""
        kind, _ = self.job(name, namespace)
        container = "pytorch" if kind == "PyTorchJob" else NODE
        selector = (
            rank0_selector(name)
            if kind == "PyTorchJob"
            else f"{JOBSET_LABEL}/jobset-name={name},{INDEX_LABEL}=0"
        )
        labelled = self._call(
            f"find rank 0 of {namespace}/{name}",
            lambda: self.core.list_namespaced_pod(namespace, label_selector=selector),
        ).items
        candidates = [pod.metadata.name for pod in labelled][::-1]  # a re-created pod is listed last
        candidates += [
            p["metadata"]["name"]
            for p in self.pods(name, namespace, kind)
            if p["metadata"]["name"] not in candidates
        ]
        if not candidates:
            raise ClusterError(f"{kind} {namespace}/{name} has no pods yet")
        for pod in candidates:
            if any(BANNER in line for line in self.log(pod, namespace, follow=False, container=container)):
                return pod, container
        return candidates[0], container


def _install_hint(what: str) -> str:
    """What to check when the cluster serves no API for `what`."""
    if "PyTorchJob" in what or "pytorchjobs" in what:
        return (
            "is the Kubeflow training operator v1.9.4 installed (kubectl get crd pytorchjobs.kubeflow.org)?"
        )
    if "TrainJob" in what or "TrainingRuntime" in what or "trainjobs" in what:
        return (
            "is Kubeflow Trainer v2.3 installed (kubectl get crd trainjobs.trainer.kubeflow.org; "
            "k8s/prerequisites/README.md)?"
        )
    return "is its CRD installed?"


def _api_message(error: Any) -> str:
    try:
        return json.loads(error.body).get("message", error.reason)
    except (TypeError, ValueError):
        return str(error.reason)
