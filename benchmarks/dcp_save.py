"""torch.distributed.checkpoint's process-based `async_save` beside the trainer's writer
(`benchmarks.state_size`): the same state, staged in shared memory, to the same moto bucket
through s3torchconnector's `S3StorageWriter`."""

from __future__ import annotations

import os
import time
import uuid
from contextlib import contextmanager

import torch

from benchmarks.moto_bucket import REGION, empty_bucket

# DCP's 4 GB save through s3torchconnector made moto (its multipart upload joined in memory)
# grow to 15 GB beside this process's 8 GB (the state, DCP's shared staging) and the kernel
# killed it: DCP is measured up to this size
DCP_MAX_GB = 2.0


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
