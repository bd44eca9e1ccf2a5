"""`make image`: build the trainer's image with the engine that answers, or a private one.

The base is the Dockerfile's BASE_IMAGE when the engine has it or can pull it. Where no
registry answers, a stand-in is made once and kept: Debian bookworm's own python3 (3.11,
the CPython the image's lock is resolved for) from `mmdebstrap`, imported as
`ddp-trainer-base:standin-bookworm`. The build gets the CA bundle named by PIP_CERT (or
--ca) as a secret, for pip behind a TLS-intercepting proxy; nothing of it stays in the image.

    python -m operator_scripts.image.build [--tag TAG] [--base IMAGE] [--ca FILE]

With `--plugin DIR` it builds a derived image instead: the package in DIR (its
pyproject.toml at the top) installed on the trainer's image (`--base`, default the chart's),
by the pattern in docs/examples/own-model/Dockerfile.

    python -m operator_scripts.image.build --plugin DIR --tag TAG [--base IMAGE]
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import tomllib

from operator_scripts.image.engine import Engine, EngineError, engine
from operator_scripts.paths import REPO
from trainer.config.argparsing import OneLineParser, existing_file
from trainer.lines import last_line

STANDIN = "ddp-trainer-base:standin-bookworm"
PULL_TIMEOUT_S = 300  # the 50 MB base takes seconds where a registry answers
STANDIN_PACKAGES = "python3,python3-venv,python3-pip,ca-certificates,netbase,tzdata"
DERIVED_DOCKERFILE = REPO / "docs" / "examples" / "own-model" / "Dockerfile"


def default_tag() -> str:
    """The chart's default image (values.yaml's repository, the chart's appVersion), so the
    rendered job names this build."""
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    return f"ghcr.io/ddp-trainer/ddp-trainer:{version}"


def dockerfile_base() -> str:
    """The Dockerfile's default BASE_IMAGE."""
    (base,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    return base


def default_ca() -> Path | None:
    """The CA bundle pip on this machine trusts (PIP_CERT), for pip inside the build."""
    path = os.environ.get("PIP_CERT")
    return Path(path) if path and Path(path).is_file() else None


@dataclass(frozen=True)
class Base:
    image: str
    why: str


def make_standin(docker: Engine) -> None:
    """Debian bookworm (minbase) with python3, imported as an image: about 20 s, 240 MB."""
    if os.geteuid() != 0 or shutil.which("mmdebstrap") is None:
        raise EngineError(
            "cannot pull the base image and cannot make a stand-in: that needs root and mmdebstrap "
            "(apt-get install mmdebstrap), or give --base IMAGE"
        )
    debootstrap = subprocess.Popen(
        ["mmdebstrap", "--quiet", "--variant=minbase", f"--include={STANDIN_PACKAGES}", "bookworm", "-"],
        stdout=subprocess.PIPE,
    )
    imported = subprocess.run(
        [docker.cli, "import", "-", STANDIN], stdin=debootstrap.stdout, env=docker.env, capture_output=True
    )
    debootstrap.stdout.close()
    if debootstrap.wait() != 0 or imported.returncode != 0:
        raise EngineError(f"making the stand-in base failed: {imported.stderr.decode().strip()[-200:]}")


def choose_base(docker: Engine, requested: str | None) -> Base:
    """The base to build on: as asked, the Dockerfile's if present or pullable, else the stand-in."""
    if requested:
        return Base(requested, "given with --base")
    wanted = dockerfile_base()
    if docker.run("image", "inspect", wanted, check=False).returncode == 0:
        return Base(wanted, "the Dockerfile's, already in the engine")
    try:  # a registry that drops packets rather than refusing them must not hold the build
        pulled = docker.run("pull", "--quiet", wanted, check=False, timeout=PULL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        reason = f"no answer in {PULL_TIMEOUT_S} s"
    else:
        if pulled.returncode == 0:
            return Base(wanted, "the Dockerfile's, pulled")
        reason = last_line(pulled.stderr, "no answer")
    print(f"image: cannot pull {wanted.split('@')[0]} ({reason[:120]}); using a stand-in", flush=True)
    if docker.run("image", "inspect", STANDIN, check=False).returncode != 0:
        print(f"image: making {STANDIN} with mmdebstrap (Debian bookworm, python3 3.11)", flush=True)
        make_standin(docker)
    return Base(STANDIN, "stand-in: Debian bookworm's python3 3.11, as no registry answered")


def build(docker: Engine, tag: str, base: Base, ca: Path | None, context: Path = REPO) -> None:
    """docker build, its output streamed; builds run on the host's network (the private
    engine has no bridge), and the CA bundle goes in as the `pip_ca` secret."""
    command = ["--build-arg", f"BASE_IMAGE={base.image}"]
    if ca is not None:
        command += ["--secret", f"id=pip_ca,src={ca}"]
    _docker_build(docker, tag, [*command, str(context)])


def build_derived(docker: Engine, tag: str, trainer_image: str, package: Path) -> None:
    """The package at `package` on `trainer_image`, one small layer (DERIVED_DOCKERFILE)."""
    if not (package / "pyproject.toml").is_file():
        raise EngineError(
            f"--plugin {package}: no pyproject.toml there; the folder must be an installable package"
        )
    if docker.run("image", "inspect", trainer_image, check=False).returncode != 0:
        raise EngineError(f"the trainer's image {trainer_image} is not in the engine: run `make image` first")
    arguments = ["--file", str(DERIVED_DOCKERFILE), "--build-arg", f"TRAINER_IMAGE={trainer_image}"]
    _docker_build(docker, tag, [*arguments, str(package)])


def _docker_build(docker: Engine, tag: str, arguments: list[str]) -> None:
    command = [docker.cli, "build", "--network", "host", "--tag", tag, *arguments]
    if subprocess.run(command, env=docker.env).returncode != 0:
        raise EngineError(f"docker build of {tag} failed (its output is above)")


class HistoryEntry(NamedTuple):
    """One step of an image's history. A step the build cache served keeps its creation
    time; a rebuilt one gets the build's."""

    created: str
    size: int
    created_by: str


def history(docker: Engine, tag: str) -> list[HistoryEntry]:
    """The image's history, oldest first."""
    row = "{{.CreatedAt}}\t{{.Size}}\t{{.CreatedBy}}"
    lines = docker.run("history", "--no-trunc", "--human=false", "--format", row, tag).stdout.splitlines()
    rows = [line.split("\t", 2) for line in lines if line.strip()]
    return [HistoryEntry(created, int(size), created_by) for created, size, created_by in reversed(rows)]


def image_bytes(docker: Engine, tag: str) -> int:
    return int(docker.run("image", "inspect", "--format", "{{.Size}}", tag).stdout)


def describe(docker: Engine, tag: str) -> list[str]:
    """The image's size and its three largest layers, as the build's last lines."""
    size = image_bytes(docker, tag)
    layers = docker.run("image", "inspect", "--format", "{{len .RootFS.Layers}}", tag).stdout.strip()
    lines = [f"image: {tag}, {size / 1e9:.2f} GB in {layers} layers; the largest:"]
    for entry in sorted(history(docker, tag), key=lambda entry: entry.size, reverse=True)[:3]:
        lines.append(f"  {entry.size / 1e6:9.1f} MB  {layer_name(entry.created_by)}")
    return lines


def layer_name(created_by: str) -> str:
    """What a history entry is, in a few words: the Dockerfile's steps by what they install."""
    if not created_by:
        return "the base image"
    if "image-requirements.txt" in created_by:
        return "the packages (image-requirements.txt: torch, CUDA libraries, ...)"
    if "/dist/*.whl" in created_by:
        return "the project (its wheel)"
    step = re.sub(r"^(RUN )?(\|\d+ (\S+=\S* )*)?/bin/sh -c ", "", created_by)  # drop RUN's build args
    return re.sub(r"\s+", " ", step)[:80]


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="image", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default=default_tag(), help="default: %(default)s (the chart's image)")
    parser.add_argument("--base", help="build on this image rather than the Dockerfile's BASE_IMAGE")
    parser.add_argument(
        "--ca",
        type=existing_file,
        default=default_ca(),
        help="CA bundle for pip inside the build (default: $PIP_CERT when it names a file)",
    )
    parser.add_argument(
        "--plugin", type=Path, metavar="DIR", help="build a derived image of the package in DIR"
    )
    args = parser.parse_args(argv)
    try:
        with engine() as docker:
            if docker.private:
                print("image: no Docker engine answered; started a private dockerd (stopped at the end)")
            if args.plugin is not None:
                trainer_image = args.base or default_tag()
                build_derived(docker, args.tag, trainer_image, args.plugin)
                print(f"image: built {args.tag}: {args.plugin} on {trainer_image}")
                return
            base = choose_base(docker, args.base)
            print(f"image: base {base.image} ({base.why})", flush=True)
            build(docker, args.tag, base, args.ca)
            print("\n".join(describe(docker, args.tag)))
            print(f"image: built {args.tag} ({image_bytes(docker, args.tag) / 1e9:.2f} GB) on {base.image}")
    except EngineError as error:
        print(f"image: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
