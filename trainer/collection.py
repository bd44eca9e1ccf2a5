"""The cyclic garbage collector around the start-up's imports.

torch's import (with dynamo and inductor, which the optimizer loads anyway) makes about a
million objects and almost no garbage, yet the collector walks them again and again as they
pile up, and again in every full collection after. With it off during the imports and what
they made frozen (`gc.freeze`: never walked again), a world of one's short run takes 0.65 of
the CPU time (docs/performance.md, "Start-up"), on every worker, every restart and every pod.
What freezing costs: the imports' little garbage is kept for good. It once showed a
deadlock that was not its own: the DDP reducer outlived `destroy_process_group` (see
`trainer.run.lifecycle._run_loop`), and freezing only moved when it was freed."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def uncollected_imports() -> Iterator[None]:
    """Run the imports inside with the collector off, freeze what they made, then turn the
    collector back on (also when an import fails, unfrozen: the error is reported by a
    process that collects as usual)."""
    gc.disable()
    try:
        yield
        gc.freeze()
    finally:
        gc.enable()
