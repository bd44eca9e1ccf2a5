"""Rank-aware logging: who prints, in what shape."""

import io
import json
import logging
import os
import subprocess
import sys

import pytest
from conftest import REPO
from tqdm import tqdm

from trainer.config import LogConfig
from trainer.distributed.process_group import read_env
from trainer.telemetry.log import JsonFormatter, TextFormatter, event, setup_logging
from trainer.telemetry.progress import logs_above_the_bar


def record(message: str, level=logging.INFO, **extra) -> logging.LogRecord:
    made = logging.LogRecord("trainer", level, __file__, 1, message, None, None)
    made.__dict__.update(extra)
    return made


def test_json_lines_carry_the_event_and_its_fields():
    line = JsonFormatter(rank=0).format(record("hi", event="progress", fields={"step": 3, "loss": 0.5}))
    document = json.loads(line)
    assert document["event"] == "progress" and document["step"] == 3 and document["loss"] == 0.5
    assert document["rank"] == 0 and document["message"] == "hi"


def test_other_ranks_prefix_their_rank_and_level():
    line = TextFormatter(rank=3).format(record("disk slow", logging.WARNING))
    assert "[rank 3] WARNING: disk slow" in line
    assert "[rank" not in TextFormatter(rank=0).format(record("hello"))


def test_only_rank_0_logs_info(monkeypatch):
    env = {"TORCHELASTIC_RUN_ID": "r", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    logger = setup_logging(LogConfig(), read_env(env))
    stream = io.StringIO()
    logger.handlers[0].setStream(stream)
    event(logger, "progress", "step 1")
    logger.warning("slow")
    assert stream.getvalue().count("\n") == 1 and "[rank 1] WARNING: slow" in stream.getvalue()


WRITER = """
import json, sys
from trainer.lines import write_line
for n in range(400):
    write_line(json.dumps({"writer": int(sys.argv[1]), "n": n, "stack": ["frame" * 300]}), sys.stdout)
"""


@pytest.mark.slow
def test_processes_sharing_a_pipe_write_whole_lines():
    """A pod's ranks and its watchdog share stdout, unbuffered in the image (PYTHONUNBUFFERED):
    every line of three writers at once reaches the pipe whole, none split by another's."""
    read, write = os.pipe()
    writers = [
        subprocess.Popen([sys.executable, "-u", "-c", WRITER, str(n)], cwd=REPO, stdout=write)
        for n in range(3)
    ]
    os.close(write)
    with os.fdopen(read) as pipe:
        lines = pipe.read().splitlines()
    assert all(writer.wait(timeout=60) == 0 for writer in writers)
    records = [json.loads(line) for line in lines]  # a split line is two records on one, or none
    assert sorted((r["writer"], r["n"]) for r in records) == [(w, n) for w in range(3) for n in range(400)]


class Writes(io.StringIO):
    """A stream that keeps each write call apart."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


@pytest.mark.parametrize(("on_a_terminal", "calls"), [(False, ["hello\n"]), (True, ["hello", "\n"])])
def test_log_lines_are_one_write_unless_a_terminal_shows_the_bar(on_a_terminal, calls, monkeypatch):
    """tqdm's redirect writes a line's text and its newline apart, which a shared unbuffered
    stdout can split: only a terminal's bar gets it."""
    stream, logger = Writes(), logging.getLogger("test-bar")
    monkeypatch.setattr(sys, "stdout", stream)  # rank 0 logs to stdout
    logger.handlers, logger.propagate = [logging.StreamHandler(sys.stdout)], False
    bar = tqdm(total=1, file=io.StringIO(), disable=not on_a_terminal)
    with bar, logs_above_the_bar(bar, logger):
        logger.warning("hello")
    assert [call for call in stream.calls if call] == calls
