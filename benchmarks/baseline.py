"""What the two baseline loops (bare DDP and Lightning) share with each other and with our
trainer's figures: the same config, data and model, and steady-state samples/s measured
the trainer's way (windows of `--log-every` steps, validation left out of the time)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

from trainer.config import Config, load_config

WARMUP_WINDOWS = 2  # windows left out as warm-up, here and from the trainer's progress lines


def parse_baseline_args(description: str) -> tuple[Config, int]:
    """`--config`, `--set key=value` (the trainer's syntax) and `--log-every`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args()
    return load_config(args.config, args.overrides), args.log_every


class RateMeter:
    """Global samples/s over windows of `every` steps; time inside `paused()` does not count."""

    def __init__(self, every: int, global_batch: int) -> None:
        self.every, self.global_batch = every, global_batch
        self.steps = 0
        self.rates: list[float] = []
        self.window_ends: list[float] = []  # wall-clock (time.time()) ends, for the CPU sampler
        self._window_start = time.perf_counter()
        self._paused = 0.0
        self._pause_start: float | None = None

    def step(self) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            now = time.perf_counter()
            self.rates.append(self.every * self.global_batch / (now - self._window_start - self._paused))
            self.window_ends.append(time.time())
            self._window_start, self._paused = now, 0.0

    def pause(self) -> None:
        self._pause_start = time.perf_counter()

    def resume(self) -> None:
        if self._pause_start is not None:
            self._paused += time.perf_counter() - self._pause_start
            self._pause_start = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def report(self) -> str:
        """One JSON line: the median rate after warm-up, the steps taken, and each window's
        end with its samples (where the benchmark reads the CPU spent in between)."""
        steady = self.rates[WARMUP_WINDOWS:] or self.rates
        return json.dumps(
            {
                "samples_per_second": statistics.median(steady),
                "steps": self.steps,
                "window_ends": self.window_ends,
                "samples_per_window": self.every * self.global_batch,
            }
        )
