"""A run's processes and threads around the loop, started and ended in order: the
checkpoint writer (spawned first, so its start-up overlaps the run's), the heartbeat, the
node's watchdog, what is built before the process group (data, model tried on one batch,
device, store, rank 0's hold on the location), the metrics server, the process group and
the node watch; and how each way the loop ends becomes the process's exit code."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.checkpoint import rng
from trainer.checkpoint.location import open_store
from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.writer_start import WriterHandle, spawn_writer
from trainer.config import CheckpointConfig, Config, ConfigError
from trainer.config.plugin_errors import PluginIOError
from trainer.data import DataSplits, build_data
from trainer.data.identity import DataIdentity, identify
from trainer.distributed.flight_recorder import start_dumps
from trainer.distributed.heartbeat import FINISH, Heartbeat, heartbeat_dir, remove_generation
from trainer.distributed.leaving import mark_left
from trainer.distributed.node_watch import start_node_watch
from trainer.distributed.process_group import DistContext, peer_lost, process_group, select_device
from trainer.distributed.recurrence import Crash, RecurringCrash, check_recurrence
from trainer.distributed.watchdog import start_watchdog
from trainer.loop.checkpoint_policy import NotDurable
from trainer.loop.ddp import check_powersgd
from trainer.loop.engine import Trainer
from trainer.loop.plan import steps_per_epoch
from trainer.loop.preemption import LEASE_LOST, Stopped, StopSignal
from trainer.loop.probe import probe_plugins
from trainer.models import build_model
from trainer.run.device_defaults import for_device, set_math
from trainer.run.ownership import Ownership, lease_lost, take_location
from trainer.run.startup import EXIT_PEER_LOST, report, say
from trainer.telemetry.job_status import CLOSE_WAIT_S, with_job_status
from trainer.telemetry.log import setup_logging
from trainer.telemetry.metrics import Metrics, prepare_multiprocess_dir, start_metrics
from trainer.telemetry.progress import summary_line
from trainer.telemetry.startup import STARTUP
from trainer.termination_message import conclude


def train(config: Config, context: DistContext) -> int:
    """Build data, model and store (failing fast), then train inside the process group. A
    rank that writes checkpoints or snapshots spawns its writer process first, so that the
    writer's start-up overlaps the run's; under torchrun the node's first rank starts the
    node's watchdog, and every rank keeps its heartbeat record from here on."""
    logger = setup_logging(config.log, context)
    writes = context.is_main or (context.is_node_main and config.checkpoint.snapshot_every_steps != 0)
    writer = spawn_writer() if config.checkpoint.async_save and writes else None
    run = context.run_id if context.launched_by_torchrun else f"local-{os.getpid()}"
    folder = heartbeat_dir(run, context.restart_count, context.node_rank)
    heartbeat = Heartbeat(folder, context.rank, config.watchdog)
    watchdog = None
    if config.watchdog.enabled and context.launched_by_torchrun and context.is_node_main:
        watchdog = start_watchdog(
            heartbeat.folder, config.log.format, config.watchdog.poll_s, config.watchdog.first_s
        )
    try:
        return _train(config, context, logger, writer, heartbeat)
    except Exception as error:  # the traceback is torchrun's to show, unless it has come before
        try:
            check_recurrence(context.rank, Crash.of(error, heartbeat.step, heartbeat.phase_name))
        except RecurringCrash as recurring:
            return report(recurring, context)
        if isinstance(error, PluginIOError):  # one line; the job's restarts retry it
            say(error, context)
            return EXIT_PEER_LOST
        raise
    finally:
        heartbeat.close()
        if not context.launched_by_torchrun:  # no node watchdog to clear up after it
            remove_generation(folder)
        for child in (writer, watchdog):
            if child is not None:
                child.stdin.close()  # a no-op for a writer the Trainer has handed its last message


@dataclass
class Prepared:
    """What a run builds before its process group: data and its identity, model (tried on
    one batch), the device, the store, and rank 0's hold on the location."""

    splits: DataSplits
    data: DataIdentity
    module: torch.nn.Module
    device: torch.device
    ownership: Ownership


def prepare(config: Config, context: DistContext, stop: StopSignal, device: torch.device) -> Prepared:
    """Build data and model and try them on one batch, then the store; rank 0 then takes
    the location (trainer.run.ownership). Raises ConfigError, holding no lease then."""
    check_powersgd(config.ddp)
    splits, module = build_and_probe(config, context.world_size, device)
    data = identify(config.data, splits)
    checkpointer = Checkpointer(
        open_store(config.checkpoint), config.checkpoint.keep_last, cache_dir(config.checkpoint)
    )
    if not context.is_main:
        return Prepared(splits, data, module, device, Ownership(checkpointer))
    ownership = take_location(config, context.run_id, checkpointer, stop, config.dist.timeout_s / 2)
    return Prepared(splits, data, module, device, ownership)


def build_and_probe(
    config: Config, world_size: int, device: torch.device
) -> tuple[DataSplits, torch.nn.Module]:
    """Data and model built and one batch through them, as every rank does before it trains
    and `--check` does where the data is: missing files, a model that does not fit its data
    and too few samples for the world are one ConfigError here. Seeds the RNG."""
    rng.seed_everything(config.seed)
    splits = build_data(config.data, config.seed)
    module = build_model(config.model, splits.spec)
    steps_per_epoch(len(splits.train), config.train, world_size)
    probe_plugins(config, splits, module, device)
    return splits, module


def cache_dir(config: CheckpointConfig) -> Path:
    """Node-local folder for downloaded checkpoints, one per checkpoint location."""
    if config.cache_dir:
        return Path(config.cache_dir)
    digest = hashlib.sha256(config.uri.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / "ddp-trainer-cache" / digest


def _train(
    config: Config,
    context: DistContext,
    logger: logging.Logger,
    writer: WriterHandle | None,
    heartbeat: Heartbeat,
) -> int:
    stop = StopSignal()
    device = select_device(config.train.device, context)
    config = for_device(config, device)
    set_math(config, device)
    try:
        prepared = prepare(config, context, stop, device)
    except ConfigError as error:
        return report(error, context)
    STARTUP.mark("data and model")
    try:
        return _train_in_group(config, context, logger, writer, heartbeat, stop, prepared)
    finally:
        prepared.ownership.let_go()
        stop.uninstall()  # the run is over: a signal now ends the process at once, quietly


def _train_in_group(
    config: Config,
    context: DistContext,
    logger: logging.Logger,
    writer: WriterHandle | None,
    heartbeat: Heartbeat,
    stop: StopSignal,
    prepared: Prepared,
) -> int:
    rng.seed_everything(config.seed * 65537 + context.rank + 1)  # distinct dropout per rank
    device = prepared.device
    prepare_multiprocess_dir(config.metrics, context)
    metrics = with_job_status(
        start_metrics(config.metrics, context, run_info(config, context), device, logger),
        context.is_main,
        config.metrics.status_post_every_s,
        logger,
    )
    try:
        with process_group(context, device, config.dist.timeout_s):
            STARTUP.mark("process group")
            # only now: a SIGTERM while the group forms (a peer that refused to start, and is
            # gone) must end this process at once, and the default action does so where a
            # Python handler would wait for TCPStore's connect loop in C++ to give up
            stop.install()
            node_watch = start_node_watch(context, config.watchdog, heartbeat, logger)
            store = prepared.ownership.checkpointer.store
            dumps = start_dumps(heartbeat.folder, context, store, logger)
            try:
                return _run_loop(config, context, logger, writer, heartbeat, stop, prepared, metrics)
            finally:
                for watcher in (node_watch, dumps):
                    if watcher is not None:
                        watcher.stop()
    except RuntimeError as error:  # DistError is one; outside the group, which a lost peer cannot close
        if (reason := peer_lost(error)) is None:
            raise
        logger.error(
            f"rank {context.rank} lost a peer ({reason}); torchrun restarts the workers "
            "and they resume from the newest snapshot or checkpoint"
        )
        mark_left(f"rank {context.rank} lost a peer")
        return EXIT_PEER_LOST
    finally:
        with heartbeat.phase(FINISH, limit_s=CLOSE_WAIT_S + 5):  # the last status post, at most
            metrics.close()
    return 0


def _run_loop(
    config: Config,
    context: DistContext,
    logger: logging.Logger,
    writer: WriterHandle | None,
    heartbeat: Heartbeat,
    stop: StopSignal,
    prepared: Prepared,
    metrics: Metrics,
) -> int:
    """The loop and its exit code, in a frame of its own: when it returns, nothing holds the
    DDP model, and the process group's teardown frees its reducer while the group is still
    registered. Freed after `destroy_process_group` instead (a caller's local), the reducer
    held the group's last reference, and its destructor joined gloo's threads on the main
    thread, holding the GIL that a gloo thread dropping a tensor waited for: a deadlock."""
    try:
        trainer = Trainer(
            config,
            context,
            prepared.device,
            prepared.splits,
            prepared.data,
            prepared.module,
            prepared.ownership.checkpointer,
            logger,
            metrics,
            stop,
            heartbeat,
            prepared.ownership.lineage,
            writer,
        )
        summary = trainer.run()
    except ConfigError as error:
        return report(error, context)
    except Stopped as stopped:  # every rank stopped together: leave together
        if stopped.signum == LEASE_LOST:
            return report(lease_lost(config, stop, trainer.progress.step), context)
        return stopped.exit_code
    except NotDurable as unsaved:
        return unsaved.exit_code
    if context.is_main:
        conclude(summary_line(summary))
    return 0


def run_info(config: Config, context: DistContext) -> dict[str, str]:
    """Labels of `ddp_run_info`: what ran, where, with what. Not the rendezvous id: whoever
    reads the metrics would learn the key of torchrun's state in the rendezvous store."""
    return {
        "model": config.model.name,
        "dataset": config.data.name,
        "world_size": str(context.world_size),
        "torch_version": torch.__version__,
        "image": os.environ.get("TRAINER_IMAGE", "none"),
    }
