"""What is checked before any work starts, and how a run that cannot go on says so: the
exit codes, and the one error line (once per node, and told to `ddp-launch` so that it
stops torchrun instead of retrying what cannot succeed)."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.checkpoint.location import open_store
from trainer.config import Config, ConfigError, load_config
from trainer.config.registry import DATASETS, MODELS
from trainer.distributed.recurrence import RecurringCrash
from trainer.lines import first_to_say, write_line
from trainer.run.arguments import parse_args
from trainer.termination_message import write_termination_message

if TYPE_CHECKING:  # torch-free: ddp-launch validates before torchrun, and torch is most of a pod's start
    from trainer.distributed.process_group import DistContext

EXIT_CONFIG_ERROR = 2
EXIT_PEER_LOST = 1  # any failure: torchrun restarts the workers while it has restarts left
SECOND_VOICE_S = 0.5  # how long a rank lets its node's first rank say an error they share
# set by `ddp-launch`: a configuration error found inside a worker is written here, so that
# the launcher stops torchrun at once instead of letting it retry what cannot succeed
FATAL_FILE_ENV = "TRAINER_FATAL_FILE"


def validate(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Config]:
    """Everything that can be checked before a process group: the arguments, the config,
    plug-ins, device, and with `--check` (as `ddp-launch` runs it) a probe write to the
    checkpoint location. Raises ConfigError."""
    args = parse_args(argv)
    config = load_config(args.config, args.overrides)
    check_environment(config)
    return args, config


def check_environment(config: Config) -> None:
    """Checks that need more than the schema: plug-ins import, URI scheme, device and AMP."""
    DATASETS.check(config.data.name)
    MODELS.check(config.model.name)
    open_store(config.checkpoint)
    device, amp = config.train.device, config.train.amp
    if device == "cuda" or amp == "fp16":  # only these ask torch whether CUDA is there
        from trainer.distributed.process_group import cuda_available

        cuda = cuda_available()
        if device == "cuda" and not cuda:
            raise ConfigError("train.device", device, "no CUDA device is visible; use auto or cpu")
        if amp == "fp16" and (device == "cpu" or not cuda):
            raise ConfigError("train.amp", amp, "fp16 needs a CUDA device; use bf16 or off on CPU")


def say(error: Exception, context: DistContext) -> str:
    """One line on stderr (rank-prefixed off rank 0), once for this node's ranks that fail
    the same way. The node's first rank says it, unprefixed on rank 0, unless it has not
    within half a second: the error is another's. Returns the line."""
    prefix = "" if context.is_main else f"[rank {context.rank}] "
    line = f"{prefix}trainer: error: {error}"
    if first_to_say(str(error), defer_s=0 if context.is_node_main else SECOND_VOICE_S):
        write_line(line)  # one write, so ranks sharing a pipe cannot interleave it
    return line


def report(error: ConfigError | RecurringCrash, context: DistContext) -> int:
    """`say` it, and tell the launcher not to retry: exit 2."""
    line = say(error, context)
    if FATAL_FILE_ENV in os.environ:
        with contextlib.suppress(OSError):
            Path(os.environ[FATAL_FILE_ENV]).write_text(line + "\n")
    else:  # run alone: its line is the container's
        write_termination_message(line)
    return EXIT_CONFIG_ERROR
