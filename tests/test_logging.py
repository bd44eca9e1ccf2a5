"""Rank-aware logging: who prints, in what shape."""

import io
import json
import logging

from trainer.config import LogConfig
from trainer.distributed.process_group import read_env
from trainer.telemetry.log import JsonFormatter, TextFormatter, event, setup_logging


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
