"""Added one-way delay on a namespace host's link, where the kernel has no `sch_netem`: the
packets that reach the host go to an NFQUEUE (an iptables INPUT rule in its namespace) and
this program, run in that namespace, lets each one go `--delay-ms` after it arrived, in order.

    ip netns exec HOST python -m benchmarks.link_delay --delay-ms 5 [--queue 0]

It asks for the packets' metadata only (no payload is copied) and for GSO packets whole,
so a 64 KiB segment is one verdict: a few thousand a second at 1 Gbit/s. Verdicts go in
batches (NFQNL_MSG_VERDICT_BATCH accepts every id up to the one given), and ids come in
order, so packets go on in the order they came. The `tbf` rate cap (`Network.shape`) sits
on the sender's device, before it. The queue's rule is added with `--queue-bypass` and the
queue with fail-open: if this program is gone or the queue is full, packets pass undelayed
rather than being dropped.

The protocol: linux/netfilter/nfnetlink_queue.h and linux/netfilter/nfnetlink.h (Linux
6.18): messages of subsystem NFNL_SUBSYS_QUEUE (3) on a NETLINK_NETFILTER (12) socket,
each an nlmsghdr, an nfgenmsg whose res_id is the queue number (big-endian), and
attributes whose numbers and payloads are big-endian.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
SOL_NETLINK, NETLINK_NO_ENOBUFS = 270, 5
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND, NFQNL_COPY_META = 1, 1
NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO = 1, 4
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NF_ACCEPT = 1
PR_SET_PDEATHSIG = 1  # linux/prctl.h
QUEUE_MAXLEN = 65536  # packets held at once: 1 Gbit/s x 100 ms is under 2,000 GSO segments

NLMSGHDR = struct.Struct("=IHHII")
NFGENMSG = struct.Struct("!BBH")
NLATTR = struct.Struct("=HH")


def attribute(kind: int, payload: bytes) -> bytes:
    padding = b"\0" * (-len(payload) % 4)
    return NLATTR.pack(NLATTR.size + len(payload), kind) + payload + padding


def message(kind: int, queue: int, attributes: bytes, flags: int = NLM_F_REQUEST) -> bytes:
    body = NFGENMSG.pack(socket.AF_UNSPEC, 0, queue) + attributes
    return NLMSGHDR.pack(NLMSGHDR.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, 0, 0) + body


def messages(data: bytes) -> list[tuple[int, bytes]]:
    """The netlink messages in one datagram: (type, payload after the nlmsghdr)."""
    found, offset = [], 0
    while offset + NLMSGHDR.size <= len(data):
        length, kind, _, _, _ = NLMSGHDR.unpack_from(data, offset)
        found.append((kind, data[offset + NLMSGHDR.size : offset + length]))
        offset += (length + 3) & ~3
    return found


def packet_id(payload: bytes) -> int | None:
    """The id in a queued packet's NFQA_PACKET_HDR (its first 4 bytes, big-endian)."""
    offset = NFGENMSG.size
    while offset + NLATTR.size <= len(payload):
        length, kind = NLATTR.unpack_from(payload, offset)
        if kind & 0x3FFF == NFQA_PACKET_HDR:
            return struct.unpack_from("!I", payload, offset + NLATTR.size)[0]
        offset += (length + 3) & ~3
    return None


def bind(queue: int) -> socket.socket:
    """A netlink socket bound to `queue`: metadata only, GSO packets whole, fail-open.
    A refusal (another program holds the queue, no NFQUEUE in the kernel) raises OSError."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    flags = struct.pack("!I", NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO)
    config = [
        attribute(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_INET)),
        attribute(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
        + attribute(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN))
        + attribute(NFQA_CFG_MASK, flags)
        + attribute(NFQA_CFG_FLAGS, flags),
    ]
    for attributes in config:
        sock.send(message(NFQNL_MSG_CONFIG, queue, attributes, NLM_F_REQUEST | NLM_F_ACK))
        for kind, payload in messages(sock.recv(65536)):
            error = struct.unpack_from("=i", payload)[0] if kind == NLMSG_ERROR else 0
            if error:
                raise OSError(-error, f"NFQUEUE {queue}: {os.strerror(-error)}")
    return sock


def delay(sock: socket.socket, queue: int, delay_s: float) -> None:
    """Hold each queued packet `delay_s`, then accept it and every one before it."""
    held: collections.deque[tuple[float, int]] = collections.deque()
    while True:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else None
        if select.select([sock], [], [], wait)[0]:
            arrived = time.monotonic()
            while True:
                try:
                    data = sock.recv(65536, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                for kind, payload in messages(data):
                    ident = packet_id(payload) if kind & 0xFF == NFQNL_MSG_PACKET else None
                    if ident is not None:
                        held.append((arrived + delay_s, ident))
        now, last = time.monotonic(), None
        while held and held[0][0] <= now:
            last = held.popleft()[1]
        if last is not None:
            verdict = attribute(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last))
            sock.send(message(NFQNL_MSG_VERDICT_BATCH, queue, verdict))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay added to each packet")
    parser.add_argument("--queue", type=int, default=0, help="the NFQUEUE number its iptables rule names")
    args = parser.parse_args(argv)
    parent = os.getppid()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    # a harness SIGKILLed runs no clean-up: go with it (prctl(2), PR_SET_PDEATHSIG)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # gone already
        return 0
    try:
        sock = bind(args.queue)
    except OSError as error:
        print(f"link_delay: {error}", file=sys.stderr)
        return 1
    print("ready", flush=True)  # the queue is bound: the iptables rule may go in
    delay(sock, args.queue, args.delay_ms / 1000)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
