"""The image's lock, image-requirements.txt: every package the CUDA image installs, pinned
with its hash.

constraints.txt pins development and CI, where torch is the CPU build. The image resolves
the same requirements under the same pins for linux x86_64 and CPython 3.11 from a package
index, where torch is the CUDA build and brings nvidia-* wheels, triton and cuda-bindings,
which constraints.txt cannot pin. `write` resolves it with pip (metadata only: no wheel is
downloaded, about 30 s); `check`, offline, says whether it still agrees with pyproject.toml
and constraints.txt (the tests run it); the Dockerfile installs it with --no-deps and
--require-hashes and then runs `pip check`, so nothing unpinned gets in and nothing is missing.

    python -m operator_scripts.image.lock write [--index-url URL]
    python -m operator_scripts.image.lock check
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from operator_scripts.paths import REPO
from trainer.config.argparsing import OneLineParser
from trainer.lines import last_line

LOCK = REPO / "image-requirements.txt"
CONSTRAINTS = REPO / "constraints.txt"
PYPROJECT = REPO / "pyproject.toml"
PYTHON_VERSION = "3.11"  # the base image's CPython (Dockerfile BASE_IMAGE)
# manylinux tags a bookworm base (glibc 2.36) installs, newest first
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
INPUTS_PREFIX = "# inputs: "


class LockError(Exception):
    """Why the lock cannot be written or is out of date, in one line."""


def inputs() -> list[str]:
    """What the image installs: the trainer's dependencies and the build backend that turns
    the project into a wheel inside the image."""
    project = tomllib.loads(PYPROJECT.read_text())
    return [*project["project"]["dependencies"], *project["build-system"]["requires"]]


def pins(text: str) -> dict[str, str]:
    """name -> version of each `name==version` line (canonical names)."""
    found = {}
    for line in text.splitlines():
        if match := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line):
            found[canonicalize_name(match[1])] = match[2]
    return found


def resolve(index_url: str) -> list[dict]:
    """pip's installation report for the image's platform: name, version, wheel hash."""
    platforms = [option for platform in PLATFORMS for option in ("--platform", platform)]
    # pip's own configuration on this machine (local indexes, wheel folders, constraints)
    # must not leak into what the image resolves
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        command = [
            sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
            "--target", str(Path(scratch) / "unused"), "--report", str(report),
            "--index-url", index_url, "--only-binary=:all:", *platforms,
            "--python-version", PYTHON_VERSION, "--implementation", "cp",
            "--abi", "cp" + PYTHON_VERSION.replace(".", ""),
            "--constraint", str(CONSTRAINTS), *inputs(),
        ]  # fmt: skip
        completed = subprocess.run(command, capture_output=True, text=True, env=env)
        if completed.returncode != 0:
            reason = last_line(completed.stderr, "pip failed")
            raise LockError(f"cannot resolve the image's packages from {index_url}: {reason}")
        return json.loads(report.read_text())["install"]


def render(installs: list[dict]) -> str:
    """The lock file: a header, then one `name==version --hash=sha256:...` line per package."""
    lines = [
        f"# The CUDA image's packages (linux x86_64, CPython {PYTHON_VERSION}), each pinned with its hash.",
        "# Written by `python -m operator_scripts.image.lock write` from pyproject.toml under",
        "# constraints.txt; `python -m operator_scripts.image.lock check` (in the tests) finds drift.",
        INPUTS_PREFIX + " ".join(inputs()),
    ]
    for item in sorted(installs, key=lambda item: canonicalize_name(item["metadata"]["name"])):
        name = canonicalize_name(item["metadata"]["name"])
        digest = item["download_info"]["archive_info"]["hashes"]["sha256"]
        lines.append(f"{name}=={item['metadata']['version']} --hash=sha256:{digest}")
    return "\n".join(lines) + "\n"


def problems(lock_text: str, constraints_text: str) -> list[str]:
    """Where the lock disagrees with pyproject.toml or constraints.txt."""
    found = []
    recorded = next((line for line in lock_text.splitlines() if line.startswith(INPUTS_PREFIX)), "")
    if recorded.removeprefix(INPUTS_PREFIX).split() != inputs():
        found.append("pyproject.toml's dependencies or build requirements changed since it was written")
    locked, constrained = pins(lock_text), pins(constraints_text)
    for name, version in sorted(locked.items()):
        if name in constrained and constrained[name] != version:
            found.append(f"{name}=={version}, but constraints.txt pins {name}=={constrained[name]}")
    for requirement in map(Requirement, inputs()):
        if canonicalize_name(requirement.name) not in locked:
            found.append(f"{requirement.name} is required but not locked")
    unhashed = [line for line in lock_text.splitlines() if "==" in line and "--hash=sha256:" not in line]
    found += [f"{line.split()[0]} has no hash" for line in unhashed]
    return found


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="image_lock", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["write", "check"])
    parser.add_argument("--index-url", default="https://pypi.org/simple")
    args = parser.parse_args(argv)
    try:
        if args.action == "write":
            LOCK.write_text(render(resolve(args.index_url)))
            print(f"wrote {LOCK.name}: {len(pins(LOCK.read_text()))} packages")
            return
        if found := problems(LOCK.read_text(), CONSTRAINTS.read_text()):
            raise LockError(
                f"{LOCK.name} is out of date ({'; '.join(found)}): "
                "run python -m operator_scripts.image.lock write"
            )
        print(f"{LOCK.name} agrees with pyproject.toml and constraints.txt")
    except LockError as error:
        parser.exit(2, f"image_lock: error: {error}\n")


if __name__ == "__main__":
    main()
