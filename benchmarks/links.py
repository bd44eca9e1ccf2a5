"""What limits the speedup, measured: 2 nodes joined by a shaped link against 1 node alone,
with and without gradient compression and DDP's options, beside what `ddp-ops estimate`
predicts.

    python -m benchmarks.links [--rates 100,1000,10000,unshaped] [--hooks none,bf16,fp16,powersgd]
                               [--options bucket_cap_mb=5,static_graph=true,...] [--delays 5]
                               [--steps 200] [--plot docs/performance/links.png]

Needs root (network namespaces, `tc`, `iptables`). Each link is a veth pair per host to one
switch, capped with a token bucket on each host and, for `--delays`, delayed each way
(`Network.delay`: this kernel has no netem); the model is the transformer config grown to
38 MB of fp32 gradients (`link_runs.MODEL`). For each link rate: samples/s of the two
nodes against one, the scaling efficiency, the step's exposed communication (the
trainer's own step split), and the estimate's prediction for the same step, gradient
bytes and link.

The estimate's inputs are measured first, as one would measure them for a cluster: each
variant's step on one node beside a busy neighbour (a hook's casts and matrix products are
step work), and what gloo's own all-reduce reaches between the namespaces in the bytes'
type (its bandwidth and per-hop latency, `benchmarks.allreduce`): where this machine's CPUs
cap it below the link's rate, the estimate takes that. At 1 Gbit/s every hook and every
`--options` setting also runs the full `--steps` and its training loss is compared with no
hook's. The last line: `links: bf16/none at 1 Gbit/s X.XXx; estimate error max Y% over N links`.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from benchmarks.link_runs import (
    MODEL,
    QUICK_MODEL,
    LinkRun,
    MeasuredLink,
    measure_link,
    one_node,
    trainer_args,
    trainer_overrides,
    two_nodes,
)
from benchmarks.namespaces import Network, linked_hosts
from operator_scripts.reports.estimate import Interconnect, hook_bytes, predict, step_allreduces
from trainer.config import DdpConfig, load_config
from trainer.data import build_data
from trainer.models import build_model

# gloo's threads need the cores the backward pass is using on this machine's 2 vCPUs, so
# the all-reduce does not overlap it (docs/performance.md, "The step split"): the estimate
# is taken without overlap, from one node's step beside a busy neighbour, as
# `benchmarks.scaling` takes it
OVERLAP = False
SECONDS_PER_RUN = 60.0  # each speed run's length, whatever the link: slow links get fewer steps
DTYPES = {"none": "float32", "bf16": "bfloat16", "fp16": "float16", "powersgd": "float32"}
OPTIONS = "bucket_cap_mb=5,bucket_cap_mb=100,static_graph=true,gradient_as_bucket_view=true"


@dataclass(frozen=True)
class Variant:
    """One way of running DDP: a communication hook, or one of `ddp.*`'s options with none."""

    name: str
    overrides: str  # the `--set` that makes it
    ddp: DdpConfig  # as the trainer reads it


def variants(hooks: list[str], options: list[str]) -> list[Variant]:
    """The hooks, then each `key=value` of `ddp.*` on its own, read by the trainer's own
    config loader (a bad key or value fails here, in its one line)."""
    settings = [(hook, f"ddp.comm_hook={hook}") for hook in hooks] + [(o, f"ddp.{o}") for o in options]
    return [
        Variant(name, overrides, load_config("tokens", [trainer_overrides(overrides)]).ddp)
        for name, overrides in settings
    ]


@dataclass(frozen=True)
class Measured:
    rate: str
    mbit: float  # the link: its cap, or gloo's float32 ceiling between the namespaces if lower
    delay_ms: float  # added each way
    variant: Variant
    run: LinkRun
    predicted_samples_per_second: float

    @property
    def hook(self) -> str:
        return self.variant.name

    @property
    def error(self) -> float:
        return self.predicted_samples_per_second / self.run.samples_per_second - 1


@dataclass(frozen=True)
class Inputs:
    """What the estimate is given, measured on this machine before any link is shaped."""

    shapes: list[tuple[int, ...]]
    samples_per_step: float  # one node's batch
    step_s: dict[str, float]  # each variant's step on one node beside a busy neighbour
    links: dict[str, MeasuredLink]  # gloo's unshaped all-reduce, by the bytes' type

    def predict(
        self, variant: Variant, rate_mbit: float | None, delay_ms: float, devices: int = 2
    ) -> tuple[float, float]:
        """The link's Mbit/s as plotted (float32's ceiling where unshaped or lower) and the
        samples/s the estimate predicts for `variant` on it; `delay_ms` each way adds to
        every hop's latency."""
        hook = variant.ddp.comm_hook
        ceiling = {dtype: link.bandwidth_bytes_s * 8 / 1e6 for dtype, link in self.links.items()}
        cap = math.inf if rate_mbit is None else rate_mbit
        latency = self.links["float32"].latency_s + delay_ms / 1000
        link = Interconnect("", min(cap, ceiling[DTYPES[hook]]) * 1e6 / 8, latency)
        fp32_bytes = hook_bytes("none", self.shapes)
        allreduces = step_allreduces(hook, fp32_bytes, variant.ddp.bucket_cap_mb)
        gradient_bytes = hook_bytes(hook, self.shapes, variant.ddp.powersgd_rank)
        guess = predict(
            self.step_s[variant.name], gradient_bytes, devices, link, overlap=OVERLAP, allreduces=allreduces
        )
        return min(cap, ceiling["float32"]), devices * self.samples_per_step / guess.step_seconds


def model_shapes(model: str) -> list[tuple[int, ...]]:
    """The parameter shapes of the benchmark's model, built here as the trainer builds it."""
    config = load_config("tokens", [model])
    spec = build_data(config.data, config.seed).spec
    return [tuple(parameter.shape) for parameter in build_model(config.model, spec).parameters()]


def steps_for(step_s: float, steps: int) -> tuple[int, int]:
    """A speed run's steps and logging interval: about `SECONDS_PER_RUN`, at most `steps`,
    with enough progress lines for a steady window."""
    run_steps = max(12, min(steps, math.ceil(SECONDS_PER_RUN / max(step_s, 1e-3))))
    return run_steps, max(1, run_steps // 12)


def label(mbit: float | None, delay_ms: float = 0.0) -> str:
    rate = "unshaped" if mbit is None else f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"
    return f"{rate} +{delay_ms:g} ms" if delay_ms else rate


def measure_inputs(network: Network, model: str, runs: list[Variant], steps: int) -> tuple[Inputs, LinkRun]:
    """The estimate's inputs (printed as they come), and one node's run alone with no hook:
    the baseline every speedup is against."""
    links = {dtype: measure_link(network, dtype) for dtype in sorted({DTYPES[v.ddp.comm_hook] for v in runs})}
    for dtype, link in links.items():
        print(
            f"gloo between the namespaces, unshaped, {dtype}: {link.bandwidth_bytes_s * 8 / 1e6:,.0f} Mbit/s "
            f"(this machine's CPUs), {link.latency_s * 1e6:,.0f} us per hop"
        )
    alone = one_node(network, trainer_args(model, "", *steps_for(0.05, steps)), 600)
    step_s = {}
    for variant in runs:
        beside = one_node(
            network, trainer_args(model, variant.overrides, *steps_for(0.05, steps)), 600, beside=True
        )
        step_s[variant.name] = beside.step_ms / 1000
    print(
        f"one node: {alone.samples_per_second:,.1f} samples/s, step {alone.step_ms:.1f} ms alone; "
        f"beside a busy neighbour: {', '.join(f'{name} {1000 * s:.1f} ms' for name, s in step_s.items())}; "
        f"{alone.parameters:,} parameters ({4 * alone.parameters / 1e6:.1f} MB of fp32 gradients)"
    )
    samples_per_step = alone.samples_per_second * alone.step_ms / 1000
    return Inputs(model_shapes(model), samples_per_step, step_s, links), alone


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", default="100,1000,10000,unshaped", help="link caps in Mbit/s, or unshaped")
    parser.add_argument("--hooks", default="none,bf16,fp16,powersgd", help="ddp.comm_hook values to compare")
    parser.add_argument(
        "--options",
        default=OPTIONS,
        help="ddp.* settings run one at a time with no hook at --reference ('' for none)",
    )
    parser.add_argument("--steps", type=int, default=200, help="steps of the loss comparison at --reference")
    parser.add_argument(
        "--reference",
        type=float,
        default=1000.0,
        help="the link (Mbit/s) every variant runs on (default 1000)",
    )
    parser.add_argument(
        "--delays",
        default="5",
        help="one-way delays (ms) added to --reference's link, each a link of its own ('' for none)",
    )
    parser.add_argument("--quick", action="store_true", help="a small model and few steps: the tests' run")
    parser.add_argument("--plot", type=Path, help="write samples/s against link rate here (PNG)")
    args = parser.parse_args(argv)
    rates = [None if rate == "unshaped" else float(rate) for rate in args.rates.split(",")]
    links = [(rate, 0.0) for rate in rates] + [
        (args.reference, float(d)) for d in args.delays.split(",") if d
    ]
    runs = variants(args.hooks.split(","), [option for option in args.options.split(",") if option])
    model = QUICK_MODEL if args.quick else MODEL
    measured: list[Measured] = []
    with linked_hosts(2) as network:
        inputs, alone = measure_inputs(network, model, runs, args.steps)
        for rate, delay_ms in links:
            for host in range(2):
                network.shape(host, rate)
                network.delay(host, delay_ms or None)
            reference = rate == args.reference and not delay_ms
            for variant in runs if reference else [v for v in runs if v.name in ("none", "bf16")]:
                mbit, predicted = inputs.predict(variant, rate, delay_ms)
                steps, log_every = (
                    (args.steps, max(1, args.steps // 20))
                    if reference
                    else steps_for(2 * inputs.samples_per_step / predicted, args.steps)
                )
                run = two_nodes(network, trainer_args(model, variant.overrides, steps, log_every), 1800)
                row = Measured(label(rate, delay_ms), mbit, delay_ms, variant, run, predicted)
                measured.append(row)
                print(
                    f"{row.rate:>12} {row.hook:>8}: {run.samples_per_second:8,.1f} samples/s, speedup "
                    f"{run.samples_per_second / alone.samples_per_second:.2f}x, efficiency "
                    f"{run.samples_per_second / alone.samples_per_second / 2:.0%}, communication "
                    f"{run.communication_share:.0%} of the step; estimate "
                    f"{row.predicted_samples_per_second:,.1f} ({row.error:+.0%}); "
                    f"loss {run.loss:.4f}",
                    flush=True,
                )
    return report(measured, alone, args.plot, label(args.reference))


def report(measured: list[Measured], alone: LinkRun, plot: Path | None, at: str) -> int:
    """The loss comparison at the reference link `at`, the plot, and the last line."""
    reference = {row.hook: row for row in measured if row.rate == at}
    for hook, row in reference.items():
        if hook != "none" and "none" in reference:
            drift = row.run.loss / reference["none"].run.loss - 1
            print(f"at {at}, {hook}: loss after the same steps {drift:+.2%} against none's")
    if plot is not None:
        from benchmarks.plots import plot_links

        print(f"wrote {plot_links(measured, alone.samples_per_second, plot)}")
    ratio = math.nan
    if {"bf16", "none"} <= reference.keys():
        ratio = reference["bf16"].run.samples_per_second / reference["none"].run.samples_per_second
    worst = max(measured, key=lambda row: abs(row.error))
    print(f"estimate error, every run: max {worst.error:+.0%} ({worst.hook} at {worst.rate})")
    errors = [abs(row.error) for row in measured if row.hook == "none"]
    print(
        f"links: bf16/none at {at} {ratio:.2f}x; estimate error max "
        f"{max(errors):.0%} over {len(errors)} links"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
