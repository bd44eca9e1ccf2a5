"""Rank-aware logging: rank 0 tells the story on stdout, other ranks speak only when it matters.

Every event is a message plus structured fields, so one call prints a readable line or,
with `log.format=json`, a JSON line carrying the same facts.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from typing import Any

from trainer.config import LogConfig
from trainer.distributed.process_group import DistContext

LOGGER_NAME = "trainer"


class TextFormatter(logging.Formatter):
    """`2026-11-29 16:00:00 message`; ranks other than 0 add `[rank N]` and the level."""

    def __init__(self, rank: int) -> None:
        super().__init__("%(asctime)s %(message)s", datefmt="%Y-%m-%dT%H:%M:%SZ")
        self.converter = time.gmtime
        self.rank = rank

    def formatMessage(self, record: logging.LogRecord) -> str:
        if self.rank != 0:
            record.message = f"[rank {self.rank}] {record.levelname}: {record.message}"
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, rank, event, message and the event's fields."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": round(record.created, 3),
            "level": record.levelname.lower(),
            "rank": self.rank,
            "event": getattr(record, "event", "message"),
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str)


def setup_logging(config: LogConfig, context: DistContext) -> logging.Logger:
    """Rank 0 logs INFO to stdout; the others WARNING and up to stderr, prefixed with rank."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers.clear()
    logger.propagate = False
    stream = sys.stdout if context.is_main else sys.stderr
    handler = logging.StreamHandler(stream)
    formatter_type = JsonFormatter if config.format == "json" else TextFormatter
    handler.setFormatter(formatter_type(context.rank))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if context.is_main else logging.WARNING)
    warnings_logger = logging.getLogger("py.warnings")
    warnings_logger.handlers = [handler]
    warnings_logger.propagate = False
    logging.captureWarnings(True)
    return logger


def event(logger: logging.Logger, name: str, message: str, **fields: Any) -> None:
    """Log an INFO event whose fields reach JSON output intact."""
    logger.info(message, extra={"event": name, "fields": fields})


def plural(count: int, singular: str, plural_form: str | None = None) -> str:
    """`1 node`, `2 nodes`, `2 processes`."""
    return f"{count} {singular if count == 1 else plural_form or singular + 's'}"


def duration(seconds: float) -> str:
    """`4.2s` under a minute, else `m:ss` or `h:mm:ss`."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
