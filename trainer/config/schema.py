"""The run's configuration as typed sections: dataclasses validated by pydantic, so every bad
value is caught before any process group, file or device is touched (`loading` reads and
checks them). Defaults are the bundled `digits` demo.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

PositiveInt = Annotated[int, Field(strict=True, gt=0)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Fraction = Annotated[float, Field(gt=0, lt=1)]
_SECTION = ConfigDict(extra="forbid")


class ConfigError(ValueError):
    """A bad configuration value: names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r}: {allowed}")

    def __reduce__(self) -> tuple[type, tuple[str, Any, str]]:
        """Pickled as its three parts: rank 0 broadcasts a resume error to every rank, and
        the default (the message alone) cannot be unpickled by this __init__."""
        return type(self), (self.key, self.value, self.allowed)


def did_you_mean(word: str, choices: Mapping[str, str]) -> str:
    """`did you mean SHOWN? ` for the name in `choices` (name -> how to show it) closest to
    a mistyped `word`, else ''."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"did you mean {choices[close[0]]}? " if close else ""


@dataclass(config=_SECTION)
class SyntheticConfig:
    """Random data of a chosen shape, for throughput work without I/O."""

    kind: Literal["images", "tokens"] = "images"
    num_samples: PositiveInt = 4096
    channels: PositiveInt = 1
    image_size: PositiveInt = 28
    num_classes: PositiveInt = 10
    seq_len: PositiveInt = 128
    vocab_size: PositiveInt = 256


@dataclass(config=_SECTION)
class ShardsConfig:
    """`data.name=shards`: how shards are read (`trainer.data.shards`). An epoch shuffles the
    shards, then the samples within each run of `block` shards; the next `prefetch` shards
    a rank will need are fetched ahead by as many threads; downloaded shards stay in a
    node-local folder (`cache_dir`, empty: one under the temporary directory) of at most
    `cache_mb`, which the node's ranks share."""

    block: PositiveInt = 4
    prefetch: PositiveInt = 4
    cache_dir: str = ""
    cache_mb: PositiveInt = 4096


@dataclass(config=_SECTION)
class DataConfig:
    """Which dataset, how it is split and how it is loaded; `on_change`: what a resume does
    when the checkpoint was trained on other data (`trainer.data.identity`): `refuse` to go
    on, or `restart_epoch`, the interrupted epoch again from its start on this data."""

    name: str = "digits"
    path: str = ""
    val_fraction: Fraction = 0.15
    test_fraction: Fraction = 0.15
    split_seed: NonNegativeInt = 0
    num_workers: NonNegativeInt = 0
    pin_memory: bool = True
    persistent_workers: bool = True
    prefetch_factor: PositiveInt = 2
    synthetic: SyntheticConfig = dataclasses.field(default_factory=SyntheticConfig)
    shards: ShardsConfig = dataclasses.field(default_factory=ShardsConfig)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    on_change: Literal["refuse", "restart_epoch"] = "refuse"


@dataclass(config=_SECTION)
class ModelConfig:
    """Which model; `width`, `depth` and `heads` mean channels, layers and attention heads."""

    name: str = "cnn"
    width: PositiveInt = 32
    depth: PositiveInt = 2
    heads: PositiveInt = 4
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.1
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(config=_SECTION)
class EarlyStoppingConfig:
    """Stop when the validation metric has not improved for `patience` epochs (0 = never)."""

    metric: Literal["val_loss", "val_accuracy"] = "val_loss"
    patience: NonNegativeInt = 0
    min_delta: NonNegativeFloat = 0.0


@dataclass(config=_SECTION)
class TrainConfig:
    """The loop: batch per rank, length, precision, compilation and clipping.

    `auto` means what the device runs fastest with: `amp` bf16 autocast on CUDA, off (fp32)
    on CPU; `compile` the whole model on CUDA, off on CPU (`trainer.loop.compiling`).
    `tf32` lets fp32 matmuls and convolutions on CUDA use TF32 (matmul precision "high");
    `deterministic` asks torch for algorithms that give the same bits every run (slower on
    CUDA: no atomics in an embedding's backward, for one).
    `compile_cache` `shared` keeps the compiled graphs beside the checkpoints too, so that a
    new pod does not compile again; `local` only in the node's own cache folder."""

    epochs: PositiveInt = 10
    max_steps: NonNegativeInt = 0
    batch_size: PositiveInt = 32
    eval_batch_size: PositiveInt = 256
    grad_accum_steps: PositiveInt = 1
    amp: Literal["auto", "off", "bf16", "fp16"] = "auto"
    tf32: bool = True
    deterministic: bool = False
    compile: Literal["auto", "off", "model", "blocks"] = "auto"
    compile_cache: Literal["shared", "local"] = "shared"
    clip_grad_norm: NonNegativeFloat = 1.0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    early_stopping: EarlyStoppingConfig = dataclasses.field(default_factory=EarlyStoppingConfig)


@dataclass(config=_SECTION)
class OptimConfig:
    """Optimizer and LR schedule; `lr` is the LR at `reference_batch_size` global samples."""

    name: Literal["adamw", "sgd"] = "adamw"
    lr: PositiveFloat = 2e-3
    lr_scaling: Literal["none", "linear", "sqrt"] = "linear"
    reference_batch_size: PositiveInt = 64
    weight_decay: NonNegativeFloat = 0.01
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    betas: tuple[Fraction, Fraction] = (0.9, 0.999)
    warmup_steps: NonNegativeInt = 20
    schedule: Literal["cosine", "step", "constant"] = "cosine"
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0
    step_every: PositiveInt = 1000
    step_gamma: Annotated[float, Field(gt=0, le=1)] = 0.1


@dataclass(config=_SECTION)
class CheckpointConfig:
    """Where checkpoints go (`uri`; empty: `checkpoints/<config>-<model>`, the config's
    name or `defaults`), how often, how many stay, and whether a start resumes.

    With `async_save` the state is copied to shared host memory at the step boundary and a
    writer process writes it: a save waits at most `save_wait_s` for the writer to have
    taken the state before (else it is skipped), never for an upload (a checkpoint staged
    while another uploads waits, and a newer one replaces it); a write is tried `attempts`
    times; exits wait up to `drain_timeout_s` for the last one. A writer with work that is
    silent for 5 times the longest gap between its reports, at least `writer_floor_s` (or a
    fixed `writer_timeout_s`), is replaced. Every
    `snapshot_every_steps` steps (0: never; auto: as often as keeps their pause under 0.5 %
    of training time, at least every 5 steps apart) each node's first rank also keeps a
    snapshot in the node-local `snapshot_dir` (memory-backed /dev/shm by default), from
    which a restart resumes when it is newer than the store's checkpoint. `cache_dir` is the node-local
    folder for downloaded checkpoints (default: the system temp dir). `s3_checksum` is what
    S3 verifies per part on upload; the manifest's sha256 covers the whole object end to
    end whichever is chosen (SHA256 on the wire costs ~20% throughput). With `lease`, rank 0
    holds the location's lease (`lease.json`, renewed every `lease_s`), so that a second job
    on the same location is refused (`trainer.checkpoint.lease`)."""

    uri: str = ""
    every_steps: NonNegativeInt = 50
    keep_last: NonNegativeInt = 3
    resume: bool = True
    async_save: bool = True
    attempts: PositiveInt = 3
    drain_timeout_s: PositiveFloat = 600.0
    save_wait_s: PositiveFloat = 5.0
    writer_timeout_s: Literal["auto"] | PositiveFloat = "auto"
    writer_floor_s: Annotated[float, Field(ge=5)] = 30.0
    snapshot_every_steps: Literal["auto"] | NonNegativeInt = "auto"
    snapshot_dir: str = "/dev/shm/ddp-trainer-snapshots"
    cache_dir: str = ""
    lease: bool = True
    lease_s: Annotated[float, Field(ge=1)] = 10.0
    multipart_chunk_mb: Annotated[int, Field(strict=True, ge=5)] = 8
    s3_checksum: Literal["CRC32", "SHA256"] = "CRC32"
    max_concurrency: PositiveInt = 10


@dataclass(config=_SECTION)
class MetricsConfig:
    """Prometheus metrics: local rank 0 serves every local rank's series on `port` (0 = off).

    `peak_flops_per_device` overrides the device table used for MFU (needed on CPU);
    `history_file`, if set, is where rank 0 appends one JSON line per progress log, the
    input of the run report. Where Kubeflow Trainer injects its status server (a TrainJob,
    feature gate `TrainJobStatus`), rank 0 posts its progress, ETA and loss there at most
    every `status_post_every_s` (0: never), into the TrainJob's `status.trainerStatus`."""

    port: Annotated[int, Field(strict=True, ge=0, le=65535)] = 9401
    address: str = "127.0.0.1"
    multiproc_dir: str = ""
    peak_flops_per_device: NonNegativeFloat = 0.0
    history_file: str = ""
    status_post_every_s: NonNegativeFloat = 10.0


@dataclass(config=_SECTION)
class DistConfig:
    """The process group. `timeout_s` bounds every collective (torch's defaults are 10 min for
    NCCL and 30 for gloo); phases where rank 0 works alone while its peers wait in one
    (resume downloads, waiting for a checkpoint write) are bounded at half of it."""

    timeout_s: Annotated[float, Field(ge=10)] = 1200.0


@dataclass(config=_SECTION)
class DdpConfig:
    """What DistributedDataParallel sends between ranks each step, and how (`trainer.loop.ddp`).

    `comm_hook` compresses the gradients before the all-reduce: `bf16` and `fp16` halve the
    bytes (fp16 keeps more mantissa, bf16 more range); `powersgd` sends a rank-`powersgd_rank`
    approximation of each gradient matrix, with plain all-reduces for its first
    `powersgd_start_step` steps and error feedback after, which is part of the training
    state. `bucket_cap_mb` sizes the all-reduces that overlap the backward pass;
    `static_graph` and `gradient_as_bucket_view` are DDP's own switches; the gradients as
    views of the buckets save a copy and a model's worth of memory, and train bit for bit
    as without (tests/test_runs.py, the accumulation test)."""

    comm_hook: Literal["none", "bf16", "fp16", "powersgd"] = "none"
    powersgd_rank: PositiveInt = 1
    powersgd_start_step: Annotated[int, Field(strict=True, ge=2)] = 100
    bucket_cap_mb: PositiveFloat = 25.0
    static_graph: bool = False
    gradient_as_bucket_view: bool = True


@dataclass(config=_SECTION)
class WatchdogConfig:
    """Finding a rank that stops making progress (`trainer.distributed.watchdog`).

    Each phase (a step, validation, a checkpoint's blocking part, ...) may take `multiple`
    times its longest recent duration, at least `floor_s`; start-up, the resume and a
    phase not yet seen may take `first_s`, and the first compiled step `compile_s`. A
    number for `timeout_s` fixes every seen phase's limit instead. A rank over its limit
    is named, its stack printed, and it is killed, so that torchrun restarts the group
    from the newest snapshot.

    Across nodes (`nodes`, `trainer.distributed.node_watch`), each node's first rank
    publishes its progress every `node_poll_s` and reads the others'; a node silent for
    `node_multiple` times the longest gap seen between its publishes, at least
    `node_floor_s` (or a fixed `node_timeout_s`), is lost, and the survivors leave the
    group so that torchrun goes on without it."""

    enabled: bool = True
    timeout_s: Literal["auto"] | PositiveFloat = "auto"
    multiple: Annotated[float, Field(ge=1)] = 5.0
    floor_s: PositiveFloat = 5.0
    first_s: PositiveFloat = 600.0
    compile_s: PositiveFloat = 1800.0
    poll_s: Annotated[float, Field(gt=0, le=10)] = 0.5
    nodes: bool = True
    node_timeout_s: Literal["auto"] | PositiveFloat = "auto"
    node_multiple: Annotated[float, Field(ge=1)] = 3.0  # a publish gap is a poll, not a phase
    node_floor_s: Annotated[float, Field(ge=2)] = 5.0
    node_poll_s: Annotated[float, Field(gt=0, le=5)] = 1.0


@dataclass(config=_SECTION)
class LogConfig:
    """Rank-0 progress log: text for humans or JSON lines for machines."""

    format: Literal["text", "json"] = "text"
    every_steps: PositiveInt = 10


@dataclass(config=_SECTION)
class Config:
    """The whole run."""

    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    dist: DistConfig = dataclasses.field(default_factory=DistConfig)
    ddp: DdpConfig = dataclasses.field(default_factory=DdpConfig)
    watchdog: WatchdogConfig = dataclasses.field(default_factory=WatchdogConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    seed: NonNegativeInt = 0
