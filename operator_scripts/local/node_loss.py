"""A node that stops answering, as Kubernetes' control plane answers it (`ddp-ops local
--freeze-node`): the timeline of one pod whose node froze, pure and on a given clock.

A frozen node (a kernel stuck, a paused VM, a cut-off link) runs nothing: not its pods, not
its kubelet. So no liveness probe fails and no container exit is reported; the control plane
sees only silence:
- after `--node-monitor-grace-period` (40 s) without a status, the node lifecycle controller
  marks the node's Ready condition Unknown, taints it `node.kubernetes.io/unreachable`
  (NoExecute) and marks its pods not Ready (`MarkPodsNotReady`), so that a headless
  Service drops their addresses: the pod's name stops resolving;
- once the pod's toleration of that taint runs out (`tolerationSeconds`; 300 s from the
  DefaultTolerationSeconds admission plugin where the pod sets none), the taint manager
  deletes it: the pod is Terminating, and stays so, for only its kubelet can finish a
  graceful deletion;
- the pod object goes when its kubelet answers again (it ends the containers, then the
  pod), or when the Node object is deleted (a vanished VM's cloud controller, or `kubectl
  delete node`): PodGC force-deletes pods bound to a node that no longer exists, checking
  every 20 s and after a 40 s quarantine (pkg/controller/podgc/gc_controller.go,
  gcCheckPeriod, quarantineTime, gcOrphaned);
- only then does the job's controller create the pod anew: training-operator creates a
  replica's pod only where none of its index exists, a Terminating one included
  (pkg/core/pod.go GetPodSlices, pkg/controller.v1/common/pod.go ReconcilePods).
A node that answers before its grace period ran out changes nothing in the API: its pods
just go on. Sources and line numbers: docs/facts.md, "Losing a node".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

# kube-controller-manager --node-monitor-grace-period (pkg/controller/nodelifecycle/config/
# v1alpha1/defaults.go; 50 s from Kubernetes 1.32, kubernetes/kubernetes#127352)
NODE_MONITOR_GRACE_S = 40.0
# plugin/pkg/admission/defaulttolerationseconds: --default-unreachable-toleration-seconds
DEFAULT_TOLERATION_S = 300.0
PODGC_PERIOD_S, PODGC_QUARANTINE_S = 20.0, 40.0  # pkg/controller/podgc/gc_controller.go
UNREACHABLE = "node.kubernetes.io/unreachable"

Stage = Literal["frozen", "not-ready", "evicted", "answering", "deleted", "gone"]
Change = Literal["not-ready", "evicted", "answers", "answers-evicted", "node-deleted", "pod-deleted"]


def toleration_seconds(template: dict[str, Any]) -> float | None:
    """How long a pod stays bound to a node tainted unreachable: its own NoExecute
    toleration's `tolerationSeconds` (None: forever, where it gives none), else the
    admission plugin's 300 s."""
    for toleration in template.get("spec", {}).get("tolerations", []):
        key, operator = toleration.get("key"), toleration.get("operator", "Equal")
        matches = key == UNREACHABLE or (key in (None, "") and operator == "Exists")
        if matches and toleration.get("effect") in (None, "", "NoExecute"):
            seconds = toleration.get("tolerationSeconds")
            return None if seconds is None else max(0.0, float(seconds))
    return DEFAULT_TOLERATION_S


@dataclass(frozen=True)
class NodeLossPlan:
    """What `ddp-ops local` does to a pod's node: freeze it `at_s` into the run; then,
    optionally, let it answer again `back_after_s` after it froze, or delete its Node
    object (the VM gone) `deleted_after_s` after it froze."""

    pod: str
    at_s: float
    back_after_s: float | None = None
    deleted_after_s: float | None = None


@dataclass
class NodeLoss:
    """One frozen node's timeline: `due(now)` says what changed since the last look."""

    plan: NodeLossPlan
    frozen_at: float
    grace_s: float
    toleration_s: float | None
    podgc_epoch: float = 0.0  # when PodGC's 20 s ticks started (the controller's start)
    stage: Stage = "frozen"
    orphan_at: float | None = field(default=None, init=False)  # PodGC's force-deletion

    @property
    def not_ready_at(self) -> float:
        return self.frozen_at + self.grace_s

    @property
    def evicted_at(self) -> float:
        return math.inf if self.toleration_s is None else self.not_ready_at + self.toleration_s

    def _when(self, after_s: float | None) -> float:
        return math.inf if after_s is None else self.frozen_at + after_s

    @property
    def kubelet_down(self) -> bool:
        """No probes, no exits reported, no restarts: the kubelet is frozen or gone."""
        return self.stage in ("frozen", "not-ready", "evicted", "deleted")

    def due(self, now: float) -> list[Change]:
        """The changes that have come due by `now`, in order; each is said once."""
        changes: list[Change] = []
        back, deleted = self._when(self.plan.back_after_s), self._when(self.plan.deleted_after_s)
        if self.stage == "frozen" and now >= self.not_ready_at and min(back, deleted) > self.not_ready_at:
            self.stage = "not-ready"
            changes.append("not-ready")
        if self.stage == "not-ready" and now >= self.evicted_at and min(back, deleted) > self.evicted_at:
            self.stage = "evicted"
            changes.append("evicted")
        if self.stage in ("frozen", "not-ready", "evicted") and now >= back:
            changes.append("answers-evicted" if self.stage == "evicted" else "answers")
            self.stage = "answering"
        elif self.stage in ("frozen", "not-ready", "evicted") and now >= deleted:
            self.stage = "deleted"
            self.orphan_at = self._podgc_after(deleted)
            changes.append("node-deleted")
        if self.stage == "deleted" and self.orphan_at is not None and now >= self.orphan_at:
            self.stage = "gone"
            changes.append("pod-deleted")
        return changes

    def _podgc_after(self, deleted_at: float) -> float:
        """PodGC's first tick after the deletion queues the node for 40 s; the tick that
        finds it still missing then force-deletes its pods."""
        ticks = math.ceil(max(0.0, deleted_at - self.podgc_epoch) / PODGC_PERIOD_S)
        queued = self.podgc_epoch + ticks * PODGC_PERIOD_S
        return queued + PODGC_QUARANTINE_S
