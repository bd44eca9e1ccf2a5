"""Sharded data from S3: samples/s and data wait against the same shards on local disk.

    python -m benchmarks.shards [--nproc 2] [--repeats 3] [--delays 0,20,100] [--set k=v ...]

Writes synthetic images (16384 of 1x28x28) as safetensors shards once, to a folder and to
moto's S3 server (its own process, lowest CPU priority, as a remote endpoint would be), then
trains the same run (`data.name=shards`, the cnn, 2 CPU ranks) on the folder and on S3 behind
the fault proxy (benchmarks/fault_proxy.py, also its own lowest-priority process) adding each
delay to every request, interleaved and repeated. The node cache is kept smaller than the
data (`data.shards.cache_mb=8`, a quarter), so every epoch streams from S3 again rather than
from the cache. Printed: median samples/s, its ratio to local disk (target >= 0.95 at
20 ms), and the data wait share of the step (`data_ms` over `step_ms`, target <= 5 % at
20 ms), with what the read-ahead and the cache cost in memory and disk.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from benchmarks.checkpoint import AWS, moto_process
from benchmarks.runner import TrainerRun, run_trainer, trainer_bench_parser
from trainer.config import ShardsConfig, load_config
from trainer.data import build_data
from trainer.data.shards.index import INDEX_FILE, parse_index
from trainer.data.shards.source import open_source
from trainer.data.shards.write import write_dataset

SAMPLES = 16384  # of 1x28x28: 64 MB, of which 35 MB (45 shards) for training
SAMPLES_PER_SHARD = 256  # 0.75 MB shards: small for a real dataset (16-256 MB), many requests
S3_PATH = "s3://shards/synthetic"
CACHE_MB = 8  # a quarter of the training shards: each epoch streams from S3 again
TARGETS = {"samples_ratio": 0.95, "data_share": 0.05}
PROXY = (
    "import sys, time; from benchmarks.fault_proxy import FaultProxy\n"
    "from benchmarks.priority import lowest_priority; lowest_priority()\n"
    "with FaultProxy(sys.argv[1], every=0, delay_s=float(sys.argv[2])) as proxy:\n"
    "    print(proxy.url, flush=True); time.sleep(1e9)\n"
)


@contextlib.contextmanager
def proxy_process(upstream: str, delay_ms: float) -> Iterator[str]:
    """The fault proxy adding `delay_ms` to each request, in a lowest-priority process."""
    server = subprocess.Popen(
        [sys.executable, "-c", PROXY, upstream, str(delay_ms / 1000)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield server.stdout.readline().strip()
    finally:
        server.kill()
        server.wait()


def write_shards(folder: Path, endpoint: str) -> None:
    """The synthetic splits as shards in `folder` and under S3_PATH on moto."""
    import boto3

    os.environ.update({**AWS, "AWS_ENDPOINT_URL": endpoint})
    boto3.client("s3").create_bucket(Bucket="shards")
    splits = build_data(
        load_config(None, ["data.name=synthetic", f"data.synthetic.num_samples={SAMPLES}"]).data, 0
    )
    for target in (str(folder), S3_PATH):
        write_dataset(splits, open_source(target, create=True), samples_per_shard=SAMPLES_PER_SHARD, seed=0)


def one_run(args, path: str, cache: Path) -> TrainerRun:
    settings = [
        "data.name=shards", f"data.path={path}", f"data.shards.cache_dir={cache}",
        f"data.shards.cache_mb={CACHE_MB}", "train.epochs=3", "train.clip_grad_norm=0",
        "checkpoint.every_steps=0", "metrics.port=0", *args.overrides,
    ]  # fmt: skip
    return run_trainer(args.nproc, settings, log_every=20, config=args.config)


def measure(args, folder: Path, endpoint: str, delays: list[float]) -> dict[str, list[TrainerRun]]:
    runs: dict[str, list[TrainerRun]] = {"local disk": [], **{f"S3 +{d:g} ms": [] for d in delays}}
    for round_number in range(args.repeats):
        with tempfile.TemporaryDirectory() as scratch:
            runs["local disk"].append(one_run(args, str(folder), Path(scratch) / "local"))
            for delay in delays[round_number % len(delays) :] + delays[: round_number % len(delays)]:
                with proxy_process(endpoint, delay) as url:
                    os.environ["AWS_ENDPOINT_URL"] = url
                    cache = Path(scratch) / f"s3-{delay:g}"
                    runs[f"S3 +{delay:g} ms"].append(one_run(args, S3_PATH, cache))
    return runs


def report(runs: dict[str, list[TrainerRun]], folder: Path, nproc: int) -> str:
    index = parse_index((folder / INDEX_FILE).read_bytes(), str(folder))
    shard_mb = statistics.mean(entry.bytes for entry in index.train) / 2**20
    defaults = ShardsConfig()
    window = 2 * defaults.block + defaults.prefetch
    local = statistics.median(run.samples_per_second for run in runs["local disk"])
    lines = [
        f"shards: {len(index.train)} training shards of {SAMPLES_PER_SHARD} samples "
        f"({shard_mb:.2f} MB each), {nproc} CPU ranks; node cache {CACHE_MB} MB (a quarter of them)",
        f"{'source':<14} {'samples/s':>10} {'vs local':>9} {'data wait':>10}",
    ]
    for name, results in runs.items():
        rate = statistics.median(run.samples_per_second for run in results)
        share = statistics.median(run.split_ms["data_ms"] / run.step_ms for run in results)
        lines.append(f"{name:<14} {rate:>10,.0f} {rate / local:>9.3f} {100 * share:>9.1f}%")
    lines += [
        f"targets at S3 +20 ms: samples/s >= {TARGETS['samples_ratio']}x local disk, "
        f"data wait <= {100 * TARGETS['data_share']:.0f}% of the step",
        f"memory: each rank holds at most 2 x block + prefetch = {window} decoded shards "
        f"(block {defaults.block}, prefetch {defaults.prefetch}): {window * shard_mb:.1f} MB here, "
        f"{window} x the shard size in general; the node cache holds data.shards.cache_mb on disk "
        f"({defaults.cache_mb} MB by default, under /tmp)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = trainer_bench_parser(__doc__, repeats=3)
    parser.add_argument("--delays", default="0,20,100", help="ms added per S3 request (default 0,20,100)")
    args = parser.parse_args(argv)
    delays = [float(value) for value in args.delays.split(",")]
    with moto_process() as (endpoint, _), tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "shards"
        write_shards(folder, endpoint)
        print(report(measure(args, folder, endpoint, delays), folder, args.nproc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
