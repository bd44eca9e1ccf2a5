"""Named builders plus user plug-ins by import path (`package.module:function`).

Datasets and models share this so that a user's own code plugs in the same way for both.
A built-in name stands for an import path too, imported only when it is built: checking a
name (`ddp-launch`, `ddp-ops`) then needs no torch, whose import is most of a pod's start-up.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from types import ModuleType
from typing import Generic, TypeVar

from trainer.config import ConfigError, did_you_mean
from trainer.config.plugin_errors import raised_by_plugin, read_through

Builder = TypeVar("Builder", bound=Callable)
T = TypeVar("T")


class Registry(Generic[Builder]):
    """Builders by name (built-ins, each an import path) or by `module:attribute` (plug-ins)."""

    def __init__(self, key: str, kind: str, arguments: tuple[str, ...], builtins: dict[str, str]) -> None:
        """`arguments`: what a builder is called with, by position (checked on plug-ins);
        `builtins`: each built-in name's `module:attribute`."""
        self.key, self.kind, self.arguments = key, kind, arguments
        self._builtins = builtins

    @property
    def names(self) -> list[str]:
        return sorted(self._builtins)

    def is_plugin(self, name: str) -> bool:
        """Whether `name` is a plug-in's `module:attribute`: the user's code, not ours."""
        return name not in self._builtins and ":" in name

    def check(self, name: str) -> None:
        """What `resolve` would refuse, without importing a built-in; a ConfigError."""
        if name not in self._builtins:
            self.resolve(name)

    def build(self, name: str, *arguments: object) -> object:
        """What the builder for `name` returns. An exception raised in a plug-in's own code
        is one line naming where (PluginError, or PluginIOError for an OSError); a built-in's
        is this project's bug, and keeps its traceback."""
        builder = self.resolve(name)
        with self.calling(name):
            return builder(*arguments)

    def reading(self, name: str, items: Iterator[T]) -> Iterator[T]:
        """`items` read from the code behind `name`: a plug-in's exception, as it reads one,
        is its one line (`read_through`); a built-in's iterator is handed back as it is."""
        return read_through(self.key, name, items) if self.is_plugin(name) else items

    def calling(self, name: str) -> AbstractContextManager[None]:
        """Around any call into the code behind `name`: a plug-in's exception leaves as its
        one line (`raised_by_plugin`), a built-in's as it is."""
        return raised_by_plugin(self.key, name) if self.is_plugin(name) else nullcontext()

    def resolve(self, name: str) -> Builder:
        """The builder for `name`, or a ConfigError naming the key and the allowed values."""
        if name in self._builtins:
            module_name, _, attribute = self._builtins[name].partition(":")
            return getattr(importlib.import_module(module_name), attribute)
        allowed = f"allowed: {', '.join(self.names)} or package.module:function"
        module_name, colon, attribute = name.partition(":")
        if not colon or not module_name or not attribute:
            hint = did_you_mean(name, {known: known for known in self.names})
            raise ConfigError(self.key, name, f"unknown {self.kind}; {hint}{allowed}")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ConfigError(self.key, name, f"cannot import {module_name} ({error})") from None
        except Exception as error:  # the module fails as it runs: a SyntaxError, a NameError at its top
            why = f"{type(error).__name__}: {error}"
            raise ConfigError(self.key, name, f"importing {module_name} failed ({why})") from None
        builder = getattr(module, attribute, None)
        if not callable(builder):
            own = [item for item, value in vars(module).items() if _is_own_builder(item, value, module)]
            raise ConfigError(self.key, name, no_callable(module_name, attribute, own))
        call = f"{attribute}({', '.join(self.arguments)})"
        try:
            inspect.signature(builder).bind(*self.arguments)
        except TypeError as error:
            raise ConfigError(self.key, name, f"cannot be called as {call}: {error}") from None
        except ValueError:  # a builtin without a signature: its call will tell
            pass
        return builder


def no_callable(module_name: str, attribute: str, own: list[str]) -> str:
    """What is wrong with a plug-in whose module lacks `attribute`, with a "did you mean"
    among the module's own public functions and classes (`own`)."""
    hint = did_you_mean(
        attribute, {item: f"{module_name}:{item}" for item in own if not item.startswith("_")}
    )
    problem = f"{module_name} has no callable {attribute!r}"
    return f"{problem}; {hint.rstrip()}" if hint else problem


def _is_own_builder(name: str, value: object, module: ModuleType) -> bool:
    """A public function or class of the module's own, not one it imported (torch's Dataset)."""
    defined_here = getattr(value, "__module__", None) == module.__name__
    return not name.startswith("_") and callable(value) and defined_here


DATASETS: Registry[Callable] = Registry(
    "data.name", "dataset", ("config", "seed"),
    builtins={
        "digits": "trainer.data.digits:build_digits",
        "mnist": "trainer.data.mnist:build_mnist",
        "shards": "trainer.data.shards:build_shards",
        "synthetic": "trainer.data.synthetic:build_synthetic",
    },
)  # fmt: skip
MODELS: Registry[Callable] = Registry(
    "model.name", "model", ("config", "spec"),
    builtins={
        "cnn": "trainer.models.cnn:build_cnn",
        "mlp": "trainer.models.mlp:build_mlp",
        "transformer": "trainer.models.transformer:build_transformer",
    },
)  # fmt: skip
