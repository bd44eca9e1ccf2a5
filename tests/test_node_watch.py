"""Nodes watching each other (trainer.distributed.node_watch): when a peer is lost, by the
watcher's own clock, and what the line says. The two-node runs are in test_nodes.py."""

from __future__ import annotations

import pytest

from trainer.config import WatchdogConfig
from trainer.distributed.elastic_bounds import node_bounds
from trainer.distributed.node_exchange import Progress
from trainer.distributed.node_judge import Loss, NodeLimits, NodeWatch, going_on


def progress(node: int, seq: int, step: int = 40, phase: str = "step") -> Progress:
    return Progress(node, f"host-{node}", step, phase, 0.1, 5.0, seq)


def watch(num_nodes: int = 3, me: int = 0, **config) -> NodeWatch:
    return NodeWatch(me, num_nodes, NodeLimits(WatchdogConfig(**config)))


def judge(nodes: NodeWatch, now: float) -> Loss | None:
    """`lost` with the store answering: its last exchange just completed."""
    nodes.answered_at = now
    return nodes.lost(now)


def test_a_peer_that_keeps_publishing_is_never_lost_whatever_its_phase():
    nodes = watch()
    for second in range(60):  # a checkpoint of a minute: its publisher runs on
        for node in (1, 2):
            nodes.observe(progress(node, second, phase="checkpoint"), float(second))
        assert judge(nodes, second + 0.9) is None


def test_a_silent_peer_is_named_after_the_floor_with_its_last_step_and_phase():
    nodes = watch()
    for second in range(10):
        nodes.observe(progress(1, second), float(second))
        nodes.observe(progress(2, second if second < 5 else 4, step=30 + second), float(second))
    assert judge(nodes, 9.0) is None  # node 2 silent since 4.0: 5 s, not over the floor
    loss = judge(nodes, 9.2)
    assert loss is not None and loss.node == 2
    assert loss.describe() == (
        "node 2 (host-2) has been silent for 5.2s (limit 5.0s) after step 34 in step: it is lost"
    )
    assert loss.fields()["step"] == 34 and loss.fields()["phase"] == "step"


def test_the_limit_grows_with_the_longest_gap_seen_between_publishes():
    nodes = watch(num_nodes=2, node_multiple=5.0)
    for at in (0.0, 1.0, 4.0, 5.0):  # one gap of 3 s: a starved publisher, not a lost node
        nodes.observe(progress(1, int(at)), at)
    assert judge(nodes, 5.0 + 14.9) is None  # 5 x 3 s
    assert judge(nodes, 5.0 + 15.1).limit_s == pytest.approx(15.0)


def test_a_fixed_timeout_replaces_the_derived_limit():
    nodes = watch(num_nodes=2, node_timeout_s=2.5)
    nodes.observe(progress(1, 1), 0.0)
    assert judge(nodes, 2.4) is None
    assert judge(nodes, 2.6).limit_s == 2.5


def test_a_peer_that_never_published_is_lost_once_the_limit_passes_from_the_start():
    nodes = watch(num_nodes=2)
    nodes.started_at = 100.0
    assert judge(nodes, 104.0) is None
    assert (
        "node 1 (?) has been silent for 5.5s (limit 5.0s) before its first publish"
        in judge(nodes, 105.5).describe()
    )


def test_a_store_that_stops_answering_is_the_rendezvous_host_lost(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "worker-0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    nodes = watch(num_nodes=2, me=1)
    nodes.observe(progress(0, 1, step=77), 0.0)
    nodes.answered_at = 1.0  # its last answer: the calls after it never return
    assert nodes.lost(5.9) is None
    loss = nodes.lost(6.5)
    assert loss.node == 0 and "the rendezvous host (store worker-0:29500)" in loss.describe()
    assert "after step 77" in loss.describe()


def test_progress_round_trips_through_the_store_encoding():
    sent = Progress(3, "gpu-node-7", 1200, "validation", 12.5, 60.0, 41)
    assert Progress.decode(sent.encode()) == sent


def test_a_peer_that_said_it_is_done_is_never_lost_while_this_node_finishes():
    nodes = watch(num_nodes=2)
    nodes.observe(progress(1, 1), 0.0)
    nodes.observe(progress(1, 2, phase="done"), 1.0)  # its run ended: it stops publishing
    assert judge(nodes, 60.0) is None  # this node's last checkpoint or test may take a minute


@pytest.mark.parametrize(
    ("env", "bounds"),
    [
        ({"TRAINER_NNODES": "1:2"}, (1, 2)),
        ({"TRAINER_NNODES": "2", "PET_NNODES": "1:4"}, (2, 2)),  # ddp-launch's, from the command line
        ({"PET_NNODES": "2:3"}, (2, 3)),  # the operator's, in the pod's environment
        ({}, None),
        ({"PET_NNODES": "auto"}, None),
    ],
)
def test_the_node_bounds_come_from_torchruns_nnodes(env, bounds):
    assert node_bounds(env) == bounds


def loss_of(node: int = 1, store_host: bool = False) -> Loss:
    return Loss(node, "vm-b", 6.0, 5.0, progress(node, 9), store_host)


@pytest.mark.parametrize(
    ("num_nodes", "bounds", "goes_on", "says"),
    [
        (2, (1, 2), True, "node 0 (vm-a) leaves the group so that torchrun re-rendezvouses without it"),
        (2, None, True, "re-rendezvouses without it"),  # plain torchrun: its bounds unknown
        (3, (2, 3), True, "re-rendezvouses without it"),
        (2, (2, 2), False, "the job's bounds (--nnodes=2) do not allow training on 1 node: node 0 (vm-a) "
         "leaves the group and waits in torchrun's rendezvous until the node is back or replaced"),
        (3, (3, 4), False, "(--nnodes=3:4) do not allow training on 2 nodes"),
    ],
)  # fmt: skip
def test_the_lost_line_says_whether_the_bounds_let_the_survivors_go_on(num_nodes, bounds, goes_on, says):
    verdict, words = going_on(loss_of(), num_nodes, bounds, "node 0 (vm-a)")
    assert verdict is goes_on and says in words


def test_a_lost_store_host_is_waited_for_whatever_the_bounds():
    verdict, words = going_on(loss_of(0, store_host=True), 2, (1, 2), "node 1 (vm-b)")
    assert verdict is False and "cannot rendezvous without the store's host" in words
