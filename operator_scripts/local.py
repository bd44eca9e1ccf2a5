"""Run a rendered PyTorchJob on this machine, each pod as a process group, as the operator
and kubelet would: the operator's injected environment, pod host names mapped to their own
loopback addresses, volumes mapped to folders, OnFailure restarts within the job's
backoffLimit, and the job's outcome decided as the operator decides it.

Local stand-ins, since there are no pods: a pod's network namespace is a loopback address
(127.0.0.2, .3, ...), passed to the trainer as `--set metrics.address=<address>` so that
every "pod" can serve its metrics port; only the pod named in the rendezvous endpoint
hosts the c10d store (`is_host` in PET_RDZV_CONF), as in a cluster where no other pod
has that host name; `secretKeyRef` values are read from this process's environment
variable of the same key; `/dev/shm` is the host's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import psutil

from operator_scripts.operator_env import PodPlan, job_outcome, plan_pods


@dataclass
class LocalPod:
    """A pod's plan and its local process."""

    plan: PodPlan
    address: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen | None = None
    restarts: int = 0
    exit_code: int | None = None
    log: TextIO | None = field(default=None, repr=False)


@dataclass(frozen=True)
class LocalOutcome:
    """What the operator would report at the end."""

    status: str
    restarts: int
    exit_codes: dict[str, int | None]
    logs: dict[str, Path]


def _mounts(plan: PodPlan, folder: Path, config_maps: dict[str, dict], shared: Path) -> dict[str, Path]:
    """mountPath -> local folder for each volume of the pod, with ConfigMaps written out."""
    volumes = {volume["name"]: volume for volume in plan.template["spec"].get("volumes", [])}
    mapped: dict[str, Path] = {}
    for mount in plan.container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if mount["mountPath"] == "/dev/shm":
            continue
        if "configMap" in volume:
            target = folder / "volumes" / mount["name"]
            target.mkdir(parents=True, exist_ok=True)
            for key, text in config_maps[volume["configMap"]["name"]].get("data", {}).items():
                (target / key).write_text(text)
        elif "persistentVolumeClaim" in volume:
            target = shared / "pvc" / volume["persistentVolumeClaim"]["claimName"]
        else:
            target = folder / "volumes" / mount["name"]
        target.mkdir(parents=True, exist_ok=True)
        mapped[mount["mountPath"]] = target
    return mapped


def _localize(value: str, mounts: dict[str, Path], hosts: dict[str, str]) -> str:
    """Pod host names to their addresses, then container paths to local folders."""
    for host, address in hosts.items():
        value = value.replace(host, address)
    for path in sorted(mounts, key=len, reverse=True):
        if value == path or value.startswith(path.rstrip("/") + "/"):
            return str(mounts[path]) + value[len(path.rstrip("/")) :]
    return value


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


def prepare(
    objects: list[dict[str, Any]], workdir: Path, host_env: dict[str, str] | None = None
) -> list[LocalPod]:
    """Local pods for the rendered objects (one PyTorchJob and its ConfigMaps)."""
    host_env = dict(os.environ if host_env is None else host_env)
    (job,) = [item for item in objects if item.get("kind") == "PyTorchJob"]
    config_maps = {item["metadata"]["name"]: item for item in objects if item.get("kind") == "ConfigMap"}
    plans = plan_pods(job)
    hosts = {plan.name: f"127.0.0.{index + 2}" for index, plan in enumerate(plans)}
    pods = []
    for plan in plans:
        folder = workdir / plan.name
        mounts = _mounts(plan, folder, config_maps, workdir)
        container = plan.container
        env = {**host_env, **_container_env(container, host_env), **plan.env}
        if "PET_RDZV_ENDPOINT" in env:  # on one machine every pod "is" the endpoint host
            is_host = env["PET_RDZV_ENDPOINT"].rsplit(":", 1)[0] == plan.name
            conf = [part for part in env.get("PET_RDZV_CONF", "").split(",") if part]
            env["PET_RDZV_CONF"] = ",".join([*conf, f"is_host={str(is_host).lower()}"])
        env = {key: _localize(value, mounts, hosts) for key, value in env.items()}
        argv = [
            _localize(arg, mounts, hosts)
            for arg in [*container.get("command", []), *container.get("args", [])]
        ]
        if argv[:1] == ["torchrun"]:  # the image's torchrun is this interpreter's
            argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
        argv += ["--set", f"metrics.address={hosts[plan.name]}"]
        pods.append(LocalPod(plan, hosts[plan.name], argv, env, folder / "pytorch.log"))
    return pods


def _start(pod: LocalPod) -> None:
    pod.log_path.parent.mkdir(parents=True, exist_ok=True)
    pod.log = open(pod.log_path, "a")  # noqa: SIM115  (closed when the pod ends)
    cwd = pod.env.get("HOME") if Path(pod.env.get("HOME", "")).is_dir() else None
    pod.process = subprocess.Popen(
        pod.command, env=pod.env, cwd=cwd, stdout=pod.log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _follow(path: Path, sink: Callable[[str], None], stop: threading.Event) -> None:
    """Stream a pod's log as it grows, like `kubectl logs -f`."""
    while not path.exists() and not stop.is_set():
        time.sleep(0.05)
    with open(path) as handle:
        while True:
            line = handle.readline()
            if line:
                sink(line.rstrip("\n"))
            elif stop.is_set():
                return
            else:
                time.sleep(0.05)


def run(
    objects: list[dict[str, Any]],
    workdir: Path,
    *,
    timeout: float = 3600,
    stream: Callable[[str], None] | None = print,
    on_tick: Callable[[list[LocalPod]], None] | None = None,
    host_env: dict[str, str] | None = None,
) -> LocalOutcome:
    """Run the job to its end: restart failed pods (OnFailure) until the job's backoffLimit
    is spent, then report Succeeded or Failed with the restarts counted."""
    (job,) = [item for item in objects if item.get("kind") == "PyTorchJob"]
    backoff_limit = job["spec"].get("runPolicy", {}).get("backoffLimit", 6)
    pods = prepare(objects, workdir, host_env)
    rank0 = next(p for p in pods if "training.kubeflow.org/job-role" in p.plan.labels)
    stop = threading.Event()
    follower = None
    if stream is not None:
        follower = threading.Thread(target=_follow, args=(rank0.log_path, stream, stop), daemon=True)
        follower.start()
    for pod in pods:
        _start(pod)
    deadline = time.monotonic() + timeout
    status = "Running"
    try:
        while status == "Running":
            if time.monotonic() > deadline:
                status = "Failed"
                break
            restarts = sum(p.restarts for p in pods)
            for pod in pods:
                code = pod.process.poll() if pod.process else None
                if code is None or pod.exit_code is not None:
                    continue
                if code != 0 and restarts < backoff_limit:  # kubelet restarts the container
                    pod.restarts += 1
                    restarts += 1
                    _start(pod)
                else:
                    pod.exit_code = code
            exits = {p.plan.name: p.exit_code for p in pods}
            status = job_outcome(job, exits)
            if on_tick is not None:
                on_tick(pods)
            time.sleep(0.1)
    finally:
        for pod in pods:
            if pod.process and pod.process.poll() is None:
                _stop(pod)
            if pod.log:
                pod.log.close()
        stop.set()
        if follower is not None:
            follower.join(timeout=5)
    return LocalOutcome(
        status=status,
        restarts=sum(p.restarts for p in pods),
        exit_codes={p.plan.name: p.exit_code for p in pods},
        logs={p.plan.name: p.log_path for p in pods},
    )


def kill_pod(pod: LocalPod, sig: int = signal.SIGKILL) -> None:
    """Signal every process of the pod, as a container's end does: torchrun starts its
    workers in sessions of their own, so the process group alone would orphan them."""
    if pod.process is None:
        return
    try:
        tree = [psutil.Process(pod.process.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(sig)


def _stop(pod: LocalPod, grace: float = 30) -> None:
    """SIGTERM the pod's processes, SIGKILL what is left after the grace period."""
    kill_pod(pod, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        pod.process.wait(timeout=grace)
    kill_pod(pod, signal.SIGKILL)
    pod.process.wait()
