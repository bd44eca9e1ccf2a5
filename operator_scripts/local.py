"""Run a rendered PyTorchJob on this machine as training-operator v1.9.4 and the kubelet
would, each pod as a process tree: the operator's defaults and injected environment, pod
names that resolve only while their pod runs, volumes mapped to folders under the work
folder, restarts and re-creations by the job's restartPolicy, restarts summed against
backoffLimit, success and clean-up as the operator decides them (`operator_status`).

Each pod's container runs in a `PodRuntime`: by default a process tree on this machine
(`ProcessRuntime`), or, with `--runtime docker`, a container of the pod's image with the
pod's user, capabilities and read-only root (`docker_runtime.DockerRuntime`). The operator
and kubelet model is the same for both.

Process stand-ins, since there are no pods:
- a pod's network namespace is a loopback address (127.0.0.2, .3, ...); each pod runs in a
  UTS and mount namespace of its own (`unshare`) whose host name is the pod's name and
  whose /etc/hosts is the job's table of running pods (`pod_sandbox`), so that a pod's
  name resolves exactly while its process runs, as a headless Service's does while its pod
  is Ready (common/service.go:229-244: no publishNotReadyAddresses);
- the trainer gets `--set metrics.address=<address>`, so that every pod can serve its port;
- every volume is a folder under `workdir/<pod>/volumes`, a PVC one under `workdir/pvc`,
  and paths under mount points are rewritten to them in the environment, the arguments
  and the ConfigMap files, so a run writes nothing outside `workdir`; emptyDirs survive a
  container restart and are emptied when the operator re-creates a pod, as on a node;
- `secretKeyRef` values are read from this process's environment variable of that key;
- the Master's `init-pytorch` container is not run.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from operator_scripts.kubelet_probe import ContainerProber
from operator_scripts.local_pods import HostsTable, LocalError, LocalPod, PodRuntime, prepare
from operator_scripts.operator_env import with_defaults
from operator_scripts.operator_status import (
    JobCondition,
    after_exit,
    counted_restarts,
    job_condition,
    pods_to_delete,
    restart_delay,
)
from operator_scripts.process_runtime import ProcessRuntime
from trainer.distributed.launch import container_exit_code


@dataclass(frozen=True)
class LocalOutcome:
    """What the operator would report at the end, and what its clean-up did."""

    job: str
    status: str
    reason: str
    restarts: int
    backoff_limit: int | None
    recreations: int
    exit_codes: dict[str, int | None]
    logs: dict[str, Path]
    deleted: list[str]
    kept_running: list[str]

    def summary(self) -> str:
        """The run's last line: `job NAME: Succeeded` or `job NAME: Failed (reason)`, then the
        restarts counted against the limit."""
        verdict = f"{self.status} ({self.reason})" if self.reason else self.status
        limit = "no backoffLimit" if self.backoff_limit is None else f"backoffLimit {self.backoff_limit}"
        return f"job {self.job}: {verdict}; {self.restarts} restarts counted ({limit})"


def _start(pod: LocalPod, hosts: HostsTable) -> None:
    pod.folder.mkdir(parents=True, exist_ok=True)
    pod.log = open(pod.log_path, "a")  # noqa: SIM115  (closed when the container ends)
    hosts.set(pod.name, pod.address)
    pod.process = pod.runtime.launch(pod, hosts, pod.log)
    pod.phase, pod.restart_at = "Running", None
    pod.prober = ContainerProber.of(pod.plan.container, pod.address)


def _check_liveness(pod: LocalPod, now: float, notify: Callable[[str], None]) -> None:
    """The kubelet's answer to a failed startup or liveness probe: kill the container, SIGTERM then,
    after the pod's grace period, SIGKILL; its exit is then handled as any other."""
    if pod.kill_at is not None:
        if now >= pod.kill_at:
            kill_pod(pod, signal.SIGKILL)
            pod.kill_at = float("inf")
        return
    if pod.prober is None or pod.prober.failed is None:
        return
    notify(f"pod {pod.name}: {pod.prober.failed}; the kubelet kills its container")
    kill_pod(pod, signal.SIGTERM)
    grace = pod.prober.grace_s
    pod.kill_at = now + (
        pod.plan.template["spec"].get("terminationGracePeriodSeconds", 30) if grace is None else grace
    )


def _follow(path: Path, sink: Callable[[str], None], stop: threading.Event) -> None:
    """Stream a pod's log as it grows, like `kubectl logs -f`."""
    while not path.exists() and not stop.is_set():
        time.sleep(0.05)
    if not path.exists():
        return
    with open(path) as handle:
        while True:
            line = handle.readline()
            if line:
                sink(line.rstrip("\n"))
            elif stop.is_set():
                return
            else:
                time.sleep(0.05)


def _advance(pod: LocalPod, hosts: HostsTable, now: float, notify: Callable[[str], None]) -> str:
    """One kubelet and operator pass over a pod; returns a permanent failure's reason."""
    if pod.phase == "Pending" and now >= pod.start_at:
        _start(pod, hosts)
        return ""
    if pod.phase != "Running":
        return ""
    if pod.process is None:  # waiting out the kubelet's back-off
        if now >= pod.restart_at:
            pod.restarts += 1
            _start(pod, hosts)
        return ""
    returncode = pod.process.poll()
    if returncode is None:
        _check_liveness(pod, now, notify)
        return ""
    code = pod.exit_code = container_exit_code(returncode)
    hosts.set(pod.name, None)  # not Ready: its Service has no endpoint
    pod.process, pod.kill_at = None, None
    if pod.prober is not None:
        pod.prober.stop()
        pod.prober = None
    pod.log.close()
    action = after_exit(pod.plan.restart_policy, code)
    if action == "restart":
        delay = restart_delay(pod.restarts + 1)
        pod.restart_at = now + delay
        notify(f"pod {pod.name} exited with code {code}; restart {pod.restarts + 1} in {delay:.0f}s")
    elif action == "recreate":
        pod.recreations += 1
        pod.phase, pod.start_at, pod.restarts = "Pending", now, 0
        for folder in pod.empty_dirs:  # a new pod gets new emptyDirs
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            folder.chmod(0o777)
        notify(f"pod {pod.name} exited with code {code} (retryable); the operator re-creates it")
    elif action == "succeeded":
        pod.phase = "Succeeded"
    else:
        pod.phase = "Failed"
        notify(f"pod {pod.name} failed with exit code {code}")
        reason = f"pod {pod.name} exited with code {code}"
        return reason + (", not retryable" if pod.plan.restart_policy == "ExitCode" else "")
    return ""


def resolve_delays(job_name: str, pods: list[LocalPod], delays: dict[str, float]) -> dict[str, float]:
    """`worker-0=75` or a full pod name -> that pod's start delay; an unknown pod is an error."""
    names = {pod.name for pod in pods}
    resolved = {}
    for key, seconds in delays.items():
        name = key if key in names else f"{job_name}-{key}"
        if name not in names:
            raise LocalError(f"--delay {key}={seconds:g}: no such pod; pods are {', '.join(sorted(names))}")
        resolved[name] = seconds
    return resolved


def run(
    objects: list[dict[str, Any]],
    workdir: Path,
    *,
    timeout: float = 3600,
    delays: dict[str, float] | None = None,
    stream: Callable[[str], None] | None = print,
    notify: Callable[[str], None] = lambda line: print(f"local: {line}", file=sys.stderr, flush=True),
    on_tick: Callable[[list[LocalPod]], None] | None = None,
    host_env: dict[str, str] | None = None,
    runtime: PodRuntime | None = None,
) -> LocalOutcome:
    """Run the job until the operator would call it Succeeded or Failed, apply its
    cleanPodPolicy, stop whatever still runs, and report."""
    (job,) = [with_defaults(item) for item in objects if item.get("kind") == "PyTorchJob"]
    run_policy = job["spec"]["runPolicy"]
    workdir.mkdir(parents=True, exist_ok=True)
    runtime = runtime or ProcessRuntime()
    pods = prepare(objects, workdir, runtime, host_env)
    start_delays = resolve_delays(job["metadata"]["name"], pods, delays or {})
    hosts = HostsTable(workdir / "etc-hosts")
    runtime.check(pods, hosts)
    rank0 = next(p for p in pods if "training.kubeflow.org/job-role" in p.plan.labels)
    stop = threading.Event()
    follower = None
    if stream is not None:
        follower = threading.Thread(target=_follow, args=(rank0.log_path, stream, stop), daemon=True)
        follower.start()
    started = time.monotonic()
    for pod in pods:
        pod.start_at = started + start_delays.get(pod.name, 0.0)
    condition = JobCondition("Running")
    deleted: list[str] = []
    kept: list[str] = []
    try:
        while condition.status == "Running":
            now = time.monotonic()
            if now - started > timeout:
                condition = JobCondition("Failed", f"DeadlineExceeded: still running after {timeout:.0f}s")
                break
            failures: list[str] = []
            for pod in pods:  # the operator reconciles on each pod's change, not once per round
                if reason := _advance(pod, hosts, now, notify):
                    failures.append(reason)
                states = [pod.state for pod in pods]
                condition = job_condition(
                    job, states, permanent_failure="; ".join(failures), new_failure=bool(failures)
                )
                if condition.status != "Running":
                    break
            if on_tick is not None:
                on_tick(pods)
            time.sleep(0.1)
        restarts = counted_restarts([pod.state for pod in pods])
        deleted = pods_to_delete(run_policy["cleanPodPolicy"], [pod.state for pod in pods])
        for pod in pods:
            if pod.name in deleted and pod.process is not None:
                notify(f"pod {pod.name} deleted (cleanPodPolicy {run_policy['cleanPodPolicy']})")
                _stop(pod)
        kept = [
            pod.name
            for pod in pods
            if pod.name not in deleted and (pod.process is not None or pod.restart_at is not None)
        ]
        for name in kept:
            notify(
                f"pod {name} kept running (cleanPodPolicy {run_policy['cleanPodPolicy']}): on a cluster "
                "it holds its resources until deleted; stopping it as this local run ends"
            )
    finally:
        for pod in pods:
            if pod.prober is not None:
                pod.prober.stop()
            if pod.process is not None:
                _stop(pod)
            if pod.log is not None:
                pod.log.close()
        stop.set()
        if follower is not None:
            follower.join(timeout=5)
    return LocalOutcome(
        job=job["metadata"]["name"],
        status=condition.status,
        reason=condition.reason,
        restarts=restarts,
        backoff_limit=run_policy.get("backoffLimit"),
        recreations=sum(pod.recreations for pod in pods),
        exit_codes={pod.name: pod.exit_code for pod in pods},
        logs={pod.name: pod.log_path for pod in pods},
        deleted=deleted,
        kept_running=kept,
    )


def kill_pod(pod: LocalPod, sig: int = signal.SIGKILL) -> None:
    """Signal every process of the pod, as a container's end does."""
    if pod.process is not None:
        pod.runtime.signal(pod, sig)


def freeze_pod(pod: LocalPod) -> None:
    """Freeze every process of the pod at once, as a hung node leaves them: SIGSTOP to the
    process runtime's tree, `docker pause` (the cgroup freezer) to a container."""
    if pod.process is not None:
        pod.runtime.freeze(pod)


def _stop(pod: LocalPod) -> None:
    """Delete a pod: SIGTERM its processes, SIGKILL what is left after its grace period."""
    grace = pod.plan.template["spec"].get("terminationGracePeriodSeconds", 30)
    kill_pod(pod, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        pod.process.wait(timeout=grace)
    kill_pod(pod, signal.SIGKILL)
    pod.exit_code = container_exit_code(pod.process.wait())
    pod.process = None
