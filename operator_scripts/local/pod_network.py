"""The pod network of `ddp-ops local` (as root): every pod a network namespace of its own on
one switch, as pods on a node's bridge, with the job's NetworkPolicy enforced in each as a
CNI's policy engine would (`network_policy`).

- The switch is a bridge in a namespace of its own; the node (the namespace `ddp-ops local`
  runs in, where the kubelet's probes and a test's S3 live) is its first address, through
  one veth pair. Each pod's namespace is joined to the switch by a veth pair of its own,
  its address the subnet's next.
- A namespace lives as long as a holder process in it (`sleep`, as a pod's pause container
  holds its sandbox). Holders die with the thread that started them (PR_SET_PDEATHSIG,
  `setpriv --pdeathsig`), so a killed `ddp-ops local` leaves no namespace, link or address
  behind: the veth pairs go with the switch's namespace.
- The network is IPv4 only: no pod interface gets an IPv6 address, so no link-local route
  goes around the rules.
- Rules are iptables tables in each pod's namespace, replaced whole (iptables-restore) as
  endpoints join: the filter table's INPUT holds the pod's ingress, OUTPUT its egress.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from operator_scripts.local.network_policy import Endpoint, ruleset
from operator_scripts.local.pods import LocalError
from operator_scripts.parent_death import dies_with_parent
from trainer.lines import last_line

DEFAULT_POD_SUBNET = "10.213.0.0/24"
TOOLS = ("ip", "nsenter", "unshare", "setpriv", "iptables-restore")


def pod_networks_available() -> bool:
    """Whether this process may make the pod network: root, and the tools it runs."""
    return os.geteuid() == 0 and all(shutil.which(tool) for tool in TOOLS)


def _run(argv: list[str], stdin: str | None = None) -> None:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        raise LocalError(f"pod network: {' '.join(argv[:6])}: {last_line(done.stderr, 'failed')}")


def enter(netns: str) -> list[str]:
    """The command prefix that runs a program in a network namespace (its /proc path)."""
    return ["nsenter", f"--net={netns}", "--"]


def enforce(policies: list[dict[str, Any]], members: list[tuple[Endpoint, str]], node: str) -> None:
    """Hold each endpoint of the pod network, with the /proc path of its namespace, to
    `policies`: its rules (`network_policy`), over all of them, replace that namespace's
    filter table, atomically."""
    endpoints = [endpoint for endpoint, _ in members]
    for endpoint, netns in members:
        table = ruleset(endpoint, policies, endpoints, node)
        _run([*enter(netns), "iptables-restore", "-w"], stdin=table)


def _hold_namespace() -> subprocess.Popen:
    """A process in a new network namespace that lives until killed or until the thread that
    started it ends; returned once it is in its namespace."""
    holder = subprocess.Popen(
        [*dies_with_parent(), "unshare", "--net", "--", "sleep", "infinity"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    ours = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if holder.poll() is not None:
            raise LocalError(f"pod network: cannot make a namespace: {last_line(holder.stderr.read(), '?')}")
        try:
            if os.readlink(f"/proc/{holder.pid}/ns/net") != ours:
                return holder
        except OSError:
            pass
        time.sleep(0.002)
    holder.kill()
    raise LocalError("pod network: a namespace holder did not start within 10 s")


@dataclass
class Attachment:
    """An endpoint on the switch and the holder of its namespace."""

    endpoint: Endpoint
    holder: subprocess.Popen

    @property
    def netns(self) -> str:
        return f"/proc/{self.holder.pid}/ns/net"

    @property
    def prefix(self) -> list[str]:
        return enter(self.netns)


@dataclass
class PodNetwork:
    """The switch, the node's port on it, and the pods' (and any guest's) namespaces."""

    subnet: str = DEFAULT_POD_SUBNET
    attached: dict[str, Attachment] = field(default_factory=dict)
    policies: list[dict[str, Any]] = field(default_factory=list)
    _switch: subprocess.Popen | None = None
    _guests: int = 0

    @property
    def _node_link(self) -> str:
        """The node's end of its veth pair, named for this process (one run at a time in it)."""
        return f"ddp-node-{os.getpid()}"[:15]

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.subnet)

    @property
    def gateway(self) -> str:
        """The node's address on the pod network: where the pods reach a service of the node."""
        return str(self.network.network_address + 1)

    def address(self, index: int) -> str:
        return str(self.network.network_address + 2 + index)

    def _check_free(self) -> None:
        listed = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
        for line in listed.splitlines():
            destination = line.split()[0]
            if destination == "default":
                continue
            if ipaddress.ip_network(destination, strict=False).overlaps(self.network):
                raise LocalError(
                    f"--pod-subnet {self.subnet} overlaps this machine's route {line.strip()!r} "
                    "(another `ddp-ops local` run, or a network of its own): give another, e.g. 10.214.0.0/24"
                )

    def open(self) -> None:
        """The switch and the node's port on it (its gateway address)."""
        self._check_free()
        self._switch = _hold_namespace()
        switch = f"/proc/{self._switch.pid}/ns/net"
        _run([*enter(switch), "ip", "-batch", "-"], stdin="link add switch type bridge\nlink set switch up\n")
        node = self._node_link
        _run(["ip", "-batch", "-"], f"link add {node} type veth peer name node netns {self._switch.pid}\n")
        _set_sysctl(None, f"net/ipv6/conf/{node}/disable_ipv6", "1")
        _run(
            ["ip", "-batch", "-"],
            f"addr add {self.gateway}/{self.network.prefixlen} dev {node}\nlink set {node} up\n",
        )
        _run([*enter(switch), "ip", "link", "set", "node", "master", "switch", "up"])

    def attach(self, endpoint: Endpoint) -> Attachment:
        """A namespace on the switch at the endpoint's address for a pod (or a guest: a
        process the tests place on the network as a pod of another install would be). Every
        endpoint's rules are renewed, as a policy engine renews them when a pod appears."""
        assert self._switch is not None, "open() the network first"
        holder = _hold_namespace()
        port = f"port{len(self.attached)}"
        netns = f"/proc/{holder.pid}/ns/net"
        _set_sysctl(netns, "net/ipv6/conf/default/disable_ipv6", "1")  # eth0 gets no IPv6
        _run([*enter(f"/proc/{self._switch.pid}/ns/net"), "ip", "-batch", "-"], stdin=(
            f"link add {port} type veth peer name eth0 netns {holder.pid}\n"
            f"link set {port} master switch up\n"
        ))  # fmt: skip
        address = f"{endpoint.address}/{self.network.prefixlen}"
        _run([*enter(netns), "ip", "-batch", "-"], stdin=(
            f"addr add {address} dev eth0\nlink set eth0 up\nlink set lo up\n"
        ))  # fmt: skip
        self.attached[endpoint.name] = Attachment(endpoint, holder)
        self.enforce(self.policies)
        return self.attached[endpoint.name]

    def guest(
        self,
        name: str,
        namespace: str,
        labels: Mapping[str, str],
        namespace_labels: Mapping[str, str] | None = None,
    ) -> Attachment:
        """A namespace for a process that is not one of the job's pods, at the top of the subnet."""
        self._guests += 1
        address = str(self.network.broadcast_address - self._guests)
        return self.attach(Endpoint(name, namespace, dict(labels), address, {}, dict(namespace_labels or {})))

    def enforce(self, policies: list[dict[str, Any]]) -> None:
        """Hold every endpoint to `policies`, as the engine sees them."""
        self.policies = list(policies)
        enforce(self.policies, [(a.endpoint, a.netns) for a in self.attached.values()], self.gateway)

    def close(self) -> None:
        """Every namespace goes with its holder, and the pods' links with the switch's. The
        node's link goes first, and at once: a namespace's own clean-up runs later, in the
        kernel's time, and a run after this one must find the subnet free."""
        if self._switch is not None:
            subprocess.run(["ip", "link", "del", self._node_link], capture_output=True)
        holders = [attachment.holder for attachment in self.attached.values()]
        holders += [self._switch] if self._switch is not None else []
        for holder in holders:
            holder.send_signal(signal.SIGKILL)
            holder.wait()
            holder.stderr.close()
        self.attached.clear()
        self._switch = None


def _set_sysctl(netns: str | None, key: str, value: str) -> None:
    """A network sysctl of a namespace (None: this one): /proc/sys/net is read per namespace."""
    command = ["sh", "-c", f"echo {value} > /proc/sys/{key}"]
    _run([*enter(netns), *command] if netns else command)
