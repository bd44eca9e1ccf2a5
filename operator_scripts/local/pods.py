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
from secrets import token_urlsafe
from typing import Any, Protocol, TextIO

import yaml

from operator_scripts.controllers.job_rules import rules_for
from operator_scripts.controllers.pytorchjob_env import PodPlan
from operator_scripts.controllers.pytorchjob_status import Phase, PodState
from operator_scripts.local.kubelet_probe import ContainerProber
from operator_scripts.local.network_policy import Endpoint, JobNetwork
from operator_scripts.local.node_loss import NodeLoss
from operator_scripts.local.termination import message_path

MESSAGE_FILE = "termination-log"  # in the pod's folder: what the kubelet mounts at terminationMessagePath


class LocalError(Exception):
    """Why a local run cannot start, in one line."""


class PodRuntime(Protocol):
    """Where a pod's container runs. `check` holds what the run needs before any pod starts
    (the pods' network with the job's policies among it) and says in a line what the pods
    get; `release` lets it go; `launch` returns a process whose exit is the container's."""

    # whether container paths become the pod's folders (in the environment, the arguments and
    # the ConfigMap files), because the container shares this machine's file system
    localizes_paths: bool
    # whether it can place a control-plane server among the pods (`control_plane`)
    hosts_control_plane: bool

    def address(self, index: int) -> str: ...
    def check(self, pods: list[LocalPod], hosts: HostsTable, job: JobNetwork) -> str: ...
    def release(self) -> None: ...
    def command(self, pod: LocalPod) -> list[str]: ...
    def launch(self, pod: LocalPod, hosts: HostsTable, log: TextIO) -> subprocess.Popen: ...
    def signal(self, pod: LocalPod, sig: int) -> None: ...
    def freeze(self, pod: LocalPod) -> None: ...
    def thaw(self, pod: LocalPod) -> None: ...
    def control_plane(self, name: str, namespace: str, labels: dict[str, str]) -> tuple[str, list[str]]:
        """Where a server of the cluster's control plane (a pod of another namespace) listens
        for the pods, once `check` has run: its address, and the command prefix that runs a
        program there."""
        ...


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
    message: str = ""  # its container's last termination message, as the pod's status holds it
    created_at: float = 0.0  # wall clock: when its controller created it (the run's start, or a re-creation)
    started_at: float | None = None  # wall clock: its container's latest start (startedAt)

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def log_path(self) -> Path:
        return self.folder / f"{self.plan.container_name}.log"

    @property
    def message_file(self) -> Path:
        """The file the kubelet mounts at the container's terminationMessagePath."""
        return self.folder / MESSAGE_FILE

    @property
    def labels(self) -> dict[str, str]:
        """The pod's labels: its template's, then what its controller adds."""
        return {**(self.plan.template.get("metadata", {}).get("labels") or {}), **self.plan.labels}

    def endpoint(self, namespace: str) -> Endpoint:
        """The pod as a NetworkPolicy sees it: its labels, its address, and the trainer
        container's named ports (which a policy's named ports find)."""
        ports = self.plan.container.get("ports", [])
        named = {p["name"]: (int(p["containerPort"]), p.get("protocol", "TCP")) for p in ports if "name" in p}
        return Endpoint(self.name, namespace, self.labels, self.address, named)

    @property
    def state(self) -> PodState:
        return PodState(self.name, self.plan.replica_type, self.phase, self.restarts)


@dataclass(frozen=True)
class ClusterObjects:
    """What the pods' volumes and variables read from the cluster: the rendered ConfigMaps,
    and the Secrets the cluster would hold, each a folder whose files are its keys (as
    `kubectl create secret generic NAME --from-file=FOLDER` reads one)."""

    config_maps: dict[str, dict[str, Any]]
    secrets: dict[str, Path]
    tokens: dict[str, str] = field(default_factory=dict)  # service-account tokens by audience

    def secret(self, name: str) -> dict[str, bytes] | None:
        folder = self.secrets.get(name)
        if folder is None:
            return None
        return {entry.name: entry.read_bytes() for entry in sorted(folder.iterdir()) if entry.is_file()}


def _mounts(
    plan: PodPlan, folder: Path, cluster: ClusterObjects, shared: Path, localize: bool
) -> tuple[dict[str, Path], list[Path]]:
    """mountPath -> local folder for each volume of the pod (ConfigMaps and Secrets written
    out, ConfigMap paths localized when asked), and the folders that are emptyDirs, which are
    world-writable as the kubelet makes them (a non-root container writes there)."""
    spec = plan.template["spec"]
    volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
    fs_group = (spec.get("securityContext") or {}).get("fsGroup")
    mapped: dict[str, Path] = {}
    empty_dirs: list[Path] = []
    projections: list[tuple[Path, dict[str, str | bytes], bool, int]] = []
    for mount in plan.container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "persistentVolumeClaim" in volume:
            target = shared / "pvc" / volume["persistentVolumeClaim"]["claimName"]
        else:
            target = folder / "volumes" / mount["name"]
            if "emptyDir" in volume:
                empty_dirs.append(target)
        target.mkdir(parents=True, exist_ok=True)
        mapped[mount["mountPath"]] = target
        if "configMap" in volume:
            source = volume["configMap"]
            contents = _config_map_contents(cluster.config_maps.get(source["name"]))
            files = _projected(source, contents, "configmap")
            projections.append((target, files, localize, source.get("defaultMode", 0o644)))
        elif "secret" in volume:
            files = _projected(volume["secret"], cluster.secret(volume["secret"]["secretName"]), "secret")
            projections.append((target, files, False, volume["secret"].get("defaultMode", 0o644)))
        elif "projected" in volume:
            files = _projected_sources(volume["projected"].get("sources", []), cluster)
            projections.append((target, files, False, volume["projected"].get("defaultMode", 0o644)))
        else:
            target.chmod(0o777)
    for target, files, localized, mode in projections:
        for path, content in files.items():
            (target / path).parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, str) and localized and path.endswith((".yaml", ".yml")):
                content = _localize_document(content, mapped)
            written = target / path
            written.write_bytes(content.encode() if isinstance(content, str) else content)
            written.chmod(mode)
            if fs_group is not None and os.geteuid() == 0:  # the kubelet gives the files to fsGroup
                os.chown(written, -1, int(fs_group))
    return mapped, empty_dirs


def _config_map_contents(config_map: dict[str, Any] | None) -> dict[str, str | bytes] | None:
    if config_map is None:
        return None
    contents: dict[str, str | bytes] = dict(config_map.get("data") or {})
    for key, encoded in (config_map.get("binaryData") or {}).items():
        contents[key] = base64.b64decode(encoded)
    return contents


def _projected(
    source: dict[str, Any], contents: dict[str, str | bytes] | None, kind: str
) -> dict[str, str | bytes]:
    """A ConfigMap's or Secret's volume files as the kubelet projects them: every key under
    its own name, or with `items` only those keys, each at its `path`. A missing object or key
    keeps the pod from starting, unless the volume is `optional`, which skips it
    (pkg/volume/configmap/configmap.go and pkg/volume/secret/secret.go, MakePayload)."""
    name = source.get("name") or source.get("secretName")
    optional = bool(source.get("optional"))
    if contents is None:
        if optional:
            return {}
        given = " (give it: ddp-ops local --secret NAME=FOLDER, a file per key)" if kind == "secret" else ""
        raise LocalError(f"{kind} {name} not found{given}")
    if "items" not in source:
        return contents
    projected = {}
    for item in source["items"]:
        if item["key"] in contents:
            projected[item["path"]] = contents[item["key"]]
        elif not optional:
            raise LocalError(f"{kind} {name} references non-existent {kind[:6]} key: {item['key']}")
    return projected


def _projected_sources(sources: list[dict[str, Any]], cluster: ClusterObjects) -> dict[str, str | bytes]:
    """A projected volume's files: its ConfigMaps' and Secrets' as their own volumes would
    hold them, and each service-account token at its path. The API server issues a token for
    any audience; here the run's issuer (`ClusterObjects.tokens`) has one only for the
    audiences it serves, and any other gets a token that nothing here accepts."""
    files: dict[str, str | bytes] = {}
    for source in sources:
        if "configMap" in source:
            contents = _config_map_contents(cluster.config_maps.get(source["configMap"]["name"]))
            files.update(_projected(source["configMap"], contents, "configmap"))
        elif "secret" in source:
            files.update(_projected(source["secret"], cluster.secret(source["secret"]["name"]), "secret"))
        elif "serviceAccountToken" in source:
            token = source["serviceAccountToken"]
            files[token["path"]] = cluster.tokens.get(token.get("audience", ""), token_urlsafe(32))
    return files


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


def _container_env(
    container: dict[str, Any], host_env: dict[str, str], cluster: ClusterObjects
) -> dict[str, str]:
    """The container's own variables: values, and `secretKeyRef`s from the Secret given to
    the run, else from this process's variable named as the key."""
    env = {}
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = str(variable["value"])
        elif "secretKeyRef" in variable.get("valueFrom", {}):
            reference = variable["valueFrom"]["secretKeyRef"]
            secret = cluster.secret(reference["name"])
            if secret is not None and reference["key"] in secret:
                env[variable["name"]] = secret[reference["key"]].decode()
            elif reference["key"] in host_env:
                env[variable["name"]] = host_env[reference["key"]]
    return env


def _host_env(host_env: dict[str, str] | None) -> dict[str, str]:
    """What a pod inherits from this machine: the interpreter's environment (a container's
    image environment), less any torchrun or operator variables of an enclosing run and any
    AWS setting: a pod's endpoint, region and credentials come from its manifest alone."""
    env = dict(os.environ if host_env is None else host_env)
    return {key: value for key, value in env.items() if not key.startswith(("PET_", "TORCHELASTIC_", "AWS_"))}


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
    secrets: dict[str, Path] | None = None,
    tokens: dict[str, str] | None = None,
) -> list[LocalPod]:
    """Local pods for the rendered objects (one job, its runtime and its ConfigMaps): the
    container's command and environment (with the controller's variables) as the manifest
    has them, and, for a process, as this machine runs them. `plans`: the job's pods, if
    its rules (`job_rules`) have already planned them; `secrets`: the Secrets the cluster
    holds, by name, each a folder of its keys; `tokens`: the service-account tokens the
    run's servers accept, by audience."""
    inherited = _host_env(host_env)
    config_maps = {item["metadata"]["name"]: item for item in objects if item.get("kind") == "ConfigMap"}
    cluster = ClusterObjects(config_maps, dict(secrets or {}), dict(tokens or {}))
    pods = []
    for index, plan in enumerate(rules_for(objects).plans() if plans is None else plans):
        folder = workdir / plan.name
        mounts, empty_dirs = _mounts(plan, folder, cluster, workdir, runtime.localizes_paths)
        container = plan.container
        mounts[message_path(container)] = folder / MESSAGE_FILE  # the kubelet's file, mounted there
        env = {**_container_env(container, inherited, cluster), **plan.env}
        argv = [expand(arg, env) for arg in [*container.get("command", []), *container.get("args", [])]]
        if runtime.localizes_paths:  # the process inherits this machine's environment, as an image's
            env = {key: _localize(value, mounts) for key, value in {**inherited, **env}.items()}
            argv = [_localize(arg, mounts) for arg in argv]
        pod = LocalPod(plan, runtime.address(index), argv, env, folder, empty_dirs, mounts, runtime)
        pod.command = runtime.command(pod)
        pods.append(pod)
    return pods
