"""Predict data-parallel speedup from a single-device step time and the gradient size.

Each rank keeps its own batch (weak scaling), so N ranks finish N times the samples of one
step in `step(N)`: speedup = N * step(1) / step(N). The gradient all-reduce is a ring:
every rank sends and receives 2(N-1)/N of the gradient bytes, in 2(N-1) latency-bound
hops for each all-reduce (one per DDP bucket; PowerSGD issues three per bucket). Each row
shows both terms and which dominates: the bytes' term levels off at twice the gradients
over the bandwidth, the latency's grows with N, and takes over at hundreds of devices for
any model whose buckets are small next to bandwidth x latency x N. With
overlap, DDP's buckets start reducing while backward (about 2/3 of the step) still runs,
hiding communication up to that long. A communication hook's own work (the casts,
PowerSGD's matrix products) is part of step(1): measure that step with the hook on.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from trainer.config.argparsing import OneLineParser, non_negative_float, positive_float, positive_int

BACKWARD_SHARE = 2 / 3  # backward costs about twice the forward


@dataclass(frozen=True)
class Interconnect:
    """Per-rank all-reduce bandwidth (bytes/s) and per-hop latency (s)."""

    name: str
    bandwidth: float
    latency: float


PRESETS = {
    preset.name: preset
    for preset in (
        Interconnect("nvlink4", 450e9, 5e-6),  # H100/H200 SXM, NVLink 4 via NVSwitch, per direction
        Interconnect("pcie4", 25e9, 10e-6),  # PCIe 4.0 x16
        Interconnect("ib-ndr400", 50e9, 5e-6),  # 400 Gb/s InfiniBand per GPU
        Interconnect("eth-100g", 12.5e9, 20e-6),  # 100 GbE
        Interconnect("eth-25g", 3.1e9, 30e-6),  # 25 GbE
        Interconnect("eth-10g", 1.25e9, 30e-6),  # 10 GbE
        Interconnect("eth-1g", 0.125e9, 50e-6),  # 1 GbE
    )
}


@dataclass(frozen=True)
class Prediction:
    """One device count's predicted step, with its communication and what overlap hides."""

    devices: int
    single_step: float
    comm_seconds: float
    hidden_seconds: float

    @property
    def step_seconds(self) -> float:
        return self.single_step + self.comm_seconds - self.hidden_seconds

    @property
    def speedup(self) -> float:
        return self.devices * self.single_step / self.step_seconds

    @property
    def efficiency(self) -> float:
        return self.speedup / self.devices


COMPRESSED_BYTES = {"none": 4, "bf16": 2, "fp16": 2}  # bytes per gradient element sent
POWERSGD_MIN_COMPRESSION = 2  # torch's PowerSGDState default min_compression_rate


def hook_bytes(hook: str, shapes: list[tuple[int, ...]], rank: int = 1) -> float:
    """The bytes one rank's gradients put through the all-reduce per step under DDP's
    communication hook `hook`: fp32, a 16-bit cast, or PowerSGD's P and Q (an n x m matrix
    sends (n + m) x rank floats where that is at least `POWERSGD_MIN_COMPRESSION` times
    smaller, as torch's hook decides; vectors and small matrices go uncompressed)."""
    if hook != "powersgd":
        return float(COMPRESSED_BYTES[hook] * sum(math.prod(shape) for shape in shapes))
    floats = 0
    for shape in shapes:
        rows, columns = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (1, math.prod(shape))
        low_rank = (rows + columns) * min(rank, rows, columns)
        compress = len(shape) > 1 and rows * columns > low_rank * POWERSGD_MIN_COMPRESSION
        floats += low_rank if compress else rows * columns
    return 4.0 * floats


def ddp_bucket_bytes(gradient_bytes: float, bucket_cap_mb: float = 25) -> list[float]:
    """The all-reduces DDP issues per step: a 1 MiB first bucket, then `bucket_cap_mb` ones
    (DDP never splits a parameter across buckets; this model does)."""
    first = min(gradient_bytes, 2**20)
    sizes, rest, cap = [first], gradient_bytes - first, bucket_cap_mb * 2**20
    sizes += [cap] * math.floor(rest / cap)
    if rest % cap:
        sizes.append(rest % cap)
    return sizes


def ddp_buckets(gradient_bytes: float, bucket_cap_mb: float = 25) -> int:
    return len(ddp_bucket_bytes(gradient_bytes, bucket_cap_mb))


# all-reduces per DDP bucket: PowerSGD's hook reduces the bucket's uncompressed tensors, then
# the Ps, then the Qs, each from the one before's callback (torch 2.13,
# torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py:570, 585 and 607)
ALLREDUCES_PER_BUCKET = {"powersgd": 3}


def step_allreduces(hook: str, fp32_bytes: float, bucket_cap_mb: float = 25) -> int:
    """The all-reduces one step issues: DDP buckets its fp32 gradients whatever the hook
    then sends (the trainer gives PowerSGD a single bucket, `trainer.loop.ddp`)."""
    buckets = 1 if hook == "powersgd" else ddp_buckets(fp32_bytes, bucket_cap_mb)
    return buckets * ALLREDUCES_PER_BUCKET.get(hook, 1)


@dataclass(frozen=True)
class RingTerms:
    """One step's ring all-reduces, in their two terms: the bytes each rank moves, which
    tends to 2x the gradients as N grows, and the hops' latency, which grows as N does."""

    bandwidth_seconds: float
    latency_seconds: float

    @property
    def seconds(self) -> float:
        return self.bandwidth_seconds + self.latency_seconds

    @property
    def dominant(self) -> str:
        return "latency" if self.latency_seconds > self.bandwidth_seconds else "bandwidth"


def ring_terms(
    gradient_bytes: float, devices: int, link: Interconnect, allreduces: int | None = None
) -> RingTerms:
    """One step's ring all-reduces of `gradient_bytes` over `devices` ranks, in `allreduces`
    calls (default: DDP's fp32 buckets), each paying 2(N-1) hops' latency."""
    if devices <= 1:
        return RingTerms(0.0, 0.0)
    hops = 2 * (devices - 1)
    calls = ddp_buckets(gradient_bytes) if allreduces is None else allreduces
    return RingTerms(hops / devices * gradient_bytes / link.bandwidth, hops * link.latency * calls)


def ring_allreduce_seconds(
    gradient_bytes: float, devices: int, link: Interconnect, allreduces: int | None = None
) -> float:
    """Time of one step's ring all-reduces (`ring_terms`, both terms)."""
    return ring_terms(gradient_bytes, devices, link, allreduces).seconds


def predict(
    step_seconds: float,
    gradient_bytes: float,
    devices: int,
    link: Interconnect,
    *,
    overlap: bool,
    allreduces: int | None = None,
) -> Prediction:
    """Step time and speedup at `devices` ranks from the measured single-device step."""
    comm = ring_allreduce_seconds(gradient_bytes, devices, link, allreduces)
    return with_communication(step_seconds, comm, devices, overlap=overlap)


def with_communication(
    step_seconds: float, comm_seconds: float, devices: int, *, overlap: bool
) -> Prediction:
    """The step at `devices` ranks given its all-reduce time (modelled or measured)."""
    hidden = min(comm_seconds, BACKWARD_SHARE * step_seconds) if overlap else 0.0
    return Prediction(devices, step_seconds, comm_seconds, hidden)


def table(
    step_seconds: float, gradient_bytes: float, devices: list[int], link: Interconnect, allreduces: int
) -> str:
    lines = [
        f"{link.name}: {link.bandwidth / 1e9:g} GB/s, {link.latency * 1e6:g} us per hop; "
        f"step {1000 * step_seconds:.1f} ms on one device, {gradient_bytes / 1e6:.1f} MB of gradients",
        "devices  all-reduce ms  (bytes ms + latency ms: dominant)  speedup (no overlap)  speedup (overlap)"
        "  efficiency (overlap)",
    ]
    for n in devices:
        plain, hidden = (
            predict(step_seconds, gradient_bytes, n, link, overlap=o, allreduces=allreduces)
            for o in (False, True)
        )
        terms = ring_terms(gradient_bytes, n, link, allreduces)
        split = (
            f"({1000 * terms.bandwidth_seconds:.2f} + {1000 * terms.latency_seconds:.2f}: {terms.dominant})"
        )
        lines.append(
            f"{n:>7}  {1000 * plain.comm_seconds:>13.2f}  {split:>35}  {plain.speedup:>20.2f}"
            f"  {hidden.speedup:>17.2f}  {100 * hidden.efficiency:>19.1f}%"
        )
    return "\n".join(lines)


def limit(prediction: Prediction, data_seconds: float) -> str:
    """What keeps `prediction` below N times one device, in one line: the communication left
    exposed, the data wait, or nothing but compute."""
    exposed = prediction.comm_seconds - prediction.hidden_seconds
    step_ms, exposed_ms, data_ms = (
        1000 * x for x in (prediction.step_seconds + data_seconds, exposed, data_seconds)
    )
    compute_ms = 1000 * prediction.single_step
    if exposed_ms >= max(data_ms, 0.05 * step_ms):
        what = f"communication: {exposed_ms:.1f} ms of all-reduce left exposed"
    elif data_ms >= 0.05 * step_ms:
        what = f"data loading: {data_ms:.1f} ms of waiting for batches"
    else:
        what = "compute: communication hides behind the backward pass and data keeps up"
    return (
        f"at {prediction.devices} devices the step is {step_ms:.1f} ms ({compute_ms:.1f} ms compute); "
        f"what limits the speedup first: {what}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="ddp-ops estimate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--step-ms",
        type=positive_float,
        required=True,
        help="measured single-device step time (ms), with --comm-hook's hook on (its casts are step work)",
    )
    parser.add_argument(
        "--grad-mb", type=positive_float, required=True, help="gradient size in MB (4 x fp32 parameters)"
    )
    parser.add_argument(
        "--devices", type=positive_int, nargs="+", default=[2, 8, 16, 64], help="device counts"
    )
    parser.add_argument("--interconnect", choices=sorted(PRESETS), default="nvlink4", help="link preset")
    parser.add_argument("--bandwidth-gbs", type=positive_float, help="override the preset's bandwidth (GB/s)")
    parser.add_argument(
        "--link-gbit", type=positive_float, help="the link's rate in Gbit/s (instead of GB/s)"
    )
    parser.add_argument(
        "--latency-us", type=positive_float, help="override the preset's per-hop latency (us)"
    )
    parser.add_argument(
        "--comm-hook", choices=["none", "bf16", "fp16"], default="none",
        help="ddp.comm_hook: bf16 and fp16 send half the bytes",
    )  # fmt: skip
    parser.add_argument(
        "--data-ms", type=non_negative_float, default=0.0, help="data wait per step on one device (ms)"
    )
    args = parser.parse_args(argv)
    if args.bandwidth_gbs is not None and args.link_gbit is not None:
        parser.error(f"--bandwidth-gbs {args.bandwidth_gbs:g} and --link-gbit {args.link_gbit:g}: give one")
    preset = PRESETS[args.interconnect]
    name, bandwidth = preset.name, preset.bandwidth
    if args.bandwidth_gbs is not None:
        bandwidth = args.bandwidth_gbs * 1e9
    if args.link_gbit is not None:
        name, bandwidth = f"{args.link_gbit:g} Gbit/s link", args.link_gbit * 1e9 / 8
    latency = preset.latency if args.latency_us is None else args.latency_us * 1e-6
    link = Interconnect(name, bandwidth, latency)
    gradient_bytes = args.grad_mb * 1e6 * COMPRESSED_BYTES[args.comm_hook] / 4
    allreduces = step_allreduces(args.comm_hook, args.grad_mb * 1e6)
    print(table(args.step_ms / 1000, gradient_bytes, args.devices, link, allreduces))
    most = predict(
        args.step_ms / 1000, gradient_bytes, max(args.devices), link, overlap=True, allreduces=allreduces
    )
    print(limit(most, args.data_ms / 1000))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
