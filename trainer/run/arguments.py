"""The trainer's command line, which `python -m trainer` runs and `ddp-launch` reads (the
arguments after `-m trainer` in torchrun's) to check the config before torchrun starts."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from trainer.config import bundled_config_names
from trainer.config.argparsing import OneLineParser

# more `--set` overrides, applied after the command line's: where only the environment can be
# given (a TrainJob made with the Kubeflow SDK, whose CustomTrainerContainer takes env only)
OVERRIDES_ENV = "TRAINER_SET"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python -m trainer",
        description="Data-parallel training under torchrun (or alone, as a world of one).",
    )
    parser.add_argument(
        "--config",
        metavar="PATH_OR_NAME",
        help=f"a YAML file or a bundled config ({', '.join(bundled_config_names())}); "
        "default: the embedded defaults (the digits demo)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a key in Helm's --set syntax (a.b=c, x={{1,2}}); repeatable; ${OVERRIDES_ENV} "
        "adds more, applied last",
    )
    parser.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the config, plug-ins, device, the data with a batch through the model, and that "
        "checkpoint.uri is writable, then exit",
    )
    args = parser.parse_args(argv)
    if extra := os.environ.get(OVERRIDES_ENV, "").strip():
        args.overrides.append(extra)
    return args
