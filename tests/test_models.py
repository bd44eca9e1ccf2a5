"""The model registry: built-ins fit their data, plug-ins load by import path, misfits are refused."""

import inspect

import pytest
import torch

from trainer.config import ConfigError, ModelConfig
from trainer.config.registry import DATASETS, MODELS
from trainer.data.base import DataSpec
from trainer.models import build_model

DIGITS = DataSpec("classification", (1, 8, 8), 10)
MNIST = DataSpec("classification", (1, 28, 28), 10)
TOKENS = DataSpec("language_modeling", (32,), 50, 32)


@pytest.mark.parametrize(
    ("name", "spec", "inputs", "out_shape"),
    [
        ("cnn", DIGITS, torch.randn(4, 1, 8, 8), (4, 10)),
        ("cnn", MNIST, torch.randn(4, 1, 28, 28), (4, 10)),
        ("mlp", MNIST, torch.randn(4, 1, 28, 28), (4, 10)),
        ("transformer", TOKENS, torch.randint(0, 50, (4, 32)), (4, 32, 50)),
    ],
)
def test_builtins_fit_their_data(name, spec, inputs, out_shape):
    model = build_model(ModelConfig(name=name, width=16, depth=2, heads=2), spec)
    assert model(inputs).shape == out_shape


@pytest.mark.parametrize("registry", [DATASETS, MODELS], ids=["datasets", "models"])
def test_each_builtin_name_imports_a_builder_that_takes_the_registrys_arguments(registry):
    """Built-ins are import paths, imported only when built: a path that names nothing would
    pass `check` (which does not import them) and fail in the pod."""
    for name in registry.names:
        registry.check(name)
        inspect.signature(registry.resolve(name)).bind(*registry.arguments)
    with pytest.raises(ConfigError, match=r"unknown .*; did you mean"):
        registry.check(registry.names[0][:-1])


def test_transformer_declares_training_flops_from_its_size():
    config = ModelConfig(name="transformer", width=32, depth=2, heads=4)
    model = build_model(config, TOKENS)
    params = sum(p.numel() for p in model.parameters()) - model.positions.weight.numel()
    assert model.flops_per_sample == (6 * params + 12 * 2 * 32 * 32) * 32


def test_transformer_is_causal():
    model = build_model(ModelConfig(name="transformer", width=16, depth=1, heads=2, dropout=0), TOKENS).eval()
    tokens = torch.randint(0, 50, (1, 32))
    changed = tokens.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 50
    assert torch.allclose(model(tokens)[0, :20], model(changed)[0, :20], atol=1e-6)


def test_models_refuse_the_wrong_kind_of_data():
    with pytest.raises(ConfigError, match=r"model\.name='cnn'.*needs classification data with 3-d inputs"):
        build_model(ModelConfig(name="cnn"), TOKENS)


def test_heads_must_divide_width():
    with pytest.raises(ConfigError, match=r"model\.heads=3: must divide model\.width=32"):
        build_model(ModelConfig(name="transformer", width=32, heads=3), TOKENS)


def test_a_users_model_plugs_in_by_import_path():
    model = build_model(ModelConfig(name="plugins:linear_model"), DIGITS)
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("vit", "unknown model; allowed: cnn, mlp, transformer or package.module:function"),
        ("plugins:absent", "plugins has no callable 'absent'$"),
        ("plugins:", "unknown model"),
        ("cn", "unknown model; did you mean cnn\\? allowed: cnn, mlp, transformer"),
        ("plugins:linear_modle", "no callable 'linear_modle'; did you mean plugins:linear_model\\?$"),
    ],
)
def test_unknown_models_name_what_is_allowed(name, message):
    with pytest.raises(ConfigError, match=message):
        build_model(ModelConfig(name=name), DIGITS)
