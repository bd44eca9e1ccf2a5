"""A frozen node under `ddp-ops local` (operator_scripts.local.node_loss): its kubelet is silent,
so no probe and no exit; the node controller marks it NotReady after its grace period, the
taint manager evicts its pod after the pod's toleration, and the pod object goes, and the
operator re-creates it, only once the node answers again or is deleted."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from conftest import (
    CPU_VALUES,
    HELPERS,
    REPO,
    assert_bits_of_an_uninterrupted_run,
    assert_lost_within,
    free_port,
    load_checkpoint,
    pod_snapshot_steps,
    process_env,
    resumes_after_a_fault,
)

from operator_scripts.chart.render import merge_values, render
from operator_scripts.cli import main as ddp_ops
from operator_scripts.controllers.job_rules import PyTorchJobRules, TrainJobRules
from operator_scripts.controllers.jobset_status import after_disruption
from operator_scripts.controllers.pytorchjob_status import PodState
from operator_scripts.local.kubelet import lose_node
from operator_scripts.local.node_loss import DEFAULT_TOLERATION_S, NodeLoss, NodeLossPlan, toleration_seconds
from operator_scripts.local.run import run

UNREACHABLE = "node.kubernetes.io/unreachable"


def loss(
    back: float | None = None, deleted: float | None = None, toleration: float | None = 20.0
) -> NodeLoss:
    return NodeLoss(NodeLossPlan("worker-1", 0.0, back, deleted), 100.0, 40.0, toleration, podgc_epoch=0.0)


def test_a_frozen_node_is_not_ready_after_the_grace_period_and_its_pod_evicted_after_its_toleration():
    node = loss()
    assert node.due(139.9) == [] and node.kubelet_down
    assert node.due(140.0) == ["not-ready"]
    assert node.due(159.9) == []
    assert node.due(160.0) == ["evicted"]
    assert node.due(10_000.0) == [] and node.stage == "evicted"  # Terminating for as long as it is silent


def test_a_node_that_answers_within_its_grace_period_changes_nothing_but_goes_on():
    node = loss(back=30.0)
    assert node.due(129.9) == [] and node.due(130.0) == ["answers"] and not node.kubelet_down


def test_a_node_that_answers_after_the_eviction_has_its_kubelet_end_the_evicted_pod():
    node = loss(back=120.0)
    assert node.due(300.0) == ["not-ready", "evicted", "answers-evicted"]


def test_a_pod_without_a_toleration_deadline_is_never_evicted():
    assert loss(toleration=None).due(1e6) == ["not-ready"]


@pytest.mark.parametrize(
    ("deleted_after", "force_deleted_at"),
    [(45.0, 200.0), (60.0, 200.0), (60.5, 220.0)],  # PodGC ticks every 20 s, then a 40 s quarantine
)
def test_a_deleted_nodes_pod_is_force_deleted_by_podgc_after_its_quarantine(deleted_after, force_deleted_at):
    node = loss(deleted=deleted_after)
    changes = node.due(100.0 + deleted_after)
    assert changes[-1] == "node-deleted" and node.kubelet_down
    assert node.due(force_deleted_at - 0.1) == [] and node.due(force_deleted_at) == ["pod-deleted"]


def template(*tolerations: dict) -> dict:
    return {"spec": {"tolerations": list(tolerations)}}


@pytest.mark.parametrize(
    ("pod", "seconds"),
    [
        (template(), DEFAULT_TOLERATION_S),  # the DefaultTolerationSeconds admission plugin's
        (
            template(
                {"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 20}
            ),
            20,
        ),
        (template({"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute"}), None),  # forever
        (template({"operator": "Exists"}), None),  # tolerates every taint
        (template({"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}), DEFAULT_TOLERATION_S),
    ],
)
def test_a_pods_toleration_of_an_unreachable_node(pod, seconds):
    assert toleration_seconds(pod) == seconds


def test_a_deleted_pod_is_recreated_by_the_operator_uncounted_and_replaced_by_the_job_per_its_policy():
    state = PodState("job-worker-1", "worker", "Running", restarts=0)
    chart = render(merge_values(files=[CPU_VALUES]), release="r", namespace="n")
    outcome = PyTorchJobRules(chart.one("PyTorchJob")).on_deleted(state, "evicted")
    assert (outcome.action, outcome.message) == (
        "recreate",
        "pod job-worker-1 deleted (evicted); the operator creates it anew",
    )
    v2 = render(merge_values(files=[CPU_VALUES], sets=["jobKind=TrainJob"]), release="r", namespace="n")
    rules = TrainJobRules(v2.one("TrainJob"), v2.one("TrainingRuntime"))
    outcome = rules.on_deleted(state, "evicted")
    assert outcome.action == "recreate" and "not counted (podFailurePolicy: Ignore)" in outcome.message
    assert rules.failed == 0
    assert after_disruption(None) == "count"


def test_freezing_a_node_that_both_answers_and_is_deleted_is_refused_in_one_line(capsys):
    code = ddp_ops(["local", "-f", str(CPU_VALUES), "--freeze-node", "worker-1=30", "--node-back-after", "60",
                    "--node-deleted-after", "90"])  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "ddp-ops local: error: --node-back-after 60 and --node-deleted-after 90: give one "
        "(a frozen node either answers again or is deleted)"
    ]


GRACE_S, TOLERATION_S, BACK_S = 3.0, 2.0, 15.0


def frozen_node_job(tmp_path, references, index: int):
    """The chart's two CPU pods (fixed size: `--nnodes=2`); pod `index`'s node frozen once
    both hold a snapshot of step 20, with a 3 s grace period and the chart's toleration set to
    2 s; it answers 15 s after it froze. The control plane's lines with the test's clock, the
    moment of the freeze and each pod's log; and, as the job's world size is 2 throughout, what
    it cost: at most the snapshot interval (5 steps) by the snapshots the harness saw at the
    freeze, and the bits of an uninterrupted run at the end."""
    values = merge_values(
        files=[CPU_VALUES],
        sets=[
            # the store on a shared claim: a re-created pod's emptyDirs start empty
            f"metrics.port={free_port()},nodeLoss.tolerationSeconds={TOLERATION_S:g},checkpoint.existingClaim=ckpt",
            "trainer.config.data.name=plugins:slow_digits,trainer.config.data.options.delay_s=0.002,"
            "trainer.config.train.max_steps=150,trainer.config.checkpoint.every_steps=1000,"
            "trainer.config.log.every_steps=10,trainer.config.log.format=json",
        ],
    )
    rendered = render(values, release="ddp-run", namespace="training")
    notes: list[tuple[float, str]] = []
    frozen: list[float] = []
    held: dict[str, int] = {}
    started = time.monotonic()

    def freeze_once_snapshotted(pods) -> None:
        if not frozen and min(max(pod_snapshot_steps(pod.folder), default=0) for pod in pods) >= 20:
            held.update({pod.name: max(pod_snapshot_steps(pod.folder), default=0) for pod in pods})
            frozen.append(time.monotonic())
            plan = NodeLossPlan(pods[index].name, 0.0, back_after_s=BACK_S)
            lose_node(pods[index], plan, frozen[0], GRACE_S, started)

    outcome = run(
        rendered.objects,
        tmp_path / "pods",
        timeout=300,
        stream=None,
        notify=lambda line: notes.append((time.monotonic(), line)),
        on_tick=freeze_once_snapshotted,
        host_env=process_env({"PYTHONPATH": os.pathsep.join([str(REPO), str(HELPERS)])}),
    )
    logs = {name: path.read_text() for name, path in outcome.logs.items()}
    assert outcome.status == "Succeeded", (
        [line for _, line in notes],
        {k: v[-2000:] for k, v in logs.items()},
    )
    assert frozen and (outcome.recreations, outcome.restarts) == (1, 0), notes
    assert not [line for _, line in notes if "probes failed" in line], (
        notes
    )  # a frozen kubelet probes nothing
    survivor = f"ddp-run-ddp-trainer-worker-{1 - index}"
    resumed = resumes_after_a_fault(list(logs.values()))[-1]  # the round that trained to the end
    assert_lost_within(held, survivor, *resumed, bound=5)
    recovered = load_checkpoint(tmp_path / "pods" / "pvc" / "ckpt" / "ddp-run")
    assert_bits_of_an_uninterrupted_run(rendered, recovered, references)
    return outcome, notes, frozen[0], logs


def records_of(log: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_frozen_nodes_pod_is_evicted_then_recreated_when_its_node_answers_and_the_job_succeeds(
    tmp_path, references
):
    """Pod 1's node freezes. Pod 0 names it lost and waits (its bounds need two nodes); the
    control plane's steps come at their times by the test's clock; the evicted pod is ended
    and re-created, and the job succeeds at world size 2 again."""
    _, notes, frozen_at, logs = frozen_node_job(tmp_path, references, 1)
    said = [line for _, line in notes]

    def at(text: str) -> float:
        return next(when for when, line in notes if text in line) - frozen_at

    worker_1 = "ddp-run-ddp-trainer-worker-1"
    assert GRACE_S <= at(f"node of pod {worker_1}: no status for 3s") < GRACE_S + 1, said
    evicted = at(f"pod {worker_1} evicted after its 2s toleration")
    assert GRACE_S + TOLERATION_S <= evicted < GRACE_S + TOLERATION_S + 1, said
    assert BACK_S <= at(f"node of pod {worker_1} answers again") < BACK_S + 1, said
    assert (
        at(f"pod {worker_1} deleted (evicted from its unreachable node); the operator creates it anew")
        > BACK_S
    )

    records = records_of(logs["ddp-run-ddp-trainer-worker-0"])
    lost = [r for r in records if r.get("event") == "node_lost"]
    assert lost and lost[0]["node"] == 1 and not lost[0]["goes_on"], lost
    assert "(--nnodes=2) do not allow training on 1 node" in lost[0]["message"]
    assert [r["world_size"] for r in records if r.get("event") == "start"][-1] == 2
    resumed = re.findall(r'"resumed_from": (\d+)', logs["ddp-run-ddp-trainer-worker-0"])
    assert resumed and int(resumed[-1]) >= 20


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_frozen_rendezvous_hosts_pod_is_waited_for_and_the_job_goes_on_once_it_is_recreated(
    tmp_path, references
):
    """Pod 0's node freezes: it holds the rendezvous store. Pod 1 names the store's host lost;
    its torchrun would wait on that store for good, so pod 1's ddp-launch stops it (one
    relaunch), waits in one line (the name stops resolving once the node is NotReady), and
    starts torchrun again once the re-created pod 0's store answers; the job succeeds, and
    pod 1's log holds lines, not torchrun's tracebacks."""
    _, notes, _, logs = frozen_node_job(tmp_path, references, 0)
    pod_1 = logs["ddp-run-ddp-trainer-worker-1"]
    lost = [r for r in records_of(pod_1) if r.get("event") == "node_lost"]
    assert lost and lost[0]["node"] == 0 and "the rendezvous host" in lost[0]["message"], pod_1[-3000:]
    launcher = [line for line in pod_1.splitlines() if line.startswith("ddp-launch: ")]
    assert len(launcher) == 3, pod_1[-3000:]  # one line for the wait, however long
    assert launcher[0] == (
        "ddp-launch: torchrun stopped: the rendezvous store's host is lost and torchrun would wait on it "
        "for good; relaunch 1 of 3"
    )
    # its name is gone by then (NotReady after 3 s); were it not yet, its store would not answer
    host = "ddp-run-ddp-trainer-worker-0"
    assert launcher[1].startswith(f"ddp-launch: waiting for the rendezvous host {host}:23456: ")
    assert launcher[2] == f"ddp-launch: rendezvous host {host} answers; starting torchrun"
    assert "Traceback" not in pod_1, pod_1[-3000:]
    assert any("pod ddp-run-ddp-trainer-worker-0 deleted (evicted" in line for _, line in notes), notes
    starts = [r for r in records_of(logs["ddp-run-ddp-trainer-worker-0"]) if r.get("event") == "start"]
    assert starts[-1]["world_size"] == 2 and starts[-1]["resumed_from_step"] >= 20
