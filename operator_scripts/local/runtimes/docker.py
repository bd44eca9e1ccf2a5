"""Pods as containers of their image: `ddp-ops local --runtime docker`.

Each pod's container runs with what the rendered manifest says: the image, command and
arguments, the environment with the operator's injected variables, the volumes (each a
folder of the pod, bound at its mountPath; emptyDirs world-writable, as the kubelet makes
them), the user and groups, a read-only root, dropped capabilities, no privilege
escalation, and the memory and CPU limits. What stands in for the cluster:
- the pod network is one `--internal` Docker network with no route out (nothing leaves
  the machine); this machine is its gateway, where a test's S3 (moto) listens;
- each pod's network namespace is held by a sandbox container (`sleep`, as the kubelet's
  pause container holds a pod's), made before the pod's first container, which joins it
  (`--network container:`); as root, the job's NetworkPolicy is enforced in it before any of
  the pod's processes starts (`network_policy`, as for the process runtime);
- each pod's host name is its pod's (the sandbox's, which a joining container takes), and
  its /etc/hosts the job's table of running pods, bound read-only, with `hosts: files`: a
  pod's name resolves only while its container runs, as a headless Service's does while its
  pod is Ready;
- a restart is a new container of the same pod (its volumes and sandbox kept), so `docker
  logs POD` is the current container's log, as `kubectl logs` is.
Values from `secretKeyRef` reach the container by name only (`docker create --env NAME`),
never on a command line; a Secret volume is a folder bound read-only.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import subprocess
from typing import Any, TextIO

from kubernetes.utils import parse_quantity

from operator_scripts.image.engine import Engine
from operator_scripts.local.keeper import Keeper
from operator_scripts.local.network_policy import JobNetwork
from operator_scripts.local.pod_network import enforce
from operator_scripts.local.pods import HostsTable, LocalError, LocalPod
from trainer.lines import last_line

DEFAULT_SUBNET = "10.213.0.0/24"


def security_options(pod_spec: dict[str, Any], container: dict[str, Any]) -> list[str]:
    """docker create options for the pod's and the container's securityContext (the container's wins)."""
    context = {**pod_spec.get("securityContext", {}), **container.get("securityContext", {})}
    options: list[str] = []
    if "runAsUser" in context:
        options += ["--user", f"{context['runAsUser']}:{context.get('runAsGroup', context['runAsUser'])}"]
    for group in [context.get("fsGroup"), *context.get("supplementalGroups", [])]:
        if group is not None:
            options += ["--group-add", str(group)]
    if context.get("readOnlyRootFilesystem"):
        options.append("--read-only")
    if context.get("allowPrivilegeEscalation") is False:
        options += ["--security-opt", "no-new-privileges"]
    if context.get("privileged"):
        options.append("--privileged")
    capabilities = context.get("capabilities", {})
    options += [option for cap in capabilities.get("drop", []) for option in ("--cap-drop", cap)]
    options += [option for cap in capabilities.get("add", []) for option in ("--cap-add", cap)]
    return options


def resource_options(container: dict[str, Any]) -> list[str]:
    """Limits as the kubelet enforces them: memory (OOM kill), CPU quota, GPUs."""
    limits = container.get("resources", {}).get("limits", {})
    options = []
    if "memory" in limits:
        options += ["--memory", str(int(parse_quantity(limits["memory"])))]
    if "cpu" in limits:
        options += ["--cpus", str(float(parse_quantity(limits["cpu"])))]
    if "nvidia.com/gpu" in limits:
        options += ["--gpus", str(limits["nvidia.com/gpu"])]
    return options


class DockerRuntime:
    """Pods as containers on one internal network; `with` makes and removes the network
    and every container of the run, and a keeper removes them should this process be
    killed before the block ends."""

    localizes_paths = False
    hosts_control_plane = False  # the internal network holds the job's containers only

    def __init__(self, engine: Engine, job: str, subnet: str = DEFAULT_SUBNET) -> None:
        self.engine = engine
        self.network = f"ddp-local-{job}"[:60]
        self.subnet = ipaddress.ip_network(subnet)

    @property
    def gateway(self) -> str:
        """This machine's address on the pod network: where the pods reach a host service."""
        return str(self.subnet.network_address + 1)

    def _containers_left(self) -> list[str]:
        label = f"label=ddp-ops-local={self.network}"
        return self.engine.run("ps", "--all", "--quiet", "--filter", label).stdout.split()

    def _network_left(self) -> list[str]:
        named = f"name=^{self.network}$"
        return self.engine.run("network", "ls", "--quiet", "--filter", named).stdout.split()

    def left_behind(self) -> list[str]:
        """Containers and the network of a run of this job that are still in the engine."""
        return self._containers_left() + self._network_left()

    def _remove_all(self) -> None:
        """Every container of a run of this job (found by its label) and the pod network."""
        if containers := self._containers_left():
            self.engine.run("rm", "--force", *containers, check=False)
        if self._network_left():
            self.engine.run("network", "rm", self.network, check=False)

    def __enter__(self) -> DockerRuntime:
        """The pod network, after clearing what a run of this job killed before its end left."""
        self._remove_all()
        created = self.engine.run(
            "network", "create", "--internal", "--subnet", str(self.subnet), "--gateway", self.gateway,
            self.network, check=False,
        )  # fmt: skip
        if created.returncode != 0:
            reason = last_line(created.stderr, "no output")
            raise LocalError(f"cannot make the pod network {self.subnet}: {reason}")
        self._keeper = Keeper(self._removal_command(), self.engine.env)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._remove_all()
        self._keeper.done()

    def _removal_command(self) -> list[str]:
        """`_remove_all` as a command, for a keeper to run should this process be killed."""
        docker, label = shlex.quote(self.engine.cli), shlex.quote(f"label=ddp-ops-local={self.network}")
        return [
            "sh", "-c",
            f"{docker} ps --all --quiet --filter {label} | xargs -r {docker} rm --force; "
            f"{docker} network rm {shlex.quote(self.network)}",
        ]  # fmt: skip

    def address(self, index: int) -> str:
        return str(self.subnet.network_address + 2 + index)

    def control_plane(self, name: str, namespace: str, labels: dict[str, str]) -> tuple[str, list[str]]:
        raise LocalError("the pod network of --runtime docker holds the job's containers only")

    def check(self, pods: list[LocalPod], hosts: HostsTable, job: JobNetwork) -> str:
        """Every pod's image is in the engine (nothing is pulled: the pods have no route out),
        and every pod's sandbox runs, the job's policy held in it where this process may."""
        for image in sorted({pod.plan.container["image"] for pod in pods}):
            if self.engine.run("image", "inspect", image, check=False).returncode != 0:
                raise LocalError(f"image {image} is not in the Docker engine: build it with `make image`")
        for pod in pods:
            self._start_sandbox(pod)
        if os.geteuid() != 0:
            return (
                f"pods on {self.subnet}, this machine {self.gateway} there; the job's NetworkPolicy "
                "is not enforced (that needs root, in each sandbox)"
            )
        sandboxes = [
            (pod.endpoint(job.namespace), f"/proc/{self._sandbox_pid(pod.name)}/ns/net") for pod in pods
        ]
        enforce(job.policies, sandboxes, self.gateway)
        return job.summary(self.subnet, self.gateway)

    def _sandbox(self, pod_name: str) -> str:
        return f"{pod_name}-sandbox"

    def _start_sandbox(self, pod: LocalPod) -> None:
        """The container that holds the pod's network namespace: the pod's host name and
        address, the image's `sleep`, as the pod's user with nothing else allowed."""
        container, spec = pod.plan.container, pod.plan.template["spec"]
        self.engine.run("rm", "--force", self._sandbox(pod.name), check=False)  # an earlier run's
        created = self.engine.run(
            "run", "--detach", "--name", self._sandbox(pod.name), "--hostname", pod.name,
            "--label", f"ddp-ops-local={self.network}", "--network", self.network, "--ip", pod.address,
            *security_options(spec, container), "--entrypoint", "sleep", container["image"], "infinity",
            check=False,
        )  # fmt: skip
        if created.returncode != 0:
            reason = last_line(created.stderr, "no output")
            raise LocalError(f"cannot start the sandbox of pod {pod.name}: {reason}")

    def _sandbox_pid(self, pod_name: str) -> int:
        found = self.engine.run("inspect", "--format", "{{.State.Pid}}", self._sandbox(pod_name))
        return int(found.stdout.strip())

    def release(self) -> None:
        """Nothing: the job's network and containers go when its context ends."""

    def command(self, pod: LocalPod) -> list[str]:
        """The container's own command and arguments: the image runs them as they are."""
        return pod.command

    def docker_create(self, pod: LocalPod, hosts: HostsTable) -> list[str]:
        """`docker create` for the pod's container, as the manifest describes it."""
        container, spec = pod.plan.container, pod.plan.template["spec"]
        options = [
            "create", "--name", pod.name, "--label", f"ddp-ops-local={self.network}",
            "--network", f"container:{self._sandbox(pod.name)}",
            "--mount", f"type=bind,source={hosts.path},target=/etc/hosts,readonly",
            "--mount", f"type=bind,source={hosts.nsswitch},target=/etc/nsswitch.conf,readonly",
        ]  # fmt: skip
        mounts = container.get("volumeMounts", [])
        read_only = {mount["mountPath"] for mount in mounts if mount.get("readOnly")}
        for path, folder in pod.mounts.items():
            flag = ",readonly" if path in read_only else ""
            options += ["--mount", f"type=bind,source={folder},target={path}{flag}"]
        options += security_options(spec, container) + resource_options(container)
        options += [option for name in pod.env for option in ("--env", name)]  # values from the environment
        if "workingDir" in container:
            options += ["--workdir", container["workingDir"]]
        if container.get("command"):  # the manifest's command replaces the image's entrypoint
            options += ["--entrypoint", pod.command[0]]
            return [self.engine.cli, *options, container["image"], *pod.command[1:]]
        return [self.engine.cli, *options, container["image"], *pod.command]

    def launch(self, pod: LocalPod, hosts: HostsTable, log: TextIO) -> subprocess.Popen:
        """A new container for the pod (the last one, if any, is gone as after a restart),
        created apart, so the engine's warnings stay out of the pod's log, then started
        attached: the process's exit is the container's."""
        self.engine.run("rm", "--force", pod.name, check=False)
        created = subprocess.run(
            self.docker_create(pod, hosts), env={**self.engine.env, **pod.env}, capture_output=True, text=True
        )
        if created.returncode != 0:
            reason = last_line(created.stderr, "no output")
            raise LocalError(f"cannot create the container of pod {pod.name}: {reason}")
        return subprocess.Popen(
            [self.engine.cli, "start", "--attach", pod.name],
            env=self.engine.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def signal(self, pod: LocalPod, sig: int) -> None:
        self.engine.run("kill", "--signal", str(int(sig)), pod.name, check=False)

    def freeze(self, pod: LocalPod) -> None:
        self.engine.run("pause", pod.name, check=False)

    def thaw(self, pod: LocalPod) -> None:
        self.engine.run("unpause", pod.name, check=False)

    def logs(self, pod_name: str) -> str:
        """`docker logs` of the pod's current container, its stdout and stderr in one stream
        in the order written, as `kubectl logs` shows them."""
        command = [self.engine.cli, "logs", pod_name]
        return subprocess.run(
            command, env=self.engine.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ).stdout
