"""What a bigger state costs: checkpoints, snapshots and restores from 0.1 to 4 GB, each
figure beside a plain copy of the same bytes in the same run (this machine's limit).

    python -m benchmarks.state_size [--sizes 0.1,0.5,1,2,4] [--no-dcp]

One rank (one process) at every size: two ranks' states, shared copies and snapshots of
4 GB would not fit this machine's 24 GiB. The state is model- and optimizer-shaped float32
tensors (16 of them). moto's S3 server runs in a lowest-priority process of its own
(`benchmarks.checkpoint.moto_process`). For each size:

- **blocked**: how long the save call holds the loop (the copy into the shared host buffer
  the writer reads), taken around the call, against a plain copy of the same tensors into
  tensors already allocated (`torch._foreach_copy_`, the fastest copy this process can make);
- **stall ratio**: what a background save costs a compute loop (the blocked time plus every
  step's excess over the undisturbed loop's median, until the write is done) over what the
  same save costs done inline (`checkpoint.async_save=false`), as `benchmarks.checkpoint`;
- **upload** of the durable checkpoint to S3 (serialize, hash, multipart upload), against
  boto3's plain `upload_file` of the same bytes; the snapshot's write to /dev/shm;
- **restore** from the snapshot (what a restarted rank does: verify and load) against
  reading the same file's bytes, and from S3 (download, verify, load) against boto3's plain
  `download_file` of the same object;
- **torch.distributed.checkpoint's `async_save`**, process-based, staged in shared memory,
  to the same bucket through s3torchconnector's `S3StorageWriter`: the time until the
  state may change again, and until the upload is done.

A size this machine cannot hold is refused in one line before any work.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import psutil
import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from benchmarks.checkpoint import LoopRun, compute_loop, moto_process
from trainer.checkpoint.location import open_store
from trainer.checkpoint.manager import CHECKPOINT_FILE, Checkpointer
from trainer.checkpoint.snapshots import SnapshotDir
from trainer.checkpoint.writer import CheckpointWriter
from trainer.config import CheckpointConfig

SIZES_GB = (0.1, 0.5, 1.0, 2.0, 4.0)
TENSORS = 16
COPIES_HELD = 4  # the state, its shared host copy, a snapshot, and a restored state
MATRIX, STEPS = 1024, 20  # the compute loop: ~40 ms steps on one thread, as benchmarks.checkpoint's
BASELINE_STEPS = 60
REGION = "us-east-1"
# moto answers each ranged GET by copying the whole object (moto/s3/responses.py,
# `_handle_range_header`: the body sliced from `key.value`), and a download is 8 MiB ranges:
# 23 s for 0.5 GB, 97 s for 1 GB here, growing as the square. Restores from S3 are measured
# up to this size; above it the time is moto's, not the trainer's
S3_RESTORE_MAX_GB = 0.5
# DCP's 4 GB save through s3torchconnector made moto (its multipart upload joined in memory)
# grow to 15 GB beside this process's 8 GB (the state, DCP's shared staging) and the kernel
# killed it: DCP is measured up to this size
DCP_MAX_GB = 2.0


@dataclass(frozen=True)
class SizeFigures:
    """One size's figures, in seconds but the ratios."""

    gigabytes: float
    copy_s: float  # a plain copy of the state's tensors
    checkpoint_blocked_s: float
    checkpoint_stall_ratio: float
    upload_s: float  # save call to the checkpoint published
    plain_upload_s: float
    snapshot_blocked_s: float
    snapshot_stall_ratio: float
    snapshot_write_s: float
    restore_snapshot_s: float
    plain_read_s: float  # the snapshot file's bytes read into memory
    restore_s3_s: float | None  # None above S3_RESTORE_MAX_GB
    plain_download_s: float | None
    dcp_blocked_s: float | None = None
    dcp_upload_s: float | None = None

    @property
    def blocked_over_copy(self) -> float:
        return max(self.checkpoint_blocked_s, self.snapshot_blocked_s) / self.copy_s


def model_state(gigabytes: float) -> dict:
    """`gigabytes` of float32 in a model- and optimizer-shaped state (a third weights, two
    thirds AdamW's moments), as the trainer hands its writer."""
    numel = int(gigabytes * 1e9) // 4 // TENSORS
    tensors = [torch.randn(numel) for _ in range(TENSORS)]
    third = TENSORS // 3
    return {
        "model": {f"layer{i}.weight": tensor for i, tensor in enumerate(tensors[:third])},
        "optimizer": {"state": {i: {"m": t} for i, t in enumerate(tensors[third:])}},
        "progress": {"step": 1},
    }


def tensors_of(state: dict) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def walk(value: object) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)

    walk(state)
    return found


def plain_copy_s(state: dict, repeats: int = 3) -> float:
    """The fastest copy of the state's tensors this process makes: into tensors already
    allocated and touched (median of `repeats`)."""
    sources = tensors_of(state)
    targets = [torch.empty_like(tensor).zero_() for tensor in sources]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        torch._foreach_copy_(targets, sources)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def refusal(sizes: list[float]) -> str | None:
    """The one line that refuses a size this machine cannot hold, or None."""
    available = psutil.virtual_memory().available / 1e9
    shm_free = shutil.disk_usage("/dev/shm").free / 1e9
    for size in sizes:
        if size <= 0:
            return f"state_size: --sizes {size:g}: each size must be more than 0 GB"
        needed = COPIES_HELD * size
        if needed > available or 2 * size > shm_free:
            largest = min(available / COPIES_HELD, shm_free / 2)
            return (
                f"state_size: --sizes {size:g}: a {size:g} GB state needs {needed:.1f} GB of memory (the "
                f"state, its shared copy, a snapshot and a restore) and {2 * size:.1f} GB in /dev/shm; this "
                f"machine has {available:.1f} GB available and {shm_free:.1f} GB of /dev/shm: at most "
                f"{largest:.1f} GB here"
            )
    return None


def quiet_logger() -> logging.Logger:
    logger = logging.getLogger("state-size")
    logger.addHandler(logging.NullHandler())
    logger.propagate = False
    return logger


@dataclass(frozen=True)
class SaveRun:
    blocked_s: float
    stall_s: float
    done_s: float  # save call to the write's end


def stall(run: LoopRun, mean_step: float) -> float:
    """What a save cost the loop: the wall time of its steps, the save call's included, over
    as many steps of the undisturbed loop (its mean: a long write's many steps would add up
    the positive half of the steps' jitter, a floor that grows with the write's length)."""
    return run.blocked + sum(run.durations) - len(run.durations) * mean_step


def undisturbed_step() -> float:
    """The loop's mean step with nothing else at work: a second's pause first (the last
    save's upload may still keep moto busy), then 60 steps, the slowest 5 % left out (one
    hiccup in the baseline, multiplied by a long write's steps, would read as a negative
    stall)."""
    time.sleep(1.0)
    durations = sorted(compute_loop(MATRIX, BASELINE_STEPS).durations)
    return statistics.mean(durations[: int(len(durations) * 0.95)])


def timed_save(writer: CheckpointWriter, state: dict, step: int, durable: bool, mean_step: float) -> SaveRun:
    """One save in a compute loop, going on until the writer is idle: its blocked time
    (taken around the call), its stall, and when its write ended."""
    marks: dict[str, float] = {}

    def save() -> None:
        marks["saved"] = time.perf_counter()
        writer.save(state, step=step, epoch=0, world_size=1, durable=durable)

    def done() -> bool:
        if writer.wait(timeout=0):
            marks.setdefault("done", time.perf_counter())
            return True
        return False

    run = compute_loop(MATRIX, STEPS, save, until=done)
    marks.setdefault("done", time.perf_counter())
    return SaveRun(run.blocked, stall(run, mean_step), marks["done"] - marks["saved"])


def compare(
    make_writer: Callable[[bool], CheckpointWriter], state: dict, durable: bool, repeats: int
) -> tuple[SaveRun, float]:
    """Background saves (after one that lays out the shared buffer, as a run's first does)
    and the same saves inline, interleaved: the median background run and stall ratio."""
    background, inline = make_writer(True), make_writer(False)
    runs, ratios = [], []
    try:
        background.save(state, step=1, epoch=0, world_size=1, durable=durable)
        background.wait(600)
        for repeat in range(repeats):
            mean_step = undisturbed_step()
            runs.append(timed_save(background, state, 2 + 2 * repeat, durable, mean_step))
            synchronous = timed_save(inline, state, 3 + 2 * repeat, durable, mean_step)
            ratios.append(runs[-1].stall_s / synchronous.stall_s)
    finally:
        background.close(600)
        inline.close(600)
    middle = sorted(range(repeats), key=lambda index: ratios[index])[repeats // 2]
    return runs[middle], ratios[middle]


def s3_config(bucket: str, prefix: str) -> CheckpointConfig:
    return CheckpointConfig(uri=f"s3://{bucket}/{prefix}", keep_last=1, attempts=1)


def checkpoint_figures(state: dict, bucket: str, cache: Path) -> tuple[SaveRun, float]:
    def writer(background: bool) -> CheckpointWriter:
        config = replace(s3_config(bucket, f"ckpt-{uuid.uuid4().hex[:6]}"), async_save=background)
        checkpointer = Checkpointer(open_store(config), keep_last=1, cache=cache)
        made = CheckpointWriter(checkpointer, config, quiet_logger(), cache=cache)
        made.start(None)
        return made

    return compare(writer, state, durable=True, repeats=repeats_at(state))


def repeats_at(state: dict) -> int:
    """Five interleaved repeats below half a gigabyte (short saves, noisy ratios), three below
    a gigabyte, one above (a 4 GB upload to moto takes minutes)."""
    size = sum(tensor.nbytes for tensor in tensors_of(state))
    return 5 if size < 0.5e9 else 3 if size < 1e9 else 1


def snapshot_figures(state: dict, scratch: Path) -> tuple[SaveRun, float, SnapshotDir]:
    """The snapshot's figures, and the folder of the background writer's snapshots."""
    folders: list[SnapshotDir] = []

    def writer(background: bool) -> CheckpointWriter:
        config = CheckpointConfig(
            uri=str(scratch / f"snapshots-{len(folders)}"),
            async_save=background,
            snapshot_dir="/dev/shm/ddp-bench",
        )
        folders.append(SnapshotDir(config, "lineage"))
        made = CheckpointWriter(None, config, quiet_logger(), cache=scratch, snapshots=True)
        made.start(folders[-1])
        return made

    run, ratio = compare(writer, state, durable=False, repeats=repeats_at(state))
    folders[1].remove()  # the inline writer's
    return run, ratio, folders[0]


def restore_from_snapshot(snapshots: SnapshotDir, state: dict) -> tuple[float, float]:
    """What a restarted rank does (the newest snapshot verified and loaded, its tensors
    copied into the model's and the optimizer's), and a plain read of the same file's bytes
    into memory already allocated."""
    targets = tensors_of(state)
    started = time.perf_counter()
    found = snapshots.newest()
    assert found is not None, f"no snapshot in {snapshots.folder}"
    torch._foreach_copy_(targets, tensors_of(found[1]))
    restore_s = time.perf_counter() - started
    path = snapshots.folder / f"step-{found[0]}" / CHECKPOINT_FILE
    del found
    buffer = np.ones(path.stat().st_size, dtype=np.uint8)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        handle.readinto(buffer)
    return restore_s, time.perf_counter() - started


def restore_from_s3(bucket: str, prefix: str, cache: Path) -> tuple[float, float]:
    """A new pod's restore (download, verify, load) and boto3's plain download of the same object."""
    import boto3

    config = s3_config(bucket, prefix)
    checkpointer = Checkpointer(open_store(config), keep_last=1, cache=cache)
    started = time.perf_counter()
    step = checkpointer.find_resumable()
    assert step is not None, f"nothing resumable in s3://{bucket}/{prefix}"
    checkpointer.load(step)
    restore_s = time.perf_counter() - started
    checkpointer.release(step)
    target = cache / "plain-download"
    started = time.perf_counter()
    boto3.client("s3").download_file(bucket, f"{prefix}/step-{step}/{CHECKPOINT_FILE}", str(target))
    plain_s = time.perf_counter() - started
    target.unlink()
    return restore_s, plain_s


def plain_upload_s(state: dict, bucket: str, scratch: Path) -> float:
    import boto3

    buffer = io.BytesIO()
    torch.save(state, buffer)
    path = scratch / "plain-upload.pt"
    path.write_bytes(buffer.getbuffer())
    del buffer
    client = boto3.client("s3")
    started = time.perf_counter()
    client.upload_file(str(path), bucket, "plain/upload.pt")
    elapsed = time.perf_counter() - started
    client.delete_object(Bucket=bucket, Key="plain/upload.pt")
    path.unlink()
    return elapsed


def dcp_figures(state: dict, bucket: str, endpoint: str) -> tuple[float, float]:
    """torch.distributed.checkpoint's process-based `async_save`, staged in shared memory,
    to S3 through s3torchconnector: until the state may change, and until it is uploaded.
    Its second save, as ours: the first starts its process and lays out its staging."""
    import torch.distributed.checkpoint as dcp
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    on_gpu = torch.cuda.is_available()  # pinned memory and a non-blocking copy need a device
    stager = DefaultStager(StagingOptions(on_gpu, True, on_gpu, on_gpu))
    client_config = S3ClientConfig(force_path_style=True)
    timings = []
    try:
        for _ in range(2):
            writer = S3StorageWriter(REGION, f"s3://{bucket}/dcp-{uuid.uuid4().hex[:6]}", client_config)
            writer.fs._client = S3Client(REGION, endpoint=endpoint, s3client_config=client_config)  # moto's
            started = time.perf_counter()
            response = dcp.async_save(
                state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=stager,
            )  # fmt: skip
            staged = getattr(response, "staging_completion", None)  # a Future where staging blocks
            if staged is not None:
                staged.result()
            blocked = time.perf_counter() - started
            getattr(response, "upload_completion", response).result()
            timings.append((blocked, time.perf_counter() - started))
            empty_bucket(bucket)
    finally:
        stager.close()
    return timings[-1]


@contextmanager
def world_of_one():
    """A gloo group of this process alone: DCP's process-based saver starts its daemon's
    group from the caller's."""
    import torch.distributed as dist

    from benchmarks.metrics import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure(size: float, bucket: str, endpoint: str, scratch: Path, with_dcp: bool) -> SizeFigures:
    state = model_state(size)
    copy_s = plain_copy_s(state)
    checkpoint, checkpoint_ratio = checkpoint_figures(state, bucket, scratch)
    plain_upload = plain_upload_s(state, bucket, scratch)
    snapshot, snapshot_ratio, snapshots = snapshot_figures(state, scratch)
    restore_snapshot, plain_read = restore_from_snapshot(snapshots, state)
    snapshots.remove()
    restore_s3 = plain_download = None
    if size <= S3_RESTORE_MAX_GB:
        prefixes = sorted(prefix_of(key) for key in list_keys(bucket) if key.startswith("ckpt-"))
        restore_s3, plain_download = restore_from_s3(bucket, prefixes[0], scratch / "restore")
    dcp_blocked = dcp_upload = None
    if with_dcp and size <= DCP_MAX_GB:
        empty_bucket(bucket)  # moto holds what it stores in memory
        dcp_blocked, dcp_upload = dcp_figures(state, bucket, endpoint)
    return SizeFigures(
        size, copy_s, checkpoint.blocked_s, checkpoint_ratio, checkpoint.done_s, plain_upload,
        snapshot.blocked_s, snapshot_ratio, snapshot.done_s, restore_snapshot, plain_read,
        restore_s3, plain_download, dcp_blocked, dcp_upload,
    )  # fmt: skip


def list_keys(bucket: str) -> list[str]:
    import boto3

    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


def prefix_of(key: str) -> str:
    return key.split("/", 1)[0]


def empty_bucket(bucket: str) -> None:
    import boto3

    client = boto3.client("s3")
    for key in list_keys(bucket):
        client.delete_object(Bucket=bucket, Key=key)


@contextmanager
def bucket_on_moto():
    """A bucket of moto's S3 in its lowest-priority process; the AWS_* variables boto3 and
    the trainer read."""
    import boto3

    with moto_process() as (endpoint, _):
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_REGION=REGION,
            AWS_ENDPOINT_URL=endpoint,
        )
        bucket = f"state-{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        yield bucket, endpoint


def describe(figures: SizeFigures) -> str:
    dcp = f"; DCP not measured (moto's memory above {DCP_MAX_GB:g} GB)"
    if figures.dcp_blocked_s is not None:
        dcp = f"; DCP async_save blocked {figures.dcp_blocked_s:.2f} s, uploaded {figures.dcp_upload_s:.1f} s"
    f = figures
    s3 = f", from S3 not measured (moto's ranged reads above {S3_RESTORE_MAX_GB:g} GB)"
    if f.restore_s3_s is not None:
        s3 = f", from S3 {f.restore_s3_s:.1f} s (plain download {f.plain_download_s:.1f} s)"
    return (
        f"{f.gigabytes:>4g} GB: plain copy {f.copy_s:.3f} s; checkpoint blocked "
        f"{f.checkpoint_blocked_s:.3f} s "
        f"({f.checkpoint_blocked_s / f.copy_s:.2f} x the copy), stall ratio {f.checkpoint_stall_ratio:.3f}, "
        f"uploaded {f.upload_s:.1f} s (plain boto3 {f.plain_upload_s:.1f} s); snapshot blocked "
        f"{f.snapshot_blocked_s:.3f} s ({f.snapshot_blocked_s / f.copy_s:.2f} x), stall ratio "
        f"{f.snapshot_stall_ratio:.3f}, written {f.snapshot_write_s:.1f} s; restore from the snapshot "
        f"{f.restore_snapshot_s:.1f} s (a plain read {f.plain_read_s:.1f} s, "
        f"{f.restore_snapshot_s / f.plain_read_s:.1f} x){s3}{dcp}"
    )


def sweep(sizes: list[float], with_dcp: bool, report: Callable[[str], None] = print) -> list[SizeFigures]:
    """Each size in turn, each with a moto of its own: moto keeps what it stores in memory and
    its process grows with every multipart upload it joins (one of 15 GB was OOM-killed at
    4 GB). A size whose S3 stand-in gives out is said in one line and the sweep goes on."""
    torch.set_num_threads(1)  # the loop stands in for a training process's host thread
    found = []
    with tempfile.TemporaryDirectory() as scratch, world_of_one():
        for size in sizes:
            try:
                with bucket_on_moto() as (bucket, endpoint):
                    found.append(measure(size, bucket, endpoint, Path(scratch), with_dcp))
            except (Exception, CheckpointException) as error:  # moto killed: a refused connection
                said = f"{type(error).__name__}: {error}".splitlines()[0][:300]
                report(f"{size:>4g} GB: stopped here, the S3 stand-in gave out ({said})")
                continue
            report(describe(found[-1]))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default=",".join(f"{size:g}" for size in SIZES_GB), help="state sizes in GB"
    )
    parser.add_argument("--no-dcp", action="store_true", help="leave out torch.distributed.checkpoint's run")
    args = parser.parse_args(argv)
    sizes = [float(size) for size in args.sizes.split(",")]
    if (refused := refusal(sizes)) is not None:
        print(refused, file=sys.stderr)
        return 2
    sweep(sizes, not args.no_dcp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
