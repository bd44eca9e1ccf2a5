"""Loaded into every test process whose PYTHONPATH includes this folder: records, per rank,
each write-like file-system call under $AUDIT_ROOT, through Python's audit hooks."""

import os
import sys

_root = os.environ.get("AUDIT_ROOT")
_log_dir = os.environ.get("AUDIT_LOG_DIR")
_rank = os.environ.get("RANK")

if _root and _log_dir and _rank is not None:
    _log = open(os.path.join(_log_dir, f"rank{_rank}.log"), "a", buffering=1)  # noqa: SIM115
    _write_events = {"os.rename", "os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree", "os.truncate"}

    def _touches_root(path: object) -> bool:
        try:
            return os.path.abspath(os.fsdecode(path)).startswith(_root)
        except TypeError:
            return False

    def _hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode = args[0], args[1]
            writes = isinstance(mode, str) and any(flag in mode for flag in "wax+")
            if writes and _touches_root(path):
                _log.write(f"open {mode} {os.fsdecode(path)}\n")
        elif event in _write_events and args and _touches_root(args[0]):
            _log.write(f"{event} {os.fsdecode(args[0])}\n")

    sys.addaudithook(_hook)
