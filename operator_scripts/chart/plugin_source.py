"""A plug-in's `package.module:function`, checked in its source before the job is rendered.

Where `ddp-ops` runs there may be no torch, and importing a user's module would run it; so
the module is found as the pod would find it, and read, not imported: in the code shipped
with the job (`--code`, the chart's `trainer.code` files, first on the pods' PYTHONPATH),
else where the operator's own Python finds it (an installed package). Its top-level
statements say whether the function is there and, for a plain `def`, whether it takes the
registry's arguments. A module found in neither place is left to the pod: it may be the
image's. A module that defines names in ways a reader cannot follow (`import *`, a module
`__getattr__`) is left to the pod too.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from trainer.config import ConfigError, did_you_mean
from trainer.config.registry import Registry, no_callable

Reader = Callable[[str], "str | None"]  # a module's source by its path ("pkg/mod.py"), or None
Listing = Callable[[str], "list[str] | None"]  # the modules in a folder ("pkg"), or None


def check_plugin_source(registry: Registry, name: str, shipped: list[dict[str, Any]]) -> None:
    """Raise the ConfigError the pod would raise for plug-in `name` (no such module or
    function, a `def` that cannot take the registry's arguments), where its source is here."""
    module_name, _, attribute = name.partition(":")
    parts = module_name.split(".")
    read, listing = shipped_reader(shipped) if is_shipped(parts[0], shipped) else installed_reader(parts[0])
    if read is None:  # the image's, or a slip of the pen for a package shipped with the job
        if hint := module_hint(parts, 0, attribute, shipped_reader(shipped)[1]("") or []):
            raise ConfigError(registry.key, name, f"{parts[0]} is not shipped with the job; {hint}")
        return
    source = module_source(parts, read, listing)
    if isinstance(source, int):  # the index of the first part not found
        within = ".".join(parts[:source]) or "the shipped code"
        hint = module_hint(parts, source, attribute, listing("/".join(parts[:source])) or [])
        problem = f"{within} has no module {parts[source]!r}"
        raise ConfigError(registry.key, name, f"{problem}; {hint}" if hint else problem)
    try:
        tree = ast.parse(source)
    except SyntaxError as error:
        why = f"SyntaxError: {error.msg}, line {error.lineno}"
        raise ConfigError(registry.key, name, f"{module_name} does not parse ({why})") from None
    defined = top_level_names(tree.body)
    if defined is None:
        return
    if attribute not in defined:
        own = [item for item, node in defined.items() if isinstance(node, ast.FunctionDef | ast.ClassDef)]
        raise ConfigError(registry.key, name, no_callable(module_name, attribute, own))
    node = defined[attribute]
    plain_def = isinstance(node, ast.FunctionDef) and not node.decorator_list  # a decorator may change it
    if plain_def and not accepts(node.args, len(registry.arguments)):
        call = f"{attribute}({', '.join(registry.arguments)})"
        where = f"its def, line {node.lineno}, takes other arguments"
        raise ConfigError(registry.key, name, f"cannot be called as {call}: {where}")


def module_hint(parts: list[str], index: int, attribute: str, modules: list[str]) -> str:
    """`did you mean pkg.module:function?` for the module closest to `parts[index]`, or ''."""
    prefix = "".join(f"{part}." for part in parts[:index])
    rest = "".join(f".{part}" for part in parts[index + 1 :])
    choices = {module: f"{prefix}{module}{rest}:{attribute}" for module in modules}
    return did_you_mean(parts[index], choices).rstrip()


def module_source(parts: list[str], read: Reader, listing: Listing) -> str | int:
    """The module's source, or the index of the first of `parts` that is not there."""
    for depth in range(1, len(parts)):  # the packages on the way (a namespace one has no __init__)
        package = "/".join(parts[:depth])
        if read(f"{package}/__init__.py") is None and listing(package) is None:
            return depth - 1
    stem = "/".join(parts)
    for path in (f"{stem}.py", f"{stem}/__init__.py"):
        if (source := read(path)) is not None:
            return source
    return len(parts) - 1


def is_shipped(top: str, shipped: list[dict[str, Any]]) -> bool:
    return any(entry["path"] == f"{top}.py" or entry["path"].startswith(f"{top}/") for entry in shipped)


def shipped_reader(shipped: list[dict[str, Any]]) -> tuple[Reader, Listing]:
    """The shipped files as the pod's /opt/ddp-code holds them."""
    files = {entry["path"]: entry.get("data") for entry in shipped}
    return files.get, lambda folder: modules_in(files, folder)


def installed_reader(top: str) -> tuple[Reader | None, Listing]:
    """Where this Python would import `top` from; nothing where it would not, or where it
    is not a source file (a built-in, an extension)."""
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: found, not imported
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None, lambda folder: None
    if spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations))).parent
    elif spec.origin and spec.origin.endswith(".py"):
        root = Path(spec.origin).parent
    else:
        return None, lambda folder: None

    def read(path: str) -> str | None:
        file = root / path
        return file.read_text() if file.is_file() else None

    def listing(folder: str) -> list[str] | None:
        place = root / folder
        if not place.is_dir():
            return None
        return [p.stem for p in place.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()]

    return read, listing


def modules_in(files: dict[str, Any], folder: str) -> list[str] | None:
    """The modules and packages in `folder` of the shipped files; None where it holds none."""
    prefix = f"{folder}/" if folder else ""
    found = {
        path[len(prefix) :].split("/")[0].removesuffix(".py")
        for path in files
        if path.startswith(prefix) and (path.endswith(".py") or "/" in path[len(prefix) :])
    }
    return sorted(found) or None


def top_level_names(body: Iterable[ast.stmt]) -> dict[str, ast.AST] | None:
    """What a module's top level defines, by name; None where a reader cannot know."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == "__getattr__":
                return None
            names[node.name] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            if any(alias.name == "*" for alias in node.names):
                return None
            names.update({(alias.asname or alias.name).split(".")[0]: node for alias in node.names})
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(
                {
                    leaf.id: node
                    for target in targets
                    for leaf in ast.walk(target)
                    if isinstance(leaf, ast.Name)
                }
            )
        elif isinstance(node, ast.If | ast.Try | ast.With):
            branches = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            branches += [handler.body for handler in getattr(node, "handlers", [])]
            for branch in branches:
                inner = top_level_names(branch)
                if inner is None:
                    return None
                names.update(inner)
    return names


def accepts(arguments: ast.arguments, count: int) -> bool:
    """Whether a `def` with these arguments can be called with `count` positional ones."""
    positional = [*arguments.posonlyargs, *arguments.args]
    required = len(positional) - len(arguments.defaults)
    required_keywords = [default for default in arguments.kw_defaults if default is None]
    return (
        (len(positional) >= count or arguments.vararg is not None)
        and required <= count
        and not required_keywords
    )
