"""Your own model and data: the example plug-in package (docs/examples/own-model) shipped
with the job by `--code DIR`, as the chart mounts it and `ddp-ops local` runs it; bad
plug-ins and a folder too large for a ConfigMap are each one line."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import CPU_VALUES, REPO, process_env, run_trainer

from operator_scripts.chart.code_bundle import CONFIGMAP_LIMIT, CodeError, code_values
from operator_scripts.chart.render import deep_merge, merge_values, render
from operator_scripts.local.pods import LocalError, _config_map_contents, _projected
from operator_scripts.local.run import run
from trainer.config import ConfigError, DataConfig, plugin_errors
from trainer.config.plugin_errors import PluginError, PluginIOError
from trainer.config.registry import Registry

EXAMPLE = REPO / "docs" / "examples" / "own-model"
PACKAGE = EXAMPLE / "wave_classifier"
PLUGINS = (
    "trainer.config.data.name=wave_classifier.data:build_dataset,"
    "trainer.config.model.name=wave_classifier.model:build_model"
)


def test_a_package_ships_under_its_own_name_and_a_folder_of_modules_at_the_top(tmp_path):
    files = code_values(PACKAGE)["trainer"]["code"]
    assert {f["path"] for f in files} == {
        "wave_classifier/__init__.py", "wave_classifier/data.py", "wave_classifier/model.py"
    }  # fmt: skip
    assert "def build_model" in next(f["data"] for f in files if f["path"].endswith("model.py"))
    (tmp_path / "mods" / "__pycache__").mkdir(parents=True)
    (tmp_path / "mods" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "mods" / "a.py").write_text("A = 1\n")
    (tmp_path / "mods" / "weights.bin").write_bytes(b"\xff\xfe")
    files = code_values(tmp_path / "mods")["trainer"]["code"]
    assert files == [{"path": "a.py", "data": "A = 1\n"}, {"path": "weights.bin", "binaryData": "//4="}]


def test_a_folder_past_a_configmap_is_refused_in_one_line_naming_the_way_out(tmp_path):
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "table.py").write_text("#" * (CONFIGMAP_LIMIT + 1))
    with pytest.raises(CodeError, match=r"^--code .*big: 1\.00 MiB, more than the 1 MiB a ConfigMap holds; "
                                        r"build a derived image instead"):  # fmt: skip
        code_values(tmp_path / "big")
    completed = subprocess.run(
        [sys.executable, "-m", "operator_scripts.cli", "render", "--code", str(tmp_path / "big")],
        capture_output=True, text=True, env=process_env(),
    )  # fmt: skip
    assert completed.returncode == 2 and completed.stdout == ""
    assert completed.stderr.strip().splitlines() == [
        f"ddp-ops render: error: --code {tmp_path / 'big'}: 1.00 MiB, more than the 1 MiB a ConfigMap holds; "
        "build a derived image instead (README, 'Your own model and data')"
    ]


def test_the_chart_mounts_shipped_code_first_on_the_path_and_nothing_without_it():
    values = merge_values(files=[CPU_VALUES])
    plain = render(values)
    assert not [c for c in plain.of_kind("ConfigMap") if c["metadata"]["name"].endswith("-code")]
    shipped = render(deep_merge(values, code_values(PACKAGE)))
    (code,) = [c for c in shipped.of_kind("ConfigMap") if c["metadata"]["name"] == "ddp-run-ddp-trainer-code"]
    assert code["immutable"] is True
    spec = shipped.one("PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "code"]
    projected = _projected(volume["configMap"], _config_map_contents(code), "configmap")
    assert projected == {f["path"]: f["data"] for f in code_values(PACKAGE)["trainer"]["code"]}
    container = spec["containers"][0]
    assert {"name": "PYTHONPATH", "value": "/opt/ddp-code"} in container["env"]
    assert {"name": "code", "mountPath": "/opt/ddp-code", "readOnly": True} in container["volumeMounts"]


def test_a_configmap_volume_naming_a_missing_key_keeps_the_pod_from_starting():
    with pytest.raises(LocalError, match="configmap code references non-existent config key: f0009"):
        _projected({"name": "code", "items": [{"key": "f0009", "path": "a.py"}]}, {"f0000": ""}, "configmap")


def test_a_plugin_module_that_fails_as_it_imports_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "needs_a_driver.py").write_text("raise RuntimeError('libcuda.so.1 not found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry("data.name", "dataset", ("config", "seed"), builtins={})
    with pytest.raises(ConfigError) as raised:
        registry.resolve("needs_a_driver:build")
    assert str(raised.value) == (
        "data.name='needs_a_driver:build': importing needs_a_driver failed "
        "(RuntimeError: libcuda.so.1 not found)"
    )


BUGGY_PLUGIN = """
import json


def build(config, seed):
    return json.loads(config)  # a ValueError raised in json, called from line 6


def needs_a_file(config, seed):
    return open("/nonexistent/labels.csv")
"""


def test_a_plugins_exception_is_one_line_naming_its_line_and_an_io_error_is_retried(tmp_path, monkeypatch):
    (tmp_path / "buggy_data.py").write_text(BUGGY_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugin_errors, "TRACEBACKS", tmp_path / "tracebacks")
    registry = Registry("data.name", "dataset", ("config", "seed"), builtins={})
    with pytest.raises(PluginError) as raised:  # a ConfigError: exit 2, no restart
        registry.build("buggy_data:build", "{", 0)
    where = f"{tmp_path / 'buggy_data.py'}:6 in build"  # the plug-in's line, not json's
    traceback_file = tmp_path / "tracebacks" / f"data-name-rank{os.environ.get('RANK', '0')}.txt"
    assert str(raised.value) == (
        "data.name='buggy_data:build': raised JSONDecodeError: Expecting property name enclosed in "
        f"double quotes: line 1 column 2 (char 1) at {where}; a bug in the plug-in, which a restart "
        f"cannot fix (traceback in {traceback_file})"
    )
    assert "json/decoder.py" in traceback_file.read_text()  # the whole traceback, there
    with pytest.raises(PluginIOError) as raised:
        registry.build("buggy_data:needs_a_file", "{}", 0)
    assert str(raised.value).startswith(
        "data.name='buggy_data:needs_a_file': raised FileNotFoundError: [Errno 2] No such file or "
        f"directory: '/nonexistent/labels.csv' at {tmp_path / 'buggy_data.py'}:10 in needs_a_file; "
        "an I/O error, which the job's restarts retry (traceback in "
    )


@pytest.mark.slow
def test_a_key_error_in_a_plugin_datasets_getitem_mid_run_is_one_line_and_no_restart(tmp_path):
    """The commonest bug in one's own data code, met by a sample read after steps have run:
    one line naming the plug-in's line, exit 2 (permanent: ddp-launch relaunches nothing),
    no traceback shown; the traceback is in the file the line names."""
    tracebacks = tmp_path / "tmp"
    tracebacks.mkdir()
    settings = "data.name=plugins:poisoned_digits,data.options.bad_index=1000,data.options.error=KeyError"
    done = run_trainer(
        ["--config", "digits", "--set", f"{settings},log.every_steps=1"],
        tmp_path,
        env=process_env({"TMPDIR": str(tracebacks)}),
    )
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.splitlines()
    assert re.fullmatch(
        r"trainer: error: data.name='plugins:poisoned_digits': raised KeyError: 'label' "
        r"at \S+/plugins\.py:\d+ in __getitem__; a bug in the plug-in, which a restart cannot fix "
        r"\(traceback in (\S+)\)",
        line,
    ), line
    assert "Traceback" not in done.stdout and re.search(r"step [1-9]\d*/", done.stdout)  # steps ran first
    saved = re.search(r"traceback in (\S+)\)$", line)[1]
    assert saved.startswith(str(tracebacks)) and "KeyError: 'label'" in Path(saved).read_text()


def test_the_example_dataset_is_the_same_on_every_rank_and_split_by_the_config():
    # the example's own file, under a name of its own: a `wave_classifier` another test of this
    # process imported (a changed copy) is not the one under test
    spec = importlib.util.spec_from_file_location("example_wave_data", PACKAGE / "data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    one, two = module.build_dataset(DataConfig(), 0), module.build_dataset(DataConfig(), 1)
    assert len(one.train) + len(one.val) + len(one.test) == 2048
    first, second = one.train.tensors[0], two.train.tensors[0]  # the run seed changes nothing
    assert torch.equal(first, second), (
        f"{(first != second).sum()} values differ, at most by {(first - second).abs().max()}"
    )
    assert one.spec.input_shape == (1, 64) and one.spec.num_classes == 4


@pytest.mark.slow
def test_ddp_ops_local_trains_the_example_shipped_with_code(tmp_path):
    """The user's command: `ddp-ops local --code DIR`, two pods, the plug-ins imported from
    the shipped files alone (the pods' PYTHONPATH is the chart's, not this checkout's)."""
    completed = subprocess.run(
        [sys.executable, "-m", "operator_scripts.cli", "local", "--code", str(PACKAGE), "-f", str(CPU_VALUES),
         "--set", f"{PLUGINS},trainer.config.train.epochs=2", "--workdir", str(tmp_path / "pods"),
         "--timeout-s", "180"],
        env=process_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert completed.stdout.strip().splitlines()[-1].startswith("job ddp-run-ddp-trainer: Succeeded")
    rank0 = (tmp_path / "pods" / "ddp-run-ddp-trainer-worker-0" / "pytorch.log").read_text()
    assert "wave_classifier.model:build_model" in rank0 and "done: " in rank0, rank0[-2000:]


@pytest.mark.slow
def test_a_shipped_model_of_the_wrong_type_fails_the_job_at_once(tmp_path):
    broken = tmp_path / "wave_classifier"
    shutil.copytree(PACKAGE, broken)
    model = broken / "model.py"  # a builder that returns its layers in a list
    model.write_text(
        model.read_text() + "\n\ndef build_model(config, spec):\n    return [nn.Linear(64, 4)]\n"
    )
    values = deep_merge(merge_values(files=[CPU_VALUES], sets=[PLUGINS]), code_values(broken))
    started = time.monotonic()
    outcome = run(
        render(values, release="bad-run").objects, tmp_path / "pods", timeout=120, host_env=process_env()
    )
    # no retry, no back-off: one start of two pods (each importing torch, beside a busy suite)
    assert time.monotonic() - started < 90
    assert outcome.status == "Failed" and "exited with code 2, not retryable" in outcome.reason
    assert (outcome.restarts, outcome.recreations) == (0, 0)
    rank0 = outcome.logs["bad-run-ddp-trainer-worker-0"].read_text().strip()
    assert rank0.splitlines()[-1] == (
        "trainer: error: model.name='wave_classifier.model:build_model': "
        "a model builder must return a torch.nn.Module"
    ), rank0[-2000:]


SHAPE_BUG = (
    "        nn.Flatten(),\n",
    "",
    re.escape(
        "trainer: error: model.name='wave_classifier.model:build_model': one batch of "
        "data.name='wave_classifier.data:build_dataset' (inputs (32, 1, 64) float32, targets (32,) int64) "
        "fails in the forward: RuntimeError: mat1 and mat2 shapes cannot be multiplied (1024x1 and 32x4)"
    ),
)
KEY_ERROR = (  # the commonest bug in one's own code: a setting the builder expects and nobody set
    "    channels, layers = spec.input_shape[0], []\n",
    '    channels, layers = spec.input_shape[0] * config.options["channels"], []\n',
    r"trainer: error: model.name='wave_classifier.model:build_model': raised KeyError: 'channels' at "
    r"\S+/wave_classifier/model.py:17 in build_model; a bug in the plug-in, which a restart cannot fix "
    r"\(traceback in \S+\.txt\)",
)


@pytest.mark.slow
@pytest.mark.alone  # its bound is the start-up of two pods, which a busy machine stretches
@pytest.mark.parametrize(("line", "replacement", "said"), [SHAPE_BUG, KEY_ERROR], ids=["shape", "key-error"])
def test_a_shipped_model_with_a_bug_fails_in_one_line_before_any_step(tmp_path, line, replacement, said):
    """The example without its Flatten: its last Linear meets (32, 32, 1), not (32, 32); or
    its builder reading a key nobody set. Tried before any process group, either is one line
    and exit 2 on each pod, and the job Failed without a retry; measured here, from outside,
    as a user runs it."""
    broken = tmp_path / "wave_classifier"
    shutil.copytree(PACKAGE, broken)
    model = broken / "model.py"
    assert line in model.read_text()
    model.write_text(model.read_text().replace(line, replacement))
    started = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-m", "operator_scripts.cli", "local", "--code", str(broken), "-f", str(CPU_VALUES),
         "--set", PLUGINS, "--workdir", str(tmp_path / "pods"), "--timeout-s", "120"],
        env=process_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    output = completed.stdout + completed.stderr
    assert completed.returncode != 0 and "Failed" in completed.stdout.strip().splitlines()[-1], output[-3000:]
    assert "Traceback" not in output and "exception occurred" not in output, output
    assert len(output.splitlines()) <= 40, output
    assert elapsed < 30, output
    rank0 = (tmp_path / "pods" / "ddp-run-ddp-trainer-worker-0" / "pytorch.log").read_text()
    assert "Traceback" not in rank0, rank0[-3000:]
    (error,) = [line for line in rank0.splitlines() if "trainer: error:" in line]
    assert re.fullmatch(said, error), error
    # the failed pod's termination message, as the kubelet reads it and `kubectl describe pod`
    # shows it: whichever pod failed first (the other is deleted), its trainer's one line
    failed = re.search(r"Failed \(pod (\S+) exited with code 2", completed.stdout)[1]
    its_log = (tmp_path / "pods" / failed / "pytorch.log").read_text()
    # its rank's line, and ddp-launch's own copy of it where rank 0 (another pod) did not say it
    said_there = {
        "trainer: error: " + line.partition("trainer: error: ")[2]  # without the [rank N] prefix
        for line in its_log.splitlines()
        if "trainer: error:" in line
    }
    (message,) = said_there
    assert re.fullmatch(said, message), message
    assert f"pod {failed}: exit 2: {message}" in completed.stderr.splitlines(), output
