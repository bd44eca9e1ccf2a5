"""The cyclic garbage collector around the start-up's imports.

torch's import (with dynamo and inductor, which the optimizer loads anyway) makes about a
million objects and almost no garbage, yet the collector walks them again and again as they
pile up: with it off during the imports, a world of one's short run takes 0.92 of the CPU
time (docs/performance.md, "Start-up"), on every worker, every restart and every pod. What
the imports made is not frozen (`gc.freeze`), though that saved far more: a DDP reducer
kept out of the collector's reach was freed at a return instead of in the process group's
teardown, and its gloo threads' join deadlocked on the GIL."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def uncollected_imports() -> Iterator[None]:
    """Run the imports inside with the collector off, then turn it back on (also when an
    import fails: the error is reported by a process that collects as usual)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
