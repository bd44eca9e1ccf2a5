"""The benchmark scripts run end to end in a reduced mode (their figures are not asserted)."""

import re
import subprocess
import sys

from conftest import REPO, process_env


def test_checkpoint_benchmark_prints_both_ratios():
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "operator_scripts.bench_checkpoint",
            "--megabytes",
            "8",
            "--repeats",
            "1",
            "--matrix",
            "128",
            "--steps",
            "5",
        ],
        cwd=REPO,
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    for label in ("stall ratio background/sync", "throughput ratio ours/plain"):
        line = next(line for line in completed.stdout.splitlines() if label in line)
        assert re.search(r": \d+\.\d{3} \(target", line), line


def test_throughput_benchmark_compares_ours_with_the_bare_loop():
    completed = subprocess.run(
        [sys.executable, "-m", "operator_scripts.bench_throughput", "--nproc", "1", "--repeats", "1",
         "--set", "train.epochs=3"],
        cwd=REPO, env=process_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert re.search(r"ratio ours/bare: \d+\.\d{3} \(target >= 0\.98\)", completed.stdout), completed.stdout
