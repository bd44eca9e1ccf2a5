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
- **stall ratio**: what a background save costs a compute loop (`stall`: the loop's time
  until the write is done, over as many undisturbed steps) over the same save done inline
  (`checkpoint.async_save=false`);
- **upload** of the durable checkpoint (serialize, hash, multipart upload) against boto3's
  plain `upload_file` of the same bytes; the snapshot's write to /dev/shm;
- **restore** from the snapshot (verify, load, copy into the model's tensors) against a read
  of the same file, and from S3 (download, verify, load) against boto3's `download_file`;
- **DCP's process-based `async_save`** (`benchmarks.dcp_save`) to the same bucket.
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
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import psutil
import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from benchmarks.dcp_save import DCP_MAX_GB, dcp_figures, world_of_one
from benchmarks.moto_bucket import bucket_on_moto, empty_bucket, list_keys, prefix_of
from benchmarks.save_stall import FULL_LOOP, Loop, SaveRun, compare, tensors_of
from trainer.checkpoint.location import open_store
from trainer.checkpoint.manager import CHECKPOINT_FILE, Checkpointer
from trainer.checkpoint.snapshots import SnapshotDir
from trainer.checkpoint.writer import CheckpointWriter
from trainer.config import CheckpointConfig

SIZES_GB = (0.1, 0.5, 1.0, 2.0, 4.0)
TENSORS = 16
COPIES_HELD = 4  # the state, its shared host copy, a snapshot, and a restored state


# moto answers each ranged GET by copying the whole object (moto/s3/responses.py,
# `_handle_range_header`: the body sliced from `key.value`), and a download is 8 MiB ranges:
# 23 s for 0.5 GB, 97 s for 1 GB here, growing as the square. Restores from S3 are measured
# up to this size; above it the time is moto's, not the trainer's
S3_RESTORE_MAX_GB = 0.5


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


def s3_config(bucket: str, prefix: str) -> CheckpointConfig:
    return CheckpointConfig(uri=f"s3://{bucket}/{prefix}", keep_last=1, attempts=1)


def checkpoint_figures(state: dict, bucket: str, cache: Path, loop: Loop) -> tuple[SaveRun, float]:
    def writer(background: bool) -> CheckpointWriter:
        config = replace(s3_config(bucket, f"ckpt-{uuid.uuid4().hex[:6]}"), async_save=background)
        checkpointer = Checkpointer(open_store(config), keep_last=1, cache=cache)
        made = CheckpointWriter(checkpointer, config, quiet_logger(), cache=cache)
        made.start(None)
        return made

    return compare(writer, state, durable=True, loop=loop)


def snapshot_figures(state: dict, scratch: Path, loop: Loop) -> tuple[SaveRun, float, SnapshotDir]:
    """The snapshot's figures, and the folder of the background writer's snapshots."""
    folders: list[SnapshotDir] = []

    def writer(background: bool) -> CheckpointWriter:
        config = CheckpointConfig(
            uri=str(scratch / f"snapshots-{len(folders)}"),
            async_save=background,
            snapshot_dir=f"/dev/shm/ddp-bench-{os.getpid()}",  # removed with its snapshots
        )
        folders.append(SnapshotDir(config, "lineage"))
        made = CheckpointWriter(None, config, quiet_logger(), cache=scratch, snapshots=True)
        made.start(folders[-1])
        return made

    run, ratio = compare(writer, state, durable=False, loop=loop)
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


def measure(
    size: float, bucket: str, endpoint: str, scratch: Path, with_dcp: bool, loop: Loop
) -> SizeFigures:
    state = model_state(size)
    copy_s = plain_copy_s(state)
    checkpoint, checkpoint_ratio = checkpoint_figures(state, bucket, scratch, loop)
    plain_upload = plain_upload_s(state, bucket, scratch)
    snapshot, snapshot_ratio, snapshots = snapshot_figures(state, scratch, loop)
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


def describe(f: SizeFigures) -> str:
    blocked = f.checkpoint_blocked_s
    s3 = f", from S3 not measured (moto's ranged reads above {S3_RESTORE_MAX_GB:g} GB)"
    if f.restore_s3_s is not None:
        s3 = f", from S3 {f.restore_s3_s:.1f} s (plain download {f.plain_download_s:.1f} s)"
    dcp = f"; DCP not measured (moto's memory above {DCP_MAX_GB:g} GB)"
    if f.dcp_blocked_s is not None:
        dcp = f"; DCP async_save blocked {f.dcp_blocked_s:.2f} s, uploaded {f.dcp_upload_s:.1f} s"
    return (
        f"{f.gigabytes:>4g} GB: plain copy {f.copy_s:.3f} s; checkpoint blocked {blocked:.3f} s "
        f"({blocked / f.copy_s:.2f} x the copy), stall ratio {f.checkpoint_stall_ratio:.3f}, "
        f"uploaded {f.upload_s:.1f} s (plain boto3 {f.plain_upload_s:.1f} s); snapshot blocked "
        f"{f.snapshot_blocked_s:.3f} s ({f.snapshot_blocked_s / f.copy_s:.2f} x), stall ratio "
        f"{f.snapshot_stall_ratio:.3f}, written {f.snapshot_write_s:.1f} s; restore from the snapshot "
        f"{f.restore_snapshot_s:.1f} s (a plain read {f.plain_read_s:.1f} s, "
        f"{f.restore_snapshot_s / f.plain_read_s:.1f} x){s3}{dcp}"
    )


def sweep(
    sizes: list[float], with_dcp: bool, report: Callable[[str], None] = print, loop: Loop = FULL_LOOP
) -> list[SizeFigures]:
    """Each size in turn, each with a moto of its own: moto keeps what it stores in memory and
    its process grows with every multipart upload it joins (one of 15 GB was OOM-killed at
    4 GB). A size whose S3 stand-in gives out is said in one line and the sweep goes on."""
    torch.set_num_threads(1)  # the loop stands in for a training process's host thread
    found = []
    with tempfile.TemporaryDirectory() as scratch, world_of_one():
        for size in sizes:
            try:
                with bucket_on_moto() as (bucket, endpoint):
                    found.append(measure(size, bucket, endpoint, Path(scratch), with_dcp, loop))
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
