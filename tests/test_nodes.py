"""Failures between nodes: two nodes (ddp-launch + torchrun agents, one rank each, c10d
rendezvous, `--nnodes=1:2`, snapshots every 5 steps); one node is frozen (every process
SIGSTOPped) or cut off (its link unplugged at the switch of real network namespaces). The
survivor must name it within 10 s and train again within 30 s at world size 1; the node
thawed or healed rejoins, and both end with exit 0 at the run's last step. Every time is the
test's own clock at the line's arrival (benchmarks.node_trials)."""

from __future__ import annotations

import json
import time

import pytest
from conftest import free_port, process_env

from benchmarks.namespaces import Network, isolation_available, linked_hosts
from benchmarks.node_trials import NodeProcess, TwoNodes, lost_lines, progress

DETECTION_BOUND_S, TRAINING_BOUND_S = 10.0, 30.0
FAULT_AFTER = 60  # rank 0's step line at which the fault comes


def starts(node: NodeProcess, after: float = 0.0) -> list[dict]:
    return [r for at, r in node.records() if at > after and r.get("event") == "start"]


def run_fault(job: TwoNodes, fault: str, network: Network | None = None) -> dict:
    """Apply `fault` ("freeze" the node without rank 0, "host-freeze" rank 0's node,
    "partition": unplug the node without rank 0) after step FAULT_AFTER, undo it once the
    survivor trains again (at once for the host), and return what the test measured."""
    job.start(process_env())
    job.wait_for(lambda: any(r["step"] >= FAULT_AFTER for n in job.nodes for _, r in progress(n)), 120)
    host = job.rank0()
    victim = host if fault == "host-freeze" else next(n for n in job.nodes if n is not host)
    survivor = next(n for n in job.nodes if n is not victim)
    index = job.nodes.index(victim)
    cut, undo = (victim.freeze, victim.thaw) if network is None else (network.cut, network.heal)
    if network is None:
        cut()
    else:
        cut(index)
    faulted = time.monotonic()
    found_at, found = job.wait_for(lambda: lost_lines(survivor, faulted), 60)[0]
    measured = {"victim": victim, "survivor": survivor, "found_s": found_at - faulted, "found": found}
    if fault != "host-freeze":  # the survivor hosts the store: it trains on alone
        again_at, _ = job.wait_for(lambda: progress(survivor, found_at), 60)[0]
        measured["training_s"] = again_at - faulted
        measured["world_after"] = starts(survivor, found_at)[0]["world_size"]
    undone = time.monotonic()
    undo() if network is None else undo(index)
    measured["codes"] = job.wait(timeout=300)
    measured["rejoined"] = [r["world_size"] for n in job.nodes for r in starts(n, undone)]
    return measured


def assert_ends_complete(job: TwoNodes, measured: dict) -> None:
    assert measured["codes"] == [0, 0], job.tail()
    summaries = [r for n in job.nodes for _, r in n.records() if r.get("event") == "summary"]
    latest = json.loads((job.workdir / "checkpoints" / "latest.json").read_text())["step"]
    assert summaries and summaries[-1]["steps"] == latest, job.tail()
    hangs = [r for n in job.nodes for _, r in n.records() if r.get("event") == "hang"]
    assert not hangs, hangs  # the node watch found it, not the local watchdogs' wait limit


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_frozen_node_is_named_in_seconds_and_the_survivor_trains_on_then_it_rejoins(workdir):
    job = TwoNodes(workdir, free_port(), epochs=150)
    try:
        measured = run_fault(job, "freeze")
    finally:
        job.close()
    found = measured["found"]
    assert measured["found_s"] < DETECTION_BOUND_S, found
    assert found["node"] == 1, found  # the frozen node (rank 0's is node 0), not the one that waits
    assert found["message"].startswith("node 1 (") and "it is lost" in found["message"]
    assert found["silent_s"] >= found["limit_s"] >= 5.0
    assert measured["training_s"] < TRAINING_BOUND_S and measured["world_after"] == 1, job.tail()
    assert 2 in measured["rejoined"], (measured["rejoined"], job.tail())  # the thawed node is back
    thawed = [r for _, r in measured["victim"].records() if r.get("event") == "node_thawed"]
    assert thawed and thawed[0]["stopped_s"] > 5, measured["victim"].text()[-3000:]
    assert_ends_complete(job, measured)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_frozen_rendezvous_host_is_named_by_the_other_node_which_waits_for_it(workdir):
    job = TwoNodes(workdir, free_port(), epochs=60)
    try:
        measured = run_fault(job, "host-freeze")
    finally:
        job.close()
    found = measured["found"]
    assert measured["found_s"] < DETECTION_BOUND_S, found
    assert found["node"] == 0 and "the rendezvous host" in found["message"], found
    assert_ends_complete(job, measured)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not isolation_available(), reason="needs root and network namespaces")
def test_a_node_cut_off_by_a_real_partition_is_named_and_rejoins_once_healed(workdir):
    with linked_hosts(2) as network:
        job = TwoNodes(
            workdir, free_port(), epochs=150, addresses=network.addresses,
            prefixes=[network.prefix(0), network.prefix(1)],
        )  # fmt: skip
        try:
            # the cut-off node sees the store not answer; the other sees the cut-off one fall silent
            measured = run_fault(job, "partition", network)
        finally:
            job.close()
    found = measured["found"]
    assert measured["found_s"] < DETECTION_BOUND_S, found
    assert found["node"] == 1, found
    assert measured["training_s"] < TRAINING_BOUND_S and measured["world_after"] == 1, job.tail()
    assert 2 in measured["rejoined"], (measured["rejoined"], job.tail())
    assert_ends_complete(job, measured)
