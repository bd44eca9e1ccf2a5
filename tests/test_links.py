"""`benchmarks.links` on a small model: two nodes in real network namespaces, joined by a link
shaped with a real token bucket, against one node; the shaped link slows the two nodes,
bf16 compression wins back part of it, and nothing is left behind."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO, process_env

from benchmarks.namespaces import isolation_available

# a delayed link (`--delays`) is tested in test_namespaces.py without the trainer, DDP's
# options (`--options`) in test_benchmarks.py without runs: each run here costs CPU seconds
pytestmark = [
    # not `alone`: what it compares (a link 100 times slower than the CPUs' own, half the
    # bytes on it) holds on a loaded machine
    pytest.mark.slow,
    pytest.mark.skipif(not isolation_available(), reason="needs root and network namespaces"),
]
ROW = re.compile(r"^\s*(.+?)\s+(none|bf16): +([\d,.]+) samples/s, speedup ([\d.]+)x")


def test_a_shaped_link_slows_two_nodes_and_bf16_sends_half():
    benchmark = subprocess.Popen(
        [
            sys.executable, "-m", "benchmarks.links", "--quick", "--rates", "8,unshaped",
            "--hooks", "none,bf16", "--options", "", "--delays", "", "--reference", "8",
            "--steps", "36",
        ],
        cwd=REPO, env=process_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stdout, stderr = benchmark.communicate(timeout=600)
    done = subprocess.CompletedProcess(benchmark.args, benchmark.returncode, stdout, stderr)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = {(m[1], m[2]): float(m[3].replace(",", "")) for m in map(ROW.match, done.stdout.splitlines()) if m}
    expected_rows = {(link, hook) for link in ("8 Mbit/s", "unshaped") for hook in ("none", "bf16")}
    assert set(rows) == expected_rows
    # the quick model's 0.5 MB of gradients take about half a second at 8 Mbit/s: the link
    # bounds the step, and half the bytes nearly halve it
    assert rows[("8 Mbit/s", "none")] < rows[("unshaped", "none")] / 3
    assert rows[("8 Mbit/s", "bf16")] > 1.5 * rows[("8 Mbit/s", "none")]
    # the estimate's inputs: gloo's all-reduce in both types bf16 and none send, and each
    # variant's own step on one node
    assert re.search(r"unshaped, bfloat16: [\d,]+ Mbit/s", done.stdout), done.stdout
    assert re.search(r"beside a busy neighbour: none [\d.]+ ms, bf16 [\d.]+ ms;", done.stdout)
    last = done.stdout.strip().splitlines()[-1]
    expected = r"links: bf16/none at 8 Mbit/s \d+\.\d\dx; estimate error max \d+% over 2 links"
    assert re.fullmatch(expected, last)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    # its namespaces (named for its pid), and with them the links, their qdiscs and iptables rules, are gone
    assert f"ddp{benchmark.pid}-" not in listed
