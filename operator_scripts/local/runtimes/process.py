"""`ddp-ops local`'s default runtime: each pod a process tree in UTS and mount namespaces of
its own (`unshare`, then `sandbox`), whose host name is the pod's name and whose /etc/hosts
is the job's table of running pods. As root, each pod also has a network namespace of its
own on the job's pod network, where the job's NetworkPolicy holds (`pod_network`); without
root the pods share this host's network on loopback addresses, and nothing is enforced."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import TextIO
from urllib.parse import urlparse

from operator_scripts.local.network_policy import JobNetwork
from operator_scripts.local.pod_network import (
    DEFAULT_POD_SUBNET,
    Attachment,
    PodNetwork,
    pod_networks_available,
)
from operator_scripts.local.pods import HostsTable, LocalError, LocalPod
from operator_scripts.parent_death import dies_with_parent
from trainer.launcher.process_tree import signal_tree
from trainer.lines import last_line

# the project's console scripts, run with this interpreter
CONSOLE_SCRIPTS = {"torchrun": "torch.distributed.run", "ddp-launch": "trainer.launcher.launch"}
# the claim of this host's ports, an abstract Unix socket: the kernel refuses a second bind
# and frees the name when its holder exits, so a killed run leaves nothing behind
PORTS_CLAIM = "\0ddp-ops-local-pods"


def sandbox_command(hostname: str, hosts: HostsTable, shm: Path | None = None) -> list[str]:
    """The prefix that runs a command as a pod: new UTS, mount and PID namespaces (a user
    namespace too when not root) whose init is `sandbox`, with the pod's host name, the
    job's hosts table and the pod's own /dev/shm. The pod ends whole when the process that
    starts it (`ddp-ops local`'s thread) ends, however it ends: `setpriv --pdeathsig` kills
    `unshare` then, `--kill-child` kills the namespace's init, and the kernel the rest."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return [
        *dies_with_parent(),
        "unshare", *user, "--mount", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc",
        "--propagation", "private", "--",
        sys.executable, "-m", "operator_scripts.local.runtimes.sandbox",
        hostname, str(hosts.path), str(hosts.nsswitch), str(shm or "-"), "--",
    ]  # fmt: skip


def claim_host_ports() -> socket.socket:
    """Pods on loopback addresses share the host's network, and the rendezvous store listens on
    every address (a TrainJob's on 29500, trainjob_env.MASTER_PORT), so two runs at once
    would join each other's rendezvous: the second is refused before any pod starts."""
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(PORTS_CLAIM)
    except OSError:
        claim.close()
        raise LocalError(
            "another `ddp-ops local` run on this host holds the pods' ports (their rendezvous "
            "store listens on every address): wait for it to end, or use --runtime docker"
        ) from None
    return claim


CONTROL_PLANE_LOOPBACK = "127.0.0.254"  # the pods take 127.0.0.2 and up


class ProcessRuntime:
    """Each pod a process tree in namespaces of its own: as root on the job's pod network
    (`network`), else on a loopback address with one run on the host at a time
    (`claim_host_ports`)."""

    localizes_paths = True
    hosts_control_plane = True

    def __init__(self, subnet: str = DEFAULT_POD_SUBNET, isolate: bool | None = None) -> None:
        isolate = pod_networks_available() if isolate is None else isolate
        self.network = PodNetwork(subnet) if isolate else None
        self._claim: socket.socket | None = None

    def address(self, index: int) -> str:
        return self.network.address(index) if self.network else f"127.0.0.{index + 2}"

    def check(self, pods: list[LocalPod], hosts: HostsTable, job: JobNetwork) -> str:
        check_sandbox(hosts)
        if self.network is None:
            self._claim = claim_host_ports()
            return (
                "not root: the pods share this host's network on loopback addresses and the job's "
                "NetworkPolicy is not enforced (as root each pod gets a network namespace, the policy held)"
            )
        check_reachable_endpoints(pods, self.network.gateway)
        try:
            self.network.open()
            for pod in pods:
                self.network.attach(pod.endpoint(job.namespace))
            self.network.enforce(job.policies)
        except BaseException:
            self.network.close()
            raise
        return job.summary(self.network.subnet, self.network.gateway)

    def release(self) -> None:
        if self.network is not None:
            self.network.close()
        if self._claim is not None:
            self._claim.close()
            self._claim = None

    def control_plane(self, name: str, namespace: str, labels: dict[str, str]) -> tuple[str, list[str]]:
        """As root a guest on the pod network, which the job's NetworkPolicy sees as a pod of
        `namespace` with `labels`; without root the top loopback address of this host."""
        if self.network is None:
            return CONTROL_PLANE_LOOPBACK, []
        guest = self.network.guest(name, namespace, labels)
        return guest.endpoint.address, guest.prefix

    def _attachment(self, pod: LocalPod) -> Attachment | None:
        return self.network.attached[pod.name] if self.network else None

    def command(self, pod: LocalPod) -> list[str]:
        """The image's console scripts are this interpreter's; on loopback, metrics and
        ddp-launch's /healthz serve on the pod's address (the pods share the host's network)."""
        argv = list(pod.command)
        if argv[0] == "ddp-launch" and self.network is None:
            argv = [argv[0], "--health-address", pod.address, *argv[1:]]
        if argv[0] in CONSOLE_SCRIPTS:
            argv = [sys.executable, "-m", CONSOLE_SCRIPTS[argv[0]], *argv[1:]]
        return argv if self.network else [*argv, "--set", f"metrics.address={pod.address}"]

    def launch(self, pod: LocalPod, hosts: HostsTable, log: TextIO) -> subprocess.Popen:
        cwd = pod.env.get("HOME") if Path(pod.env.get("HOME", "")).is_dir() else pod.folder
        attachment = self._attachment(pod)
        return subprocess.Popen(
            [
                *(attachment.prefix if attachment else []),
                *sandbox_command(pod.name, hosts, pod.mounts.get("/dev/shm")),
                *pod.command,
            ],
            env=pod.env,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def signal(self, pod: LocalPod, sig: int) -> None:
        signal_tree(pod.process, sig)

    def freeze(self, pod: LocalPod) -> None:
        signal_tree(pod.process, signal.SIGSTOP)

    def thaw(self, pod: LocalPod) -> None:
        signal_tree(pod.process, signal.SIGCONT)


def check_reachable_endpoints(pods: list[LocalPod], gateway: str) -> None:
    """An S3 endpoint on loopback would be each pod's own loopback once pods have networks of
    their own: refused before any pod starts, with the address that reaches this machine."""
    for pod in pods:
        for key in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            url = urlparse(pod.env.get(key, ""))
            if url.hostname and (url.hostname == "localhost" or url.hostname.startswith("127.")):
                port = f":{url.port}" if url.port else ""
                raise LocalError(
                    f"{key}={pod.env[key]}: each pod has a network of its own here, so loopback is its "
                    f"own; serve the store on this machine's pod-network address and give "
                    f"{url.scheme}://{gateway}{port} (checkpoint.s3.endpoint)"
                )


def check_sandbox(hosts: HostsTable) -> None:
    """Fail in one line, before any pod starts, where namespaces cannot be made."""
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        raise LocalError(
            "needs `unshare` and `setpriv` (util-linux) to give each pod its host name, hosts table "
            "and a process tree that ends with the run"
        )
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
