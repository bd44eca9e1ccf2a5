"""Command-line parsing that fails the way every command here fails: one line on stderr
that names the argument, the value and what is allowed, and exit code 2."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistake is one line (`PROG: error: ...; see --help`), not the usage
    block and the message; sub-commands' parsers inherit it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def positive_float(text: str) -> float:
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be greater than 0")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 or more")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a whole number greater than 0")
    return value


def existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: no such file")
    return path


def _number(text: str, kind: type) -> float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a {kind.__name__}") from None
