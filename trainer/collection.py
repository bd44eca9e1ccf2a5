"""The cyclic garbage collector around the start-up's imports.

torch's import (with dynamo and inductor, which the optimizer loads anyway) makes about a
million objects and almost no garbage, yet the collector walks them again and again as they
pile up: with it off, the imports take 1.27 CPU-s instead of 1.73 (docs/performance.md,
"Start-up"), on every worker, every restart and every pod. What they made is frozen after
(`gc.freeze`): it lives as long as the process, and a full collection during training no
longer walks it."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def uncollected_imports() -> Iterator[None]:
    """Run the imports inside with the collector off; freeze what they made, then turn the
    collector back on (also when an import fails: the error is reported by a process that
    collects as usual)."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
