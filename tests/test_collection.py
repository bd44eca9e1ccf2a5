"""trainer/collection.py: a worker's imports with the cyclic collector off, what they made
frozen after, and the collector back on whatever happened (benchmarks/startup.py measures
what it saves)."""

from __future__ import annotations

import gc

import pytest

from trainer.collection import uncollected_imports


@pytest.fixture(autouse=True)
def _collector_as_it_was():
    yield
    gc.unfreeze()  # this test process's objects go back to the collector's oldest generation
    gc.enable()


def test_the_imports_run_uncollected_and_what_they_made_is_frozen():
    before = gc.get_freeze_count()
    with uncollected_imports():
        assert not gc.isenabled()
        made = [[index] for index in range(1000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= before + len(made)


def test_a_failed_import_leaves_the_collector_on():
    with pytest.raises(ModuleNotFoundError), uncollected_imports():
        import no_such_module  # noqa: F401
    assert gc.isenabled()
