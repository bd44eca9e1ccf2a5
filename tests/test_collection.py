"""trainer/collection.py: a worker's imports with the cyclic collector off, what they made
frozen, and the collector back on whatever happened (benchmarks/startup.py measures what it
saves)."""

from __future__ import annotations

import gc

import pytest

from trainer.collection import uncollected_imports


@pytest.fixture(autouse=True)
def _collector_on():
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.enable()


def test_the_imports_run_uncollected_and_the_collector_is_on_after():
    with uncollected_imports():
        assert not gc.isenabled()
        made = [[] for _ in range(100)]  # noqa: F841 (what an import leaves behind)
    assert gc.isenabled() and gc.get_freeze_count() >= 100


def test_a_failed_import_leaves_the_collector_on():
    with pytest.raises(ModuleNotFoundError), uncollected_imports():
        import no_such_module  # noqa: F401
    assert gc.isenabled() and gc.get_freeze_count() == 0
