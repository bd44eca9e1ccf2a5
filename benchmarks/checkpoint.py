"""Checkpoint benchmark: what a save costs the training loop, and how fast uploads go.

    python -m benchmarks.checkpoint [--megabytes 128] [--repeats 3]

Starts moto's S3 server in its own process on loopback (or uses --endpoint), then measures,
interleaved and repeated, side by side in one run:
  1. the stall: what saving a checkpoint of the given size costs a compute loop, with the
     writer process vs a synchronous save of the same state: the time the save call blocks
     plus each step's excess over the undisturbed loop's median step, until the upload
     has finished (never negative: jitter adds a small floor rather than cancelling out);
  2. upload throughput: our store's multipart, checksummed upload vs a plain boto3
     `upload_file` of the same bytes to the same endpoint.
It prints medians, the stall ratio's range over repeats, and the two ratios with their
targets (stall <= 0.10, throughput >= 0.9). Beside each wall time stands what it cost in CPU:
the seconds a save adds to this process and its writer, the seconds per GB an upload takes.

moto runs at the lowest CPU priority Linux has (SCHED_IDLE: only on a core nobody else
wants), since a real S3 endpoint is another machine's CPU; what is left of the stall is the
design's, not the stand-in's competition for two cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import psutil
import torch

from trainer.checkpoint.location import open_store
from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.writer import CheckpointWriter
from trainer.config import CheckpointConfig

# what boto3 and the trainer need to reach moto (any keys do), beside its endpoint
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}
MOTO = (
    "from moto.server import ThreadedMotoServer as S; import time; "
    "from benchmarks.priority import lowest_priority; lowest_priority(); "
    "S(ip_address='127.0.0.1', port={port}).start(); time.sleep(1e9)"
)


@contextmanager
def moto_process() -> Iterator[tuple[str, int]]:
    """moto's S3 server in a separate, lowest-priority process: it shares neither our GIL
    nor, where a core is free, our CPU, as a remote S3 endpoint would. Yields its URL and pid."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-c", MOTO.format(port=port)],
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("moto server did not start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", server.pid
    finally:
        server.terminate()
        server.wait()


def own_cpu_seconds(server_pid: int | None) -> float:
    """CPU-seconds of this process (every thread, exactly) and of its children (the checkpoint
    writer, in clock ticks), the S3 server aside."""
    total = time.process_time()
    for child in psutil.Process().children(recursive=True):
        if child.pid == server_pid:
            continue
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
    return total


def model_like_state(megabytes: int) -> dict:
    """About `megabytes` of float32 tensors in a model/optimizer-shaped dict."""
    tensors = 16
    numel = megabytes * 2**20 // 4 // tensors
    return {
        "model": {f"layer{i}.weight": torch.randn(numel) for i in range(tensors)},
        "progress": {"step": 1},
    }


@dataclass(frozen=True)
class LoopRun:
    """A compute loop's step durations, the seconds its `save` call blocked, the CPU-seconds
    its processes took meanwhile, and the main thread's CPU-seconds in the steps themselves."""

    durations: list[float]
    blocked: float
    cpu_s: float
    steps_cpu_s: float


def compute_loop(
    matrix: int,
    steps: int,
    save: Callable[[], None] | None = None,
    until: Callable[[], bool] | None = None,
    cpu: Callable[[], float] = time.process_time,
) -> LoopRun:
    """Fixed-size matmul steps: `steps` of them, calling `save` before step `steps // 4`,
    and going on while `until()` is false (a write still running); `cpu()` is read before
    and after, the main thread's CPU time around each step."""
    a, b = torch.randn(matrix, matrix), torch.randn(matrix, matrix)
    durations, blocked, steps_cpu, step = [], 0.0, 0.0, 0
    cpu_start = cpu()
    while step < steps or (until is not None and not until()):
        started = time.perf_counter()
        if step == steps // 4 and save is not None:
            save()
            blocked = time.perf_counter() - started
            started = time.perf_counter()
        thread_started = time.thread_time()
        a = torch.tanh(a @ b)
        steps_cpu += time.thread_time() - thread_started
        durations.append(time.perf_counter() - started)
        step += 1
    return LoopRun(durations, blocked, cpu() - cpu_start, steps_cpu)


def stall_of(run: LoopRun, typical: float) -> float:
    """What a save cost the loop: the time the call blocked, plus every step's excess over
    the typical (median) step of an undisturbed loop. Each part is >= 0, so the stall is;
    step jitter adds a small positive floor instead of cancelling out."""
    return run.blocked + sum(max(0.0, seconds - typical) for seconds in run.durations)


def save_cpu_of(run: LoopRun) -> float:
    """The CPU-seconds a save added: everything the loop's processes spent but its steps
    (the save call, the writer's threads and process, the waits' polling)."""
    return run.cpu_s - run.steps_cpu_s


def measure_stall(
    checkpointer: Checkpointer, state: dict, repeats: int, matrix: int, steps: int, server_pid: int | None
) -> dict[str, list[float]]:
    """Per repeat, interleaved: the stall of a synchronous save and of a background save
    (counted until its upload has finished), the background save's blocking copy, and the
    CPU-seconds each save added to this process and its writer (the S3 server's aside)."""
    quiet = logging.getLogger("bench")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    config = checkpointer_config(checkpointer)
    sync = CheckpointWriter(checkpointer, replace(config, async_save=False), quiet, cache=checkpointer.cache)
    # a prefix of its own: two writers on one latest.json would each find the other's writes
    apart = replace(config, async_save=True, uri=f"{config.uri}-background")
    elsewhere = Checkpointer(open_store(apart), checkpointer.keep_last, checkpointer.cache)
    background = CheckpointWriter(elsewhere, apart, quiet, cache=checkpointer.cache)
    for writer in (sync, background):
        writer.start(None)
    background.save(state, step=1, epoch=0, world_size=1, durable=True)  # the writer warms up
    background.wait(120)
    cpu = partial(own_cpu_seconds, server_pid)
    figures: dict[str, list[float]] = {
        name: [] for name in ("sync", "background", "copy", "sync_cpu", "background_cpu")
    }
    try:
        for repeat in range(repeats):
            typical = statistics.median(compute_loop(matrix, steps).durations)
            save = partial(sync.save, state, step=2 + repeat, epoch=0, world_size=1, durable=True)
            run = compute_loop(matrix, steps, save, cpu=cpu)
            figures["sync"].append(stall_of(run, typical))
            figures["sync_cpu"].append(save_cpu_of(run))
            save = partial(background.save, state, step=100 + repeat, epoch=0, world_size=1, durable=True)
            run = compute_loop(matrix, steps, save, until=lambda: background.wait(timeout=0), cpu=cpu)
            figures["background"].append(stall_of(run, typical))
            figures["background_cpu"].append(save_cpu_of(run))
            figures["copy"].append(background.stats.last_stall_seconds)
    finally:
        background.close(120)
    return figures


def checkpointer_config(checkpointer: Checkpointer) -> CheckpointConfig:
    return CheckpointConfig(uri=checkpointer.store.uri, keep_last=checkpointer.keep_last, attempts=1)


def measure_upload(
    store, client, bucket: str, data: bytes, scratch: Path, repeats: int
) -> dict[str, tuple[float, float]]:
    """Median MB/s and CPU-seconds per GB (this process's, boto3's threads included) publishing
    a staged checkpoint through our store, and for boto3's plain `upload_file` of the same
    bytes from disk, with its default and with SHA256 checksums. Files are written before any
    timing, the order rotates, and uploads are deleted after each round so the server's
    memory stays flat."""
    reference = scratch / "plain.pt"
    reference.write_bytes(data)

    def ours(round_: int) -> None:
        staging = store.staging(round_, scratch)
        os.link(reference, staging / "checkpoint.pt")
        (staging / "manifest.json").write_bytes(b"{}")  # the small file that names the step, last
        store.publish(round_, staging, ["checkpoint.pt", "manifest.json"], None)

    def plain(extra: dict) -> Callable[[int], None]:
        def upload(round_: int) -> None:
            client.upload_file(str(reference), bucket, f"plain/{round_}.pt", ExtraArgs=extra)

        return upload

    contenders = {"ours": ours, "plain": plain({}), "plain_sha256": plain({"ChecksumAlgorithm": "SHA256"})}
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_ in range(repeats):
        for name in names[round_ % 3 :] + names[: round_ % 3]:
            started, cpu_started = time.perf_counter(), time.process_time()
            contenders[name](round_)
            rates[name].append(len(data) / 1e6 / (time.perf_counter() - started))
            cpu[name].append((time.process_time() - cpu_started) / (len(data) / 1e9))
            store.delete_step(round_)
            client.delete_object(Bucket=bucket, Key=f"plain/{round_}.pt")
    return {name: (statistics.median(rates[name]), statistics.median(cpu[name])) for name in names}


def run(
    endpoint: str, megabytes: int, repeats: int, matrix: int, steps: int, server_pid: int | None
) -> dict[str, float]:
    import boto3

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_REGION", "us-east-1")
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client = boto3.client("s3")
    client.create_bucket(Bucket=bucket)
    store = open_store(CheckpointConfig(uri=f"s3://{bucket}/run"))
    with tempfile.TemporaryDirectory() as cache:
        checkpointer = Checkpointer(store, keep_last=2, cache=Path(cache))
        state = model_like_state(megabytes)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        stalls = measure_stall(checkpointer, state, repeats, matrix, steps, server_pid)
        uploads = measure_upload(store, client, bucket, data, Path(cache), repeats)
    ratios = [b / s for b, s in zip(stalls["background"], stalls["sync"], strict=True)]
    return {
        "state_mb": len(data) / 1e6,
        "sync_stall_s": statistics.median(stalls["sync"]),
        "background_stall_s": statistics.median(stalls["background"]),
        "sync_cpu_s": statistics.median(stalls["sync_cpu"]),
        "background_cpu_s": statistics.median(stalls["background_cpu"]),
        "snapshot_s": statistics.median(stalls["copy"]),
        "step_s": statistics.median(compute_loop(matrix, 5).durations),
        "stall_ratio": statistics.median(ratios),
        "stall_ratio_min": min(ratios),
        "stall_ratio_max": max(ratios),
        "repeats": len(ratios),
        "ours_mb_s": uploads["ours"][0],
        "plain_mb_s": uploads["plain"][0],
        "plain_sha256_mb_s": uploads["plain_sha256"][0],
        "ours_cpu_s_gb": uploads["ours"][1],
        "plain_cpu_s_gb": uploads["plain"][1],
        "plain_sha256_cpu_s_gb": uploads["plain_sha256"][1],
        "throughput_ratio": uploads["ours"][0] / uploads["plain"][0],
        "local_server": server_pid is not None,
    }


def report(results: dict[str, float]) -> str:
    server = (
        "moto on loopback, at the lowest CPU priority (SCHED_IDLE), its CPU not counted"
        if results["local_server"]
        else "the given endpoint"
    )
    return "\n".join(
        [
            f"checkpoint of {results['state_mb']:.0f} MB to S3 ({server}); "
            f"compute loop of {1000 * results['step_s']:.0f} ms steps",
            f"  training stall, synchronous save : {results['sync_stall_s']:.3f} s; "
            f"{results['sync_cpu_s']:.3f} CPU-s per save",
            f"  training stall, background write : {results['background_stall_s']:.3f} s"
            f" (of which the blocking copy to shared memory: {results['snapshot_s']:.3f} s); "
            f"{results['background_cpu_s']:.3f} CPU-s per save, the writer process's included",
            f"  stall ratio background/sync      : {results['stall_ratio']:.3f} (target <= 0.10; "
            f"median of {results['repeats']}, range {results['stall_ratio_min']:.3f}-"
            f"{results['stall_ratio_max']:.3f})",
            f"  upload, ours (multipart, CRC32)   : {results['ours_mb_s']:.0f} MB/s; "
            f"{results['ours_cpu_s_gb']:.2f} CPU-s per GB",
            f"  upload, plain boto3 upload_file  : {results['plain_mb_s']:.0f} MB/s "
            f"({results['plain_sha256_mb_s']:.0f} MB/s with SHA256 checksums); "
            f"{results['plain_cpu_s_gb']:.2f} CPU-s per GB "
            f"({results['plain_sha256_cpu_s_gb']:.2f} with SHA256)",
            f"  throughput ratio ours/plain      : {results['throughput_ratio']:.3f} (target >= 0.9)",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--megabytes", type=int, default=128, help="checkpoint size (default 128)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    parser.add_argument("--endpoint", help="an S3 endpoint URL to use instead of a local moto server")
    parser.add_argument(
        "--matrix",
        type=int,
        default=1024,
        help="matmul size of one loop step (default 1024: ~40 ms on 1 thread)",
    )
    parser.add_argument("--steps", type=int, default=40, help="loop steps at least (default 40)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the loop stands in for a training process's host thread
    if args.endpoint:
        results = run(args.endpoint, args.megabytes, args.repeats, args.matrix, args.steps, None)
    else:
        with moto_process() as (endpoint, server_pid):
            results = run(endpoint, args.megabytes, args.repeats, args.matrix, args.steps, server_pid)
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
