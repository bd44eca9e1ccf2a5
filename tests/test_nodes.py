"""Failures between nodes: two nodes (ddp-launch + torchrun agents, one rank each, c10d
rendezvous, `--nnodes=1:2`, snapshots every 5 steps); one node is frozen (every process
SIGSTOPped) or cut off (its link unplugged at the switch of real network namespaces). The
survivor must name it within 10 s and train again within 30 s at world size 1; the node
thawed or healed rejoins, and both end with exit 0 at the run's last step. Where the bounds
do not allow one node (`--nnodes=2`), the survivor says so and waits, saying so again at a
steady interval, until the node is back. Every time is the test's own clock at the line's
arrival (benchmarks.node_trials.node_trial, which the fault trials run too). What the fault
cost is the harness's too: the steps between the line it read before the fault and the step
the job resumed from, at most the snapshot interval, and the final weights and optimizer
state bit for bit those of the job's rounds replayed without a fault at their world sizes
(`NodeJob.replay`): every sample trained exactly once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
from conftest import free_port, process_env

from benchmarks.fault_trials import REPLAYABLE
from benchmarks.namespaces import isolation_available, linked_hosts
from benchmarks.node_trials import (
    DETECTION_BOUND_S,
    TRAINING_BOUND_S,
    NodeJob,
    NodeTrial,
    node_trial,
    rounds,
)
from benchmarks.trial_record import final_state, same_state

FAULT_AFTER = 60  # rank 0's step line at which the fault comes
WAITING_LINE_S = 3.0  # ddp-launch's steady line while torchrun waits for nodes (30 s in pods)
# steps that wait 64 ms for their data: a run long enough for the fault and the node's return
# (rejoined about 25 s after the start, done at 50 s) costs the machine waits, not CPU: half
# the steps of 32 ms ones, and so half the replay, for the same time; the replay reads the
# same samples without waiting
WAITING_DATA, REPLAY_DATA = (
    ",data.name=plugins:slow_digits,data.options.delay_s=0.002",
    ",data.options.delay_s=0",
)


@pytest.fixture
def two_nodes(workdir) -> Iterator[Callable[..., NodeJob]]:
    """Make the job under test, on a schedule its replay can follow (constant LR); whatever is
    left of it ends with the test, pass or fail."""
    jobs: list[NodeJob] = []

    def make(waiting_data: bool = True, **options) -> NodeJob:
        data = (WAITING_DATA, REPLAY_DATA) if waiting_data else ("", "")
        jobs.append(
            NodeJob(workdir, free_port(), extra=REPLAYABLE + data[0], replay_extra=data[1], **options)
        )
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


def assert_ends_complete_losing_at_most_a_snapshot_interval_bit_exact(job: NodeJob, trial: NodeTrial) -> None:
    assert trial.codes == [0, 0], job.tail()
    assert trial.complete, job.tail()  # the summary's last step is latest.json's, every epoch done
    assert trial.false_alarms == 0, job.tail()  # the node watch found it, not a local watchdog's limit
    assert trial.lost is not None and trial.lost <= job.every, (trial.seen_step, trial.resumed_from)
    (job.workdir / "replay").mkdir()
    expected = final_state(job.replay(job.workdir / "replay", process_env()))
    assert same_state(final_state(job.workdir / "checkpoints"), expected), rounds(job)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_frozen_node_is_named_in_seconds_and_the_survivor_trains_on_then_it_rejoins(two_nodes):
    job = two_nodes(epochs=20)
    trial = node_trial(job, "node-freeze", FAULT_AFTER, process_env())
    found = trial.found
    assert trial.found_s < DETECTION_BOUND_S, found
    assert found["node"] == 1, found  # the frozen node (rank 0's is node 0), not the one that waits
    assert found["message"].startswith("node 1 (") and "it is lost" in found["message"]
    assert found["goes_on"] and "re-rendezvouses without it" in found["message"], found
    assert found["silent_s"] >= found["limit_s"] >= 5.0
    assert trial.training_s < TRAINING_BOUND_S and trial.world_after == 1, job.tail()
    assert 2 in trial.rejoined, (trial.rejoined, job.tail())  # the thawed node is back
    assert trial.thawed and trial.thawed[0]["stopped_s"] > 5, job.nodes[trial.victim].text()[-3000:]
    assert_ends_complete_losing_at_most_a_snapshot_interval_bit_exact(job, trial)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_frozen_rendezvous_host_is_named_by_the_other_node_which_waits_for_it(two_nodes):
    job = two_nodes(epochs=10)
    trial = node_trial(job, "host-freeze", FAULT_AFTER, process_env())
    found = trial.found
    assert trial.found_s < DETECTION_BOUND_S, found
    assert found["node"] == 0 and "the rendezvous host" in found["message"], found
    assert not found["goes_on"], found
    assert "ddp-launch stops torchrun and starts it again once that store answers" in found["message"], found
    assert_ends_complete_losing_at_most_a_snapshot_interval_bit_exact(job, trial)


@pytest.mark.slow
@pytest.mark.alone  # beside the busy suite a local watchdog once found a starved rank hung
@pytest.mark.timeout(400)
def test_where_the_bounds_need_both_nodes_the_survivor_says_so_and_waits_until_the_node_is_back(two_nodes):
    # with --nnodes=2 the survivor never trains alone, so the run cannot end before the node
    # is back: 20 epochs (400 steps) leave room for the fault at step 60
    job = two_nodes(
        waiting_data=False, epochs=20, nnodes="2", launcher_args=[f"--waiting-line-s={WAITING_LINE_S}"]
    )  # alone, it pays its wall time in full: steps at the CPU's pace
    waiting: list[float] = []

    def waited_twice(survivor, found_at: float) -> bool:
        waiting[:] = [
            at for at, line in survivor.lines if at > found_at and "torchrun has run no worker" in line
        ]
        return len(waiting) >= 2

    trial = node_trial(job, "node-freeze", FAULT_AFTER, process_env(), undo_when=waited_twice)
    found = trial.found
    assert trial.found_s < DETECTION_BOUND_S and found["node"] == 1, found
    assert not found["goes_on"], found
    assert "the job's bounds (--nnodes=2) do not allow training on 1 node" in found["message"], found
    # said again at a steady interval while it waits, by the test's clock
    assert WAITING_LINE_S * 0.8 <= waiting[1] - waiting[0] <= WAITING_LINE_S * 2, waiting
    survivor = job.nodes[1 - trial.victim]
    line = next(line for at, line in survivor.lines if at == waiting[0])
    assert "for at least 2 nodes (--nnodes=2)" in line, line
    assert trial.world_after == 2 and set(trial.rejoined) == {2}, job.tail()  # never trained alone
    assert_ends_complete_losing_at_most_a_snapshot_interval_bit_exact(job, trial)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not isolation_available(), reason="needs root and network namespaces")
def test_a_node_cut_off_by_a_real_partition_is_named_and_rejoins_once_healed(two_nodes):
    with contextlib.ExitStack() as stack:
        network = stack.enter_context(linked_hosts(2))
        job = two_nodes(
            epochs=20, addresses=network.addresses, prefixes=[network.prefix(0), network.prefix(1)]
        )
        stack.callback(job.close)  # before the namespaces go
        # the cut-off node sees the store not answer; the other sees the cut-off one fall silent
        trial = node_trial(job, "partition", FAULT_AFTER, process_env(), network)
    found = trial.found
    assert trial.found_s < DETECTION_BOUND_S, found
    assert found["node"] == 1, found
    assert trial.training_s < TRAINING_BOUND_S and trial.world_after == 1, job.tail()
    assert 2 in trial.rejoined, (trial.rejoined, job.tail())
    assert_ends_complete_losing_at_most_a_snapshot_interval_bit_exact(job, trial)
