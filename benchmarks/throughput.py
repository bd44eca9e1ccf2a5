"""Framework overhead: our trainer against the plainest DDP loop and PyTorch Lightning, on
the same model, data, optimizer and world size, interleaved and repeated.

    python -m benchmarks.throughput [--config NAME] [--nproc 2] [--repeats 7] [--set k=v ...]
                                    [--hanging-status-server]

All three validate after every epoch and leave that time out of their windows. Ours runs
without gradient clipping and durable checkpoints here (the other two have neither): the
comparison is of loop overhead, not of features that cost compute; `benchmarks.checkpoint`
measures checkpoints. Ours keeps its default node-local snapshots, and their pauses count
as time: they are part of every step's price (`benchmarks.snapshot` measures them apart).
Lightning is the optional `bench` extra (`pip install -e '.[bench]'`).

`--hanging-status-server` adds ours once more, posting its progress to a Trainer status
server (as a TrainJob's pods are given one) that takes each connection and never answers:
its rate over ours without one is what a hung server costs training (target >= 0.98).

Beside each wall-clock rate: CPU-seconds per 1,000 samples over the same steady windows,
of the contender's whole process tree (torchrun's agent, the ranks, our snapshot writers),
sampled from outside (`cpu_time`). On two shared cores wall time swings with the machine;
CPU time per sample swings far less and shows where a difference comes from.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import socket
import statistics
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from benchmarks.runner import BaselineRun, TrainerRun, run_baseline, run_trainer, trainer_bench_parser

DEFAULTS = [
    "train.epochs=30",
    "train.clip_grad_norm=0",
    "optim.lr_scaling=none",
    "checkpoint.every_steps=0",
    "metrics.port=0",
]
LOG_EVERY = 20
TARGETS = {"bare DDP loop": 0.98, "Lightning": 1.0}
HUNG = "ours, hung status"
HUNG_TARGET = 0.98

Run = TrainerRun | BaselineRun
Runner = Callable[[int, list[str]], Run]


def ours(nproc: int, overrides: list[str], *, config: str | None) -> TrainerRun:
    return run_trainer(nproc, overrides, log_every=LOG_EVERY, config=config)


@contextlib.contextmanager
def hung_status_server() -> Iterator[None]:
    """Trainer's status-server variables, as its TrainJobStatus plugin injects them, naming a
    listener on this host that takes connections and never answers (not even TLS)."""
    from operator_scripts.local.status_server import issue_credentials, status_url

    with tempfile.TemporaryDirectory() as folder, socket.create_server(("127.0.0.1", 0)) as silent:
        issue_credentials(Path(folder), [])
        (Path(folder) / "token").write_text("token")
        injected = {
            "KUBEFLOW_TRAINER_SERVER_URL": status_url("bench", "run", "127.0.0.1", silent.getsockname()[1]),
            "KUBEFLOW_TRAINER_SERVER_CA_CERT": f"{folder}/ca.crt",
            "KUBEFLOW_TRAINER_SERVER_TOKEN": f"{folder}/token",
        }
        os.environ.update(injected)
        try:
            yield
        finally:
            for name in injected:
                del os.environ[name]


def ours_with_hung_status(nproc: int, overrides: list[str], *, config: str | None) -> TrainerRun:
    with hung_status_server():
        return ours(nproc, [*overrides, "metrics.status_post_every_s=1"], config=config)


def contenders(config: str | None, hung_status: bool = False) -> dict[str, Runner]:
    runners: dict[str, Runner] = {
        "ours": functools.partial(ours, config=config),
        "bare DDP loop": functools.partial(run_baseline, "bare_ddp", log_every=LOG_EVERY, config=config),
    }
    if importlib.util.find_spec("pytorch_lightning"):
        runners["Lightning"] = functools.partial(
            run_baseline, "lightning_ddp", log_every=LOG_EVERY, config=config
        )
    if hung_status:
        runners[HUNG] = functools.partial(ours_with_hung_status, config=config)
    return runners


def measure(
    nproc: int, overrides: list[str], repeats: int, config: str | None, hung_status: bool = False
) -> dict[str, list[Run]]:
    """Every contender's runs, `repeats` rounds, the order rotated each round so no
    contender always runs first (or right after the slowest)."""
    runners = contenders(config, hung_status)
    names = list(runners)
    results: dict[str, list[Run]] = {name: [] for name in names}
    for round_ in range(repeats):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            results[name].append(runners[name](nproc, overrides))
    return results


def ratio_line(label: str, mine: list[float], theirs: list[float], target: str) -> str:
    """Ours over theirs round by round (a round's runs are back to back, so they share the
    machine's mood): the median and range."""
    rounds = [a / b for a, b in zip(mine, theirs, strict=True)]
    return (
        f"  {label}: {statistics.median(rounds):.3f} "
        f"(median of rounds, range {min(rounds):.3f}-{max(rounds):.3f}{target})"
    )


def summary(results: dict[str, list[Run]]) -> list[str]:
    """Median and spread of samples/s and of CPU-seconds per 1,000 samples for each, then ours
    over each other: the wall-clock ratio (with its target) and the CPU-time ratio."""
    lines = []
    for name, runs in results.items():
        rates = [run.samples_per_second for run in runs]
        cpu = [run.cpu_per_1000 for run in runs]
        lines.append(
            f"  {name:14s}: {statistics.median(rates):>9,.0f} samples/s "
            f"(median of {len(rates)}, spread {min(rates):,.0f}-{max(rates):,.0f}); "
            f"{statistics.median(cpu):.3f} CPU-s per 1,000 samples (spread {min(cpu):.3f}-{max(cpu):.3f})"
        )
    for name, target in TARGETS.items():
        if name not in results:
            continue
        label = name.split()[0].lower()
        ours_runs, their_runs = results["ours"], results[name]
        lines.append(
            ratio_line(
                f"ratio ours/{label}",
                [run.samples_per_second for run in ours_runs],
                [run.samples_per_second for run in their_runs],
                f"; target >= {target:.2f}",
            )
        )
        lines.append(
            ratio_line(
                f"CPU-s ratio ours/{label}",
                [run.cpu_per_1000 for run in ours_runs],
                [run.cpu_per_1000 for run in their_runs],
                "; lower is leaner",
            )
        )
    if HUNG in results:
        lines.append(
            ratio_line(
                "ratio ours with a hung status server/ours",
                [run.samples_per_second for run in results[HUNG]],
                [run.samples_per_second for run in results["ours"]],
                f"; target >= {HUNG_TARGET:.2f}",
            )
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = trainer_bench_parser(__doc__, repeats=7)
    parser.add_argument(
        "--hanging-status-server", action="store_true", help="ours once more, its status server hung"
    )
    args = parser.parse_args(argv)
    results = measure(
        args.nproc, [*DEFAULTS, *args.overrides], args.repeats, args.config, args.hanging_status_server
    )
    if "Lightning" not in results:
        print("PyTorch Lightning is not installed (the optional `bench` extra): ours against the bare loop")
    processes = f"{args.nproc} process{'es' if args.nproc > 1 else ''}"
    print(f"{processes}, one thread each; steady-state global samples/s, validation excluded")
    print("\n".join(summary(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
