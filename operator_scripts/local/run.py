"""Run a rendered job on this machine as its controllers and the kubelet would, each pod as a
process tree: a PyTorchJob as training-operator v1.9.4 runs it, a TrainJob as Trainer v2.3.0,
JobSet v0.12.0 and the Job controller do (`job_rules`): the injected environment, pod names
that resolve only while their pod runs, volumes mapped to folders under the work folder,
restarts and re-creations by the restart and failure policies, the limits they count
against, success and clean-up as the controllers decide them.

Each pod's container runs in a `PodRuntime`: by default a process tree on this machine
(`ProcessRuntime`), or, with `--runtime docker`, a container of the pod's image with the
pod's user, capabilities and read-only root (`runtimes.docker.DockerRuntime`). The operator
and kubelet model is the same for both.

Process stand-ins, since there are no pods:
- as root, a pod's network namespace is its own, on the job's pod network (10.213.0.0/24 by
  default: this machine .1, the pods .2, .3, ...), where the job's NetworkPolicy holds as a
  CNI enforces it (`pod_network`, `network_policy`); without root it is a loopback address
  (127.0.0.2, .3, ...) on this host's network, one such run at a time
  (`runtimes.process.claim_host_ports`), the policy not enforced, and the trainer gets
  `--set metrics.address=<address>` so that every pod can serve its port;
- each pod runs in a UTS and mount namespace of its own (`unshare`) whose host name is the
  pod's name and whose /etc/hosts is the job's table of running pods (`runtimes.sandbox`),
  so that a pod's name resolves exactly while its process runs, as a headless Service's does
  while its pod is Ready (common/service.go:229-244: no publishNotReadyAddresses);
- every volume is a folder under `workdir/<pod>/volumes`, a PVC one under `workdir/pvc`,
  and paths under mount points are rewritten to them in the environment, the arguments
  and the ConfigMap files, so a run writes nothing outside `workdir`; emptyDirs survive a
  container restart and are emptied when the operator re-creates a pod, as on a node;
- the Secrets a pod reads are folders given to the run (`--secret NAME=FOLDER`), a file per
  key: a Secret volume is written out as the kubelet projects it (its items, mode and fsGroup),
  and a `secretKeyRef` is read from there, else from this process's variable of that key; the
  pods inherit no AWS_* variable of this process;
- the Master's `init-pytorch` container is not run.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from operator_scripts.cluster.status import failure_line
from operator_scripts.controllers.job_rules import rules_for
from operator_scripts.controllers.pytorchjob_status import JobCondition
from operator_scripts.local.interruption import Interruption
from operator_scripts.local.kubelet import advance_pod, lose_node, stop_pods
from operator_scripts.local.leftovers import check_no_leftovers
from operator_scripts.local.network_policy import JobNetwork
from operator_scripts.local.node_loss import (
    NODE_MONITOR_GRACE_S,
    NodeLossPlan,
)
from operator_scripts.local.pods import HostsTable, LocalError, LocalPod, PodRuntime, prepare
from operator_scripts.local.runtimes.process import ProcessRuntime
from operator_scripts.local.status_server import HOST, LABELS, NAMESPACE, LocalStatusServer


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
    messages: dict[str, str] = field(default_factory=dict)  # each pod's last termination message
    trainer_status: dict[str, Any] | None = None  # a TrainJob's status.trainerStatus, as last posted
    # each pod's creation and its container's latest start, wall clock (its status's times)
    starts: dict[str, tuple[float, float | None]] = field(default_factory=dict)
    rank0: str = ""  # the pod whose log it streamed
    interrupted: str = ""  # the signal that ended the run before its job ended (SIGTERM, ...)

    def start_line(self) -> str | None:
        """Rank 0's pod's start before its trainer's own split (the trainer's `start-up` line):
        created to its container's start, where a cluster schedules and pulls the image."""
        created, started = self.starts.get(self.rank0, (0.0, None))
        if started is None:
            return None
        return (
            f"start of pod {self.rank0}: its container started {started - created:.1f}s after the pod's "
            "creation (--delay stands for scheduling and the image pull); the trainer's split is its "
            "start-up line"
        )

    def summary(self) -> str:
        """The run's last line: `job NAME: Succeeded` (a TrainJob: `Complete`) or `job NAME:
        Failed (reason)`, then the restarts counted against the limit."""
        verdict = f"{self.status} ({self.reason})" if self.reason and self.status == "Failed" else self.status
        limit = "no backoffLimit" if self.backoff_limit is None else f"backoffLimit {self.backoff_limit}"
        if self.interrupted:
            verdict = f"stopped by {self.interrupted} while {verdict}, every pod with it"
        if self.kind == "TrainJob":
            return (
                f"trainjob {self.job}: {verdict}; {self.restarts} failures counted ({limit}), "
                f"{self.jobset_restarts} JobSet restarts"
            )
        return f"job {self.job}: {verdict}; {self.restarts} restarts counted ({limit})"

    def failed_pods(self) -> list[str]:
        """For each pod whose container last exited non-zero, `kubectl describe pod`'s view:
        its exit code and its termination message's last line."""
        codes = self.exit_codes.items()
        return [failure_line(name, code, self.messages.get(name, "")) for name, code in codes if code]


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
    secrets: dict[str, Path] | None = None,
    runtime: PodRuntime | None = None,
    node_losses: list[NodeLossPlan] = (),
    node_grace_s: float = NODE_MONITOR_GRACE_S,
    status_server: bool = True,
    interruption: Interruption | None = None,
) -> LocalOutcome:
    """Run the job until its controller would call it finished, apply the clean-up it does
    then, stop whatever still runs, and report. Each of `node_losses` freezes a pod's node
    at its time (node_loss), with `node_grace_s` as the node controller's grace period;
    `secrets` are the Secrets the cluster would hold, each a folder of its keys. A TrainJob
    gets Trainer's status server (`status_server`; the TrainJobStatus gate on) where the
    runtime can place it among the pods. A signal counted by `interruption` ends the run as
    the job's deletion would: every pod stopped at once, each after its grace period."""
    interruption = interruption or Interruption()
    try:
        rules = rules_for(objects)
    except ValueError as error:
        raise LocalError(str(error)) from None
    workdir.mkdir(parents=True, exist_ok=True)
    runtime = runtime or ProcessRuntime()
    plans, status = rules.plans(), None
    if status_server and rules.kind == "TrainJob" and not runtime.hosts_control_plane:
        notify("no Trainer status server for this runtime: the TrainJob's status gets no progress")
    elif status_server and rules.kind == "TrainJob":
        (trainjob,) = [item for item in objects if item.get("kind") == "TrainJob"]
        status = LocalStatusServer(trainjob, workdir / "trainer-status-server")
        plans, objects = status.inject(plans), [*objects, *status.config_maps()]
    pods = prepare(
        objects, workdir, runtime, host_env, plans=plans, secrets=secrets, tokens=status and status.tokens
    )
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
    check_no_leftovers(workdir)
    notify(runtime.check(pods, hosts, JobNetwork.of(objects)))
    try:
        if status is not None:
            address, prefix = runtime.control_plane("trainer-status-server", NAMESPACE, LABELS)
            status.start(address, prefix)
            hosts.set(HOST, address)
        if stream is not None:
            follower = threading.Thread(target=_follow, args=(rank0.log_path, stream, stop), daemon=True)
            follower.start()
        started = time.monotonic()
        for pod in pods:
            pod.start_at = started + start_delays.get(pod.name, 0.0)
            pod.created_at = time.time()
        while condition.status == "Running" and not interruption.first:
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
                if reason := advance_pod(pod, pods, rules, hosts, now, notify):
                    failures.append(reason)
                condition = rules.condition([pod.state for pod in pods], "; ".join(failures))
                if condition.status != "Running":
                    break
            if on_tick is not None:
                on_tick(pods)
            time.sleep(0.1)
        restarts = rules.counted_restarts([pod.state for pod in pods])
        interrupted = interruption.name()
        if interrupted:  # every pod goes, each said as it ends; a second signal hurries them
            notify(
                f"got {interrupted}: every pod stops as a deleted job's does (SIGTERM, its grace "
                "period, SIGKILL); a second signal cuts the grace short"
            )
            deleted, why = [pod.name for pod in pods], f"ddp-ops local got {interrupted}"
        else:  # the controller's clean-up; any signal now hurries it
            deleted, why = rules.to_delete([pod.state for pod in pods])
            for pod in pods:
                if pod.name in deleted and pod.process is not None:
                    notify(f"pod {pod.name} deleted ({why})")
        stop_pods(
            [pod for pod in pods if pod.name in deleted],
            hurry=lambda: interruption.since(1 if interrupted else 0),
            notify=notify if interrupted else None,
        )
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
        signals = len(interruption.received)
        stop_pods(pods, hurry=lambda: interruption.since(signals))
        for pod in pods:
            if pod.log is not None:
                pod.log.close()
        stop.set()
        if status is not None:
            status.stop()
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
        messages={pod.name: pod.message for pod in pods},
        trainer_status=status and status.applied(),
        starts={pod.name: (pod.created_at, pod.started_at) for pod in pods},
        rank0=rank0.name,
        interrupted=interruption.name() if condition.status == "Running" else "",
    )
