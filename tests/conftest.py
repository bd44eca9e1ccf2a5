"""Shared helpers: start real `torchrun` and `python -m trainer` processes on loopback."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from benchmarks.fault_proxy import FaultProxy
from benchmarks.metrics import free_port
from benchmarks.namespaces import enter_private_network, isolation_available
from benchmarks.trial_record import same_state
from operator_scripts.local.pod_network import PodNetwork, pod_networks_available
from trainer.config import CheckpointConfig
from trainer.config.loading import load_config
from trainer.data import build_data
from trainer.data.shards.source import open_source
from trainer.data.shards.write import write_dataset

REPO = Path(__file__).resolve().parents[1]
HELPERS = Path(__file__).parent / "helpers"
CPU_VALUES = REPO / "helm" / "ci" / "cpu-values.yaml"  # the chart's two CPU pods
S3_SECRET = "s3-keys"  # the Secret the chart's S3 values name (cpu_chart_on_s3)


def cpu_chart_on_s3(bucket: str, prefix: str, endpoint: str, *sets: str) -> dict:
    """The chart's two CPU pods with checkpoints in s3://BUCKET/PREFIX at `endpoint` (its
    keys in the Secret s3-keys), `sets` over them."""
    from operator_scripts.chart.render import merge_values

    s3 = (
        f"checkpoint.s3.bucket={bucket},checkpoint.s3.prefix={prefix},checkpoint.s3.endpoint={endpoint},"
        f"checkpoint.s3.region=us-east-1,checkpoint.s3.existingSecret={S3_SECRET}"
    )
    return merge_values(files=[CPU_VALUES], sets=[s3, *sets])


SHARDS_PREFIX = "datasets/digits"


@pytest.fixture
def shards_in_s3(s3_bucket: S3Bucket) -> str:
    """The digits data as shards of 64 samples under the bucket's `datasets/digits`."""
    write_dataset(build_data(load_config("digits").data, 0), open_source(s3_bucket.uri(SHARDS_PREFIX)),
                  samples_per_shard=64, seed=0)  # fmt: skip
    return s3_bucket.uri(SHARDS_PREFIX)


AUDIT = HELPERS / "audit"
sys.path.insert(0, str(HELPERS))  # the test plug-ins, importable in-process as in subprocesses

from snapshot_folders import snapshot_steps  # noqa: E402 (importable once HELPERS is on the path)


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_stay_in_pytests_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every process a test starts inherits TMPDIR: checkpoint caches, metrics folders and
    torchrun's error files then land under pytest's own temporary folder, not in /tmp."""
    folder = tmp_path_factory.mktemp("tmpdir")
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None  # re-read on next use
    yield
    if previous is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = previous
    tempfile.tempdir = None


SNAPSHOT_ROOT = Path(CheckpointConfig().snapshot_dir)
SNAPSHOTS_BEFORE = pytest.StashKey[set[Path]]()


def _is_controller(config: pytest.Config) -> bool:
    """The one process of a test run that is not an xdist worker: session-wide clean-up
    belongs there, or a worker that ends early would remove what another's test still uses."""
    return not hasattr(config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    if _is_controller(session.config):
        before = set(SNAPSHOT_ROOT.iterdir()) if SNAPSHOT_ROOT.is_dir() else set()
        session.config.stash[SNAPSHOTS_BEFORE] = before


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Runs killed on purpose leave node-local snapshots in /dev/shm (the default
    `checkpoint.snapshot_dir`), as a real node would keep them; the test run removes those
    its tests made, once every worker is done, so that memory is not held after it."""
    before = session.config.stash.get(SNAPSHOTS_BEFORE, None)
    if before is None or not SNAPSHOT_ROOT.is_dir():
        return
    for entry in set(SNAPSHOT_ROOT.iterdir()) - before:
        shutil.rmtree(entry, ignore_errors=True)


# The tests that run `ddp-ops local`'s process runtime, which holds the host's ports
# (operator_scripts.local.runtimes.process.claim_host_ports). Each xdist worker is a host of
# its own where this machine allows it (root: a network namespace per worker,
# benchmarks/namespaces.py), and then they spread over the workers like any test; elsewhere
# they are one unit of work, run one after another on one worker. (xdist's own
# `xdist_group` mark cannot do it under pytest 9: its worker renames `item._nodeid`, which
# pytest 9's nodes no longer read.)
LOCAL_PODS = (
    "tests/test_local.py::",
    "tests/test_local_signals.py::",
    "tests/test_liveness.py::",
    "tests/test_own_code.py::",
    "tests/test_shards_jobs.py::",
    "tests/test_cli.py::test_local_command_runs_the_cpu_scenario",
)
OWN_NETWORK = "own_network"
NAMESPACE_FILES = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    if not _is_controller(config) and config.workerinput.get(OWN_NETWORK):
        # before any test opens a socket or starts a process; the folder goes with the worker
        config.stash[NAMESPACE_FILES] = Path(tempfile.mkdtemp(prefix="ddp-tests-host-"))
        enter_private_network(config.stash[NAMESPACE_FILES])


def pytest_unconfigure(config: pytest.Config) -> None:
    if NAMESPACE_FILES in config.stash:
        shutil.rmtree(config.stash[NAMESPACE_FILES], ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest tests first, by their durations on record (tests/durations.json), else a
    raised timeout, then the multi-process `slow` ones, in collection order otherwise: on
    xdist the one-process tests then fill the last minutes, where a multi-process test
    handed out late would run on alone with the other cores idle."""
    record_file = Path(__file__).with_name("durations.json")
    recorded = json.loads(record_file.read_text()) if record_file.is_file() else {}

    def expected_length(item: pytest.Item) -> tuple[bool, float]:
        raised = item.get_closest_marker("timeout")
        guess = raised.args[0] if raised else 30.0  # a new multi-process test: a middling one
        slow = item.get_closest_marker("slow") is not None
        return not slow, -recorded.get(item.nodeid, guess if slow else 0.0)

    items.sort(key=expected_length)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: object) -> None:
    node.workerinput[OWN_NETWORK] = isolation_available()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Each test its own unit of work, as xdist's `load`; the LOCAL_PODS tests one unit
    where the workers share the host's network, handed out where the first of them is
    collected (test_cli.py), early in the run."""
    from xdist.scheduler import LoadScopeScheduling

    together = not isolation_available()

    class EachTestItsOwn(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "local-pods" if together and nodeid.startswith(LOCAL_PODS) else nodeid

    return EachTestItsOwn(config, log)


def pod_snapshot_steps(pod_folder: Path) -> list[int]:
    """Steps of the snapshots in a local pod's own /dev/shm (its emptyDir folder)."""
    return snapshot_steps(pod_folder / "volumes" / "dshm")


def freeze_pod_1_once_snapshotted(step: int, frozen: list[str], held: dict[str, int] | None = None):
    """An `on_tick` for `ddp-ops local`'s `run`: once every pod holds a snapshot of `step` or
    later, freeze every process of pod 1 (the runtime's stand-in for a frozen node), once;
    its name goes into `frozen`, and each pod's newest snapshot step then into `held`."""
    from operator_scripts.local.kubelet import freeze_pod

    def tick(pods) -> None:
        if not frozen and min(max(pod_snapshot_steps(pod.folder), default=0) for pod in pods) >= step:
            if held is not None:
                held.update({pod.name: max(pod_snapshot_steps(pod.folder), default=0) for pod in pods})
            freeze_pod(pods[1])
            frozen.append(pods[1].name)

    return tick


def resumes_after_a_fault(logs: list[str]) -> list[tuple[int, int]]:
    """(resumed from, steps lost by the trainer's count) of every JSON `plan` line of these
    pods' logs that resumed a run: a fault's recoveries, as the trainer tells them."""
    found = []
    for log in logs:
        for line in log.splitlines():
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("event") == "plan" and record.get("resumed_from") is not None:
                found.append((record["resumed_from"], record.get("lost_steps") or 0))
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """In CI (`CI` set, as .ci/run's runner sets it) only a missing GPU may skip a test: a
    skip for a missing tool or dependency would hide what `make test` failed to install."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and os.environ.get("CI")) or "gpu" in item.keywords:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if "CUDA" not in reason:
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where only a missing GPU may skip a test: {reason}"


def assert_lost_within(held: dict[str, int], survivor: str, resumed: int, told: int, bound: int) -> None:
    """What losing a node cost, judged from the harness's own view: `held` is the newest
    snapshot step each pod's /dev/shm held when the harness sent the kill. The run had
    completed the newest of them (it may have gone further before the kill landed: a
    container's takes a moment), and the survivor's newest is never overwritten, so a correct
    resume is at least the survivor's and at most `bound` steps short of the newest. The
    trainer's own count `told` is only a cross-check: no lower than what the harness saw lost."""
    seen_lost = max(held.values()) - resumed
    assert resumed >= held[survivor], f"resumed from step {resumed}, the survivor held {held}"
    assert seen_lost <= bound, f"resumed from step {resumed} with {held} held at the kill"
    assert max(seen_lost, 0) <= told <= bound, f"the trainer counted {told} lost; the harness saw {seen_lost}"


def process_env(extra: dict[str, str] | None = None, *, audit: bool = False) -> dict[str, str]:
    """The environment for a trainer process: our package and the test plug-ins importable,
    and no GPU: these are the CPU (gloo) tests on any host; the `gpu` tests pass their own.
    No fork server (trainer/launcher/forkserver.py), which tests/test_forkserver.py and the
    image's e2e test run: its 2.5 CPU-seconds of imports per torchrun, at the lowest priority,
    outlive most of the suite's short runs unused, and on the suite's two busy cores took
    about a tenth of the fault tests' CPU time (114 CPU-s against 103 for four of them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["TRAINER_FORK_SERVER"] = "0"
    paths = [str(REPO), str(HELPERS)] + ([str(AUDIT)] if audit else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["OMP_NUM_THREADS"] = "1"
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.update(extra or {})
    return env


def node_env(workdir: Path, node: str, extra: dict[str, str]) -> dict[str, str]:
    """The environment of one of several torchrun agents on this host, each a 'node': a
    temporary folder of its own, as a pod has its own /tmp (its node-local cache, writer lock
    and heartbeats); sharing one, a second node's writer waited 60 s for the first's lock."""
    tmp = workdir / f"tmp-{node}"
    tmp.mkdir(exist_ok=True)
    return process_env({**extra, "TMPDIR": str(tmp)})


def run_trainer(
    args: Sequence[str],
    cwd: Path,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 180,
    entry: Sequence[str] = ("-m", "trainer"),
) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` as a world of one (or `python ENTRY ARGS`: a `-c` that wraps it)."""
    return subprocess.run(
        [sys.executable, *entry, *args],
        cwd=cwd,
        env=env or process_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def torchrun_command(
    args: Sequence[str], *, nproc: int = 2, launcher: Sequence[str] = ("--standalone",)
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher,
        f"--nproc_per_node={nproc}",
        "-m",
        "trainer",
        *args,
    ]


def run_torchrun(
    args: Sequence[str],
    cwd: Path,
    *,
    nproc: int = 2,
    launcher: Sequence[str] = ("--standalone",),
    env: dict[str, str] | None = None,
    timeout: float = 240,
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=N -m trainer ARGS`, waited for."""
    return subprocess.run(
        torchrun_command(args, nproc=nproc, launcher=launcher),
        cwd=cwd,
        env=env or process_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_helper(script: str, output: Path, *, nproc: int, cwd: Path) -> dict:
    """Run `tests/helpers/SCRIPT` under torchrun; it writes JSON results to `output`."""
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(HELPERS / script),
            str(output),
        ],
        cwd=cwd,
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(output.read_text())


def json_records(agent: subprocess.Popen, on_record=None, timeout: float = 240) -> tuple[list[dict], str]:
    """A run's JSON log lines (each handed to `on_record` as it comes) and its stderr,
    once it has exited."""
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(agent.stderr), daemon=True)
    reader.start()
    seen = []
    for line in agent.stdout:
        if line.startswith("{"):
            seen.append(json.loads(line))
            if on_record is not None:
                on_record(seen[-1])
    agent.wait(timeout=timeout)
    reader.join(timeout=10)
    return seen, "".join(stderr)


def kill_rank_when(agent: subprocess.Popen, rank: int, ready) -> int:
    """SIGKILL the worker of `rank` under the torchrun agent once `ready()` holds; its pid."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert agent.poll() is None, "the run ended before the kill"
        if ready():
            for child in psutil.Process(agent.pid).children(recursive=True):
                try:
                    if child.environ().get("RANK") == str(rank):
                        child.kill()  # psutil checks that the pid is still this child's
                        return child.pid
                except psutil.NoSuchProcess:
                    continue
        time.sleep(0.01)
    raise AssertionError("no worker to kill")


def load_checkpoint(root: Path, step: int | None = None) -> dict:
    """A checkpoint as any consumer would load it: tensors only."""
    if step is None:
        step = json.loads((root / "latest.json").read_text())["step"]
    return torch.load(root / f"step-{step}" / "checkpoint.pt", weights_only=True)


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the whole test run, every xdist worker's (each worker's base temp is a
    `popen-gwN` folder inside the run's): the uninterrupted runs tests compare against, each
    run once however many tests ask for it."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "references"
    root.mkdir(exist_ok=True)
    return root


def uninterrupted_checkpoint(references: Path, config: Path, env: dict[str, str] | None = None) -> dict:
    """The final checkpoint of CONFIG run start to end by two ranks on this host, with a
    container's folders (checkpoints, snapshots, the cache in /tmp) in a folder of its own,
    so that it leaves nothing in the host's /tmp or /dev/shm. Run once per effective config
    (and plug-in path) in a test run: a second test asking for it, on any worker, waits for
    the first one's run and reads its checkpoint."""

    def own_folders(entry: Path) -> list[str]:
        return [
            f"checkpoint.uri={entry / 'checkpoints'}",
            f"checkpoint.snapshot_dir={entry / 'shm'}",
            f"checkpoint.cache_dir={entry / 'cache'}",
            "metrics.port=0",
        ]

    effective = dataclasses.asdict(load_config(str(config), own_folders(Path("/entry"))))
    plugins = (env or {}).get("PYTHONPATH", "")
    key = hashlib.sha256(json.dumps([effective, plugins], sort_keys=True, default=str).encode()).hexdigest()
    entry = references / key[:16]
    with open(f"{entry}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (entry / "checkpoints" / "latest.json").is_file():
            shutil.rmtree(entry, ignore_errors=True)  # a run that failed before
            entry.mkdir()
            arguments = ["--config", str(config), "--set", ",".join(own_folders(entry))]
            run = run_torchrun(arguments, entry, env=env)
            assert run.returncode == 0, run.stderr[-3000:]
    return load_checkpoint(entry / "checkpoints")


def assert_bits_of_an_uninterrupted_run(
    rendered: object, recovered: dict, references: Path, env: dict[str, str] | None = None
) -> None:
    """The recovered checkpoint has the bits of the chart's config run start to end on this
    host (`uninterrupted_checkpoint`): weights, optimizer state and progress."""
    (config_map,) = [c for c in rendered.of_kind("ConfigMap") if c["metadata"]["name"].endswith("-config")]
    config = Path(tempfile.mkdtemp()) / "config.yaml"
    config.write_text(config_map["data"]["config.yaml"])
    expected = uninterrupted_checkpoint(references, config, env)
    assert expected["progress"] == recovered["progress"]
    assert same_state(expected, recovered), "weights or optimizer state differ from the uninterrupted run's"


@dataclass
class S3Bucket:
    """A bucket on the moto server, the environment a trainer needs to reach it, and a
    client for the test's own looks."""

    name: str
    endpoint: str
    env: dict[str, str]
    client: object

    def uri(self, prefix: str) -> str:
        return f"s3://{self.name}/{prefix}"

    @property
    def pod_endpoint(self) -> str:
        """The endpoint as `ddp-ops local`'s pods reach it: this machine's address on their
        pod network where each has a network of its own (as root), else loopback's."""
        if not pod_networks_available():
            return self.endpoint
        return self.endpoint.replace("127.0.0.1", PodNetwork().gateway)

    def latest_step(self, prefix: str) -> int | None:
        try:
            body = self.client.get_object(Bucket=self.name, Key=f"{prefix}/latest.json")["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None
        return json.loads(body)["step"]

    def load(self, prefix: str, step: int | None = None) -> dict:
        step = self.latest_step(prefix) if step is None else step
        body = self.client.get_object(Bucket=self.name, Key=f"{prefix}/step-{step}/checkpoint.pt")["Body"]
        return torch.load(io.BytesIO(body.read()), weights_only=True)


AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}


@contextlib.contextmanager
def serve_moto(address: str) -> Iterator[str]:
    """moto's S3 in server mode over real HTTP on `address`, a free port; yields its URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address=address, port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """moto's S3 for the whole session, at http://127.0.0.1:PORT; on every address where
    `ddp-ops local`'s pods have networks of their own (as root), so that they reach it at
    this machine's address there (`S3Bucket.pod_endpoint`)."""
    with serve_moto("0.0.0.0" if pod_networks_available() else "127.0.0.1") as url:
        yield url.replace("0.0.0.0", "127.0.0.1")


def s3_secrets(folder: Path, key_id: str = "testing", secret_key: str = "testing") -> dict[str, Path]:
    """The Secret `s3-keys` as `ddp-ops local --secret` takes it: a folder with its one key,
    `credentials`, an AWS credentials file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "credentials").write_text(
        f"[default]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret_key}\n"
    )
    return {S3_SECRET: folder}


def s3_env(endpoint: str, **extra: str) -> dict[str, str]:
    """Standard AWS variables only: what a pod would get from a Secret or IRSA."""
    return process_env({**AWS_TEST_ENV, "AWS_ENDPOINT_URL": endpoint, **extra})


@pytest.fixture
def s3_bucket(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> S3Bucket:
    import boto3

    for key, value in {**AWS_TEST_ENV, "AWS_ENDPOINT_URL": moto_server}.items():
        monkeypatch.setenv(key, value)
    client = boto3.client("s3")
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return S3Bucket(name, moto_server, s3_env(moto_server), client)


@dataclass
class PrometheusServer:
    """A real Prometheus scraping one trainer pod's metrics port every second."""

    url: str
    metrics_port: int

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        parameters = {"query": expr, **({"time": str(at)} if at is not None else {})}
        with urllib.request.urlopen(
            f"{self.url}/api/v1/query?{urllib.parse.urlencode(parameters)}"
        ) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.url}{path}") as response:
            return json.load(response)


@pytest.fixture
def prometheus_server(tmp_path: Path) -> Iterator[PrometheusServer]:
    """Debian's prometheus on 127.0.0.1 with a temporary TSDB, our alert rules loaded, and
    a 1 s scrape of `metrics_port`. `make test` installs the binary (Debian's 'prometheus')."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: `make test` installs Debian's 'prometheus'"
    from operator_scripts.generate.monitoring import RULES_FILE

    metrics_port, web_port = free_port(), free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES_FILE)],
        "scrape_configs": [
            {"job_name": "ddp-test", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}
        ],
    }
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{web_port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/-/ready") as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, (
            tmp_path / "prometheus.log"
        ).read_text()
        time.sleep(0.2)
    yield PrometheusServer(url, metrics_port)
    process.terminate()
    process.wait(timeout=30)
    log.close()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty directory to run a trainer in, so relative checkpoint paths land here."""
    path = tmp_path / "work"
    path.mkdir()
    return path


def uploading(proxy: FaultProxy) -> set[int]:
    """The steps whose checkpoint the proxy has seen go up (a PUT under step-N/)."""
    found = (re.search(r"/step-(\d+)/", path) for method, path in list(proxy.requests) if method == "PUT")
    return {int(match[1]) for match in found if match}
