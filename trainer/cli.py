"""`python -m trainer`: check everything, then train. Run by torchrun in each pod or on a laptop.

The command line only: its arguments (trainer/run/arguments.py) and checks
(trainer/run/startup.py), then the run (trainer/run/lifecycle.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from trainer.checkpoint.location import open_store
from trainer.config import Config, ConfigError, dump_yaml
from trainer.config.plugin_errors import PluginIOError
from trainer.distributed.process_group import read_env
from trainer.run.device_defaults import for_device
from trainer.run.lifecycle import build_and_probe, train
from trainer.run.startup import EXIT_PEER_LOST, report, say, validate
from trainer.telemetry.startup import STARTUP


@record
def main(argv: Sequence[str] | None = None) -> int:
    STARTUP.mark("imports")
    context = read_env()
    try:
        args, config = validate(argv)
        if args.check:
            data = checked_data(config)
            open_store(config.checkpoint).prepare()
    except ConfigError as error:
        return report(error, context)
    except PluginIOError as error:
        say(error, context)
        return EXIT_PEER_LOST
    if args.print_config:
        print(dump_yaml(config), end="")
        return 0
    if args.check:
        print(f"trainer: configuration, {data} and {config.checkpoint.uri} are usable")
        return 0
    return train(config, context)


def checked_data(config: Config) -> str:
    """What `--check` says of the data after building it here, as a rank would, with one
    batch through the model on the CPU; a dataset in S3 is read by the pods, not here."""
    if config.data.path.startswith("s3://"):
        return f"data {config.data.name} (its {config.data.path} is read and checked in the pods)"
    cpu = torch.device("cpu")
    splits, _ = build_and_probe(for_device(config, cpu), 1, cpu)
    model = config.model.name
    return f"data {config.data.name} ({len(splits.train):,} training samples, a batch through {model})"
