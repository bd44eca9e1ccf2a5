"""A rendered job's pods as this machine runs them (`ddp-ops local`): each pod's command and
environment as the manifest has them, with the controller's variables and `$(VAR)`
references expanded as the kubelet does; its
volumes as folders under the work folder (ConfigMaps written out, emptyDirs world-writable
as the kubelet makes them); and, for a runtime that shares this file system, container
paths rewritten to those folders in the environment, the arguments and the ConfigMap files.
The job's hosts table, through which pod names resolve while their pods run, is here too."""

from __future__ import annotations

import base64
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import yaml

from operator_scripts.controllers.job_rules import rules_for
from operator_scripts.controllers.pytorchjob_env import PodPlan
from operator_scripts.controllers.pytorchjob_status import Phase, PodState
from operator_scripts.local.kubelet_probe import ContainerProber
from operator_scripts.local.node_loss import NodeLoss


class LocalError(Exception):
    """Why a local run cannot start, in one line."""


class PodRuntime(Protocol):
    """Where a pod's container runs. `check` holds what the run needs before any pod starts
    and `release` lets it go; `launch` returns a process whose exit is the container's."""

    # whether container paths become the pod's folders (in the environment, the arguments and
    # the ConfigMap files), because the container shares this machine's file system
    localizes_paths: bool

    def address(self, index: int) -> str: ...
    def check(self, pods: list[LocalPod], hosts: HostsTable) -> None: ...
    def release(self) -> None: ...
    def command(self, pod: LocalPod) -> list[str]: ...
    def launch(self, pod: LocalPod, hosts: HostsTable, log: TextIO) -> subprocess.Popen: ...
    def signal(self, pod: LocalPod, sig: int) -> None: ...
    def freeze(self, pod: LocalPod) -> None: ...
    def thaw(self, pod: LocalPod) -> None: ...


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
    prober: ContainerProber | None = field(default=None, repr=False)
    kill_at: float | None = None  # a liveness kill's SIGKILL, after the grace period
    node: NodeLoss | None = field(default=None, repr=False)  # its node, while it does not answer
    deleting: str = ""  # why the kubelet is ending the pod for its deletion (its exit re-creates it)

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def log_path(self) -> Path:
        return self.folder / f"{self.plan.container_name}.log"

    @property
    def state(self) -> PodState:
        return PodState(self.name, self.plan.replica_type, self.phase, self.restarts)


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
            config_mounts.append((target, volume["configMap"]))
    for target, source in config_mounts:
        for path, content in _projected(source, config_maps[source["name"]]).items():
            (target / path).parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, str) and localize and path.endswith((".yaml", ".yml")):
                content = _localize_document(content, mapped)
            (target / path).write_bytes(content.encode() if isinstance(content, str) else content)
    return mapped, empty_dirs


def _projected(source: dict[str, Any], config_map: dict[str, Any]) -> dict[str, str | bytes]:
    """A ConfigMap volume's files as the kubelet projects them: every key under its own name,
    or with `items` only those keys, each at its `path`; a key the ConfigMap lacks keeps the
    pod from starting (pkg/volume/configmap/configmap.go, MakePayload: "references
    non-existent config key")."""
    contents: dict[str, str | bytes] = dict(config_map.get("data") or {})
    for key, encoded in (config_map.get("binaryData") or {}).items():
        contents[key] = base64.b64decode(encoded)
    if "items" not in source:
        return contents
    projected = {}
    for item in source["items"]:
        if item["key"] not in contents:
            raise LocalError(f"configmap {source['name']} references non-existent config key: {item['key']}")
        projected[item["path"]] = contents[item["key"]]
    return projected


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


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a command or argument (third_party/forked/golang/expansion):
    `$(NAME)` becomes the container's variable NAME where it has one and stays as written
    where it has none; `$$` is a literal `$`."""

    def replace(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        return env.get(match[1], match[0])

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", replace, text)


def prepare(
    objects: list[dict[str, Any]],
    workdir: Path,
    runtime: PodRuntime,
    host_env: dict[str, str] | None = None,
    plans: list[PodPlan] | None = None,
) -> list[LocalPod]:
    """Local pods for the rendered objects (one job, its runtime and its ConfigMaps): the
    container's command and environment (with the controller's variables) as the manifest
    has them, and, for a process, as this machine runs them. `plans`: the job's pods, if
    its rules (`job_rules`) have already planned them."""
    inherited = _host_env(host_env)
    config_maps = {item["metadata"]["name"]: item for item in objects if item.get("kind") == "ConfigMap"}
    pods = []
    for index, plan in enumerate(rules_for(objects).plans() if plans is None else plans):
        folder = workdir / plan.name
        mounts, empty_dirs = _mounts(plan, folder, config_maps, workdir, runtime.localizes_paths)
        container = plan.container
        env = {**_container_env(container, inherited), **plan.env}
        argv = [expand(arg, env) for arg in [*container.get("command", []), *container.get("args", [])]]
        if runtime.localizes_paths:  # the process inherits this machine's environment, as an image's
            env = {key: _localize(value, mounts) for key, value in {**inherited, **env}.items()}
            argv = [_localize(arg, mounts) for arg in argv]
        pod = LocalPod(plan, runtime.address(index), argv, env, folder, empty_dirs, mounts, runtime)
        pod.command = runtime.command(pod)
        pods.append(pod)
    return pods
