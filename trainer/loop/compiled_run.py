"""`train.compile` in a run: the cache opened and the forward compiled before DDP wraps the
model, the first step in a watchdog phase of its own (the compile happens in it), and the
graphs kept and reported once they exist."""

from __future__ import annotations

import logging
import os
from types import TracebackType

import torch
from torch import nn

from trainer.checkpoint.store import CheckpointStore
from trainer.config import Config, ConfigError
from trainer.distributed import heartbeat as phases
from trainer.distributed.heartbeat import Heartbeat
from trainer.distributed.process_group import DistContext
from trainer.loop.compile_cache import CompileCache, cache_key
from trainer.loop.compiling import compile_in_place, graph_breaks, graphs_compiled
from trainer.telemetry.log import event, plural


def share_compile_workers(local_ranks: int) -> None:
    """Inductor compiles kernels in a pool of worker processes, `min(32, CPUs)` of them per
    process (torch/_inductor/config.py, `decide_compile_threads`): 8 ranks of a node would
    start 256 on its CPUs, each importing torch. The node's CPUs are shared among its ranks
    instead, unless the job sets `TORCHINDUCTOR_COMPILE_THREADS`; one means no pool."""
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        # the CPUs this process may run on (Linux), else all of them (a laptop's macOS)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch._inductor.config.compile_threads = max(1, min(32, cpus // local_ranks))


class CompiledRun:
    """What compiling adds to a run; every method is a no-op with `train.compile=off`."""

    def __init__(
        self,
        config: Config,
        store: CheckpointStore,
        device_name: str,
        context: DistContext,
        heartbeat: Heartbeat,
        log: logging.Logger,
    ) -> None:
        """`store` is the checkpoints'; `device_name` keys the cache."""
        self.mode, self.model_name = config.train.compile, config.model.name
        self.limit_s = config.watchdog.compile_s
        self.heartbeat, self.log, self.is_main = heartbeat, log, context.is_main
        self.local_ranks = context.local_world_size
        shared = config.train.compile_cache == "shared"
        self.cache = CompileCache(
            store, cache_key(config, device_name), shared=shared, writes=context.is_main
        )
        self.found = "off"  # where the cache came from
        self.graphs = 0  # graphs compiled when last settled

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def compile(self, module: nn.Module) -> None:
        """Open the cache, then compile in place (ConfigError for `blocks` without blocks)."""
        if self.on:
            self.found = self.cache.open(self.log)
            share_compile_workers(self.local_ranks)
            compile_in_place(module, self.mode, self.model_name)

    def __enter__(self) -> None:
        """Around each step and validation, where compiles happen: nothing going in."""

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _: TracebackType | None
    ) -> None:
        """A compile that fails (inductor's C++ or Triton, a dynamo error) is one line and
        exit 2, which no restart would change, instead of a traceback per rank."""
        if isinstance(error, torch._dynamo.exc.TorchDynamoException):
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ConfigError(
                "train.compile",
                self.mode,
                f"torch.compile could not compile model.name={self.model_name!r} ({reason}); "
                "set train.compile=off to train it eager",
            ) from None

    def enter_first_step(self) -> None:
        """The step about to run compiles: the watchdog allows `watchdog.compile_s` and names
        the phase `compile`; the first step's end starts the `step` phase as ever."""
        if self.on:
            self.heartbeat.enter(phases.COMPILE, limit_s=self.limit_s)

    def settle(self) -> None:
        """After the first step and each validation: where new graphs were compiled, say so
        once (rank 0) and keep them in the store's archive."""
        if not self.on or graphs_compiled() == self.graphs:
            return
        first, self.graphs = self.graphs == 0, graphs_compiled()
        if first and self.is_main:
            seconds = self.heartbeat.limits.longest.get(phases.COMPILE, 0.0)
            breaks = graph_breaks()
            reasons = "; ".join(f"{reason} ({count}x)" for reason, count in breaks.most_common(3))
            event(
                self.log,
                "compiled",
                f"train.compile={self.mode}: the first step took {seconds:.1f}s with its compile "
                f"(cache: {self.found}), {plural(self.graphs, 'graph')}, "
                f"{plural(breaks.total(), 'graph break')}" + (f": {reasons}" if reasons else ""),
                seconds=round(seconds, 3),
                cache=self.found,
                graphs=self.graphs,
                graph_breaks=breaks.total(),
            )
        self.cache.publish(self.log)

    def wait(self, timeout_s: float) -> None:
        """Let an upload of the cache finish before the process ends (rank 0, at exit)."""
        upload = self.cache.upload
        if upload is not None:
            upload.join(timeout_s)
