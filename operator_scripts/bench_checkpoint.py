"""Checkpoint benchmark: what a save costs the training loop, and how fast uploads go.

    python -m operator_scripts.bench_checkpoint [--megabytes 128] [--repeats 3]

Starts moto's S3 server in its own process on loopback (or uses --endpoint), then measures,
interleaved and repeated, side by side in one run:
  1. the stall: extra wall time a compute loop needs when it saves a checkpoint of the
     given size, with the background writer vs a synchronous save of the same state;
  2. upload throughput: our store's multipart, checksummed upload vs a plain boto3
     `upload_file` of the same bytes to the same endpoint.
It prints medians and the two ratios with their targets (stall <= 0.10, throughput >= 0.9).
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from trainer.checkpoint import Checkpointer, CheckpointWriter, open_store
from trainer.config import CheckpointConfig

MOTO = (
    "from moto.server import ThreadedMotoServer as S; import time; "
    "S(ip_address='127.0.0.1', port={port}).start(); time.sleep(1e9)"
)


@contextmanager
def moto_process() -> str:
    """moto's S3 server in a separate, lowest-priority process: it shares neither our GIL
    nor, where a core is free, our CPU, as a remote S3 endpoint would."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-c", MOTO.format(port=port)],
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.nice(19),  # a remote S3 would not take this machine's CPU
    )
    try:
        deadline = time.monotonic() + 30
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("moto server did not start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait()


def model_like_state(megabytes: int) -> dict:
    """About `megabytes` of float32 tensors in a model/optimizer-shaped dict."""
    tensors = 16
    numel = megabytes * 2**20 // 4 // tensors
    return {
        "model": {f"layer{i}.weight": torch.randn(numel) for i in range(tensors)},
        "progress": {"step": 1},
    }


def compute_loop(
    matrix: int, steps: int, save: Callable[[], None] | None = None, until: Callable[[], bool] | None = None
) -> tuple[float, int]:
    """Wall time and count of fixed-size matmul steps: `steps` of them, calling `save`
    before the tenth, and going on while `until()` is false (a write still running)."""
    a, b = torch.randn(matrix, matrix), torch.randn(matrix, matrix)
    started, step = time.perf_counter(), 0
    while step < steps or (until is not None and not until()):
        if step == 10 and save is not None:
            save()
        a = torch.tanh(a @ b)
        step += 1
    return time.perf_counter() - started, step


def measure_stall(
    checkpointer: Checkpointer, state: dict, repeats: int, matrix: int, steps: int
) -> tuple[float, float, float]:
    """Median extra loop time caused by one synchronous save and by one background save,
    the latter counted until its upload has finished."""
    quiet = logging.getLogger("bench")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    sync = CheckpointWriter(checkpointer, background=False, attempts=1, logger=quiet)
    background = CheckpointWriter(checkpointer, background=True, attempts=1, logger=quiet)
    sync_stalls, background_stalls, snapshots = [], [], []
    for repeat in range(repeats):
        baseline, _ = compute_loop(matrix, steps)
        per_step = baseline / steps
        elapsed, done = compute_loop(
            matrix, steps, partial(sync.save, state, step=2 + repeat, epoch=0, world_size=1)
        )
        sync_stalls.append(elapsed - done * per_step)
        elapsed, done = compute_loop(
            matrix,
            steps,
            partial(background.save, state, step=100 + repeat, epoch=0, world_size=1),
            until=lambda: background.wait(timeout=0),
        )
        background_stalls.append(elapsed - done * per_step)
        snapshots.append(background.stats.last_stall_seconds)
    return statistics.median(sync_stalls), statistics.median(background_stalls), statistics.median(snapshots)


def measure_upload(
    store, client, bucket: str, data: bytes, scratch: Path, repeats: int
) -> tuple[float, float, float]:
    """Median MB/s publishing a staged checkpoint through our store, and for boto3's plain
    `upload_file` of the same bytes from disk, with its default and with SHA256 checksums.
    Files are written before any timing, the order rotates, and uploads are deleted after
    each round so the server's memory stays flat."""
    reference = scratch / "plain.pt"
    reference.write_bytes(data)

    def ours(round_: int) -> float:
        staging = store.staging(round_, scratch)
        os.link(reference, staging / "checkpoint.pt")
        started = time.perf_counter()
        store.publish(round_, staging, ["checkpoint.pt"])
        return time.perf_counter() - started

    def plain(extra: dict) -> Callable[[int], float]:
        def upload(round_: int) -> float:
            started = time.perf_counter()
            client.upload_file(str(reference), bucket, f"plain/{round_}.pt", ExtraArgs=extra)
            return time.perf_counter() - started

        return upload

    contenders = {"ours": ours, "plain": plain({}), "plain_sha256": plain({"ChecksumAlgorithm": "SHA256"})}
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_ in range(repeats):
        for name in names[round_ % 3 :] + names[: round_ % 3]:
            rates[name].append(len(data) / 1e6 / contenders[name](round_))
            store.delete_step(round_)
            client.delete_object(Bucket=bucket, Key=f"plain/{round_}.pt")
    return tuple(statistics.median(rates[name]) for name in names)


def run(endpoint: str, megabytes: int, repeats: int, matrix: int, steps: int) -> dict[str, float]:
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
        sync_stall, background_stall, snapshot = measure_stall(checkpointer, state, repeats, matrix, steps)
        ours, plain, plain_sha256 = measure_upload(store, client, bucket, data, Path(cache), repeats)
    return {
        "state_mb": len(data) / 1e6,
        "sync_stall_s": sync_stall,
        "background_stall_s": background_stall,
        "snapshot_s": snapshot,
        "step_s": compute_loop(matrix, 5)[0] / 5,
        "stall_ratio": background_stall / sync_stall,
        "ours_mb_s": ours,
        "plain_mb_s": plain,
        "plain_sha256_mb_s": plain_sha256,
        "throughput_ratio": ours / plain,
    }


def report(results: dict[str, float]) -> str:
    return "\n".join(
        [
            f"checkpoint of {results['state_mb']:.0f} MB to S3 (moto on loopback); "
            f"compute loop of {1000 * results['step_s']:.0f} ms steps",
            f"  training stall, synchronous save : {results['sync_stall_s']:.3f} s",
            f"  training stall, background write : {results['background_stall_s']:.3f} s"
            f" (of which the blocking snapshot copy: {results['snapshot_s']:.3f} s)",
            f"  stall ratio background/sync      : {results['stall_ratio']:.3f} (target <= 0.10)",
            f"  upload, ours (multipart, CRC32)   : {results['ours_mb_s']:.0f} MB/s",
            f"  upload, plain boto3 upload_file  : {results['plain_mb_s']:.0f} MB/s "
            f"({results['plain_sha256_mb_s']:.0f} MB/s with SHA256 checksums)",
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
        results = run(args.endpoint, args.megabytes, args.repeats, args.matrix, args.steps)
    else:
        with moto_process() as endpoint:
            results = run(endpoint, args.megabytes, args.repeats, args.matrix, args.steps)
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
