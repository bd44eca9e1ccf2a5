"""`ddp-ops flight-recorder LOCATION`: what the ranks were doing in their collectives when the
watchdog killed a hung one, from the flight-recorder dumps they left beside the checkpoints
(`trainer.distributed.flight_recorder`).

    ddp-ops flight-recorder LOCATION [--out DIR]   # a checkpoint folder or s3://bucket/prefix

For each run and restart that left dumps: the dumps fetched to DIR (one file per rank,
`rank-<r>`, as torch's analyser reads them), then per process group each rank's last
collective and the ranks that never reached the newest one: the ranks to look at. Then
torch's own analyser over the same folder (`python -m torch.distributed.flight_recorder.fr_trace`),
which matches collectives across ranks in depth where it can read the dumps: NCCL's. gloo's
dumps name no process group (torch 2.13: `pg_config` holds one unnamed group), which its
analyser cannot read; the summary above does not need the names.

A dump is a pickle; it is read with an unpickler that builds plain containers and numbers
only, so a dump that someone else wrote cannot run code here.
"""

from __future__ import annotations

import argparse
import io
import pickle
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from trainer.checkpoint.location import open_store
from trainer.config import CheckpointConfig
from trainer.distributed.flight_recorder import FOLDER


class PlainUnpickler(pickle.Unpickler):
    """Dicts, lists, tuples, strings and numbers: what a flight-recorder dump holds."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"a flight-recorder dump holds no objects, yet this one names {module}.{name}"
        )


def read_dump(data: bytes) -> dict[str, Any]:
    return PlainUnpickler(io.BytesIO(data)).load()


def last_collectives(dumps: dict[int, dict[str, Any]]) -> list[str]:
    """Per process group: the newest collective any rank entered, and the ranks whose last
    one is older (they never reached it: the stuck ones, or the ones a stuck peer held)."""
    newest: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for rank, dump in dumps.items():
        for entry in dump.get("entries", []):
            group = str(entry["process_group"][0])
            if entry["collective_seq_id"] >= newest[group].get(rank, {}).get("collective_seq_id", -1):
                newest[group][rank] = entry
    lines = []
    for group, by_rank in sorted(newest.items()):
        ahead = max(entry["collective_seq_id"] for entry in by_rank.values())
        behind = sorted(rank for rank, entry in by_rank.items() if entry["collective_seq_id"] < ahead)
        missing = sorted(set(dumps) - set(by_rank))
        leader = next(entry for entry in by_rank.values() if entry["collective_seq_id"] == ahead)
        frames = leader.get("frames") or []  # the innermost first: torch's own, then the caller's
        where = next((frame for frame in frames if "/torch/" not in frame["filename"]), None)
        origin = f" from {where['filename']}:{where['line']}" if where else ""
        what = f"{leader['profiling_name']}, sizes {leader['input_sizes']}{origin}"
        said = f"group {group}: collective #{ahead} ({what})"
        if behind:
            last = ", ".join(f"rank {rank} at #{by_rank[rank]['collective_seq_id']}" for rank in behind)
            said += f" never reached by {last}"
        else:
            said += " reached by every rank that dumped"
        lines.append(said + (f"; no entries from ranks {missing}" if missing else ""))
    return lines


def fetch(location: str, out: Path) -> dict[Path, dict[int, dict[str, Any]]]:
    """Every restart's dumps under LOCATION, written to `out/<run>/restart-<n>/rank-<r>` and read."""
    store = open_store(CheckpointConfig(uri=location))
    restarts: dict[Path, dict[int, dict[str, Any]]] = defaultdict(dict)
    for name in store.names(f"{FOLDER}/"):
        data = store.get(name)
        if data is None:
            continue
        path = out / Path(name).relative_to(FOLDER)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        restarts[path.parent][int(path.name.removeprefix("rank-"))] = read_dump(data)
    return restarts


def torch_analysis(folder: Path) -> str:
    """torch's analyser over one restart's folder, or the line that says why it could not."""
    command = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder), "-p", "rank-"]
    done = subprocess.run([*command, "--allow-incomplete-ranks"], capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return done.stdout.strip()
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return f"torch's analyser could not read these dumps ({last})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ddp-ops flight-recorder",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("location", help="the job's checkpoint location: a folder or s3://bucket/prefix")
    parser.add_argument("--out", type=Path, help="where the dumps go (default: a temporary folder)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="flight-recorder-"))
    restarts = fetch(args.location, out)
    if not restarts:
        print(f"ddp-ops flight-recorder: no dumps under {args.location}/{FOLDER}/: no rank was killed "
              "as hung while TORCH_FR_BUFFER_SIZE or TORCH_NCCL_TRACE_BUFFER_SIZE was set")  # fmt: skip
        return 1
    for folder, dumps in sorted(restarts.items()):
        print(f"{folder}: ranks {', '.join(map(str, sorted(dumps)))}")
        for line in last_collectives(dumps):
            print(f"  {line}")
        print(f"  {torch_analysis(folder)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
