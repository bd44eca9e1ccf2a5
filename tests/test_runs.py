"""Real training runs: `python -m trainer` and `torchrun` worker processes on loopback with gloo."""

from __future__ import annotations

import fcntl
import json
import math
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    free_port,
    kill_rank_when,
    load_checkpoint,
    process_env,
    run_helper,
    run_torchrun,
    run_trainer,
    torchrun_command,
)
from eval_worker import datasets_and_models

from benchmarks.device_check import split_problems
from trainer.telemetry.timing import PARTS

QUICK = ["--config", "digits", "--set", "log.every_steps=5"]


@pytest.mark.slow
def test_two_rank_demo_run(workdir, tmp_path):
    """The demo under torchrun: rank 0 tells the story, rank 1 stays silent and writes nothing,
    and the checkpoint holds plain module weights that load with weights_only=True."""
    logs, audit = tmp_path / "logs", tmp_path / "audit"
    audit.mkdir()
    checkpoints = workdir / "ckpt"
    env = process_env({"AUDIT_ROOT": str(checkpoints), "AUDIT_LOG_DIR": str(audit)}, audit=True)
    args = [*QUICK, "--set", "checkpoint.uri=ckpt,checkpoint.every_steps=40,train.epochs=4"]
    launcher = ["--standalone", f"--log-dir={logs}", "--redirects=3"]
    completed = run_torchrun(args, workdir, launcher=launcher, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]

    rank_dirs = {path.name: path for path in logs.glob("*/attempt_0/*")}
    assert set(rank_dirs) == {"0", "1"}
    assert (rank_dirs["1"] / "stdout.log").read_text() == ""
    assert (rank_dirs["1"] / "stderr.log").read_text() == ""
    rank0 = (rank_dirs["0"] / "stdout.log").read_text()
    assert "world size 2 (1 node x 2 processes)" in rank0
    assert "global batch 32 per rank x 2 ranks x 1 accumulation = 64" in rank0
    assert "epoch 4/4 step 76/76" in rank0
    summary = rank0.strip().splitlines()[-1]
    assert "done: 76 steps, 4 epochs" in summary and "test loss" in summary
    test_accuracy = float(summary.split("test loss")[1].split("accuracy ")[1].split("%")[0])
    assert test_accuracy > 85

    writes = (audit / "rank0.log").read_text()  # torch.save's own open() is not audited; the rest is
    assert writes.count("os.rename ckpt/.step-") == 2 and "manifest.json" in writes
    assert not (audit / "rank1.log").exists() or (audit / "rank1.log").read_text() == ""

    state = load_checkpoint(checkpoints)
    assert state["progress"]["step"] == 76 and state["world_size"] == 2
    assert not any(key.startswith("module.") for key in state["model"])
    assert len(state["rng"]) == 2 and state["config"]["train"]["epochs"] == 4
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "latest.json",
        "lease.json",  # released: its epoch stays for the next run
        "lineage.json",
        "step-40",
        "step-76",
    ]
    assert json.loads((checkpoints / "lease.json").read_text())["released_at"]


def test_python_m_trainer_runs_as_a_world_of_one_and_leaves_no_heartbeat_folder(workdir):
    temporary = workdir / "tmp"
    temporary.mkdir()
    completed = run_trainer(
        [*QUICK, "--set", "train.max_steps=12"], workdir, env=process_env({"TMPDIR": str(temporary)})
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "world size 1 (1 node x 1 process)" in completed.stdout
    assert "32 per rank x 1 rank x 1 accumulation = 32" in completed.stdout
    assert load_checkpoint(workdir / "checkpoints" / "digits-cnn")["progress"]["step"] == 12
    assert not list(temporary.glob("ddp-heartbeat-*"))  # no node watchdog removes it for a world of one


# `python -m trainer`, with DDP's end and the process group's destruction written down in order
TEARDOWN_ORDER = """
import runpy, sys, weakref
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
events = []
init, destroy = DistributedDataParallel.__init__, dist.destroy_process_group
def tracked(self, *args, **kwargs):
    init(self, *args, **kwargs)
    weakref.finalize(self, events.append, "ddp freed")
def destroying(*args, **kwargs):
    events.append("group destroyed")
    destroy(*args, **kwargs)
DistributedDataParallel.__init__, dist.destroy_process_group = tracked, destroying
sys.argv[0] = "trainer"
try:
    runpy.run_module("trainer", run_name="__main__", alter_sys=True)
finally:
    print("teardown:", ", ".join(events), file=sys.stderr)
"""


def test_the_loops_ddp_model_is_freed_before_its_process_group_is_destroyed(workdir):
    """Freed after, DDP's reducer held the group's last reference and its destructor joined
    gloo's threads on the main thread, which deadlocked when one of them needed the GIL
    (py-spy on hung ranks; docs/performance.md, "Start-up")."""
    args = [*QUICK, "--set", "train.max_steps=4,checkpoint.every_steps=0,checkpoint.snapshot_every_steps=0"]
    completed = run_trainer(args, workdir, entry=("-c", TEARDOWN_ORDER))
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "teardown: ddp freed, group destroyed" in completed.stderr, completed.stderr[-3000:]


@pytest.mark.slow
def test_progress_bar_only_on_a_terminal(workdir):
    args = [sys.executable, "-m", "trainer", *QUICK, "--set", "train.max_steps=8"]
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(args, cwd=workdir, env=process_env(), stdout=secondary, stderr=subprocess.PIPE)
    os.close(secondary)
    chunks = []
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # EIO once the child has closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(primary)
    assert process.wait(timeout=60) == 0
    on_terminal = b"".join(chunks).decode(errors="replace")
    assert "8/8" in on_terminal and "step/s" in on_terminal
    piped = run_trainer([*QUICK, "--set", "train.max_steps=8,checkpoint.uri=piped"], workdir)
    assert piped.returncode == 0 and "step/s" not in piped.stdout + piped.stderr


@pytest.mark.slow
def test_bf16_autocast_and_loader_workers_on_cpu(workdir):
    overrides = "train.amp=bf16,data.num_workers=2,train.max_steps=45,log.every_steps=45"
    completed = run_trainer(["--config", "digits", "--set", overrides], workdir)
    assert completed.returncode == 0, completed.stderr[-3000:]
    progress = next(line for line in completed.stdout.splitlines() if "step 45/45" in line)
    assert math.isfinite(float(progress.split(" loss ")[1].split()[0]))
    assert "validation after step 39" in completed.stdout


def test_json_log_lines(workdir):
    # a port of its own: on the default one, a run beside it would make this one warn
    overrides = f"train.max_steps=10,log.format=json,metrics.port={free_port()}"
    completed = run_trainer([*QUICK, "--set", overrides], workdir)
    assert completed.returncode == 0, completed.stderr[-3000:]
    documents = [json.loads(line) for line in completed.stdout.splitlines()]
    events = [document["event"] for document in documents if document["event"] != "metrics"]
    assert events[0] == "start" and events[-1] == "summary"
    assert all(document["event"] != "message" for document in documents)  # every line is an event
    assert {"batch_math", "progress", "checkpoint", "validation"} <= set(events)
    progress = next(document for document in documents if document["event"] == "progress")
    assert {
        "epoch",
        "step",
        "total_steps",
        "loss",
        "lr",
        "samples_per_second",
        "data_wait_share",
        "eta_seconds",
    } <= set(progress)
    start = next(document for document in documents if document["event"] == "start")
    assert start["global_batch"] == 32 and documents[-1]["test_accuracy"] is not None


@pytest.mark.slow
def test_progress_lines_split_the_step_and_report_mfu_and_memory(workdir):
    """Two ranks of the transformer with a stated peak: each progress line's parts are
    non-negative, the steps it timed fit in the wall-clock time since the line before, MFU is
    the declared FLOPs over the peak, and the peak memory is the process's own. (Tests run on
    the CPU: conftest hides any GPU.)"""
    peak = 1e11
    completed = subprocess.run(
        torchrun_command(
            ["--config", "tokens", "--set", f"train.max_steps=30,log.every_steps=10,log.format=json,"
             f"train.amp=bf16,metrics.peak_flops_per_device={peak:g}"]
        ),
        cwd=workdir, env=process_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    documents = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
    start = next(document for document in documents if document["event"] == "start")
    assert start["amp"] == "bf16" and start["device_name"] == "cpu" and start["flops_per_sample"] > 0
    lines = [document for document in documents if document["event"] == "progress"]
    assert [line["step"] for line in lines] == [10, 20, 30]
    # the steps, as timed, happened between the lines on the wall clock (summed: each rank's
    # windows have edges of their own; benchmarks.device_check's split_problems, which says why)
    assert split_problems(lines, world_size=2) == []
    for line in lines:
        parts = [line[f"{name}_ms"] for name in PARTS]
        assert min(parts) >= 0 and line["compute_ms"] > 0
        expected = start["flops_per_sample"] * line["samples_per_second"] / (peak * 2)
        assert math.isclose(line["mfu"], expected, rel_tol=0.01, abs_tol=1e-4)
        assert 50 < line["peak_memory_mb"] < 8192


@pytest.mark.slow
@pytest.mark.alone  # it times each rank's step split, and the start-up's, against the wall clock
def test_a_slow_rank_is_the_straggler_and_the_split_accounts_for_the_wall_clock(workdir):
    """Rank 1 does 20 ms more work per step: every progress line names it, with a lag near
    its extra work; rank 0's wait for it is communication. The lines' step times add up to
    the wall clock between the lines within 5 %; so do the start-up's phases to the time
    from torchrun's launch to the start-up line's arrival, as this test sees them."""
    settings = (
        "model.name=plugins:straggler_model,model.options.rank=1,model.options.delay_s=0.02,"
        "train.batch_size=8,train.max_steps=60,log.every_steps=10,log.format=json,checkpoint.every_steps=0,"
        "checkpoint.snapshot_every_steps=0,metrics.history_file=history.jsonl"
    )
    arrivals: list[tuple[float, str]] = []
    with open(workdir / "stderr", "w+") as stderr:
        launched = time.time()
        process = subprocess.Popen(
            torchrun_command(["--set", settings]),
            cwd=workdir, env=process_env(), stdout=subprocess.PIPE, stderr=stderr, text=True,
        )  # fmt: skip
        arrivals.extend((time.time(), line) for line in process.stdout)  # each as it arrives
        assert process.wait(timeout=240) == 0, (workdir / "stderr").read_text()[-3000:]
    startup = [(at, json.loads(line)) for at, line in arrivals if '"event": "startup"' in line]
    assert len(startup) == 1, arrivals[:20]
    arrived, record = startup[0]
    phases = ["launch_and_rendezvous", "imports", "data_and_model", "process_group", "resume", "first_step"]
    assert all(record[phase] >= 0 for phase in phases) and record["imports"] > 0.5, record  # torch's import
    assert sum(record[phase] for phase in phases) == pytest.approx(arrived - launched, rel=0.05), record
    records = [json.loads(line) for line in (workdir / "history.jsonl").read_text().splitlines()]
    history = [record for record in records if "event" not in record]  # progress, not validations
    assert [line["step"] for line in history] == [10, 20, 30, 40, 50, 60]
    for line in history:
        assert line["slowest_rank"] == 1 and line["straggler_lag"] > 0.5, line  # max < 1 at 2 ranks
        assert line["communication_ms"] > 5, line  # the fast rank's wait, averaged over both
    # the steps account for the wall clock: over the steady windows (the first warms up; the
    # last line is logged at once, not a step later) the lines' step times add up to the time
    # between their lines. Summed over 30 steps, so one late line's jitter is diluted.
    steady = history[1:-1]
    wall_ms = 1000 * (steady[-1]["time"] - steady[0]["time"])
    timed_ms = sum(10 * line["step_ms"] for line in steady[1:])
    assert timed_ms == pytest.approx(wall_ms, rel=0.05), (timed_ms, wall_ms, steady)


@pytest.mark.slow
def test_exact_distributed_evaluation_equals_one_process(tmp_path):
    expected = {}
    for name, (dataset, model) in datasets_and_models().items():
        inputs, targets = dataset.tensors
        with torch.no_grad():
            logits = model(inputs)
        flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        expected[name] = {
            "loss": F.cross_entropy(flat_logits, flat_targets).item(),
            "accuracy": (flat_logits.argmax(-1) == flat_targets).double().mean().item(),
            "samples": len(dataset),
        }
    for world in (2, 3):
        measured = run_helper("eval_worker.py", tmp_path / f"eval{world}.json", nproc=world, cwd=tmp_path)
        for name, values in expected.items():
            assert measured[name]["samples"] == values["samples"]
            assert math.isclose(measured[name]["accuracy"], values["accuracy"], rel_tol=1e-12)
            assert math.isclose(measured[name]["loss"], values["loss"], rel_tol=1e-6)


@pytest.mark.slow
def test_accumulation_under_no_sync_equals_one_large_batch(tmp_path):
    result = run_helper("accum_worker.py", tmp_path / "accum.json", nproc=2, cwd=tmp_path)
    assert result["accumulated_allreduce_calls"] == result["big_batch_allreduce_calls"] >= 1
    assert result["max_update"] > 1e-3
    assert result["max_difference"] < 1e-6
    assert result["bucket_views_exact"]  # ddp.gradient_as_bucket_view's default rests on it


@pytest.mark.slow
def test_bad_config_under_torchrun_is_the_root_cause(workdir):
    completed = run_torchrun(["--set", "train.batch_size=0"], workdir)
    assert completed.returncode != 0
    errors = [line for line in completed.stderr.splitlines() if "trainer: error:" in line]
    assert len(errors) == 1, completed.stderr  # said once for the two ranks that met it
    assert errors[0].endswith("trainer: error: train.batch_size=0: must be greater than 0")
    assert "exitcode  : 2" in completed.stderr
    assert list(workdir.iterdir()) == []


@pytest.mark.slow
def test_incompatible_checkpoint_is_a_clear_error(workdir):
    shared = [*QUICK, "--set", "checkpoint.uri=shared"]  # a location named, as a job's is
    first = run_trainer([*shared, "--set", "train.max_steps=5"], workdir)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = sorted((workdir / "shared").rglob("*"))
    for change, saved_value in {"model.name": "'cnn'", "optim.name": "'adamw'", "model.width": "32"}.items():
        value = {"model.name": "mlp", "optim.name": "sgd", "model.width": "16"}[change]
        second = run_trainer([*shared, "--set", f"train.max_steps=10,{change}={value}"], workdir)
        assert second.returncode == 2
        (line,) = second.stderr.strip().splitlines()
        assert line.startswith(f"trainer: error: {change}=")
        assert f"step 5 in shared was trained with {change}={saved_value}" in line
        assert line.endswith(f"resume with {change}={saved_value}, or start over in another checkpoint.uri")
        assert sorted((workdir / "shared").rglob("*")) == saved


@pytest.mark.slow
def test_runs_of_two_models_without_a_location_each_get_their_own(workdir):
    """No checkpoint.uri: each config and model checkpoints in a folder of its own, so the
    second model (a plug-in) trains instead of being refused by the first one's checkpoints."""
    for model, folder in (("cnn", "digits-cnn"), ("plugins:linear_model", "digits-plugins.linear_model")):
        completed = run_trainer([*QUICK, "--set", f"train.max_steps=5,model.name={model}"], workdir)
        assert completed.returncode == 0, completed.stderr[-3000:]
        assert f"checkpoints in checkpoints/{folder}" in completed.stdout
    folders = sorted(path.name for path in (workdir / "checkpoints").iterdir())
    assert folders == ["digits-cnn", "digits-plugins.linear_model"]
    assert load_checkpoint(workdir / "checkpoints" / folders[1])["progress"]["step"] == 5


@pytest.mark.slow
def test_changed_settings_on_resume_are_applied_and_reported(workdir):
    first = run_trainer([*QUICK, "--set", "train.max_steps=5,log.format=json"], workdir)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_trainer([*QUICK, "--set", "train.max_steps=8,optim.lr=0.004,log.format=json"], workdir)
    assert second.returncode == 0, second.stderr[-3000:]
    records = [json.loads(line) for line in second.stdout.splitlines() if line.startswith("{")]
    notes = [r["message"] for r in records if r.get("event") == "resume_change"]
    assert notes == [
        "changed since step 5, applied: train.max_steps 5 -> 8",
        "changed since step 5, applied: optim.lr 0.002 -> 0.004",
    ]
    plan = next(r for r in records if r.get("event") == "start")
    assert plan["total_steps"] == 8 and plan["lr"] == 0.004 * 32 / 64


@pytest.mark.slow
def test_early_stopping_ends_the_run_and_a_restart_only_tests(workdir):
    args = [*QUICK, "--set", "train.early_stopping.patience=1,train.early_stopping.min_delta=100"]
    first = run_trainer(args, workdir)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "early stopping after epoch 2" in first.stdout
    state = load_checkpoint(workdir / "checkpoints" / "digits-cnn")
    assert state["progress"]["stopped_early"] and state["progress"]["epoch"] == 2
    again = run_trainer(args, workdir)
    assert again.returncode == 0 and "already complete" in again.stdout
    ended = state["progress"]["step"]  # the run's last step: nothing came after it
    assert f"resumed from step {ended} (checkpoints/digits-cnn, 0 steps lost)" in again.stdout


def checkpoint_step(root: Path) -> int:
    try:
        return json.loads((root / "latest.json").read_text())["step"]
    except (FileNotFoundError, json.JSONDecodeError):
        return -1


@pytest.mark.slow
@pytest.mark.parametrize(
    "ddp", ["ddp.comm_hook=none", "ddp.comm_hook=powersgd,ddp.powersgd_start_step=5,ddp.powersgd_rank=2"]
)
def test_sigkill_and_restart_resumes_bitwise_identically(workdir, ddp):
    """A worker SIGKILLed after a checkpoint, restarted by torchrun, ends with the same bits
    as an uninterrupted run; dropout is on, so RNG restore is part of what is checked, and
    with PowerSGD (started at step 5, the kill after step 20) its error feedback, warm
    matrices and generator are."""
    common = [
        "--config",
        "digits",
        "--set",
        "data.name=plugins:slow_digits,data.options.delay_s=0.002,train.max_steps=60,"
        f"checkpoint.every_steps=10,model.dropout=0.3,log.every_steps=10,{ddp}",
    ]
    reference = run_torchrun([*common, "--set", "checkpoint.uri=reference"], workdir)
    assert reference.returncode == 0, reference.stderr[-3000:]

    interrupted = workdir / "interrupted"
    agent = subprocess.Popen(
        torchrun_command(
            [*common, "--set", "checkpoint.uri=interrupted"], launcher=["--standalone", "--max-restarts=1"]
        ),
        cwd=workdir,
        # as the chart deploys it: with the agent's shared store, a restarted round can read
        # the previous round's gloo addresses and fail to connect (docs/facts.md, pytorch#135712)
        env=process_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    kill_rank_when(agent, 1, lambda: checkpoint_step(interrupted) >= 20)
    stdout, stderr = agent.communicate(timeout=240)
    assert agent.returncode == 0, stderr[-3000:]
    assert "restart 1" in stdout and "resumed from step" in stdout

    expected, resumed = load_checkpoint(workdir / "reference"), load_checkpoint(interrupted)
    assert expected["progress"] == resumed["progress"] and resumed["progress"]["step"] == 60
    for name, tensor in expected["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    for a, b in zip(
        expected["optimizer"]["state"].values(), resumed["optimizer"]["state"].values(), strict=True
    ):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    if "powersgd" in ddp:  # every rank's error feedback is in the checkpoint, and it is not zero
        errors = resumed["powersgd"]["errors"]
        assert errors.shape[0] == 2 and errors.abs().sum() > 0
        assert torch.equal(errors, expected["powersgd"]["errors"])


def read_indices(folder: Path) -> dict[str, list[int]]:
    return {
        path.stem: [int(line) for line in path.read_text().split()]
        for path in sorted(folder.glob("rank*.txt"))
    }


def files(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in root.rglob("*") if path.is_file()}


@pytest.mark.slow
def test_mid_epoch_resume_continues_the_epoch_order_and_other_data_is_refused_or_starts_it_again(workdir):
    """Stop at step 25 (mid epoch 2 of 19-step epochs), resume to 38: each rank reads
    exactly the samples, in the order, that an uninterrupted run to 38 reads. The same
    checkpoint on re-split data (as many samples, other ones) is refused in one line before
    any read; with data.on_change=restart_epoch, epoch 2 is read again from its start."""

    def overrides(record: str, uri: str, steps: int) -> str:
        (workdir / record).mkdir(exist_ok=True)
        return (
            f"data.name=plugins:recording_digits,data.options.record_dir={workdir / record},"
            f"checkpoint.uri={uri},train.max_steps={steps},optim.schedule=constant"
        )

    def run(record: str, uri: str, steps: int, more: str = ""):
        args = ["--config", "digits", "--set", overrides(record, uri, steps) + more]
        completed = run_torchrun(args, workdir)
        assert completed.returncode == 0, completed.stderr[-3000:]
        return completed

    run("whole", "whole", 38)
    run("first", "split", 25)
    shutil.copytree(workdir / "split", workdir / "resplit")
    second = run("second", "split", 38)
    assert "resumed from step 25" in second.stdout

    whole, first, rest = (
        read_indices(workdir / "whole"),
        read_indices(workdir / "first"),
        read_indices(workdir / "second"),
    )
    for rank in ("rank0", "rank1"):
        assert first[rank] + rest[rank] == whole[rank]
    per_step = 32
    epoch_two = [i for rank in ("rank0", "rank1") for i in first[rank][19 * per_step :] + rest[rank]]
    assert len(epoch_two) == len(set(epoch_two)) == 19 * 64

    saved = files(workdir / "resplit")
    resplit = overrides("refused", "resplit", 38) + ",data.split_seed=1"
    refused = run_trainer(["--config", "digits", "--set", resplit], workdir)
    assert refused.returncode == 2
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith(
        "trainer: error: data.name='plugins:recording_digits': step 25 in resplit was trained on other "
        "data (samples sha256 "
    )
    assert "data.split_seed 0 -> 1" in line and "set data.on_change=restart_epoch" in line
    assert line.endswith("set checkpoint.uri elsewhere to start a new run (or remove resplit)")
    assert read_indices(workdir / "refused") == {} and files(workdir / "resplit") == saved

    again = run("again", "resplit", 38, ",data.split_seed=1,data.on_change=restart_epoch")
    seen = (25 - 19) * 64  # epoch 2's samples that steps 20 to 25 trained on
    restarted = "epoch 2 starts again from its beginning on this data (data.on_change=restart_epoch)"
    assert f"{restarted}; {seen} of its samples had been trained on" in again.stdout
    for rank, indices in read_indices(workdir / "again").items():
        assert indices == whole[rank][19 * per_step : (19 + 13) * per_step]
    recorded = load_checkpoint(workdir / "resplit")["data"]
    assert recorded["split_seed"] == 1
    assert recorded["content"] != load_checkpoint(workdir / "split")["data"]["content"]


@pytest.mark.slow
def test_two_nodes_from_the_operators_pet_environment(workdir):
    """Two torchrun agents configured only by the PET_* variables that the Kubeflow operator
    injects for an elastic c10d job, as two 'pods' on loopback, each with a temporary
    folder of its own (its node-local cache and writer lock)."""
    from conftest import free_port, node_env

    pet = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
        "PET_RDZV_ID": "ddp-run-test",
        "PET_MAX_RESTARTS": "0",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    command = [
        c
        for c in torchrun_command([*QUICK, "--set", "train.max_steps=20"], launcher=[])
        if not c.startswith("--nproc_per_node")
    ]
    nodes = [
        subprocess.Popen(
            command,
            cwd=workdir,
            env=node_env(workdir, str(index), pet),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(2)
    ]
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    banners = [out for out, _ in outputs if "rank 0 on host" in out]
    assert len(banners) == 1
    assert "world size 2 (2 nodes x 1 process)" in banners[0] and "run id ddp-run-test" in banners[0]
    assert load_checkpoint(workdir / "checkpoints" / "digits-cnn")["world_size"] == 2
