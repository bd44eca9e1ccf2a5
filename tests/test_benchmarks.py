"""The benchmark scripts run end to end in a reduced mode (their figures are not asserted)."""

import json
import re
import subprocess
import sys

import pytest
from conftest import REPO, process_env

from benchmarks.device_check import split_problems
from benchmarks.fault_trials import summary
from benchmarks.gpu import GpuFigures
from benchmarks.links import variants
from benchmarks.namespaces import isolation_available
from benchmarks.node_trials import replay_segments
from benchmarks.trial_record import Trial
from trainer.config import ConfigError


def run_benchmark(module: str, *args: str, timeout: float = 300) -> str:
    """stdout of `python -m benchmarks.MODULE ARGS`, which must succeed."""
    completed = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        cwd=REPO,
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed.stdout


@pytest.mark.slow
def test_startup_benchmark_runs_the_trainer_both_ways_and_prints_the_ratios():
    out = run_benchmark("startup", "--rounds", "1", "--steps", "3")
    figure = r"\d+\.\d\d"
    for way in ("shipped", "collecting"):
        line = rf"^ *{way}: {figure} CPU-s, {figure} s wall \(median of 1\)$"
        assert re.search(line, out, re.MULTILINE), out
    ratios = rf"startup: shipped/collecting CPU {figure} \(median of 1 rounds\), wall {figure}"
    assert re.fullmatch(ratios, out.strip().splitlines()[-1]), out


@pytest.mark.slow
def test_checkpoint_benchmark_prints_both_ratios():
    """Each round saves synchronously and in the background, each inside its compute loop:
    both stalls are measured, positive (the save call itself blocks), and so is their ratio."""
    out = run_benchmark("checkpoint", "--megabytes", "8", "--repeats", "1", "--matrix", "128", "--steps", "5")
    assert "at the lowest CPU priority (SCHED_IDLE)" in out, out
    for label in ("training stall, synchronous save", "training stall, background write"):
        stall = re.search(rf"{label} *: (\d+\.\d+) s.*; (-?\d+\.\d+) CPU-s per save", out)
        assert stall and float(stall[1]) > 0 and float(stall[2]) > 0, out
    for label in ("upload, ours", "upload, plain boto3"):
        upload = re.search(rf"{label} .*; (\d+\.\d+) CPU-s per GB", out)
        assert upload and float(upload[1]) > 0, out
    for label in ("stall ratio background/sync", "throughput ratio ours/plain"):
        ratio = re.search(rf"{label} *: (\d+\.\d{{3}}) \(target", out)
        assert ratio and float(ratio[1]) > 0, out


@pytest.mark.slow
def test_snapshot_benchmark_prints_each_interval_against_none():
    out = run_benchmark("snapshot", "--repeats", "1", "--every", "auto", "7", "--set", "train.epochs=4")
    assert re.search(r"^  no snapshots +: +[\d,]+ samples/s$", out, re.MULTILINE), out
    auto = r"^  every +auto steps: +[\d,]+ samples/s, ratio \d\.\d{3} \(range .*; target >= 0\.98\); pauses"
    assert re.search(auto, out, re.MULTILINE), out
    assert re.search(r"^  every +7 steps: .* of step time, [\d.]+ ms per snapshot$", out, re.MULTILINE), out


@pytest.mark.slow
def test_throughput_benchmark_compares_ours_with_the_bare_loop_and_lightning():
    """Lightning is in the dev extra, so all three contenders run (one round each)."""
    out = run_benchmark("throughput", "--nproc", "1", "--repeats", "1", "--set", "train.epochs=4")
    for name in ("ours", "bare DDP loop", "Lightning"):
        assert re.search(rf"^  {name} +: +[\d,]+ samples/s \(median of 1", out, re.MULTILINE), out
        cpu = re.search(rf"^  {name} +: .*; (\d+\.\d{{3}}) CPU-s per 1,000 samples", out, re.MULTILINE)
        assert cpu and float(cpu[1]) > 0, out
    assert re.search(r"ratio ours/bare: \d+\.\d{3} \(median of rounds, .*target >= 0\.98\)", out), out
    assert re.search(r"ratio ours/lightning: \d+\.\d{3} \(.*target >= 1\.00\)", out), out
    for label in ("bare", "lightning"):
        assert re.search(rf"CPU-s ratio ours/{label}: \d+\.\d{{3}} \(median of rounds", out), out


@pytest.mark.slow
@pytest.mark.timeout(600)  # 100 s beside the other tests
def test_scaling_benchmark_prints_speedups_and_predictions_and_draws_both_plots(tmp_path):
    # one workload of the two: the other runs the same code on another model, at twice the cost
    out = run_benchmark(
        "scaling", "--repeats", "1", "--steps", "30", "--workloads", "communication-heavy mlp",
        "--plots", str(tmp_path), timeout=600,
    )  # fmt: skip
    link = r"all-reduce [\d.]+ ms measured in 2 buckets \(ring model from \d+ us per hop and [\d.]+ GB/s"
    assert len(re.findall(link, out)) == 1, out
    assert "communication-heavy mlp: " in out and "compute-bound cnn" not in out
    for runner in ("ours", "bare"):
        assert len(re.findall(rf"^  {runner} .* \d+\.\d\d +\d+%$", out, re.MULTILINE)) == 1, out
    assert len(re.findall(r"predicted without overlap: \d+\.\d\d \([+-]\d+\.\d% vs ours", out)) == 1
    split = r"ms per step at 2 processes: data [\d.]+, compute [\d.]+, communication [\d.]+"
    assert len(re.findall(split, out)) == 1
    for name in ("scaling.png", "step-split.png"):
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.slow
def test_gpu_benchmark_reduced_mode_reports_tokens_mfu_and_memory():
    peak_tflops = 0.05
    out = run_benchmark("gpu", "--reduced", "--steps", "30", "--json", "--peak-tflops", str(peak_tflops))
    result = json.loads(out.strip().splitlines()[-1])
    assert result["device_name"] == "cpu" and result["world_size"] == 2 and result["global_batch"] == 16
    assert result["tokens_per_second"] == pytest.approx(64 * result["samples_per_second"])
    assert 0 < result["mfu"] < 1 and 50 < result["peak_memory_mb"] < 8192
    lines = GpuFigures(**{k: v for k, v in result.items() if k != "tokens_per_second"}).lines()
    assert lines[0] == "device: cpu x 2, bf16 autocast" and lines[3] == f"MFU: {result['mfu']:.1%}"


def progress_record(step: int, time: float, **ms: float) -> dict:
    parts = {
        "data_ms": 1.0,
        "compute_ms": 10.0,
        "communication_ms": 2.0,
        "checkpoint_ms": 0.0,
        "logging_ms": 0.5,
    }
    parts.update(ms)
    return {"step": step, "time": time, "step_ms": sum(parts.values()), **parts}


def test_the_device_check_flags_steps_timed_past_the_wall_clock_or_no_communication():
    """Steps of 13.5 ms, 10 per 0.2 s between lines, fit the wall clock; said to take 45 ms
    each in one window they do not (the windows summed: 585 ms timed in 400 ms); a line with
    no communication at 2 ranks is a problem."""
    good = [progress_record(10, 100.0), progress_record(20, 100.2), progress_record(30, 100.4)]
    assert split_problems(good, world_size=2) == []
    overstated = [good[0], good[1], {**good[2], "step_ms": 45.0}]
    assert split_problems(overstated, world_size=2) == ["steps 10-30: timed 585.0 ms in 400.0 ms"]
    silent = progress_record(40, 100.6, communication_ms=0.0)
    assert split_problems([*good, silent], world_size=2) == ["step 40: no communication time at 2 ranks"]
    assert split_problems([silent], world_size=1) == []  # one GPU has nothing to communicate


@pytest.mark.slow
def test_the_device_check_runs_every_step_of_its_cpu_path_and_writes_its_report(tmp_path):
    """What the lent GPU machine runs, on one CPU process and the small model: eager,
    compiled (inductor's C++), the bare loop compiled, the checkpoint stall and a
    deterministic resume; every step's line, and the report in its file."""
    out = run_benchmark("device_check", "--out", str(tmp_path / "report.md"), timeout=600)
    report = (tmp_path / "report.md").read_text()
    assert out.strip() == report.strip()
    assert report.startswith("device check: the CPU path; torch "), report
    for step in ("eager", "compiled", "split", "bare", "stall", "resume"):
        assert re.search(rf"^ok   {step}: ", report, re.MULTILINE), report
    # one process, as on the lent machine's one GPU (a second would ask for cuda:1)
    assert "gloo at world size 1" in report, report
    assert "resume: from step 10, final state bit-identical" in report and "FAIL" not in report


@pytest.mark.parametrize(
    ("rounds", "segments"),
    [
        ([(2, 0)], [(2, 0)]),  # no fault: one run to the end
        ([(2, 0), (1, 60), (2, 75)], [(2, 60), (1, 75), (2, 0)]),  # lost, then back
        ([(2, 0), (1, 60), (1, 65), (2, 80)], [(2, 60), (1, 80), (2, 0)]),  # a restart at one size
        ([(2, 0), (1, 60), (2, 55)], [(2, 0)]),  # the world-1 round lost all it trained
    ],
)
def test_a_trials_rounds_replay_as_segments_each_stopped_where_the_next_resumed(rounds, segments):
    assert replay_segments(rounds) == segments


def test_the_links_benchmark_reads_each_variant_as_the_trainer_does():
    hooks, options = ["none", "powersgd"], ["bucket_cap_mb=5", "static_graph=true"]
    made = {variant.name: variant for variant in variants(hooks, options)}
    assert list(made) == [*hooks, *options]
    assert made["powersgd"].ddp.comm_hook == "powersgd" and made["powersgd"].ddp.powersgd_start_step == 10
    assert made["bucket_cap_mb=5"].ddp.bucket_cap_mb == 5 and made["bucket_cap_mb=5"].ddp.comm_hook == "none"
    assert made["static_graph=true"].ddp.static_graph is True
    assert made["static_graph=true"].overrides == "ddp.static_graph=true"  # what its runs are given
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        variants([], ["bucket_cap_mb=-1"])


def kill_trial(seen: int, resumed: int, told: int, identical: bool = True) -> Trial:
    return Trial("kill", 1, seen, resumed, "snapshot on vm", told, identical, None, 1.1, 0, 8.7, warm=True)


def test_a_fault_trial_passes_only_within_its_bound_bit_identical_and_reports_in_one_line():
    """The kill trials' own judgement and report (`benchmarks.fault_trials`, run by hand):
    steps lost as seen at most the bound and at most the trainer's count, which is within the
    bound too, the state bit-identical; the line says each."""
    good, passed_a_snapshot = kill_trial(23, 20, 3), kill_trial(19, 20, 0)
    assert good.passed(5) and passed_a_snapshot.passed(5)  # the run passed a snapshot after the line
    assert not kill_trial(27, 20, 7).passed(5)  # over the bound
    assert not kill_trial(23, 20, 2).passed(5)  # the trainer counts fewer than the harness saw
    assert not kill_trial(23, 20, 3, identical=False).passed(5)
    assert good.describe(1) == (
        "trial 1: SIGKILL rank 1 after step 23, its restart warm -> resumed from step 20 (snapshot on vm), "
        "3 lost as seen, 3 as the trainer counts; training again after 1.1s; final state bit-identical"
    )
    line = summary([good, kill_trial(27, 20, 7)], bound=5, seconds=61.4)
    assert line == (
        "2 kill trials in 61s: steps lost [3, 7] (bound 5); training again after median 1.1s, max 1.1s; "
        "cold start median 8.7s, max 8.7s; recovery / cold start median 0.13 (0.13-0.13); "
        "1/2 within the bounds and bit-identical"
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not isolation_available(), reason="needs root and network namespaces")
def test_the_scale_benchmarks_small_run_names_every_figure_of_its_last_line():
    """Two real nodes, sixteen simulated ones, a 20 MB state and a pod of 2 ranks: every part
    runs and its last line carries the figures the targets are about. What it asserts of
    them is behaviour, not speed: the watcher's round trips stay bounded (2 a node and poll;
    the watcher before made 2N-1 = 31 at 16), a frozen node is named, real and simulated,
    and no metric series appears as the run goes on."""
    out = run_benchmark("scale", "--quick", timeout=540)
    last = out.strip().splitlines()[-1]
    number = r"(-?\d+\.\d+)"
    expected = (
        rf"scale: control plane 2/2 nodes {number}; frozen node named {number} s, training {number} s; "
        rf"16 nodes {number} round trips per node per poll, p99 {number} ms, named {number} s; "
        rf"blocked {number} x a copy; stall {number} at 20 MB"
    )
    found = re.fullmatch(expected, last)
    assert found, out[-3000:]
    assert 1.0 <= float(found[4]) <= 3.0, last
    assert "series added after the first checkpoint over 16 s: none" in out, out
    assert re.search(r"16 torchrun agents: state \d+ kB; [\d,]+ requests/s", out), out
