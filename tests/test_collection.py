"""trainer/collection.py: a worker's imports with the cyclic collector off, and the collector
back on whatever happened (benchmarks/startup.py measures what it saves)."""

from __future__ import annotations

import gc

import pytest

from trainer.collection import uncollected_imports


@pytest.fixture(autouse=True)
def _collector_on():
    yield
    gc.enable()


def test_the_imports_run_uncollected_and_the_collector_is_on_after():
    with uncollected_imports():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_failed_import_leaves_the_collector_on():
    with pytest.raises(ModuleNotFoundError), uncollected_imports():
        import no_such_module  # noqa: F401
    assert gc.isenabled()
