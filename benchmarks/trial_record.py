"""What a process or pod fault trial records, and the final state it is held to: shared by
`benchmarks.fault_trials` (process faults) and `benchmarks.pod_trials` (a frozen pod), and
the bounds the node trials share with them."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

DETECTION_BOUND_S, TRAINING_BOUND_S = 10.0, 30.0


@dataclass(frozen=True)
class Trial:
    fault: str
    rank: int
    seen_step: int | None  # the step of rank 0's last line before the fault: completed
    resumed_from: int | None
    origin: str | None
    lost_steps: int | None  # the trainer's own count
    identical: bool
    detected_s: float | None  # fault to the watchdog's line or the kubelet's kill (not for kill)
    training_s: float | None  # fault to the first step after the resume
    false_alarms: int  # hangs reported that were not the fault's
    cold_s: float | None  # launch to the first step, in the same run: what a restart is held to
    warm: bool | None = None  # whether the agent's fork server listened at the fault

    @property
    def seen_lost(self) -> int | None:
        """Steps lost as the harness saw them: at most what was lost."""
        if self.seen_step is None or self.resumed_from is None:
            return None
        return self.seen_step - self.resumed_from

    def passed(self, bound: int) -> bool:
        seen, told = self.seen_lost, self.lost_steps
        timely = self.training_s is not None and self.training_s <= TRAINING_BOUND_S
        if self.fault != "kill":
            timely = timely and self.detected_s is not None and self.detected_s <= DETECTION_BOUND_S
        return (
            self.identical
            and timely
            and self.false_alarms == 0
            and seen is not None
            and told is not None
            and seen <= bound
            and seen <= told <= bound
        )

    def describe(self, index: int) -> str:
        resumed = (
            f"resumed from step {self.resumed_from} ({self.origin}), {self.seen_lost} lost as seen, "
            f"{self.lost_steps} as the trainer counts"
            if self.resumed_from is not None
            else "did not resume"
        )
        timing = "" if self.detected_s is None else f"found in {self.detected_s:.1f}s, "
        timing += "" if self.training_s is None else f"training again after {self.training_s:.1f}s; "
        verdict = "bit-identical" if self.identical else "DIFFERENT"
        alarms = f"; {self.false_alarms} FALSE ALARMS" if self.false_alarms else ""
        what = {"kill": "SIGKILL rank", "stop": "SIGSTOP rank", "freeze": "froze the pod of rank"}[self.fault]
        fault = f"{what} {self.rank} after step {self.seen_step}"
        if self.warm is not None:
            fault += ", its restart " + ("warm" if self.warm else "cold")
        return f"trial {index}: {fault} -> {resumed}; {timing}final state {verdict}{alarms}"


def final_state(folder: Path) -> dict:
    step = json.loads((folder / "latest.json").read_text())["step"]
    return torch.load(folder / f"step-{step}" / "checkpoint.pt", weights_only=True)


def same_state(a: dict, b: dict) -> bool:
    """Weights and optimizer state equal bit for bit, and the same progress."""
    if a["progress"] != b["progress"]:
        return False
    tensors = lambda state: [  # noqa: E731
        *state["model"].values(),
        *(value for slot in state["optimizer"]["state"].values() for value in slot.values()),
    ]
    return all(torch.equal(x, y) for x, y in zip(tensors(a), tensors(b), strict=True))


class Timeline:
    """What the harness reads in rank 0's JSON lines around a fault, on its own clock."""

    def __init__(self, fault_after: int) -> None:
        self.fault_after = fault_after
        self.launched_at = time.monotonic()
        self.first_step_at: float | None = None
        self.fault_at: float | None = None
        self.seen: int | None = None
        self.resumed: dict | None = None
        self.detected_at: float | None = None
        self.training_at: float | None = None
        self.hangs = 0

    def due(self, record: dict) -> bool:
        """Whether this line is the one to apply the fault after."""
        progress = record.get("event") == "progress"
        return self.fault_at is None and progress and record["step"] >= self.fault_after

    def faulted(self, step: int) -> None:
        self.fault_at, self.seen = time.monotonic(), step

    def read(self, record: dict) -> None:
        event = record.get("event")
        if event == "hang":
            self.hangs += 1
            self.detected_at = self.detected_at or time.monotonic()
        elif event == "plan" and record.get("resumed_from") is not None:
            self.resumed = record
        elif event == "progress" and self.first_step_at is None:
            self.first_step_at = time.monotonic()
        elif event == "progress" and self.resumed is not None and self.training_at is None:
            self.training_at = time.monotonic()

    def since_fault(self, at: float | None) -> float | None:
        return None if at is None or self.fault_at is None else at - self.fault_at

    @property
    def cold_s(self) -> float | None:
        return None if self.first_step_at is None else self.first_step_at - self.launched_at
