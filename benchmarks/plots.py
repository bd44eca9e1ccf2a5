"""The scaling benchmark's two PNGs: throughput against processes with the ideal line, and
our step time split into data, compute, communication, checkpoint and loop bookkeeping."""

from __future__ import annotations

from pathlib import Path

from benchmarks.scaling_results import Scaling

PARTS = (
    ("data_ms", "waiting for data", "#8da0cb"),
    ("compute_ms", "compute (forward, backward, optimizer)", "#66c2a5"),
    ("communication_ms", "communication left exposed", "#fc8d62"),
    ("checkpoint_ms", "checkpoint snapshot", "#e78ac3"),
    ("logging_ms", "loop bookkeeping", "#a6d854"),
)


def _pyplot():
    """pyplot on the file-only backend, imported late: matplotlib is the optional `report` extra."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scaling(results: list[Scaling], out: Path) -> Path:
    """One panel per workload: samples/s of ours and of the bare loop at each process
    count, and the ideal line (N x one process's rate)."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for axis, scaling in zip(axes[0], results, strict=True):
        counts = sorted(scaling.ours)
        ideal = [n * scaling.rate("ours", 1) for n in counts]
        axis.plot(counts, ideal, "k--", label="ideal (N x 1 process)")
        for runner, marker in (("ours", "o-"), ("bare", "s-")):
            rates = [scaling.rate(runner, n) for n in counts]
            label = f"{runner} ({scaling.speedup(runner):.2f}x)"
            axis.plot(counts, rates, marker, label=label)
        axis.set_title(scaling.name)
        axis.set_xlabel("processes (one thread each)")
        axis.set_ylabel("global samples/s")
        axis.set_xticks(counts)
        axis.set_ylim(bottom=0)
        axis.legend()
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def plot_step_split(results: list[Scaling], out: Path) -> Path:
    """Stacked bars of our mean step time by part, one bar per workload and process count."""
    plt = _pyplot()
    labels, splits = [], []
    for scaling in results:
        for nproc in sorted(scaling.split_ms):
            labels.append(f"{scaling.name}\n{nproc} process{'es' if nproc > 1 else ''}")
            splits.append(scaling.split(nproc))
    figure, axis = plt.subplots(figsize=(9, 1.1 * len(labels) + 1.8))
    left = [0.0] * len(labels)
    for field, legend, colour in PARTS:
        widths = [split[field] for split in splits]
        axis.barh(labels, widths, left=left, label=legend, color=colour)
        left = [start + width for start, width in zip(left, widths, strict=True)]
    axis.set_xlabel("ms per optimizer step (mean over ranks)")
    axis.invert_yaxis()
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize="small")
    axis.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def plot_links(measured: list, one_node_rate: float, out: Path) -> Path:
    """Two nodes' samples/s against the link's rate (the estimate's bandwidth: the cap, or
    the CPUs' stream ceiling), measured with and without compression, the estimate's
    prediction as lines, a delayed link's run as a cross, and the ideal (twice one node)."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.2))
    for hook, color in (
        ("none", "#fc8d62"),
        ("bf16", "#66c2a5"),
        ("fp16", "#8da0cb"),
        ("powersgd", "#e78ac3"),
    ):
        rows = sorted((row for row in measured if row.hook == hook), key=lambda row: row.mbit)
        for row in [row for row in rows if row.delay_ms]:  # a point of its own, off the lines
            axis.plot(
                row.mbit, row.run.samples_per_second, "x", color=color, label=f"{hook}, +{row.delay_ms:g} ms"
            )
        rows = [row for row in rows if not row.delay_ms]
        if not rows:
            continue
        rates = [row.mbit for row in rows]
        axis.plot(
            rates, [row.run.samples_per_second for row in rows], "o", color=color, label=f"{hook}, measured"
        )
        if len(rows) > 1:
            predicted = [row.predicted_samples_per_second for row in rows]
            axis.plot(rates, predicted, "-", color=color, alpha=0.7, label=f"{hook}, estimate")
    axis.axhline(2 * one_node_rate, color="k", linestyle="--", label="ideal (2 x one node)")
    axis.axhline(one_node_rate, color="gray", linestyle=":", label="one node")
    axis.set_xscale("log")
    axis.set_xlabel("link rate, Mbit/s (the estimate's bandwidth)")
    axis.set_ylabel("global samples/s, 2 nodes")
    axis.set_ylim(bottom=0)
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def plot_scale(results, out: Path) -> Path:
    """The scale benchmark's four panels (`benchmarks.scale.Results`): start-up against real
    nodes; the watcher store's requests against nodes, measured, simulated and (dashed) what
    the watcher before made, derived; and against the state's size, the time a save blocks
    and a restore takes, each beside a plain copy of the same bytes."""
    plt = _pyplot()
    figure, ((start, store), (blocked, restore)) = plt.subplots(2, 2, figsize=(12, 8.5))
    counts = [figures.nodes for figures in results.nodes]
    start.plot(counts, [f.first_step_s for f in results.nodes], "o-", label="launch to first step")
    start.plot(
        counts, [f.control_plane_s for f in results.nodes], "s-", label="control plane (rendezvous, group)"
    )
    start.plot(
        counts,
        [f.training_s or float("nan") for f in results.nodes],
        "^-",
        label="frozen node: training again",
    )
    start.set(title="real nodes on 2 cores", xlabel="nodes", ylabel="seconds", xticks=counts)
    simulated = [load.nodes for load in results.watched]
    everything = counts + simulated
    store.plot(
        counts,
        [f.group_store.requests / f.window_s for f in results.nodes],
        "o-",
        label="measured, real nodes",
    )
    store.plot(
        simulated, [load.requests_per_s for load in results.watched], "s-", label="measured, simulated nodes"
    )
    store.plot(
        everything,
        [n * (2 * n - 1) for n in everything],
        "k--",
        label="the watcher before (derived, N(2N-1))",
    )
    if results.agents:
        store.plot(
            [a.nodes for a in results.agents],
            [a.requests_per_s for a in results.agents],
            "^:",
            label="torchrun agents (rendezvous store)",
        )
    store.set(title="store requests per second", xlabel="nodes", xscale="log", yscale="log")
    gigabytes = [size.gigabytes for size in results.sizes]
    for label, values, style in (
        ("plain copy", [s.copy_s for s in results.sizes], "k--"),
        ("checkpoint blocked", [s.checkpoint_blocked_s for s in results.sizes], "o-"),
        ("snapshot blocked", [s.snapshot_blocked_s for s in results.sizes], "s-"),
        ("DCP async_save blocked", [s.dcp_blocked_s or float("nan") for s in results.sizes], "^:"),
    ):
        blocked.plot(gigabytes, values, style, label=label)
    blocked.set(title="training blocked per save", xlabel="state (GB)", ylabel="seconds")
    for label, values, style in (
        ("plain read of the snapshot", [s.plain_read_s for s in results.sizes], "k--"),
        ("restore from the snapshot", [s.restore_snapshot_s for s in results.sizes], "o-"),
        ("upload, plain boto3", [s.plain_upload_s for s in results.sizes], "k:"),
        ("checkpoint published", [s.upload_s for s in results.sizes], "s-"),
    ):
        restore.plot(gigabytes, values, style, label=label)
    restore.set(title="restore and upload", xlabel="state (GB)", ylabel="seconds", yscale="log")
    for axis in (start, store, blocked, restore):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
