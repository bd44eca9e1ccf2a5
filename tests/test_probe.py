"""The one-batch probe of model and data before any process group (trainer/loop/probe.py):
a model that does not fit its data is one line naming both; one that fits passes, with its
weights, gradients and the RNG as they were, also where the meta device cannot run it.
`python -m trainer --check` runs it too, with the data built where the command runs."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from trainer.cli import main
from trainer.config import ConfigError, load_config, plugin_errors
from trainer.config.plugin_errors import PluginError
from trainer.data import build_data
from trainer.loop.probe import probe_plugins

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def digits():
    config = load_config("digits")
    return config, build_data(config.data, config.seed)


class Reads(nn.Module):
    """Fits the data, but reads a value (`.item()`), which no meta tensor has."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Dropout(0.5), nn.Linear(64, 10), nn.BatchNorm1d(10))
        self.seen = 0.0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.seen += inputs.abs().sum().item()
        return self.layers(inputs)


def test_a_model_that_fits_passes_and_nothing_of_it_or_the_rng_changes(digits):
    config, splits = digits
    model = Reads()  # meta cannot run it: the real run on a copy decides
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    rng = torch.get_rng_state()
    probe_plugins(config, splits, model, CPU)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert model.seen == 0.0 and all(parameter.grad is None for parameter in model.parameters())


def test_a_model_that_declares_no_flops_gets_what_the_meta_pass_counted(digits):
    config, splits = digits
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    probe_plugins(config, splits, model, CPU)
    # the forward's matmul and the weight's gradient, 2 x 64 x 10 each a sample (the inputs
    # need no gradient); the bias's is a sum, no FLOP counted
    assert model.flops_per_sample == 2 * (2 * 64 * 10)
    declared = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    declared.flops_per_sample = 1.0
    probe_plugins(config, splits, declared, CPU)
    assert declared.flops_per_sample == 1.0  # a model's own figure wins


@pytest.mark.parametrize(
    ("model", "failure"),
    [
        (nn.Linear(64, 10), "fails in the forward: RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
        (nn.Sequential(nn.Flatten(0)), "fails in the loss: "),  # a 1-D output: no class axis
    ],
)
def test_a_model_that_does_not_fit_its_data_is_one_line_naming_both(digits, model, failure):
    config, splits = digits
    with pytest.raises(ConfigError) as raised:
        probe_plugins(config, splits, model, CPU)
    line = str(raised.value)
    shapes = "(inputs (32, 1, 8, 8) float32, targets (32,) int64)"
    assert line.startswith(f"model.name='cnn': one batch of data.name='digits' {shapes} "), line
    assert failure in line and "\n" not in line, line


def test_check_builds_the_data_and_puts_a_batch_through_the_model_where_it_runs(tmp_path, capsys):
    uri = tmp_path / "checkpoints"
    assert main(["--config", "digits", "--set", f"checkpoint.uri={uri}", "--check"]) == 0
    said = capsys.readouterr().out.strip()
    data = r"data digits \([\d,]+ training samples, a batch through cnn\)"
    expected = rf"trainer: configuration, {data} and {uri} are usable"
    assert re.fullmatch(expected, said), said
    # a model that cannot take the data is found by --check, not by the pods' first step
    assert (
        main(["--config", "digits", "--set", f"model.name=transformer,checkpoint.uri={uri}", "--check"]) == 2
    )
    assert "model.name='transformer': needs language_modeling data" in capsys.readouterr().err


def test_check_refuses_a_data_path_that_is_not_there_and_leaves_one_in_s3_to_the_pods(tmp_path, capsys):
    uri, missing = tmp_path / "checkpoints", tmp_path / "nowhere"
    assert main(["--set", f"data.name=mnist,data.path={missing},checkpoint.uri={uri}", "--check"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"trainer: error: data.path='{missing}': "), line
    settings = f"data.name=shards,data.path=s3://datasets/tokens,checkpoint.uri={uri}"
    assert main(["--set", settings, "--check"]) == 0
    assert "data shards (its s3://datasets/tokens is read and checked in the pods)" in capsys.readouterr().out


class RaisingOnRead(Dataset):
    """A plug-in dataset whose reading fails: the commonest bug, a key its samples lack."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return {"image": torch.zeros(64)}["label"]


def test_a_plugin_datasets_first_read_that_raises_is_one_line_naming_its_line(digits, tmp_path, monkeypatch):
    monkeypatch.setattr(plugin_errors, "TRACEBACKS", tmp_path)
    config = load_config("digits", ["data.name=my_data:build"])
    splits = dataclasses.replace(digits[1], val=RaisingOnRead())
    with pytest.raises(PluginError) as raised:
        probe_plugins(config, splits, nn.Linear(64, 10), CPU)
    assert re.fullmatch(
        r"data.name='my_data:build': raised KeyError: 'label' at \S+/tests/test_probe.py:\d+ in __getitem__; "
        r"a bug in the plug-in, which a restart cannot fix \(traceback in \S+\)",
        str(raised.value),
    )
