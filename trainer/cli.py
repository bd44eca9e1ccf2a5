"""`python -m trainer`: check everything, then train. Run by torchrun in each pod or on a laptop.

The command line only: its arguments (trainer/run/arguments.py) and checks
(trainer/run/startup.py), then the run (trainer/run/lifecycle.py)."""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import record

from trainer.checkpoint.location import open_store
from trainer.config import ConfigError, dump_yaml
from trainer.distributed.process_group import read_env
from trainer.run.lifecycle import train
from trainer.run.startup import report, validate


@record
def main(argv: Sequence[str] | None = None) -> int:
    context = read_env()
    try:
        args, config = validate(argv)
        if args.check:
            open_store(config.checkpoint).prepare()
    except ConfigError as error:
        return report(error, context)
    if args.print_config:
        print(dump_yaml(config), end="")
        return 0
    if args.check:
        print(f"trainer: configuration and {config.checkpoint.uri} are usable")
        return 0
    return train(config, context)
