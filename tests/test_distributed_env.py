"""What the trainer reads from torchrun's environment."""

from trainer.distributed import read_env


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
