"""What `train.compile` costs at a start, measured from outside, and what its checkpoints load.

    python -m benchmarks.compile [--config tokens] [--repeats 2] [--steps 20]

Each run is the trainer under `torchrun --standalone --nproc_per_node=2` for `--steps` steps
with validation and test at its end, timed on this process's clock from launch to exit:
  eager     `train.compile=off`: the baseline every compile time is taken against;
  cold      compiled, an empty node-local cache folder and none in the store;
  restart   compiled again on the same node: the folder the cold run left (what a rank that
            torchrun restarts in its pod finds);
  new pod   compiled, an empty folder, a store that holds only the cold run's archive (what
            a pod re-created on another node finds beside the checkpoints).
A start's compile time is its run's wall time less the eager run's (the fastest of
`--repeats` rounds each). Target: restart and new pod each at most 20 % of cold.

Then the checkpoints, on the digits demo (whose loss moves in a few steps, where the
synthetic tokens' stays at ln 256): an eager run's checkpoint resumed compiled and a
compiled run's resumed eager, each checked to resume at its step and to end within 2 % of
the loss of a run that never switched. Without dropout: inductor draws its dropout masks
from a stream of its own, so with dropout the runs part ways by design, not by the load.
Bit-exactness of a compiled run across a kill is
`python -m benchmarks.fault_trials --set train.compile=model`; the DDP placement is
`python -m benchmarks.compile_placement`.

Last line: `compile: restart X% and new pod Y% of a cold compile (Zs); checkpoints load both
ways`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.runner import checkout_path
from trainer.launcher.launch import RDZV_ENV

TARGET = 0.20
LOSS_TOLERANCE = 0.02


@dataclass(frozen=True)
class Bench:
    """What every run of this benchmark shares."""

    workdir: Path
    config: str
    steps: int
    extra: str = ""  # overrides before every run's own

    def run(self, uri: Path, cache: Path, overrides: str, steps: int = 0) -> tuple[float, list[dict]]:
        """`run` in this benchmark's folder, for `steps` or its own number of steps."""
        return run(self.workdir, uri, cache, self.extra + overrides, steps or self.steps, self.config)


def run(
    workdir: Path,
    uri: Path,
    cache: Path,
    overrides: str,
    steps: int,
    config: str,
    log_every: int = 0,
    nproc: int = 2,
) -> tuple[float, list[dict]]:
    """One trainer run of `nproc` processes in `workdir`: its wall time in seconds and rank
    0's JSON records (a progress line every `log_every` steps, or at the end)."""
    settings = (
        f"train.max_steps={steps},log.every_steps={log_every or steps},log.format=json,metrics.port=0,"
        f"checkpoint.uri={uri},checkpoint.snapshot_every_steps=0,{overrides}"
    )
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "trainer", "--config", config, "--set", settings,
    ]  # fmt: skip
    env = {
        **os.environ, **RDZV_ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": checkout_path(),
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
    }  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return seconds, records


def record(records: list[dict], event: str) -> dict:
    return next(item for item in records if item.get("event") == event)


def start_times(bench: Bench, repeats: int) -> dict[str, float]:
    """The fastest wall time of each start over `repeats` rounds."""
    best: dict[str, float] = {}
    compiled = "train.compile=model"
    for round_ in range(repeats):
        base = bench.workdir / f"round-{round_}"
        times = {"eager": bench.run(base / "eager", base / "eager-cache", "train.compile=off")[0]}
        times["cold"] = bench.run(base / "cold", base / "node-a", compiled)[0]
        times["restart"] = bench.run(base / "restart", base / "node-a", compiled)[0]
        pod = base / "new-pod"
        pod.mkdir()
        for archive in (base / "cold").glob("compile-cache-*.tar.gz"):
            shutil.copy(archive, pod / archive.name)
        times["new pod"] = bench.run(pod, base / "node-b", compiled)[0]
        for name, seconds in times.items():
            best[name] = min(best.get(name, seconds), seconds)
        print(f"round {round_ + 1}: " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()), flush=True)
    return best


def switched_resumes(bench: Bench) -> list[str]:
    """Problems of checkpoints written one way and resumed the other; empty when none."""
    problems = []
    cache, steps = bench.workdir / "switch-cache", bench.steps
    bench = Bench(bench.workdir, bench.config, steps, "model.dropout=0.0,")
    _, straight = bench.run(bench.workdir / "straight", cache, "train.compile=off", 2 * steps)
    reference = record(straight, "summary")["val_loss"]
    for first, second in (("off", "model"), ("model", "off")):
        uri = bench.workdir / f"switch-{first}-{second}"
        bench.run(uri, cache, f"train.compile={first}")
        _, records = bench.run(uri, cache, f"train.compile={second}", 2 * steps)
        resumed, loss = record(records, "plan").get("resumed_from"), record(records, "summary")["val_loss"]
        drift = abs(loss / reference - 1)
        print(f"compile={first} checkpoint resumed with compile={second}: from step {resumed}, "
              f"val loss {loss:.4f} against {reference:.4f} never switched ({100 * drift:.2f}%)")  # fmt: skip
        if resumed != steps or drift > LOSS_TOLERANCE:
            problems.append(f"{first} -> {second}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="tokens")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="compile-bench-") as folder:
        bench = Bench(Path(folder), args.config, args.steps)
        best = start_times(bench, args.repeats)
        problems = switched_resumes(Bench(bench.workdir, "digits", bench.steps))
    cold = best["cold"] - best["eager"]
    shares = {name: max(best[name] - best["eager"], 0.0) / cold for name in ("restart", "new pod")}
    for name, share in shares.items():
        print(f"{name}: compile {best[name] - best['eager']:.1f}s, {100 * share:.0f}% of cold ({cold:.1f}s)")
    loads = "checkpoints load both ways" if not problems else f"CHECKPOINTS FAIL: {', '.join(problems)}"
    print(
        f"compile: restart {100 * shares['restart']:.0f}% and new pod {100 * shares['new pod']:.0f}% "
        f"of a cold compile ({cold:.1f}s); {loads}"
    )
    return 0 if max(shares.values()) <= TARGET and not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
