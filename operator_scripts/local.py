"""Run a rendered PyTorchJob on this machine as training-operator v1.9.4 and the kubelet
would, each pod as a process tree: the operator's defaults and injected environment, pod
names that resolve only while their pod runs, volumes mapped to folders under the work
folder, restarts and re-creations by the job's restartPolicy, restarts summed against
backoffLimit, success and clean-up as the operator decides them (`operator_status`).

Each pod's container runs in a `PodRuntime`: by default a process tree on this machine
(`ProcessRuntime`), or, with `--runtime docker`, a container of the pod's image with the
pod's user, capabilities and read-only root (`docker_runtime.DockerRuntime`). The operator
and kubelet model is the same for both.

Process stand-ins, since there are no pods:
- a pod's network namespace is a loopback address (127.0.0.2, .3, ...); each pod runs in a
  UTS and mount namespace of its own (`unshare`) whose host name is the pod's name and
  whose /etc/hosts is the job's table of running pods (`pod_sandbox`), so that a pod's
  name resolves exactly while its process runs, as a headless Service's does while its pod
  is Ready (common/service.go:229-244: no publishNotReadyAddresses);
- the trainer gets `--set metrics.address=<address>`, so that every pod can serve its port;
- every volume is a folder under `workdir/<pod>/volumes`, a PVC one under `workdir/pvc`,
  and paths under mount points are rewritten to them in the environment, the arguments
  and the ConfigMap files, so a run writes nothing outside `workdir`; emptyDirs survive a
  container restart and are emptied when the operator re-creates a pod, as on a node;
- `secretKeyRef` values are read from this process's environment variable of that key;
- the Master's `init-pytorch` container is not run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import yaml

from operator_scripts.operator_env import PodPlan, plan_pods, with_defaults
from operator_scripts.operator_status import (
    JobCondition,
    Phase,
    PodState,
    after_exit,
    counted_restarts,
    job_condition,
    pods_to_delete,
    restart_delay,
)
from trainer.argparsing import last_line
from trainer.launch import container_exit_code, signal_tree

# the project's console scripts, run with this interpreter
CONSOLE_SCRIPTS = {"torchrun": "torch.distributed.run", "ddp-launch": "trainer.launch"}


class LocalError(Exception):
    """Why a local run cannot start, in one line."""


class PodRuntime(Protocol):
    """Where a pod's container runs. `launch` returns a process whose exit is the container's."""

    # whether container paths become the pod's folders (in the environment, the arguments and
    # the ConfigMap files), because the container shares this machine's file system
    localizes_paths: bool

    def address(self, index: int) -> str: ...
    def check(self, pods: list[LocalPod], hosts: HostsTable) -> None: ...
    def command(self, pod: LocalPod) -> list[str]: ...
    def launch(self, pod: LocalPod, hosts: HostsTable, log: TextIO) -> subprocess.Popen: ...
    def signal(self, pod: LocalPod, sig: int) -> None: ...


@dataclass
class LocalPod:
    """A pod's plan, its local process and what the kubelet and operator know of it."""

    plan: PodPlan
    address: str
    command: list[str]
    env: dict[str, str]
    folder: Path
    empty_dirs: list[Path]
    mounts: dict[str, Path]  # mountPath -> the pod's folder for that volume
    runtime: PodRuntime
    start_at: float = 0.0
    phase: Phase = "Pending"
    restarts: int = 0
    recreations: int = 0
    restart_at: float | None = None
    exit_code: int | None = None
    process: subprocess.Popen | None = None
    log: TextIO | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def log_path(self) -> Path:
        return self.folder / "pytorch.log"

    @property
    def state(self) -> PodState:
        return PodState(self.name, self.plan.replica_type, self.phase, self.restarts)


@dataclass(frozen=True)
class LocalOutcome:
    """What the operator would report at the end, and what its clean-up did."""

    job: str
    status: str
    reason: str
    restarts: int
    backoff_limit: int | None
    recreations: int
    exit_codes: dict[str, int | None]
    logs: dict[str, Path]
    deleted: list[str]
    kept_running: list[str]

    def summary(self) -> str:
        """The run's last line: `job NAME: Succeeded` or `job NAME: Failed (reason)`, then the
        restarts counted against the limit."""
        verdict = f"{self.status} ({self.reason})" if self.reason else self.status
        limit = "no backoffLimit" if self.backoff_limit is None else f"backoffLimit {self.backoff_limit}"
        return f"job {self.job}: {verdict}; {self.restarts} restarts counted ({limit})"


def _mounts(
    plan: PodPlan, folder: Path, config_maps: dict[str, dict], shared: Path, localize: bool
) -> tuple[dict[str, Path], list[Path]]:
    """mountPath -> local folder for each volume of the pod (ConfigMaps written out, with
    their mount paths localized when asked), and the folders that are emptyDirs, which are
    world-writable as the kubelet makes them (a non-root container writes there)."""
    volumes = {volume["name"]: volume for volume in plan.template["spec"].get("volumes", [])}
    mapped: dict[str, Path] = {}
    empty_dirs: list[Path] = []
    config_mounts: list[tuple[Path, dict]] = []
    for mount in plan.container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "persistentVolumeClaim" in volume:
            target = shared / "pvc" / volume["persistentVolumeClaim"]["claimName"]
        else:
            target = folder / "volumes" / mount["name"]
            if "emptyDir" in volume:
                empty_dirs.append(target)
        target.mkdir(parents=True, exist_ok=True)
        if "configMap" not in volume:
            target.chmod(0o777)
        mapped[mount["mountPath"]] = target
        if "configMap" in volume:
            config_mounts.append((target, config_maps[volume["configMap"]["name"]]))
    for target, config_map in config_mounts:
        for key, text in config_map.get("data", {}).items():
            (target / key).write_text(_localize_document(text, mapped) if localize else text)
    return mapped, empty_dirs


def _localize(value: str, mounts: dict[str, Path]) -> str:
    """A container path under a mount point, as the path of its local folder."""
    for path in sorted(mounts, key=len, reverse=True):
        if value == path or value.startswith(path.rstrip("/") + "/"):
            return str(mounts[path]) + value[len(path.rstrip("/")) :]
    return value


def _localize_document(text: str, mounts: dict[str, Path]) -> str:
    """A ConfigMap file with the container paths inside it localized, when it is YAML
    (the trainer's config names its checkpoint, cache and metrics folders)."""
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if not isinstance(tree, dict | list):
        return text

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: walk(item) for key, item in node.items()}
        if isinstance(node, list):
            return [walk(item) for item in node]
        return _localize(node, mounts) if isinstance(node, str) else node

    return yaml.safe_dump(walk(tree), sort_keys=False)


def _container_env(container: dict[str, Any], host_env: dict[str, str]) -> dict[str, str]:
    env = {}
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = str(variable["value"])
        elif "secretKeyRef" in variable.get("valueFrom", {}):
            key = variable["valueFrom"]["secretKeyRef"]["key"]
            if key in host_env:
                env[variable["name"]] = host_env[key]
    return env


def _host_env(host_env: dict[str, str] | None) -> dict[str, str]:
    """What a pod inherits from this machine: the interpreter's environment (a container's
    image environment), less any torchrun or operator variables of an enclosing run."""
    env = dict(os.environ if host_env is None else host_env)
    return {key: value for key, value in env.items() if not key.startswith(("PET_", "TORCHELASTIC_"))}


def prepare(
    objects: list[dict[str, Any]],
    workdir: Path,
    host_env: dict[str, str] | None = None,
    runtime: PodRuntime | None = None,
) -> list[LocalPod]:
    """Local pods for the rendered objects (one PyTorchJob and its ConfigMaps): the
    container's command and environment (with the operator's variables) as the manifest
    has them, and, for a process, as this machine runs them."""
    runtime = runtime or ProcessRuntime()
    inherited = _host_env(host_env)
    (job,) = [item for item in objects if item.get("kind") == "PyTorchJob"]
    config_maps = {item["metadata"]["name"]: item for item in objects if item.get("kind") == "ConfigMap"}
    pods = []
    for index, plan in enumerate(plan_pods(job)):
        folder = workdir / plan.name
        mounts, empty_dirs = _mounts(plan, folder, config_maps, workdir, runtime.localizes_paths)
        container = plan.container
        env = {**_container_env(container, inherited), **plan.env}
        argv = [*container.get("command", []), *container.get("args", [])]
        if runtime.localizes_paths:  # the process inherits this machine's environment, as an image's
            env = {key: _localize(value, mounts) for key, value in {**inherited, **env}.items()}
            argv = [_localize(arg, mounts) for arg in argv]
        pod = LocalPod(plan, runtime.address(index), argv, env, folder, empty_dirs, mounts, runtime)
        pod.command = runtime.command(pod)
        pods.append(pod)
    return pods


class HostsTable:
    """The job's /etc/hosts: `localhost` and each running pod's address. Pods see it through
    a bind mount, which pins the file, so it is rewritten in place: new text from offset
    0, then truncated (a reader that races sees whole lines of the old or the new table)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.running: dict[str, str] = {}
        path.write_text(self._text())
        (path.parent / "nsswitch.conf").write_text("hosts: files\n")

    @property
    def nsswitch(self) -> Path:
        return self.path.parent / "nsswitch.conf"

    def _text(self) -> str:
        lines = ["127.0.0.1 localhost"] + [f"{address} {name}" for name, address in self.running.items()]
        return "\n".join(lines) + "\n"

    def set(self, name: str, address: str | None) -> None:
        if address is None:
            self.running.pop(name, None)
        else:
            self.running[name] = address
        with open(self.path, "r+") as handle:
            handle.write(self._text())
            handle.truncate()


def sandbox_command(hostname: str, hosts: HostsTable, shm: Path | None = None) -> list[str]:
    """The prefix that runs a command as a pod: new UTS and mount namespaces (a user
    namespace too when not root), the pod's host name, the job's hosts table and the pod's
    own /dev/shm."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return [
        "unshare", *user, "--mount", "--uts", "--propagation", "private", "--",
        sys.executable, "-m", "operator_scripts.pod_sandbox",
        hostname, str(hosts.path), str(hosts.nsswitch), str(shm or "-"), "--",
    ]  # fmt: skip


class ProcessRuntime:
    """Each pod a process tree in namespaces of its own, on a loopback address."""

    localizes_paths = True

    def address(self, index: int) -> str:
        return f"127.0.0.{index + 2}"

    def check(self, pods: list[LocalPod], hosts: HostsTable) -> None:
        check_sandbox(hosts)

    def command(self, pod: LocalPod) -> list[str]:
        """The image's console scripts are this interpreter's; metrics serve on the pod's address."""
        argv = list(pod.command)
        if argv[0] in CONSOLE_SCRIPTS:
            argv = [sys.executable, "-m", CONSOLE_SCRIPTS[argv[0]], *argv[1:]]
        return [*argv, "--set", f"metrics.address={pod.address}"]

    def launch(self, pod: LocalPod, hosts: HostsTable, log: TextIO) -> subprocess.Popen:
        cwd = pod.env.get("HOME") if Path(pod.env.get("HOME", "")).is_dir() else pod.folder
        return subprocess.Popen(
            [*sandbox_command(pod.name, hosts, pod.mounts.get("/dev/shm")), *pod.command],
            env=pod.env,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def signal(self, pod: LocalPod, sig: int) -> None:
        signal_tree(pod.process.pid, sig)


def check_sandbox(hosts: HostsTable) -> None:
    """Fail in one line, before any pod starts, where namespaces cannot be made."""
    if shutil.which("unshare") is None:
        raise LocalError("needs `unshare` (util-linux) to give each pod its host name and hosts table")
    resolve_localhost = "import socket; socket.getaddrinfo('localhost', 1)"
    probe = subprocess.run(
        [*sandbox_command("probe", hosts), sys.executable, "-c", resolve_localhost],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        reason = last_line(probe.stderr, "unknown error")
        raise LocalError(
            f"cannot give pods namespaces of their own ({reason}): run as root, or enable "
            "unprivileged user namespaces"
        )


def _start(pod: LocalPod, hosts: HostsTable) -> None:
    pod.folder.mkdir(parents=True, exist_ok=True)
    pod.log = open(pod.log_path, "a")  # noqa: SIM115  (closed when the container ends)
    hosts.set(pod.name, pod.address)
    pod.process = pod.runtime.launch(pod, hosts, pod.log)
    pod.phase, pod.restart_at = "Running", None


def _follow(path: Path, sink: Callable[[str], None], stop: threading.Event) -> None:
    """Stream a pod's log as it grows, like `kubectl logs -f`."""
    while not path.exists() and not stop.is_set():
        time.sleep(0.05)
    if not path.exists():
        return
    with open(path) as handle:
        while True:
            line = handle.readline()
            if line:
                sink(line.rstrip("\n"))
            elif stop.is_set():
                return
            else:
                time.sleep(0.05)


def _advance(pod: LocalPod, hosts: HostsTable, now: float, notify: Callable[[str], None]) -> str:
    """One kubelet and operator pass over a pod; returns a permanent failure's reason."""
    if pod.phase == "Pending" and now >= pod.start_at:
        _start(pod, hosts)
        return ""
    if pod.phase != "Running":
        return ""
    if pod.process is None:  # waiting out the kubelet's back-off
        if now >= pod.restart_at:
            pod.restarts += 1
            _start(pod, hosts)
        return ""
    returncode = pod.process.poll()
    if returncode is None:
        return ""
    code = pod.exit_code = container_exit_code(returncode)
    hosts.set(pod.name, None)  # not Ready: its Service has no endpoint
    pod.process = None
    pod.log.close()
    action = after_exit(pod.plan.restart_policy, code)
    if action == "restart":
        delay = restart_delay(pod.restarts + 1)
        pod.restart_at = now + delay
        notify(f"pod {pod.name} exited with code {code}; restart {pod.restarts + 1} in {delay:.0f}s")
    elif action == "recreate":
        pod.recreations += 1
        pod.phase, pod.start_at, pod.restarts = "Pending", now, 0
        for folder in pod.empty_dirs:  # a new pod gets new emptyDirs
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            folder.chmod(0o777)
        notify(f"pod {pod.name} exited with code {code} (retryable); the operator re-creates it")
    elif action == "succeeded":
        pod.phase = "Succeeded"
    else:
        pod.phase = "Failed"
        notify(f"pod {pod.name} failed with exit code {code}")
        reason = f"pod {pod.name} exited with code {code}"
        return reason + (", not retryable" if pod.plan.restart_policy == "ExitCode" else "")
    return ""


def resolve_delays(job_name: str, pods: list[LocalPod], delays: dict[str, float]) -> dict[str, float]:
    """`worker-0=75` or a full pod name -> that pod's start delay; an unknown pod is an error."""
    names = {pod.name for pod in pods}
    resolved = {}
    for key, seconds in delays.items():
        name = key if key in names else f"{job_name}-{key}"
        if name not in names:
            raise LocalError(f"--delay {key}={seconds:g}: no such pod; pods are {', '.join(sorted(names))}")
        resolved[name] = seconds
    return resolved


def run(
    objects: list[dict[str, Any]],
    workdir: Path,
    *,
    timeout: float = 3600,
    delays: dict[str, float] | None = None,
    stream: Callable[[str], None] | None = print,
    notify: Callable[[str], None] = lambda line: print(f"local: {line}", file=sys.stderr, flush=True),
    on_tick: Callable[[list[LocalPod]], None] | None = None,
    host_env: dict[str, str] | None = None,
    runtime: PodRuntime | None = None,
) -> LocalOutcome:
    """Run the job until the operator would call it Succeeded or Failed, apply its
    cleanPodPolicy, stop whatever still runs, and report."""
    (job,) = [with_defaults(item) for item in objects if item.get("kind") == "PyTorchJob"]
    run_policy = job["spec"]["runPolicy"]
    workdir.mkdir(parents=True, exist_ok=True)
    runtime = runtime or ProcessRuntime()
    pods = prepare(objects, workdir, host_env, runtime)
    start_delays = resolve_delays(job["metadata"]["name"], pods, delays or {})
    hosts = HostsTable(workdir / "etc-hosts")
    runtime.check(pods, hosts)
    rank0 = next(p for p in pods if "training.kubeflow.org/job-role" in p.plan.labels)
    stop = threading.Event()
    follower = None
    if stream is not None:
        follower = threading.Thread(target=_follow, args=(rank0.log_path, stream, stop), daemon=True)
        follower.start()
    started = time.monotonic()
    for pod in pods:
        pod.start_at = started + start_delays.get(pod.name, 0.0)
    condition = JobCondition("Running")
    deleted: list[str] = []
    kept: list[str] = []
    try:
        while condition.status == "Running":
            now = time.monotonic()
            if now - started > timeout:
                condition = JobCondition("Failed", f"DeadlineExceeded: still running after {timeout:.0f}s")
                break
            failures: list[str] = []
            for pod in pods:  # the operator reconciles on each pod's change, not once per round
                if reason := _advance(pod, hosts, now, notify):
                    failures.append(reason)
                states = [pod.state for pod in pods]
                condition = job_condition(
                    job, states, permanent_failure="; ".join(failures), new_failure=bool(failures)
                )
                if condition.status != "Running":
                    break
            if on_tick is not None:
                on_tick(pods)
            time.sleep(0.1)
        restarts = counted_restarts([pod.state for pod in pods])
        deleted = pods_to_delete(run_policy["cleanPodPolicy"], [pod.state for pod in pods])
        for pod in pods:
            if pod.name in deleted and pod.process is not None:
                notify(f"pod {pod.name} deleted (cleanPodPolicy {run_policy['cleanPodPolicy']})")
                _stop(pod)
        kept = [
            pod.name
            for pod in pods
            if pod.name not in deleted and (pod.process is not None or pod.restart_at is not None)
        ]
        for name in kept:
            notify(
                f"pod {name} kept running (cleanPodPolicy {run_policy['cleanPodPolicy']}): on a cluster "
                "it holds its resources until deleted; stopping it as this local run ends"
            )
    finally:
        for pod in pods:
            if pod.process is not None:
                _stop(pod)
            if pod.log is not None:
                pod.log.close()
        stop.set()
        if follower is not None:
            follower.join(timeout=5)
    return LocalOutcome(
        job=job["metadata"]["name"],
        status=condition.status,
        reason=condition.reason,
        restarts=restarts,
        backoff_limit=run_policy.get("backoffLimit"),
        recreations=sum(pod.recreations for pod in pods),
        exit_codes={pod.name: pod.exit_code for pod in pods},
        logs={pod.name: pod.log_path for pod in pods},
        deleted=deleted,
        kept_running=kept,
    )


def kill_pod(pod: LocalPod, sig: int = signal.SIGKILL) -> None:
    """Signal every process of the pod, as a container's end does."""
    if pod.process is not None:
        pod.runtime.signal(pod, sig)


def _stop(pod: LocalPod) -> None:
    """Delete a pod: SIGTERM its processes, SIGKILL what is left after its grace period."""
    grace = pod.plan.template["spec"].get("terminationGracePeriodSeconds", 30)
    kill_pod(pod, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        pod.process.wait(timeout=grace)
    kill_pod(pod, signal.SIGKILL)
    pod.exit_code = container_exit_code(pod.process.wait())
    pod.process = None
