"""What the kubelet and the job's controller do to one pod, pass by pass: start its container,
probe it, see it exit, restart or re-create it as the controller decides, stop it, and
answer its node's silence as the control plane does (node_loss)."""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable

from operator_scripts.controllers.job_rules import ExitOutcome, JobRules
from operator_scripts.local.kubelet_probe import ContainerProber
from operator_scripts.local.node_loss import UNREACHABLE, NodeLoss, NodeLossPlan, toleration_seconds
from operator_scripts.local.pods import HostsTable, LocalPod
from operator_scripts.local.termination import termination_message
from trainer.launcher.process_tree import container_exit_code


def start_pod(pod: LocalPod, hosts: HostsTable) -> None:
    pod.folder.mkdir(parents=True, exist_ok=True)
    pod.message_file.write_bytes(b"")  # each container instance gets an empty one, which
    pod.message_file.chmod(0o666)  # a non-root container may write (the kubelet's chmod)
    pod.log = open(pod.log_path, "a")  # noqa: SIM115  (closed when the container ends)
    for name in (pod.name, *pod.plan.aliases):
        hosts.set(name, pod.address)
    pod.process = pod.runtime.launch(pod, hosts, pod.log)
    pod.started_at = time.time()  # its container's startedAt
    pod.phase, pod.restart_at = "Running", None
    pod.prober = ContainerProber.of(pod.plan.container, pod.address)


def check_liveness(pod: LocalPod, now: float, notify: Callable[[str], None]) -> None:
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


def recreate_pod(pod: LocalPod, start_at: float) -> None:
    """The pod anew, as a controller creates it: Pending until `start_at`, restartCount 0,
    new emptyDirs."""
    pod.recreations += 1
    pod.phase, pod.start_at, pod.restarts, pod.restart_at = "Pending", start_at, 0, None
    pod.created_at, pod.started_at = time.time(), None
    for folder in pod.empty_dirs:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        folder.chmod(0o777)


def advance_pod(
    pod: LocalPod,
    pods: list[LocalPod],
    rules: JobRules,
    hosts: HostsTable,
    now: float,
    notify: Callable[[str], None],
) -> str:
    """One kubelet and controller pass over a pod; returns a job failure's reason."""
    if pod.node is not None:
        if reason := advance_node(pod, pods, rules, hosts, now, notify):
            return reason
        if pod.node is not None and pod.node.kubelet_down:  # nothing on the node runs
            return ""
    if pod.phase == "Pending" and now >= pod.start_at:
        start_pod(pod, hosts)
        return ""
    if pod.phase != "Running":
        return ""
    if pod.process is None:  # waiting out the kubelet's back-off
        if now >= pod.restart_at:
            pod.restarts += 1
            start_pod(pod, hosts)
        return ""
    returncode = pod.process.poll()
    if returncode is None:
        check_liveness(pod, now, notify)
        return ""
    pod.exit_code = container_exit_code(returncode)
    pod_ended(pod, hosts)
    pod.message = termination_message(pod.plan.container, pod.exit_code, pod.message_file, pod.log_path)
    if pod.deleting:  # the kubelet ended a pod deleted meanwhile: the controller creates it anew
        outcome, pod.deleting = rules.on_deleted(pod.state, pod.deleting), ""
    else:
        outcome = rules.on_exit(pod.state, pod.exit_code, [p.state for p in pods])
    return apply_outcome(outcome, pod, pods, now, notify)


def pod_ended(pod: LocalPod, hosts: HostsTable) -> None:
    """The pod's container is gone: not Ready (its Service has no endpoint), no probes."""
    for name in (pod.name, *pod.plan.aliases):
        hosts.set(name, None)
    pod.process, pod.kill_at = None, None
    if pod.prober is not None:
        pod.prober.stop()
        pod.prober = None
    pod.log.close()


def apply_outcome(
    outcome: ExitOutcome, pod: LocalPod, pods: list[LocalPod], now: float, notify: Callable[[str], None]
) -> str:
    """Carry out what the controller decided about a pod; a job failure's reason, or ""."""
    if outcome.message:
        notify(outcome.message)
    if outcome.action == "restart":
        pod.restart_at = now + outcome.delay
    elif outcome.action == "recreate":
        recreate_pod(pod, now + outcome.delay)
    elif outcome.action == "restart-all":
        stop_pods(pods)
        for other in pods:
            recreate_pod(other, now)
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


def advance_node(
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
                return apply_outcome(rules.on_deleted(pod.state, pod.deleting), pod, pods, now, notify)
        elif change == "node-deleted":
            if pod.process is not None:  # the VM is gone, and all that ran on it
                kill_pod(pod, signal.SIGKILL)
                pod.process.wait()
                pod_ended(pod, hosts)
            notify(
                f"node of pod {pod.name} deleted after {silent}: PodGC force-deletes its pods "
                f"{loss.orphan_at - now:.0f}s from now (a 40s quarantine on its 20s period)"
            )
        elif change == "pod-deleted":
            pod.node = None
            return apply_outcome(
                rules.on_deleted(pod.state, "force-deleted by PodGC: its node no longer exists"),
                pod,
                pods,
                now,
                notify,
            )
    return ""


def kill_pod(pod: LocalPod, sig: int = signal.SIGKILL) -> None:
    """Signal every process of the pod, as a container's end does."""
    if pod.process is not None:
        pod.runtime.signal(pod, sig)


def freeze_pod(pod: LocalPod) -> None:
    """Freeze every process of the pod at once, as a hung node leaves them: SIGSTOP to the
    process runtime's tree, `docker pause` (the cgroup freezer) to a container."""
    if pod.process is not None:
        pod.runtime.freeze(pod)


def stop_pods(
    pods: list[LocalPod],
    hurry: Callable[[], bool] = lambda: False,
    notify: Callable[[str], None] | None = None,
) -> None:
    """Delete pods at once, as the kubelet ends a deleted job's pods: SIGTERM to every one,
    then SIGKILL to each still running after its own grace period (its
    terminationGracePeriodSeconds), or as soon as `hurry()` says so. A pod whose node is
    frozen gets SIGKILL straight away (after a thaw, which a paused container needs before it
    can die): nothing there could answer a SIGTERM. `notify` gets one line per pod."""
    started = time.monotonic()
    running = [pod for pod in pods if pod.process is not None]
    grace = {pod.name: pod.plan.template["spec"].get("terminationGracePeriodSeconds", 30) for pod in running}
    how = {pod.name: "SIGTERM" for pod in running}
    for pod in running:
        if pod.node is not None:
            pod.runtime.thaw(pod)
            kill_pod(pod, signal.SIGKILL)
            how[pod.name] = "SIGKILL: its node is frozen"
        else:
            kill_pod(pod, signal.SIGTERM)
    while running:
        elapsed = time.monotonic() - started
        for pod in list(running):
            if pod.process.poll() is None and how[pod.name] == "SIGTERM":
                if elapsed >= grace[pod.name]:
                    how[pod.name] = f"SIGTERM, SIGKILL after its {grace[pod.name]:g}s grace period"
                elif hurry():
                    how[pod.name] = f"SIGTERM, SIGKILL {elapsed:.1f}s in: a second signal cut its grace short"
                if how[pod.name] != "SIGTERM":
                    kill_pod(pod, signal.SIGKILL)
            if pod.process.poll() is not None:
                running.remove(pod)
                _container_ended(pod)
                if notify is not None:
                    notify(
                        f"pod {pod.name} stopped ({how[pod.name]}): "
                        f"exit code {pod.exit_code} after {elapsed:.1f}s"
                    )
        time.sleep(0.05 if running else 0)


def _container_ended(pod: LocalPod) -> None:
    """What the pod's status says of a container the kubelet stopped."""
    pod.exit_code = container_exit_code(pod.process.wait())
    pod.process = None
    pod.message = termination_message(pod.plan.container, pod.exit_code, pod.message_file, pod.log_path)
