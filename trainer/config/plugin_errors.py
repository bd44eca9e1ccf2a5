"""An exception raised in a user's plug-in while it builds, as one line that says where.

Uncaught, it was a crash: every rank printed its traceback, torchrun printed them again,
the job restarted, and only the same crash at the same step, a restart later, ended it as
permanent (`trainer/distributed/recurrence.py`). Here the line names the plug-in, the
exception, and the file and line in the user's code where it was raised; the traceback goes
to a file the line names. A bug (a KeyError, a TypeError, ...) is a PluginError, a
ConfigError: exit 2, no restart. An OSError (a file or a service not there yet) is a
PluginIOError, which the job's restarts retry, and the line says so.
"""

from __future__ import annotations

import os
import sysconfig
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from trainer.config.schema import ConfigError

# where libraries live: the frame a line names is the innermost one outside them, the
# user's own call into pandas rather than pandas' raise
LIBRARIES = tuple({sysconfig.get_paths()[kind] for kind in ("stdlib", "platstdlib", "purelib", "platlib")})
TRACEBACKS = Path(tempfile.gettempdir()) / "ddp-trainer-errors"
T = TypeVar("T")


class PluginError(ConfigError):
    """A plug-in's own code raised while it built: a bug there, which no restart fixes."""


class PluginIOError(Exception):
    """A plug-in's code raised an OSError: worth the job's restarts. `error` names it and
    where it was raised, as the recurrence check's record of the crash."""

    def __init__(self, line: str, error: str) -> None:
        super().__init__(line)
        self.error = error

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (str(self), self.error)


@contextmanager
def raised_by_plugin(key: str, name: str) -> Iterator[None]:
    """Around a call into the plug-in `name` (config key `key`): an exception its code
    raises leaves as its one line; its own ConfigError (a DataError, say) already is one."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as error:
        raise plugin_failure(key, name, error) from error


def plugin_failure(key: str, name: str, error: Exception) -> PluginError | PluginIOError:
    """The one-line error for `error`, raised by the plug-in `name` (config key `key`)."""
    saved = _save_traceback(key, error)
    message = (str(error).strip().splitlines() or [""])[0]
    what = f"{type(error).__name__}{f': {message}' if message else ''}{_where(error)}"
    if isinstance(error, OSError):
        retried = "an I/O error, which the job's restarts retry"
        return PluginIOError(f"{key}={name!r}: raised {what}; {retried} ({saved})", what)
    bug = "a bug in the plug-in, which a restart cannot fix"
    return PluginError(key, name, f"raised {what}; {bug} ({saved})")


def read_through(key: str, name: str, items: Iterator[T]) -> Iterator[T]:
    """`items` (a plug-in dataset's batches, read as training goes), with an exception its
    code raises while one is read turned into its one line, as at build."""
    while True:
        with raised_by_plugin(key, name):
            try:
                item = next(items)
            except StopIteration:
                return
        yield item


def _where(error: Exception) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    own = [frame for frame in frames if not frame.filename.startswith(LIBRARIES)] or frames
    return f" at {own[-1].filename}:{own[-1].lineno} in {own[-1].name}" if own else ""


def _save_traceback(key: str, error: Exception) -> str:
    """The traceback in this rank's file, what the line says of it. Named by rank, not by
    process: a restart's same error is then the same line, which the recurrence check
    (trainer/distributed/recurrence.py) finds permanent."""
    path = TRACEBACKS / f"{key.replace('.', '-')}-rank{os.environ.get('RANK', '0')}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(error)))
    except OSError as unwritable:
        return f"its traceback could not be written to {path}: {unwritable.strerror}"
    return f"traceback in {path}"
