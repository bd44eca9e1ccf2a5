"""`train.compile` and its cache, in one process: what compiles, what a checkpoint's keys
stay, which blocks are found, and how the cache folder travels. The compiled multi-rank runs
(bit-exact across a kill, cold against warm compile times) are `python -m benchmarks.compile`
and `python -m benchmarks.fault_trials --set train.compile=model`."""

from __future__ import annotations

import copy
import io
import logging
import tarfile
import tempfile

import pytest
import torch
from conftest import process_env, run_trainer

from trainer.checkpoint.store import LocalStore
from trainer.config import ConfigError, load_config
from trainer.data.base import DataSpec
from trainer.launcher.forkserver import differing_import_time_env
from trainer.loop.compile_cache import CompileCache, cached_files
from trainer.loop.compiling import compile_in_place, graphs_compiled, repeated_blocks
from trainer.models import build_model
from trainer.run.device_defaults import for_device

LOG = logging.getLogger("test")
DIGITS = DataSpec("classification", (1, 8, 8), 10)
TOKENS = DataSpec("language_modeling", (16,), 32)


def model(name: str, spec: DataSpec, **sets: object) -> torch.nn.Module:
    overrides = ",".join(f"model.{key}={value}" for key, value in {"name": name, **sets}.items())
    torch.manual_seed(0)
    return build_model(load_config(None, [overrides]).model, spec)


def test_a_compiled_sequential_really_compiles_and_keeps_its_keys_and_numbers():
    """The bundled models are bare nn.Sequentials (the CNN) or hold them, which
    `nn.Module.compile()` leaves eager (no graph): the forward compiled in place gives graphs,
    the eager model's keys and its outputs. A small one: the class is the point."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, 8), torch.nn.ReLU(), torch.nn.Linear(8, 10)
    )
    compiled = copy.deepcopy(eager)
    before = graphs_compiled()
    assert compile_in_place(compiled, "model", "cnn") == 1
    inputs = torch.randn(4, 1, 8, 8)
    eager.eval(), compiled.eval()
    torch.testing.assert_close(compiled(inputs), eager(inputs), rtol=1e-5, atol=1e-6)
    assert graphs_compiled() > before
    assert list(compiled.state_dict()) == list(eager.state_dict())
    eager.load_state_dict(compiled.state_dict())  # a compiled run's checkpoint loads eager


def test_blocks_are_the_transformers_layers_and_a_model_without_them_is_refused():
    transformer = model("transformer", TOKENS, width=16, depth=3, heads=2)
    assert [type(block).__name__ for block in repeated_blocks(transformer)] == ["Block"] * 3
    cnn = model("cnn", DIGITS, width=4, depth=3)  # repeated Conv2d and ReLU: layers, not blocks
    assert repeated_blocks(cnn) == []
    with pytest.raises(ConfigError) as refused:
        compile_in_place(cnn, "blocks", "cnn")
    assert str(refused.value).startswith("train.compile='blocks': model.name='cnn' has no blocks")
    assert str(refused.value).endswith("use train.compile=model")


@pytest.mark.parametrize(
    ("device", "sets", "expected"),
    [
        ("cpu", "", ("off", "off")),
        ("cuda", "", ("bf16", "model")),
        ("cuda", "train.amp=off,train.compile=blocks", ("off", "blocks")),
        ("cpu", "train.amp=bf16,train.compile=model", ("bf16", "model")),
    ],
)
def test_auto_means_bf16_and_compiled_on_cuda_and_fp32_eager_on_cpu(device, sets, expected):
    config = for_device(load_config(None, [sets] if sets else []), torch.device(device))
    assert (config.train.amp, config.train.compile) == expected


def test_the_cache_folder_travels_as_one_archive_and_unpacks_whole(tmp_path, monkeypatch):
    """Rank 0 of the first pod publishes its folder; a new pod's empty folder is filled from
    the store; a restart's own folder is used as it is."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node-a"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    store = LocalStore(tmp_path / "checkpoints")
    store.prepare()
    first = CompileCache(store, "k1", shared=True, writes=True)
    assert first.open(LOG) == "cold"
    (first.folder / "fxgraph" / "ab").mkdir(parents=True)
    (first.folder / "fxgraph" / "ab" / "entry").write_bytes(b"graph")
    (first.folder / "locks").mkdir()
    (first.folder / "locks" / "held.lock").write_bytes(b"")
    first.publish(LOG)
    first.upload.join(timeout=30)
    assert (tmp_path / "checkpoints" / "compile-cache-k1.tar.gz").is_file()

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node-b"))  # a new pod: an empty /tmp
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")  # its own process: the first one's setting is not there
    second = CompileCache(store, "k1", shared=True, writes=False)
    assert second.folder != first.folder
    assert second.open(LOG) == "shared"
    assert cached_files(second.folder) == {"fxgraph/ab/entry"}  # no lock files shipped
    for key, found in {"k1": "local", "k2": "cold"}.items():  # a restart; another configuration
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
        assert CompileCache(store, key, shared=True, writes=False).open(LOG) == found


def test_an_archive_that_reaches_outside_its_folder_or_is_damaged_costs_a_compile_only(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        entry = tarfile.TarInfo("../escaped")
        entry.size = 1
        archive.addfile(entry, io.BytesIO(b"x"))
    store = LocalStore(tmp_path / "checkpoints")
    store.prepare()
    for key, data in {"escape": buffer.getvalue(), "damaged": buffer.getvalue()[:20]}.items():
        store.put(f"compile-cache-{key}.tar.gz", data)
        cache = CompileCache(store, key, shared=True, writes=False)
        assert cache.open(LOG) == "cold"
        assert cached_files(cache.folder) == set()
    assert not list(tmp_path.rglob("escaped"))
    assert [record.getMessage().split(" cannot be unpacked")[0] for record in caplog.records] == [
        "compile cache: compile-cache-escape.tar.gz",
        "compile cache: compile-cache-damaged.tar.gz",
    ]


def test_a_fork_server_serves_only_workers_with_its_compile_settings():
    server = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": "/cache"}
    assert differing_import_time_env(dict(server), server) is None
    worker = {**server, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
    assert (
        differing_import_time_env(worker, server) == "TORCHINDUCTOR_FX_GRAPH_CACHE differ from the server's"
    )
    assert differing_import_time_env({"OMP_NUM_THREADS": "1"}, server) == (
        "TORCHINDUCTOR_CACHE_DIR differ from the server's"
    )


@pytest.mark.slow
def test_a_compile_that_fails_is_one_line_and_exit_2_and_saves_nothing(tmp_path):
    """No C++ compiler (a derived image without one, say): inductor's build fails in the
    first step, and the run says so in one line, with what to do, instead of a traceback."""
    env = {
        **process_env(),
        "CXX": str(tmp_path / "no-compiler"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
    }
    overrides = f"train.compile=model,train.max_steps=3,metrics.port=0,checkpoint.uri={tmp_path / 'run'}"
    done = run_trainer(["--set", overrides], tmp_path, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "trainer: error:" in line]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert errors[0].startswith("trainer: error: train.compile='model': torch.compile could not compile")
    assert errors[0].endswith("set train.compile=off to train it eager")
    assert not list((tmp_path / "run").glob("step-*"))
