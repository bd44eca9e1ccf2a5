"""`python -m trainer`: check everything, then train. Run by torchrun in each pod or on a laptop."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from trainer.checkpoint import Checkpointer, open_store, rng
from trainer.checkpoint.lease import Lease, job_id
from trainer.checkpoint.manager import LATEST_FILE
from trainer.checkpoint.policy import NotDurable
from trainer.checkpoint.writer_process import writer_lock
from trainer.checkpoint.writer_start import WriterHandle, spawn_writer
from trainer.config import CheckpointConfig, Config, ConfigError, bundled_config_names, dump_yaml, load_config
from trainer.config.argparsing import OneLineParser
from trainer.data import DATASETS, DataSplits, build_data
from trainer.distributed.heartbeat import Heartbeat, heartbeat_dir
from trainer.distributed.node_watch import start_node_watch
from trainer.distributed.preemption import LEASE_LOST, Stopped, StopSignal
from trainer.distributed.process_group import (
    DistContext,
    cuda_available,
    peer_lost,
    process_group,
    read_env,
    select_device,
)
from trainer.distributed.recurrence import Crash, RecurringCrash, check_recurrence
from trainer.distributed.watchdog import start_watchdog
from trainer.loop.engine import Trainer
from trainer.loop.plan import steps_per_epoch
from trainer.loop.probe import probe_plugins
from trainer.models import MODELS, build_model
from trainer.telemetry.lines import first_to_say, write_line
from trainer.telemetry.log import setup_logging
from trainer.telemetry.metrics import prepare_multiprocess_dir, start_metrics

EXIT_CONFIG_ERROR = 2
EXIT_PEER_LOST = 1  # any failure: torchrun restarts the workers while it has restarts left
SECOND_VOICE_S = 0.5  # how long a rank lets its node's first rank say an error they share
# set by `ddp-launch`: a configuration error found inside a worker is written here, so that
# the launcher stops torchrun at once instead of letting it retry what cannot succeed
FATAL_FILE_ENV = "TRAINER_FATAL_FILE"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python -m trainer",
        description="Data-parallel training under torchrun (or alone, as a world of one).",
    )
    parser.add_argument(
        "--config",
        metavar="PATH_OR_NAME",
        help=f"a YAML file or a bundled config ({', '.join(bundled_config_names())}); "
        "default: the embedded defaults (the digits demo)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key in Helm's --set syntax (a.b=c, x={1,2}); repeatable",
    )
    parser.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the config, plug-ins, device and that checkpoint.uri is writable, then exit",
    )
    return parser.parse_args(argv)


def validate(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Config]:
    """Everything that can be checked before a process group: the arguments, the config,
    plug-ins, device, and with `--check` (as `ddp-launch` runs it) a probe write to the
    checkpoint location. Raises ConfigError."""
    args = parse_args(argv)
    config = load_config(args.config, args.overrides)
    check_environment(config)
    return args, config


def check_environment(config: Config) -> None:
    """Checks that need more than the schema: plug-ins import, URI scheme, device and AMP."""
    DATASETS.resolve(config.data.name)
    MODELS.resolve(config.model.name)
    open_store(config.checkpoint)
    device, amp = config.train.device, config.train.amp
    if device == "cuda" and not cuda_available():
        raise ConfigError("train.device", device, "no CUDA device is visible; use auto or cpu")
    if amp == "fp16" and (device == "cpu" or not cuda_available()):
        raise ConfigError("train.amp", amp, "fp16 needs a CUDA device; use bf16 or off on CPU")


def cache_dir(config: CheckpointConfig) -> Path:
    """Node-local folder for downloaded checkpoints, one per checkpoint location."""
    if config.cache_dir:
        return Path(config.cache_dir)
    digest = hashlib.sha256(config.uri.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / "ddp-trainer-cache" / digest


def report(error: ConfigError | RecurringCrash, context: DistContext) -> int:
    """One line on stderr (rank-prefixed off rank 0), once for this node's ranks that fail
    the same way, and the launcher told not to retry. The node's first rank says it,
    unprefixed on rank 0, unless it has not within half a second: the error is another's."""
    prefix = "" if context.is_main else f"[rank {context.rank}] "
    line = f"{prefix}trainer: error: {error}"
    if first_to_say(str(error), defer_s=0 if context.is_node_main else SECOND_VOICE_S):
        write_line(line)  # one write, so ranks sharing a pipe cannot interleave it
    if FATAL_FILE_ENV in os.environ:
        with contextlib.suppress(OSError):
            Path(os.environ[FATAL_FILE_ENV]).write_text(line + "\n")
    return EXIT_CONFIG_ERROR


def lease_lost(config: Config, stop: StopSignal, step: int) -> ConfigError:
    """What a run says that stopped because another run took its checkpoint location: a
    permanent error, since a retry would be refused the lease."""
    return ConfigError(
        "checkpoint.uri",
        config.checkpoint.uri,
        f"another run holds its lease now ({stop.detail}); this run stopped at step {step} "
        "and publishes nothing more",
    )


def refuse_overwrite(config: Config, checkpointer: Checkpointer) -> None:
    """A fresh start must not write over checkpoints another run saved."""
    if config.checkpoint.resume:
        return
    steps = checkpointer.store.steps()  # not only what latest.json names: it may be gone
    if steps or checkpointer.committed_step() is not None:
        newest = max(steps) if steps else checkpointer.committed_step()
        raise ConfigError(
            "checkpoint.resume",
            False,
            f"{config.checkpoint.uri} already holds checkpoints up to step {newest}; "
            "set checkpoint.resume=true or choose another checkpoint.uri",
        )


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
        raise
    finally:
        heartbeat.close()
        for child in (writer, watchdog):
            if child is not None:
                child.stdin.close()  # a no-op for a writer the Trainer has handed its last message


@dataclass
class Prepared:
    """What a run builds before its process group: data, model (tried on one batch), the
    device, store, and rank 0's lineage and lease."""

    splits: DataSplits
    module: torch.nn.Module
    device: torch.device
    checkpointer: Checkpointer
    lineage: str | None = None
    lease: Lease | None = None
    latest_at_start: tuple[bytes, str] | None = None  # latest.json as the lease was taken

    def let_go(self) -> None:
        """Release the lease; a run that published nothing gives it back as it found it."""
        if self.lease is None:
            return
        if self.checkpointer.store.get_versioned(LATEST_FILE) == self.latest_at_start:
            self.lease.give_back()
        else:
            self.lease.release()


def prepare(config: Config, context: DistContext, stop: StopSignal) -> Prepared:
    """Build data and model and try them on one batch, then the store; on rank 0 probe
    the store, take its lease before writing anything, then clean up and find the lineage.
    Raises ConfigError, holding no lease then."""
    rng.seed_everything(config.seed)
    splits = build_data(config.data, config.seed)
    module = build_model(config.model, splits.spec)
    steps_per_epoch(len(splits.train), config.train, context.world_size)
    device = select_device(config.train.device, context)
    probe_plugins(config, splits, module, device)
    checkpointer = Checkpointer(
        open_store(config.checkpoint), config.checkpoint.keep_last, cache_dir(config.checkpoint)
    )
    prepared = Prepared(splits, module, device, checkpointer)
    if not context.is_main:
        return prepared
    checkpointer.store.prepare()
    lease = None
    if config.checkpoint.lease:
        lease = Lease(checkpointer.store, job_id(context.run_id), context.run_id, config.checkpoint.lease_s)
        lease.refuse_if_taken()  # another job's: refused at once, not after the wait below
    # a killed attempt's writer may still be publishing (under the lease it was given) from
    # its staging folders: it finishes before this attempt takes the lease and cleans up
    with writer_lock(checkpointer.cache, config.dist.timeout_s / 2):
        if lease is not None:
            prepared.lease = hold_lease(lease, checkpointer, stop)
        try:
            checkpointer.store.clean_staging(checkpointer.cache)
            refuse_overwrite(config, checkpointer)
            prepared.latest_at_start = checkpointer.store.get_versioned(LATEST_FILE)
            if prepared.lease is not None and prepared.lease.took_over:
                checkpointer.fence_latest()  # the superseded run's late write of it is refused from now on
            prepared.lineage = checkpointer.lineage(fresh=not config.checkpoint.resume)
        except BaseException:
            if prepared.lease is not None:
                prepared.lease.give_back()  # refused before writing: the lease as it was found
            raise
    return prepared


def hold_lease(lease: Lease, checkpointer: Checkpointer, stop: StopSignal) -> Lease:
    """Rank 0's hold on the checkpoint location (ConfigError naming a live owner): every
    commit is fenced by it, and losing it stops the run."""
    lease.acquire()
    checkpointer.fence = lease.fence
    lease.start(on_lost=lambda owner: stop.request(LEASE_LOST, owner))
    return lease


def _train(
    config: Config,
    context: DistContext,
    logger: logging.Logger,
    writer: WriterHandle | None,
    heartbeat: Heartbeat,
) -> int:
    stop = StopSignal()
    try:
        prepared = prepare(config, context, stop)
    except ConfigError as error:
        return report(error, context)
    try:
        return _train_in_group(config, context, logger, writer, heartbeat, stop, prepared)
    finally:
        prepared.let_go()
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
    metrics = start_metrics(config.metrics, context, run_info(config, context), device, logger)
    try:
        with process_group(context, device, config.dist.timeout_s):
            # only now: a SIGTERM while the group forms (a peer that refused to start, and is
            # gone) must end this process at once, and the default action does so where a
            # Python handler would wait for TCPStore's connect loop in C++ to give up
            stop.install()
            node_watch = start_node_watch(context, config.watchdog, heartbeat, logger)
            try:
                trainer = Trainer(
                    config,
                    context,
                    device,
                    prepared.splits,
                    prepared.module,
                    prepared.checkpointer,
                    logger,
                    metrics,
                    stop,
                    heartbeat,
                    prepared.lineage,
                    writer,
                )
                trainer.run()
            except ConfigError as error:
                return report(error, context)
            except Stopped as stopped:  # every rank stopped together: leave together
                if stopped.signum == LEASE_LOST:
                    return report(lease_lost(config, stop, trainer.progress.step), context)
                return stopped.exit_code
            except NotDurable as unsaved:
                return unsaved.exit_code
            finally:
                if node_watch is not None:
                    node_watch.stop()
    except RuntimeError as error:  # DistError is one; outside the group, which a lost peer cannot close
        if (reason := peer_lost(error)) is None:
            raise
        logger.error(
            f"rank {context.rank} lost a peer ({reason}); torchrun restarts the workers "
            "and they resume from the newest snapshot or checkpoint"
        )
        return EXIT_PEER_LOST
    finally:
        metrics.close()
    return 0


def run_info(config: Config, context: DistContext) -> dict[str, str]:
    """Labels of `ddp_run_info`: what ran, where, with what."""
    return {
        "run_id": context.run_id,
        "model": config.model.name,
        "dataset": config.data.name,
        "world_size": str(context.world_size),
        "torch_version": torch.__version__,
        "image": os.environ.get("TRAINER_IMAGE", "none"),
    }


@record
def main(argv: Sequence[str] | None = None) -> int:
    context = read_env()
    try:
        args, config = validate(argv)
        if args.check:
            open_store(config.checkpoint).prepare()
    except ConfigError as error:
        return report(error, context)
    if args.print_config:
        print(dump_yaml(config), end="")
        return 0
    if args.check:
        print(f"trainer: configuration and {config.checkpoint.uri} are usable")
        return 0
    return train(config, context)
