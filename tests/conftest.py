"""Shared helpers: start real `torchrun` and `python -m trainer` processes on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
HELPERS = Path(__file__).parent / "helpers"
AUDIT = HELPERS / "audit"
sys.path.insert(0, str(HELPERS))  # the test plug-ins, importable in-process as in subprocesses


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def process_env(extra: dict[str, str] | None = None, *, audit: bool = False) -> dict[str, str]:
    """The environment for a trainer process: our package and the test plug-ins importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    paths = [str(REPO), str(HELPERS)] + ([str(AUDIT)] if audit else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def run_trainer(
    args: Sequence[str], cwd: Path, *, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` as a world of one."""
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        cwd=cwd,
        env=env or process_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def torchrun_command(
    args: Sequence[str], *, nproc: int = 2, launcher: Sequence[str] = ("--standalone",)
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher,
        f"--nproc_per_node={nproc}",
        "-m",
        "trainer",
        *args,
    ]


def run_torchrun(
    args: Sequence[str],
    cwd: Path,
    *,
    nproc: int = 2,
    launcher: Sequence[str] = ("--standalone",),
    env: dict[str, str] | None = None,
    timeout: float = 240,
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=N -m trainer ARGS`, waited for."""
    return subprocess.run(
        torchrun_command(args, nproc=nproc, launcher=launcher),
        cwd=cwd,
        env=env or process_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_helper(script: str, output: Path, *, nproc: int, cwd: Path) -> dict:
    """Run `tests/helpers/SCRIPT` under torchrun; it writes JSON results to `output`."""
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(HELPERS / script),
            str(output),
        ],
        cwd=cwd,
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(output.read_text())


def load_checkpoint(root: Path, step: int | None = None) -> dict:
    """A checkpoint as any consumer would load it: tensors only."""
    if step is None:
        step = json.loads((root / "latest.json").read_text())["step"]
    return torch.load(root / f"step-{step}" / "checkpoint.pt", weights_only=True)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty directory to run a trainer in, so relative checkpoint paths land here."""
    path = tmp_path / "work"
    path.mkdir()
    return path
