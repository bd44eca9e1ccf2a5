"""NetworkPolicy (networking.k8s.io/v1) as a CNI's policy engine enforces it, as pure
functions: which pods a policy selects, which peers a rule admits, and the iptables rules
that hold it in one pod's network namespace (`pod_network` applies them).

The semantics (docs/facts.md, "NetworkPolicy"): a pod selected by any policy of its namespace
with Ingress (Egress) among its policyTypes is isolated that way and takes only what some
rule of some such policy allows, the rules of every policy adding up; a rule matches when its
peers (`from`/`to`, all when absent) and its ports (all when absent) both do; a peer with a
namespaceSelector and a podSelector selects the pods that match the one in the namespaces
that match the other, a podSelector alone the pods of the policy's own namespace; an ipBlock
holds its cidr less its `except`s. Replies to an allowed connection are allowed, a pod always
reaches itself, and its own node always reaches it (the kubelet's probes). What a pod sends
its node is held to its egress rules, as Calico and Cilium hold it: a job that works here
works there.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server


@dataclass(frozen=True)
class JobNetwork:
    """What the job's objects say about its network: its namespace and its NetworkPolicies."""

    namespace: str
    policies: list[dict[str, Any]]

    @classmethod
    def of(cls, objects: list[dict[str, Any]]) -> JobNetwork:
        (job,) = [item for item in objects if item.get("kind") in ("PyTorchJob", "TrainJob")]
        policies = [item for item in objects if item.get("kind") == "NetworkPolicy"]
        return cls(job["metadata"].get("namespace", "default"), policies)

    def summary(self, subnet: object, node: str) -> str:
        """What a run says of its pods' network, where the policy holds."""
        held = "held" if self.policies else "none rendered"
        return f"pods on {subnet}, this machine {node} there; NetworkPolicy {held}"


@dataclass(frozen=True)
class Endpoint:
    """A pod on the pod network, as the policy engine sees it: who it is and where."""

    name: str
    namespace: str
    labels: Mapping[str, str]
    address: str
    ports: Mapping[str, tuple[int, str]] = field(default_factory=dict)  # named container ports
    namespace_labels: Mapping[str, str] = field(default_factory=dict)  # besides the name label

    def in_namespace(self, selector: Mapping[str, Any]) -> bool:
        return matches(selector, {**self.namespace_labels, NAMESPACE_NAME_LABEL: self.namespace})


def matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector against a label set: every matchLabels pair and every expression
    holds (an empty selector matches everything)."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != str(value):
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        present = key in labels
        held = {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels.get(key) not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[operator]
        if not held:
            return False
    return True


def selecting(policies: Iterable[Mapping[str, Any]], endpoint: Endpoint) -> list[Mapping[str, Any]]:
    """The policies of the endpoint's namespace whose podSelector matches it."""
    return [
        policy
        for policy in policies
        if policy["metadata"].get("namespace", "default") == endpoint.namespace
        and matches(policy["spec"].get("podSelector"), endpoint.labels)
    ]


def policy_types(policy: Mapping[str, Any]) -> set[str]:
    """policyTypes, or its default: Ingress, and Egress when the policy has egress rules."""
    spec = policy["spec"]
    if "policyTypes" in spec:
        return set(spec["policyTypes"])
    return {"Ingress", *(["Egress"] if spec.get("egress") else [])}


def peer_endpoints(
    peer: Mapping[str, Any], policy_namespace: str, endpoints: Iterable[Endpoint]
) -> list[Endpoint]:
    """The pods a pod-or-namespace peer selects."""
    if "namespaceSelector" in peer:
        in_scope = [e for e in endpoints if e.in_namespace(peer["namespaceSelector"])]
    else:
        in_scope = [e for e in endpoints if e.namespace == policy_namespace]
    return [e for e in in_scope if matches(peer.get("podSelector"), e.labels)]


def resolve_ports(
    spec: Mapping[str, Any] | None, owner: Endpoint | None
) -> list[tuple[str | None, str | None]]:
    """A NetworkPolicyPort as (protocol, "port" or "low:high" or None for every port); a rule
    without ports (None) is every protocol and port. A named port is the destination pod's
    container port of that name (`owner`), and matches nothing where that pod has none (or
    where the destination is an address, not a pod)."""
    if spec is None:
        return [(None, None)]
    protocol = str(spec.get("protocol", "TCP")).lower()
    port = spec.get("port")
    if port is None:
        return [(protocol, None)]
    if isinstance(port, str) and not port.isdigit():
        named = (owner.ports if owner is not None else {}).get(port)
        if named is None or named[1].lower() != protocol:
            return []
        return [(protocol, str(named[0]))]
    end = spec.get("endPort")
    return [(protocol, f"{int(port)}:{int(end)}" if end else str(int(port)))]


@dataclass
class _Chains:
    """An iptables-restore filter table under construction."""

    lines: list[str] = field(default_factory=list)
    declared: list[str] = field(default_factory=list)
    count: int = 0

    def new(self, prefix: str) -> str:
        self.count += 1
        name = f"{prefix}-{self.count}"
        self.declared.append(name)
        return name

    def add(self, chain: str, *parts: str) -> None:
        self.lines.append(" ".join(["-A", chain, *parts]))


def _port_arguments(ports: list[tuple[str | None, str | None]]) -> list[list[str]]:
    return [["-p", proto, *(["--dport", span] if span else [])] if proto else [] for proto, span in ports]


def _allow(
    chains: _Chains,
    chain: str,
    rule: Mapping[str, Any],
    peers_key: str,
    flag: str,
    namespace: str,
    endpoints: list[Endpoint],
    port_owner: Endpoint | None,
) -> None:
    """One rule: ACCEPT what comes from (goes to) its peers on its ports. Named ports of an
    egress rule resolve per destination pod."""
    specs = rule.get("ports") or [None]

    def accept_in(target: str, match: list[str], owner: Endpoint | None) -> None:
        for spec in specs:
            for port_args in _port_arguments(resolve_ports(spec, owner)):
                chains.add(target, *match, *port_args, "-j", "ACCEPT")

    peers = rule.get(peers_key)
    if peers is None:
        accept_in(chain, [], port_owner)
        return
    for peer in peers:
        if "ipBlock" in peer:
            block = peer["ipBlock"]
            if ipaddress.ip_network(block["cidr"], strict=False).version != 4:
                continue  # the pod network here is IPv4 only
            # the block's chain: an excepted address goes back (RETURN), any other is
            # accepted on the rule's ports
            target = chains.new("BLOCK")
            chains.add(chain, flag, block["cidr"], "-j", target)
            for excepted in block.get("except", []):
                chains.add(target, flag, excepted, "-j", "RETURN")
            accept_in(target, [], None)
            continue
        for other in peer_endpoints(peer, namespace, endpoints):
            accept_in(chain, [flag, f"{other.address}/32"], port_owner if flag == "-s" else other)


def ruleset(
    endpoint: Endpoint, policies: list[Mapping[str, Any]], endpoints: list[Endpoint], node: str
) -> str:
    """The filter table for one pod's network namespace (iptables-restore input): the
    policies that select it, over every endpoint of the pod network, with `node` the address
    of its node."""
    chains = _Chains()
    chosen = selecting(policies, endpoint)
    for direction, chain, key, peers_key, flag in (
        ("Ingress", "INPUT", "ingress", "from", "-s"),
        ("Egress", "OUTPUT", "egress", "to", "-d"),
    ):
        isolating = [p for p in chosen if direction in policy_types(p)]
        if not isolating:
            continue
        interface = "-i" if chain == "INPUT" else "-o"
        chains.add(chain, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        chains.add(chain, interface, "lo", "-j", "ACCEPT")
        if chain == "INPUT":
            chains.add(chain, "-s", f"{node}/32", "-j", "ACCEPT")
        for policy in isolating:
            namespace = policy["metadata"].get("namespace", "default")
            for rule in policy["spec"].get(key) or []:
                _allow(chains, chain, rule, peers_key, flag, namespace, endpoints, endpoint)
        chains.add(chain, "-j", "DROP")
    header = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]"]
    header += [f":{name} - [0:0]" for name in chains.declared]
    return "\n".join([*header, *chains.lines, "COMMIT", ""])
