"""The code's shape, which a review alone does not keep: no import cycle between modules or
between packages, and no module a reader cannot hold in their head (400 lines)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("trainer", "operator_scripts", "benchmarks")
MAX_LINES = 400


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imported_names(path: Path) -> set[str]:
    """Every name an import in the file may load, function-level imports included: a lazy
    import is still a dependency, only a later one."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def module_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for top in PACKAGES for p in (ROOT / top).rglob("*.py")}
    return {
        name: {dep for dep in imported_names(path) if dep in files and dep != name}
        for name, path in files.items()
    }


def package_of(module: str) -> str:
    """A module's room: its second-level package (`trainer.checkpoint`), or the module itself
    where it sits at the top of its tree (`trainer.lines`, `trainer.cli`)."""
    parts = module.split(".")
    if len(parts) > 2 or (ROOT.joinpath(*parts) / "__init__.py").exists():
        return ".".join(parts[:2])
    return module


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_modules():
    assert cycles(module_graph()) == []


def test_no_import_cycle_between_packages():
    graph = module_graph()
    packages: dict[str, set[str]] = {}
    for module, deps in graph.items():
        packages.setdefault(package_of(module), set()).update(
            package_of(dep) for dep in deps if package_of(dep) != package_of(module)
        )
    found = cycles(packages)
    arrows = [
        f"{module} -> {dep}"
        for component in found
        for module, deps in graph.items()
        for dep in deps
        if package_of(module) in component
        and package_of(dep) in component
        and package_of(module) != package_of(dep)
    ]
    assert found == [], "\n".join(arrows)


def test_the_scan_finds_a_cycle_where_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert package_of("trainer.checkpoint.writer") == "trainer.checkpoint"
    assert package_of("trainer.lines") == "trainer.lines"
    assert package_of("trainer.checkpoint") == "trainer.checkpoint"


def test_no_module_is_over_400_lines():
    long = {
        str(path.relative_to(ROOT)): lines
        for top in PACKAGES
        for path in (ROOT / top).rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


@pytest.mark.parametrize(
    "module",
    [
        "operator_scripts.cli",
        "operator_scripts.local.run",
        "trainer.launcher.launch",
        "trainer.launcher.fork_client",
    ],
)
def test_the_operators_cli_the_pods_launcher_and_the_fork_client_import_no_torch(module):
    """`ddp-ops local` starts pods, each pod's `ddp-launch` validates the job before torchrun
    imports torch, and a forked worker's client starts before torch loads: none may pay
    torch's import (seconds, a pod's start-up twice over) on its path."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "False"


def test_every_folder_of_modules_is_a_package():
    """setuptools' find_packages leaves out a folder without `__init__.py` (an implicit
    namespace package), so an installed copy (the image's) would lack its modules."""
    folders = {path.parent for top in PACKAGES for path in (ROOT / top).rglob("*.py")}
    assert sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists()) == []
