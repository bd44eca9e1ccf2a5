"""The storage path's faults, each a real torchrun job (the digits demo, 2 CPU ranks) on an
S3 endpoint (moto) through the fault proxy, measured from outside: every time is the
harness's own clock at a line's arrival, every state the store's own objects.

  writer-stop  rank 0's checkpoint writer SIGSTOPped while it uploads a checkpoint through a
               link slowed to 20 KB/s: training must go on (40 more steps within 20 s), the
               writer be named within 60 s and replaced, and the run end durable at its last
               step (`writer_stop_trial`);
  slow-store   every upload slower than the checkpoint interval: the run against the same
               job on the fast store, samples/s side by side (benchmarks.storage);
  zombie       job A's write of latest.json held in the network while A's whole process tree
               is paused; A's lease goes stale, job B takes the location over and ends; the
               held write arrives, then A thaws and plain torchrun restarts it: the store
               must refuse the write (412), A end non-zero, and nothing in the store change
               after B's end (`zombie_trial`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.fault_proxy import FaultProxy
from trainer.launcher.process_tree import signal_tree

WRITER_STOP_BOUNDS = {"steps": 40, "steps_within_s": 20.0, "named_within_s": 60.0}
DIGITS = (
    "data.name=plugins:slow_digits,data.options.delay_s=0.002,log.format=json,log.every_steps=5,"
    "metrics.port=0,checkpoint.snapshot_every_steps=5"
)
HELPERS = Path(__file__).resolve().parents[1] / "tests" / "helpers"  # the slow_digits plug-in


@dataclass(frozen=True)
class S3Target:
    """Where a trial writes: an endpoint, a bucket on it, and the environment to reach it."""

    endpoint: str
    bucket: str
    env: dict[str, str]

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.env.get("AWS_REGION", "us-east-1"),
            aws_access_key_id=self.env.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=self.env.get("AWS_SECRET_ACCESS_KEY"),
        )

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def latest(self, prefix: str) -> dict | None:
        try:
            return json.loads(
                self.client().get_object(Bucket=self.bucket, Key=f"{prefix}/latest.json")["Body"].read()
            )
        except self.client().exceptions.NoSuchKey:
            return None

    def listing(self, prefix: str) -> dict[str, str]:
        """Every object under `prefix` with its ETag: what changes if anything is written."""
        found = self.client().list_objects_v2(Bucket=self.bucket, Prefix=f"{prefix}/").get("Contents", [])
        return {item["Key"]: item["ETag"] for item in found}

    def open_uploads(self) -> int:
        return len(self.client().list_multipart_uploads(Bucket=self.bucket).get("Uploads", []))


def trainer(overrides: str, cwd: Path, env: dict[str, str], restarts: int = 0) -> subprocess.Popen:
    """A 2-rank digits job under `torchrun --standalone`, JSON lines on its stdout."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        f"--max-restarts={restarts}", "-m", "trainer", "--config", "digits", "--set", overrides,
    ]  # fmt: skip
    paths = os.pathsep.join([str(HELPERS), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        command, cwd=cwd, env={**env, "PYTHONPATH": paths, "TMPDIR": str(cwd)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@dataclass
class Lines:
    """A job's JSON lines and stderr, each line with the harness's time of arrival."""

    records: list[tuple[float, dict]]
    stderr: list[str]

    @classmethod
    def follow(cls, job: subprocess.Popen, on_record=None) -> tuple[Lines, threading.Thread]:
        lines = cls([], [])

        def read() -> None:
            errors = threading.Thread(target=lambda: lines.stderr.extend(job.stderr), daemon=True)
            errors.start()
            for line in job.stdout:
                if line.startswith("{"):
                    lines.records.append((time.monotonic(), json.loads(line)))
                    if on_record is not None:
                        on_record(lines.records[-1][1])
            errors.join(timeout=10)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        return lines, reader

    def events(self, name: str) -> list[tuple[float, dict]]:
        return [(at, r) for at, r in self.records if r.get("event") == name]

    def text(self) -> str:
        return "".join(self.stderr) + "\n".join(json.dumps(r) for _, r in self.records)


def writer_of(job: subprocess.Popen) -> psutil.Process | None:
    """Rank 0's checkpoint writer: a child forked from its worker (the same command line; the
    fork server's differs)."""
    for child in psutil.Process(job.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") != "0" or "trainer" not in child.cmdline():
                continue
            for grandchild in child.children():
                if grandchild.cmdline() == child.cmdline():
                    return grandchild
        except psutil.NoSuchProcess:
            continue
    return None


@dataclass(frozen=True)
class WriterStopTrial:
    stopped_step: int | None  # rank 0's step line after which the writer was stopped
    steps_s: float | None  # the stop to the line of 40 steps later
    named_s: float | None  # the stop to the `writer_stuck` line
    named: dict | None
    old_writer_gone: bool
    skip_lines: int  # skipped-save warnings (one per streak)
    code: int
    final_step: int | None  # the summary's
    store_step: int | None  # latest.json's
    open_uploads: int

    def passed(self) -> bool:
        bounds = WRITER_STOP_BOUNDS
        return (
            self.steps_s is not None and self.steps_s <= bounds["steps_within_s"]
            and self.named_s is not None and self.named_s <= bounds["named_within_s"]
            and self.old_writer_gone and self.code == 0
            and self.final_step is not None and self.store_step == self.final_step and self.open_uploads == 0
        )  # fmt: skip

    def describe(self, index: int) -> str:
        steps = "never" if self.steps_s is None else f"{self.steps_s:.1f}s"
        named = "never" if self.named_s is None else f"{self.named_s:.1f}s"
        return (
            f"trial {index}: writer stopped after step {self.stopped_step} -> 40 more steps in {steps}, "
            f"writer named in {named} and replaced; exit {self.code}, store at step {self.store_step} of "
            f"{self.final_step}, {self.open_uploads} open uploads"
        )


def writer_stop_trial(workdir: Path, target: S3Target, *, floor_s: float = 30.0) -> WriterStopTrial:
    """Stop rank 0's writer while it uploads through a 20 KB/s link; lift the slowness once the
    writer is named, so that the new one catches up."""
    uploading = threading.Event()

    def checkpoint_bodies(method: str, path: str) -> bool:
        if method in {"PUT", "POST"} and "/step-" in path and "checkpoint.pt" in path:
            uploading.set()
            return True
        return False

    stopped: list[tuple[float, int, psutil.Process]] = []
    with FaultProxy(target.endpoint, every=0, matches=checkpoint_bodies, rate_bps=20_000) as proxy:
        overrides = (
            f"{DIGITS},train.max_steps=400,train.epochs=30,checkpoint.every_steps=20,checkpoint.save_wait_s=2,"
            f"checkpoint.writer_floor_s={floor_s:g},checkpoint.uri={target.uri('stopped')},"
            f"checkpoint.snapshot_dir={workdir / 'shm'}"
        )
        job = trainer(overrides, workdir, {**target.env, "AWS_ENDPOINT_URL": proxy.url})

        def on_record(record: dict) -> None:
            if not stopped and uploading.is_set() and record.get("event") == "progress":
                writer = writer_of(job)
                if writer is not None:
                    writer.send_signal(signal.SIGSTOP)
                    stopped.append((time.monotonic(), record["step"], writer))
            if record.get("event") == "writer_stuck":
                proxy.rate_bps = 0  # the link is fine again: the new writer catches up

        lines, reader = Lines.follow(job, on_record)
        try:
            job.wait(timeout=300)
            reader.join(timeout=30)
        finally:
            if job.poll() is None:
                signal_tree(job)
            if stopped:
                with contextlib.suppress(psutil.NoSuchProcess):
                    stopped[0][2].kill()  # psutil checks that the pid is still the writer's
    at, step, writer = stopped[0] if stopped else (None, None, None)
    later = [t for t, r in lines.events("progress") if step is not None and r["step"] >= step + 40]
    named = lines.events("writer_stuck")
    summary = lines.events("summary")
    latest = target.latest("stopped")
    gone = writer is not None and (
        not psutil.pid_exists(writer.pid) or writer.status() == psutil.STATUS_ZOMBIE
    )
    return WriterStopTrial(
        stopped_step=step,
        steps_s=later[0] - at if later and at else None,
        named_s=named[0][0] - at if named and at else None,
        named=named[0][1] if named else None,
        old_writer_gone=gone,
        skip_lines=sum("skipped: the writer has not taken" in r.get("message", "") for _, r in lines.records),
        code=job.returncode,
        final_step=summary[-1][1]["steps"] if summary else None,
        store_step=latest and latest["step"],
        open_uploads=target.open_uploads(),
    )


@dataclass(frozen=True)
class ZombieTrial:
    held_status: int | None  # what the store answered A's held write of latest.json
    b_code: int
    b_took_over: bool
    b_final: int | None
    store_step: int | None  # latest.json's at the end
    store_epoch: int | None
    a_code: int | None
    a_lost_line: bool  # A's ranks said another run holds the lease
    a_refused_restart: bool  # A's torchrun restarts were refused as superseded
    unchanged_after_b: bool  # nothing in the store changed after B's end
    a_text: str

    def passed(self) -> bool:
        return (
            self.held_status == 412 and self.b_code == 0 and self.b_took_over
            and self.store_step == self.b_final and self.a_code not in (None, 0)
            and self.a_refused_restart and self.unchanged_after_b
        )  # fmt: skip

    def describe(self, index: int) -> str:
        return (
            f"trial {index}: A's held latest.json answered {self.held_status}; B took over and ended at step "
            f"{self.b_final} (exit {self.b_code}); A exited {self.a_code} "
            f"({'restarts refused as superseded' if self.a_refused_restart else 'RESTARTS NOT REFUSED'}); "
            f"latest.json at step {self.store_step}, lease epoch {self.store_epoch}; store "
            f"{'unchanged' if self.unchanged_after_b else 'CHANGED'} after B's end"
        )


def zombie_trial(workdir: Path, target: S3Target) -> ZombieTrial:
    """Job A (plain torchrun, 2 restarts) is paused with its next latest.json write held in
    the network; job B takes the location over and ends; the write is let through, then A
    thaws."""
    common = f"{DIGITS},checkpoint.every_steps=10,checkpoint.lease_s=2,checkpoint.uri={target.uri('run')}"
    a_dir, b_dir = workdir / "a", workdir / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    with FaultProxy(target.endpoint, every=0) as proxy:
        a_env = {**target.env, "AWS_ENDPOINT_URL": proxy.url, "TRAINER_JOB_ID": "job-a"}
        job_a = trainer(f"{common},train.epochs=60,checkpoint.snapshot_dir={a_dir / 'shm'}", a_dir, a_env, 2)
        held: list = []

        def hold_the_next_pointer(record: dict) -> None:
            if record.get("event") == "checkpoint" and not held:
                held.append(
                    proxy.hold(lambda method, path: method == "PUT" and path.endswith("/run/latest.json"))
                )

        lines, reader = Lines.follow(job_a, hold_the_next_pointer)
        try:
            deadline = time.monotonic() + 120
            while not (held and held[0].arrived.is_set()) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not (held and held[0].arrived.is_set()):
                raise RuntimeError("job A never wrote latest.json again:\n" + lines.text()[-3000:])
            signal_tree(job_a, signal.SIGSTOP)  # A's node pauses, its request in the network
            time.sleep(7)  # A's lease (2 s, stale after 3 intervals) goes stale
            b_env = {**target.env, "TRAINER_JOB_ID": "job-b"}
            job_b = trainer(f"{common},train.epochs=8,checkpoint.snapshot_dir={b_dir / 'shm'}", b_dir, b_env)
            b_out, b_err = job_b.communicate(timeout=240)
            after_b = target.listing("run")
            held[0].release()  # A's write of latest.json arrives, late
            held[0].answered.wait(30)
            signal_tree(job_a, signal.SIGCONT)
            job_a.wait(timeout=240)
            reader.join(timeout=30)
        finally:
            if job_a.poll() is None:
                signal_tree(job_a, signal.SIGCONT)
                signal_tree(job_a)
    b_records = [json.loads(line) for line in b_out.splitlines() if line.startswith("{")]
    b_summary = [r for r in b_records if r.get("event") == "summary"]
    latest = target.latest("run") or {}
    a_text = lines.text()
    return ZombieTrial(
        held_status=held[0].status,
        b_code=job_b.returncode,
        b_took_over="took over the checkpoint lease" in b_out + b_err,
        b_final=b_summary[-1]["steps"] if b_summary else None,
        store_step=latest.get("step"),
        store_epoch=latest.get("lease_epoch"),
        a_code=job_a.returncode,
        a_lost_line="another run holds its lease now" in a_text,
        a_refused_restart="job job-a was superseded here" in a_text,
        unchanged_after_b=target.listing("run") == after_b,
        a_text=a_text,
    )


STORAGE_FAULTS = ("writer-stop", "slow-store", "zombie")


def slow_store_trial(index: int, endpoint: str, bucket: str) -> tuple[str, bool, float]:
    """The job on the fast store, then on one whose uploads run at 100 KB/s (benchmarks.storage):
    its line, whether it held (samples/s >= 0.95x, the store at the run's last step), the ratio."""
    import argparse

    from benchmarks.storage import TARGET, one_run, slow_link

    options = argparse.Namespace(nproc=2, config=None, overrides=[])
    fast = one_run(options, endpoint, bucket)
    with slow_link(endpoint, 100_000) as slow:
        slowed = one_run(options, slow, bucket)
    ratio = slowed.samples_per_second / fast.samples_per_second
    line = (
        f"trial {index}: 100 KB/s store {slowed.samples_per_second:,.0f} samples/s against "
        f"{fast.samples_per_second:,.0f} on the fast one ({ratio:.3f}x); {slowed.written} written, "
        f"{slowed.coalesced} replaced by a newer one, {slowed.skipped} skipped; the store at step "
        f"{slowed.store_step} of {slowed.final_step}"
    )
    return line, ratio >= TARGET and slowed.store_step == slowed.final_step, ratio


def storage_trials(fault: str, trials: int) -> int:
    """`trials` runs of one storage fault against moto's S3 server (its own process); a line
    each, a summary, and exit status 1 unless every one held its bounds."""
    import statistics
    import tempfile
    import uuid

    from benchmarks.checkpoint import moto_process
    from benchmarks.storage import AWS

    started = time.perf_counter()
    results: list[bool] = []
    figures: list[float] = []
    with moto_process() as (endpoint, _), tempfile.TemporaryDirectory(prefix="storage-trials-") as folder:
        env = {**os.environ, **AWS, "AWS_ENDPOINT_URL": endpoint, "OMP_NUM_THREADS": "1"}
        os.environ.update({**AWS, "AWS_ENDPOINT_URL": endpoint})
        for index in range(1, trials + 1):
            bucket = f"trial-{uuid.uuid4().hex[:10]}"
            target = S3Target(endpoint, bucket, env)
            target.client().create_bucket(Bucket=bucket)
            workdir = Path(folder) / f"trial-{index}"
            workdir.mkdir()
            if fault == "writer-stop":
                trial = writer_stop_trial(workdir, target)
                line, passed = trial.describe(index), trial.passed()
                figures += [trial.named_s or float("inf")]
            elif fault == "zombie":
                trial = zombie_trial(workdir, target)
                line, passed = trial.describe(index), trial.passed()
            else:
                line, passed, ratio = slow_store_trial(index, endpoint, bucket)
                figures.append(ratio)
            print(line, flush=True)
            results.append(passed)
    summary = f"{trials} {fault} trials in {time.perf_counter() - started:.0f}s"
    if fault == "writer-stop":
        summary += f"; writer named in median {statistics.median(figures):.1f}s, max {max(figures):.1f}s"
    if fault == "slow-store":
        summary += f"; slow/fast samples/s median {statistics.median(figures):.3f}x, min {min(figures):.3f}x"
    print(f"{summary}; {sum(results)}/{trials} within the bounds")
    return 0 if all(results) else 1
