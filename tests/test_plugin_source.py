"""`ddp-ops render` reads a shipped plug-in's source for its module and function, as the
pod would import them, and refuses only what the import would refuse."""

from __future__ import annotations

import pytest

from operator_scripts.chart.plugin_source import check_plugin_source
from trainer.config import ConfigError
from trainer.config.registry import MODELS


def package(model: str) -> list[dict[str, str]]:
    """The chart's `trainer.code` entries of a package `nets` whose `model.py` is `model`."""
    return [{"path": "nets/__init__.py", "data": ""}, {"path": "nets/model.py", "data": model}]


@pytest.mark.parametrize(
    "source",
    [
        "def build(config, spec):\n    pass\n",
        "def build(config, spec, width=8, *, depth=2):\n    pass\n",
        "def build(*arguments):\n    pass\n",
        "@cache\ndef build(config):\n    pass\n",  # a decorator may change the call: the pod decides
        "from .impl import build\n",
        "build = make_builder()\n",
        "try:\n    from fast import build\nexcept ImportError:\n    def build(config, spec): ...\n",
        "from .impl import *\n",  # a reader cannot know: the pod decides
        "def __getattr__(name):\n    return None\n",
    ],
    ids=["def", "defaults", "varargs", "decorated", "re-export", "assigned", "try", "star", "getattr"],
)
def test_what_the_pods_import_would_find_passes(source):
    check_plugin_source(MODELS, "nets.model:build", package(source))


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("def build(config):\n    pass\n", "cannot be called as build(config, spec): its def, line 1, takes"),
        ("def build(config, spec, extra):\n    pass\n", "cannot be called as build(config, spec)"),
        ("def built(a, b): ...", "nets.model has no callable 'build'; did you mean nets.model:built?"),
        ("def build(config, spec)\n", "nets.model does not parse (SyntaxError: expected ':', line 1)"),
    ],
    ids=["too-few", "too-many", "misnamed", "syntax"],
)
def test_what_the_pods_import_would_refuse_is_one_line_now(source, says):
    with pytest.raises(ConfigError) as refused:
        check_plugin_source(MODELS, "nets.model:build", package(source))
    line = str(refused.value)
    assert line.startswith("model.name='nets.model:build': ") and says in line and "\n" not in line


def test_a_module_in_neither_the_shipped_code_nor_this_python_is_left_to_the_image():
    check_plugin_source(MODELS, "in_the_image.model:build", package("def build(config, spec): ...\n"))
    check_plugin_source(MODELS, "in_the_image.model:build", [])
