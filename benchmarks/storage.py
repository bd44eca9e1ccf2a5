"""A store slower than the checkpoint interval costs durability, not training time.

    python -m benchmarks.storage [--nproc 2] [--repeats 3] [--rate-kbps 100] [--set k=v ...]

The same job (the digits demo at 2 CPU ranks, 30 epochs, a durable checkpoint to S3 every
20 steps, snapshots every 5) runs against moto's S3 server (its own lowest-priority process)
directly, and through the fault proxy (also its own process) reading every checkpoint body
at `--rate-kbps`, so that each upload takes seconds where the interval between checkpoints
is a fraction of one. The rounds are interleaved. Printed per store: median steady
samples/s, its ratio to the fast store's (target >= 0.95), the durable checkpoints written,
those replaced by a newer one while an upload ran (latest wins), the saves skipped, and the
step the store holds at the end (the run's last: the end waits for its own write).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from benchmarks.baseline import WARMUP_WINDOWS
from benchmarks.checkpoint import AWS, moto_process
from benchmarks.runner import config_args, torchrun, trainer_bench_parser

TARGET = 0.95
SETTINGS = (
    "train.epochs=30,checkpoint.every_steps=20,checkpoint.snapshot_every_steps=5,metrics.port=0,"
    "log.format=json,log.every_steps=20"
)
PROXY = (
    "import sys, time; from benchmarks.fault_proxy import FaultProxy\n"
    "from benchmarks.priority import lowest_priority; lowest_priority()\n"
    "bodies = lambda method, path: method in ('PUT', 'POST') and 'checkpoint.pt' in path\n"
    "with FaultProxy(sys.argv[1], every=0, matches=bodies, rate_bps=float(sys.argv[2])) as proxy:\n"
    "    print(proxy.url, flush=True); time.sleep(1e9)\n"
)


@contextmanager
def slow_link(upstream: str, rate_bps: float) -> Iterator[str]:
    """The fault proxy reading checkpoint bodies at `rate_bps`, in a lowest-priority process."""
    server = subprocess.Popen(
        [sys.executable, "-c", PROXY, upstream, str(rate_bps)], stdout=subprocess.PIPE, text=True
    )
    try:
        yield server.stdout.readline().strip()
    finally:
        server.kill()
        server.wait()


@dataclass(frozen=True)
class StoreRun:
    samples_per_second: float
    written: int
    coalesced: int
    skipped: int
    final_step: int
    store_step: int | None


def one_run(args, endpoint: str, bucket: str) -> StoreRun:
    import boto3

    prefix = uuid.uuid4().hex[:8]
    uri = f"s3://{bucket}/{prefix}"
    os.environ.update({**AWS, "AWS_ENDPOINT_URL": endpoint})
    with tempfile.TemporaryDirectory() as workdir:
        settings = [SETTINGS, *args.overrides, f"checkpoint.uri={uri},checkpoint.snapshot_dir={workdir}/shm"]
        launched = torchrun(args.nproc, ["-m", "trainer", *config_args(settings, args.config)], workdir)
    records = [json.loads(line) for line in launched.stdout.splitlines() if line.startswith("{")]
    steady = [r for r in records if r["event"] == "progress"][WARMUP_WINDOWS:]
    messages = [r.get("message", "") for r in records]
    body = boto3.client("s3").get_object(Bucket=bucket, Key=f"{prefix}/latest.json")["Body"].read()
    return StoreRun(
        statistics.median(r["samples_per_second"] for r in steady),
        sum(r["event"] == "checkpoint" for r in records),
        sum("replaced it while an upload ran" in m for m in messages),
        sum("skipped" in m for m in messages),
        next(r for r in records if r["event"] == "summary")["steps"],
        json.loads(body)["step"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = trainer_bench_parser(__doc__, repeats=3)
    parser.add_argument(
        "--rate-kbps", type=float, default=100, help="the slow store's upload rate (default 100)"
    )
    args = parser.parse_args(argv)
    import boto3

    runs: dict[str, list[StoreRun]] = {"fast store": [], f"{args.rate_kbps:g} KB/s store": []}
    with moto_process() as (endpoint, _):
        os.environ.update({**AWS, "AWS_ENDPOINT_URL": endpoint})
        boto3.client("s3").create_bucket(Bucket="storage")
        with slow_link(endpoint, args.rate_kbps * 1000) as slow:
            for round_number in range(args.repeats):
                order = [("fast store", endpoint), (f"{args.rate_kbps:g} KB/s store", slow)]
                for name, url in order[round_number % 2 :] + order[: round_number % 2]:
                    runs[name].append(one_run(args, url, "storage"))
    fast = statistics.median(run.samples_per_second for run in runs["fast store"])
    columns = ("samples/s", "vs fast", "written", "coalesced", "skipped", "end")
    print(f"{'store':<18}" + "".join(f"{column:>11}" for column in columns))
    for name, results in runs.items():
        rate = statistics.median(run.samples_per_second for run in results)
        counts = [
            statistics.median(getattr(r, field) for r in results)
            for field in ("written", "coalesced", "skipped")
        ]
        ends = ",".join(sorted({f"{run.store_step}/{run.final_step}" for run in results}))
        print(
            f"{name:<18}{rate:>11,.0f}{rate / fast:>11.3f}"
            + "".join(f"{c:>11.0f}" for c in counts)
            + f"{ends:>11}"
        )
    slow = statistics.median(run.samples_per_second for run in runs[f"{args.rate_kbps:g} KB/s store"])
    durable = all(run.store_step == run.final_step for results in runs.values() for run in results)
    print(
        f"storage: slow/fast samples/s {slow / fast:.3f}x (target >= {TARGET}); the store at the final step "
        f"in {'every' if durable else 'NOT every'} run"
    )
    return 0 if slow / fast >= TARGET and durable else 1


if __name__ == "__main__":
    raise SystemExit(main())
