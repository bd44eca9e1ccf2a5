"""What the trainer reads from torchrun's environment."""

import pytest
import torch.distributed as dist

from trainer.distributed.process_group import peer_lost, read_env


def test_without_torchrun_it_is_a_world_of_one():
    context = read_env({"RANK": "5", "WORLD_SIZE": "8"})  # stray variables without torchrun
    assert (context.rank, context.world_size, context.num_nodes, context.launched_by_torchrun) == (
        0,
        1,
        1,
        False,
    )


def test_reads_what_torchrun_sets_for_a_multi_node_job():
    env = {
        "RANK": "9",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "16",
        "LOCAL_WORLD_SIZE": "8",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "TORCHELASTIC_RESTART_COUNT": "3",
        "TORCHELASTIC_RUN_ID": "ddp-run-7f3a",
    }
    context = read_env(env)
    assert (context.rank, context.local_rank, context.world_size) == (9, 1, 16)
    assert (context.node_rank, context.num_nodes, context.restart_count) == (1, 2, 3)
    assert context.run_id == "ddp-run-7f3a" and not context.is_main and not context.is_node_main


GLOO_PATH = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
GLOO_LOST = "Connection closed by peer [10.213.0.3]:23688. This is typically caused by a remote worker ..."
NCCL_ABORTED = "NCCL communicator was aborted on rank 3."


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (RuntimeError(GLOO_PATH + GLOO_LOST), "Connection closed by peer [10.213.0.3]:23688"),
        (dist.DistBackendError(NCCL_ABORTED), "NCCL communicator was aborted on rank 3"),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"), None),
    ],
)
def test_a_lost_peer_is_told_apart_from_a_bug(error, reason):
    """A collective that failed because another rank went away is one line (torchrun restarts
    the workers); any other error keeps its traceback."""
    assert peer_lost(error) == reason
