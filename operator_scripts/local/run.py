"""Run a rendered job on this machine as its controllers and the kubelet would, each pod as a
process tree: a PyTorchJob as training-operator v1.9.4 runs it, a TrainJob as Trainer v2.3.0,
JobSet v0.12.0 and the Job controller do (`job_rules`): the injected environment, pod names
that resolve only while their pod runs, volumes mapped to folders under the work folder,
restarts and re-creations by the restart and failure policies, the limits they count
against, success and clean-up as the controllers decide them.

Each pod's container runs in a `PodRuntime`: by default a process tree on this machine
(`ProcessRuntime`), or, with `--runtime docker`, a container of the pod's image with the
pod's user, capabilities and read-only root (`docker_runtime.DockerRuntime`). The operator
and kubelet model is the same for both.

Process stand-ins, since there are no pods:
- a pod's network namespace is a loopback address (127.0.0.2, .3, ...), so one such run
  at a time on a host (`process_runtime.claim_host_ports`); each pod runs in a
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
import dataclasses
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

from operator_scripts.controllers.job_rules import ExitOutcome, JobRules, rules_for
from operator_scripts.controllers.pytorchjob_status import JobCondition
from operator_scripts.local.kubelet_probe import ContainerProber
from operator_scripts.local.node_loss import (
    NODE_MONITOR_GRACE_S,
    UNREACHABLE,
    NodeLoss,
    NodeLossPlan,
    toleration_seconds,
)
from operator_scripts.local.pods import HostsTable, LocalError, LocalPod, PodRuntime, prepare
from operator_scripts.local.runtimes.process import ProcessRuntime
from trainer.launcher.process_tree import container_exit_code


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
    kind: str = "PyTorchJob"
    jobset_restarts: int = 0  # a TrainJob's whole-job restarts

    def summary(self) -> str:
        """The run's last line: `job NAME: Succeeded` (a TrainJob: `Complete`) or `job NAME:
        Failed (reason)`, then the restarts counted against the limit."""
        verdict = f"{self.status} ({self.reason})" if self.reason and self.status == "Failed" else self.status
        limit = "no backoffLimit" if self.backoff_limit is None else f"backoffLimit {self.backoff_limit}"
        if self.kind == "TrainJob":
            return (
                f"trainjob {self.job}: {verdict}; {self.restarts} failures counted ({limit}), "
                f"{self.jobset_restarts} JobSet restarts"
            )
        return f"job {self.job}: {verdict}; {self.restarts} restarts counted ({limit})"


def _start(pod: LocalPod, hosts: HostsTable) -> None:
    pod.folder.mkdir(parents=True, exist_ok=True)
    pod.log = open(pod.log_path, "a")  # noqa: SIM115  (closed when the container ends)
    for name in (pod.name, *pod.plan.aliases):
        hosts.set(name, pod.address)
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


def _recreate(pod: LocalPod, start_at: float) -> None:
    """The pod anew, as a controller creates it: Pending until `start_at`, restartCount 0,
    new emptyDirs."""
    pod.recreations += 1
    pod.phase, pod.start_at, pod.restarts, pod.restart_at = "Pending", start_at, 0, None
    for folder in pod.empty_dirs:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        folder.chmod(0o777)


def _advance(
    pod: LocalPod,
    pods: list[LocalPod],
    rules: JobRules,
    hosts: HostsTable,
    now: float,
    notify: Callable[[str], None],
) -> str:
    """One kubelet and controller pass over a pod; returns a job failure's reason."""
    if pod.node is not None:
        if reason := _advance_node(pod, pods, rules, hosts, now, notify):
            return reason
        if pod.node is not None and pod.node.kubelet_down:  # nothing on the node runs
            return ""
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
    pod.exit_code = container_exit_code(returncode)
    _ended(pod, hosts)
    if pod.deleting:  # the kubelet ended a pod deleted meanwhile: the controller creates it anew
        outcome, pod.deleting = rules.on_deleted(pod.state, pod.deleting), ""
    else:
        outcome = rules.on_exit(pod.state, pod.exit_code, [p.state for p in pods])
    return _apply(outcome, pod, pods, now, notify)


def _ended(pod: LocalPod, hosts: HostsTable) -> None:
    """The pod's container is gone: not Ready (its Service has no endpoint), no probes."""
    for name in (pod.name, *pod.plan.aliases):
        hosts.set(name, None)
    pod.process, pod.kill_at = None, None
    if pod.prober is not None:
        pod.prober.stop()
        pod.prober = None
    pod.log.close()


def _apply(
    outcome: ExitOutcome, pod: LocalPod, pods: list[LocalPod], now: float, notify: Callable[[str], None]
) -> str:
    """Carry out what the controller decided about a pod; a job failure's reason, or ""."""
    if outcome.message:
        notify(outcome.message)
    if outcome.action == "restart":
        pod.restart_at = now + outcome.delay
    elif outcome.action == "recreate":
        _recreate(pod, now + outcome.delay)
    elif outcome.action == "restart-all":
        for other in pods:
            if other.process is not None:
                _stop(other)
            _recreate(other, now)
    elif outcome.action == "succeeded":
        pod.phase = "Succeeded"
    else:
        pod.phase = "Failed"
        return outcome.reason
    return ""


def lose_node(pod: LocalPod, plan: NodeLossPlan, now: float, grace_s: float, podgc_epoch: float) -> None:
    """The pod's node stops answering now: its processes frozen at once, its kubelet silent
    (no probes, no exits reported), and the control plane's answer on its clock (node_loss)."""
    if pod.prober is not None:
        pod.prober.stop()
        pod.prober = None
    if pod.process is not None:
        pod.runtime.freeze(pod)
    pod.node = NodeLoss(plan, now, grace_s, toleration_seconds(pod.plan.template), podgc_epoch)


def _advance_node(
    pod: LocalPod,
    pods: list[LocalPod],
    rules: JobRules,
    hosts: HostsTable,
    now: float,
    notify: Callable[[str], None],
) -> str:
    """What the control plane does about the pod's silent node, as it comes due."""
    loss = pod.node
    for change in loss.due(now):
        silent = f"{now - loss.frozen_at:.0f}s"
        if change == "not-ready":
            for name in (pod.name, *pod.plan.aliases):
                hosts.set(name, None)
            notify(
                f"node of pod {pod.name}: no status for {loss.grace_s:g}s (node-monitor-grace-period): "
                f"NotReady, tainted {UNREACHABLE}:NoExecute; the pod is not Ready: its name stops resolving"
            )
        elif change == "evicted":
            notify(
                f"pod {pod.name} evicted after its {loss.toleration_s:g}s toleration of {UNREACHABLE}: "
                "Terminating until its node answers or is deleted; no replacement is created while it exists"
            )
        elif change == "answers":
            pod.node = None
            if pod.process is not None:
                pod.runtime.thaw(pod)
                for name in (pod.name, *pod.plan.aliases):
                    hosts.set(name, pod.address)
                pod.prober = ContainerProber.of(pod.plan.container, pod.address)
            notify(f"node of pod {pod.name} answers again after {silent}: the pod goes on")
        elif change == "answers-evicted":
            pod.node, pod.deleting = None, "evicted from its unreachable node"
            notify(
                f"node of pod {pod.name} answers again after {silent}: its kubelet ends the evicted pod "
                "(SIGTERM, then SIGKILL after its grace period)"
            )
            if pod.process is not None:
                pod.runtime.thaw(pod)
                kill_pod(pod, signal.SIGTERM)
                pod.kill_at = now + pod.plan.template["spec"].get("terminationGracePeriodSeconds", 30)
            else:
                return _apply(rules.on_deleted(pod.state, pod.deleting), pod, pods, now, notify)
        elif change == "node-deleted":
            if pod.process is not None:  # the VM is gone, and all that ran on it
                kill_pod(pod, signal.SIGKILL)
                pod.process.wait()
                _ended(pod, hosts)
            notify(
                f"node of pod {pod.name} deleted after {silent}: PodGC force-deletes its pods "
                f"{loss.orphan_at - now:.0f}s from now (a 40s quarantine on its 20s period)"
            )
        elif change == "pod-deleted":
            pod.node = None
            return _apply(
                rules.on_deleted(pod.state, "force-deleted by PodGC: its node no longer exists"),
                pod,
                pods,
                now,
                notify,
            )
    return ""


def resolve_pod(job_name: str, pods: list[LocalPod], option: str, key: str, seconds: float) -> str:
    """`worker-0` or a full pod name -> the pod's name; an unknown pod is an error."""
    names = {pod.name for pod in pods}
    name = key if key in names else f"{job_name}-{key}"
    if name not in names:
        raise LocalError(f"{option} {key}={seconds:g}: no such pod; pods are {', '.join(sorted(names))}")
    return name


def resolve_delays(job_name: str, pods: list[LocalPod], delays: dict[str, float]) -> dict[str, float]:
    """`worker-0=75` or a full pod name -> that pod's start delay."""
    return {resolve_pod(job_name, pods, "--delay", key, seconds): seconds for key, seconds in delays.items()}


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
    node_losses: list[NodeLossPlan] = (),
    node_grace_s: float = NODE_MONITOR_GRACE_S,
) -> LocalOutcome:
    """Run the job until its controller would call it finished, apply the clean-up it does
    then, stop whatever still runs, and report. Each of `node_losses` freezes a pod's node
    at its time (node_loss), with `node_grace_s` as the node controller's grace period."""
    try:
        rules = rules_for(objects)
    except ValueError as error:
        raise LocalError(str(error)) from None
    workdir.mkdir(parents=True, exist_ok=True)
    runtime = runtime or ProcessRuntime()
    pods = prepare(objects, workdir, runtime, host_env, plans=rules.plans())
    start_delays = resolve_delays(rules.name, pods, delays or {})
    losses = [
        dataclasses.replace(plan, pod=resolve_pod(rules.name, pods, "--freeze-node", plan.pod, plan.at_s))
        for plan in node_losses
    ]
    hosts = HostsTable(workdir / "etc-hosts")
    rank0 = next(p for p in pods if p.plan.is_rank0)
    stop = threading.Event()
    follower = None
    condition = JobCondition("Running")
    deleted: list[str] = []
    kept: list[str] = []
    runtime.check(pods, hosts)
    try:
        if stream is not None:
            follower = threading.Thread(target=_follow, args=(rank0.log_path, stream, stop), daemon=True)
            follower.start()
        started = time.monotonic()
        for pod in pods:
            pod.start_at = started + start_delays.get(pod.name, 0.0)
        while condition.status == "Running":
            now = time.monotonic()
            if now - started > timeout:
                condition = JobCondition("Failed", f"DeadlineExceeded: still running after {timeout:.0f}s")
                break
            for plan in [plan for plan in losses if now - started >= plan.at_s]:
                losses.remove(plan)
                frozen = next(pod for pod in pods if pod.name == plan.pod)
                notify(f"node of pod {frozen.name} froze: its processes and its kubelet stop")
                lose_node(frozen, plan, now, node_grace_s, started)
            failures: list[str] = []
            for pod in pods:  # the controller reconciles on each pod's change, not once per round
                if reason := _advance(pod, pods, rules, hosts, now, notify):
                    failures.append(reason)
                condition = rules.condition([pod.state for pod in pods], "; ".join(failures))
                if condition.status != "Running":
                    break
            if on_tick is not None:
                on_tick(pods)
            time.sleep(0.1)
        restarts = rules.counted_restarts([pod.state for pod in pods])
        deleted, why = rules.to_delete([pod.state for pod in pods])
        for pod in pods:
            if pod.name in deleted and pod.process is not None:
                notify(f"pod {pod.name} deleted ({why})")
                _stop(pod)
        kept = [
            pod.name
            for pod in pods
            if pod.name not in deleted and (pod.process is not None or pod.restart_at is not None)
        ]
        for name in kept:
            notify(
                f"pod {name} kept running ({why}): on a cluster "
                "it holds its resources until deleted; stopping it as this local run ends"
            )
    finally:
        for pod in pods:
            if pod.prober is not None:
                pod.prober.stop()
            if pod.process is not None and pod.node is not None:  # a frozen node: nothing graceful
                kill_pod(pod, signal.SIGKILL)
            if pod.process is not None:
                _stop(pod)
            if pod.log is not None:
                pod.log.close()
        stop.set()
        if follower is not None:
            follower.join(timeout=5)
        runtime.release()
    return LocalOutcome(
        job=rules.name,
        status=condition.status,
        reason=condition.reason,
        restarts=restarts,
        backoff_limit=rules.backoff_limit,
        recreations=sum(pod.recreations for pod in pods),
        exit_codes={pod.name: pod.exit_code for pod in pods},
        logs={pod.name: pod.log_path for pod in pods},
        deleted=deleted,
        kept_running=kept,
        kind=rules.kind,
        jobset_restarts=rules.jobset_restarts,
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
