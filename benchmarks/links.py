"""What limits the speedup, measured: 2 nodes joined by a shaped link against 1 node alone,
with and without gradient compression, beside what `ddp-ops estimate` predicts.

    python -m benchmarks.links [--rates 100,1000,10000,unshaped] [--hooks none,bf16,fp16,powersgd]
                               [--steps 200] [--plot docs/performance/links.png]

Needs root (network namespaces, `tc`). Each link is a veth pair per host to one switch,
capped with a token bucket on each host; the model is the transformer config grown to
38 MB of fp32 gradients (`link_runs.MODEL`). For each link rate: samples/s of the two
nodes against one, the scaling efficiency, the step's exposed communication (the
trainer's own step split), and the estimate's prediction for the same step, gradient
bytes and link. The estimate takes the link's rate, or what gloo's own all-reduce reaches
between the namespaces where this machine's CPUs cap it lower, and the per-hop latency of
a small all-reduce there (both measured first, by `benchmarks.allreduce`). At
1 Gbit/s every hook also runs the full `--steps` and its training loss is compared with
no hook's. The last line: `links: bf16/none at 1 Gbit/s X.XXx; estimate error max Y% over N links`.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from benchmarks.link_runs import MODEL, QUICK_MODEL, LinkRun, measure_link, one_node, trainer_args, two_nodes
from benchmarks.namespaces import linked_hosts
from operator_scripts.reports.estimate import Interconnect, hook_bytes, predict
from trainer.config import load_config
from trainer.data import build_data
from trainer.models import build_model

# gloo's threads need the cores the backward pass is using on this machine's 2 vCPUs, so
# the all-reduce does not overlap it (docs/performance.md, "The step split"): the estimate
# is taken without overlap, from one node's step beside a busy neighbour, as
# `benchmarks.scaling` takes it
OVERLAP = False
SECONDS_PER_RUN = 60.0  # each speed run's length, whatever the link: slow links get fewer steps


@dataclass(frozen=True)
class Measured:
    rate: str
    mbit: float  # what the estimate takes: the cap, or gloo's unshaped ceiling where lower
    hook: str
    run: LinkRun
    predicted_samples_per_second: float

    @property
    def error(self) -> float:
        return self.predicted_samples_per_second / self.run.samples_per_second - 1


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


def label(mbit: float | None) -> str:
    if mbit is None:
        return "unshaped"
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", default="100,1000,10000,unshaped", help="link caps in Mbit/s, or unshaped")
    parser.add_argument("--hooks", default="none,bf16,fp16,powersgd", help="ddp.comm_hook values to compare")
    parser.add_argument("--steps", type=int, default=200, help="steps of the loss comparison at --reference")
    parser.add_argument(
        "--reference", type=float, default=1000.0, help="the link (Mbit/s) every hook runs on (default 1000)"
    )
    parser.add_argument("--quick", action="store_true", help="a small model and few steps: the tests' run")
    parser.add_argument("--plot", type=Path, help="write samples/s against link rate here (PNG)")
    args = parser.parse_args(argv)
    rates = [None if rate == "unshaped" else float(rate) for rate in args.rates.split(",")]
    hooks = args.hooks.split(",")
    model = QUICK_MODEL if args.quick else MODEL
    shapes = model_shapes(model)
    measured: list[Measured] = []
    with linked_hosts(2) as network:
        measured_link = measure_link(network)
        ceiling = measured_link.bandwidth_bytes_s * 8 / 1e6
        print(
            f"gloo between the namespaces, unshaped: {ceiling:,.0f} Mbit/s (this machine's CPUs), "
            f"{measured_link.latency_s * 1e6:,.0f} us per hop"
        )
        one_args = trainer_args(model, "none", *steps_for(0.05, args.steps))
        alone, beside = one_node(network, one_args, 600), one_node(network, one_args, 600, beside=True)
        step_s = beside.step_ms / 1000
        samples_per_step = alone.samples_per_second * alone.step_ms / 1000
        print(
            f"one node: {alone.samples_per_second:,.1f} samples/s, step {alone.step_ms:.1f} ms alone, "
            f"{beside.step_ms:.1f} ms beside a busy neighbour; {alone.parameters:,} parameters "
            f"({4 * alone.parameters / 1e6:.1f} MB of fp32 gradients)"
        )
        for rate in rates:
            for host in range(2):
                network.shape(host, rate)
            mbit = ceiling if rate is None else min(rate, ceiling)
            link = Interconnect(label(rate), mbit * 1e6 / 8, measured_link.latency_s)
            for hook in hooks if rate == args.reference else [h for h in ("none", "bf16") if h in hooks]:
                gradient_bytes = hook_bytes(hook, shapes)
                guess = predict(step_s, gradient_bytes, 2, link, overlap=OVERLAP)
                steps, log_every = (
                    (args.steps, max(1, args.steps // 20))
                    if rate == args.reference
                    else steps_for(guess.step_seconds, args.steps)
                )
                run = two_nodes(network, trainer_args(model, hook, steps, log_every), 1800)
                predicted = 2 * samples_per_step / guess.step_seconds  # two nodes, each one node's batch
                row = Measured(label(rate), mbit, hook, run, predicted)
                measured.append(row)
                print(
                    f"{row.rate:>12} {hook:>8}: {run.samples_per_second:8,.1f} samples/s, speedup "
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
    errors = [abs(row.error) for row in measured if row.hook == "none"]
    print(
        f"links: bf16/none at {at} {ratio:.2f}x; estimate error max "
        f"{max(errors):.0%} over {len(errors)} links"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
