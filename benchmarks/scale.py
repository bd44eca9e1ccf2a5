"""The cost of a bigger job, in one command: real nodes on this machine, simulated nodes
beyond it, the state from 0.1 to 4 GB, and the metrics' series.

    python -m benchmarks.scale [--nodes 2,4,8,16] [--simulate 64,256,1024]
                               [--sizes 0.1,0.134,0.5,1,2,4] [--plot docs/performance/scale.png]
    python -m benchmarks.scale --quick     # the test suite's small run

Each part is a module of its own, runnable alone: `scale_nodes` (2 to 16 network
namespaces, each a torchrun agent with one rank), `store_load` (64 to 1,024 nodes' watchers
and torchrun agents against a real TCPStore), `state_size` (checkpoints, snapshots,
restores and DCP's async_save, each beside a plain copy of the same bytes) and
`metric_series` (a pod of 8 ranks). Every ratio is taken within this one run. Needs root
(network namespaces). A count or size this machine cannot hold is refused in one line
before anything starts.

The last line begins `scale:` and carries the figures the targets are about: the control
plane (rendezvous and process group, the imports left out) at the most nodes over the
fewest, a frozen node's naming and recovery at the most nodes, the watcher's round trips,
poll p99 and naming at the most simulated nodes, the worst time blocked per save over a
plain copy, and the checkpoint's stall ratio at the size nearest 134 MB.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import metric_series, scale_nodes, state_size, store_load
from benchmarks.namespaces import isolation_available
from benchmarks.save_stall import FULL_LOOP, QUICK_LOOP

# the suite's run: its figures are not the point, and its fork servers (nice 19) may wait long
# for idle CPU beside the other tests, so its freeze does not wait for them
QUICK = {
    "nodes": "2",
    "simulate": "16",
    "sizes": "0.02",
    "ranks": 2,
    "window_s": 5.0,
    "fork_server_wait_s": 0.0,
}
STALL_AT_MB = 134


@dataclass(frozen=True)
class Results:
    nodes: list[scale_nodes.NodesFigures]
    watched: list[store_load.WatchLoad]
    agents: list[store_load.AgentLoad]
    sizes: list[state_size.SizeFigures]
    series: metric_series.SeriesFigures


def numbers(text: str, kind: type) -> list:
    return [kind(value) for value in text.split(",") if value]


def last_line(results: Results) -> str:
    fewest, most = results.nodes[0], results.nodes[-1]
    watched = results.watched[-1]
    stall_at = min(results.sizes, key=lambda size: abs(size.gigabytes * 1000 - STALL_AT_MB))
    named = "never" if most.named_s is None else f"{most.named_s:.1f}"
    training = "never" if most.training_s is None else f"{most.training_s:.1f}"
    all_named = "never" if watched.named_by_all_s is None else f"{watched.named_by_all_s:.1f}"
    blocked = max(size.blocked_over_copy for size in results.sizes)
    return (
        f"scale: control plane {most.nodes}/{fewest.nodes} nodes "
        f"{most.control_plane_s / fewest.control_plane_s:.2f}; frozen node named {named} s, training "
        f"{training} s; {watched.nodes} nodes {watched.per_node_per_poll:.2f} round trips per node per poll, "
        f"p99 {watched.poll_p99_ms:.1f} ms, named {all_named} s; blocked {blocked:.2f} x a copy; stall "
        f"{stall_at.checkpoint_stall_ratio:.3f} at {stall_at.gigabytes * 1000:.0f} MB"
    )


def refusal(node_counts: list[int], sizes: list[float]) -> str | None:
    if not isolation_available():
        return "scale: needs root and network namespaces (the nodes and the simulated store are hosts)"
    return scale_nodes.refusal(node_counts) or state_size.refusal(sizes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", default="2,4,8,16", help="real node counts (network namespaces)")
    parser.add_argument("--simulate", default="64,256,1024", help="simulated node counts")
    parser.add_argument("--sizes", default="0.1,0.134,0.5,1,2,4", help="state sizes in GB")
    parser.add_argument("--ranks", type=int, default=8, help="ranks of the pod whose series are counted")
    parser.add_argument("--plot", type=Path, help="write the curves here (PNG)")
    parser.add_argument("--quick", action="store_true", help="a small run of every part: the tests'")
    args = parser.parse_args(argv)
    window_s, fork_server_wait_s = scale_nodes.WINDOW_S, scale_nodes.FORK_SERVER_WAIT_S
    if args.quick:
        args.nodes, args.simulate, args.sizes, args.ranks = (
            QUICK[key] for key in ("nodes", "simulate", "sizes", "ranks")
        )
        window_s, fork_server_wait_s = QUICK["window_s"], QUICK["fork_server_wait_s"]
    node_counts, sizes = sorted(numbers(args.nodes, int)), numbers(args.sizes, float)
    if (refused := refusal(node_counts, sizes)) is not None:
        print(refused, file=sys.stderr)
        return 2
    print("== real nodes (network namespaces, one rank each)", flush=True)
    nodes = []
    for count in node_counts:
        nodes.append(scale_nodes.run_nodes(count, window_s, fork_server_wait_s))
        print(scale_nodes.describe(nodes[-1]), flush=True)
    print("== simulated nodes against a real TCPStore", flush=True)
    watched, agents = store_load.simulate(
        numbers(args.simulate, int), quick=args.quick, report=lambda line: print(line, flush=True)
    )
    print("== state size (one rank)", flush=True)
    loop = QUICK_LOOP if args.quick else FULL_LOOP
    measured = state_size.sweep(sizes, with_dcp=True, report=lambda line: print(line, flush=True), loop=loop)
    print("== metrics", flush=True)
    series = metric_series.measure(args.ranks)
    print(metric_series.describe(series), flush=True)
    results = Results(nodes, watched, agents, measured, series)
    if args.plot is not None:
        from benchmarks.plots import plot_scale

        print(f"wrote {plot_scale(results, args.plot)}")
    print(last_line(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
