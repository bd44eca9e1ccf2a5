"""DistributedDataParallel as `ddp.*` asks: its buckets, its graph switches, and a
communication hook that sends fewer bytes per step than fp32 gradients.

`bf16` and `fp16` cast each bucket before its all-reduce and back after (torch's own
hooks). `powersgd` is torch's PowerSGD with error feedback and warm start: its state (the
step count, the Q matrices, the random generator that seeds them, and each rank's error
feedback) is training state, saved in checkpoints and snapshots by `PowerSGDCheckpoint`.
That state is kept per DDP bucket, so with PowerSGD the buckets must be the same at every
start: DDP builds them once and rebuilds them by gradient order after the first step unless
`find_unused_parameters` is set (torch/nn/parallel/distributed.py,
`compute_bucket_size_limits`: all parameters in one bucket until the rebuild; the rebuild in
`_pre_forward`), so PowerSGD runs with it set, which also keeps DDP's first-step layout.

torch's PowerSGD hook issues a bucket's second and third all-reduce from the callback of the
one before, on the thread that completed it. On the job's process group these raced with
the trainer's own collectives (the stop agreement in flight during the next step): two
ranks issued them in different orders, which gloo reports as "Received data size doesn't
match expected size" and aborts (seen here on the digits CNN; pytorch/pytorch#58467 found
PowerSGD failing on gloo too). So PowerSGD gets a process group of its own, and one bucket
(`bucket_cap_mb_list`, sized to the model) so that its chains cannot interleave with each
other either: its bytes are few, so little overlap with the backward pass is lost.

No `from __future__ import annotations` here: `register_comm_hook` compares a hook's
annotations with the classes themselves.
"""

import inspect
import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from trainer.config import ConfigError, DdpConfig


def bf16_compress(
    process_group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16 compression under a name of its own: DDP refuses a hook *named*
    `bf16_compress_hook` unless CUDA and NCCL 2.10+ are there (register_comm_hook,
    torch/nn/parallel/distributed.py:2485-2504 in torch 2.13), though gloo all-reduces bf16
    too; the hook itself is the same cast, all-reduce and cast back."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


HOOKS = {"bf16": bf16_compress, "fp16": default_hooks.fp16_compress_hook}


def check_powersgd(config: DdpConfig) -> None:
    """PowerSGD's one bucket needs DDP's `bucket_cap_mb_list`, which torch 2.13 has and
    earlier ones may lack (the lent GPU machine's 2.11): refused there in one line."""
    if (
        config.comm_hook == "powersgd"
        and "bucket_cap_mb_list" not in inspect.signature(DistributedDataParallel).parameters
    ):
        raise ConfigError(
            "ddp.comm_hook",
            config.comm_hook,
            f"this torch ({torch.__version__}) has no DDP bucket_cap_mb_list, which PowerSGD's single "
            "bucket needs; use bf16, fp16 or none, or torch 2.13",
        )


def wrap(
    module: nn.Module, device: torch.device, config: DdpConfig, powersgd: "PowerSGDCheckpoint | None" = None
) -> DistributedDataParallel:
    """The module in DDP with `config`'s buckets, switches and hook; `powersgd` holds the
    PowerSGD state when the hook is `powersgd`."""
    powersgd_on = config.comm_hook == "powersgd"
    buckets = {}
    if powersgd_on:  # a bucket the size of the model (see the module's docstring)
        model_mb = sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20
        buckets = {"bucket_cap_mb_list": [math.ceil(model_mb) + 1]}
    model = DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=config.bucket_cap_mb,
        static_graph=config.static_graph,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
        find_unused_parameters=powersgd_on,
        **buckets,
    )
    if powersgd_on:
        model.register_comm_hook(powersgd.state, powerSGD_hook.powerSGD_hook)
    elif config.comm_hook in HOOKS:
        model.register_comm_hook(None, HOOKS[config.comm_hook])
    return model


class PowerSGDCheckpoint:
    """PowerSGD's state, as plain tensors a weights-only load reads back. What every rank
    holds alike (step count, Q matrices, generator) is saved once; each rank's error
    feedback is saved for every rank (`local_errors`, gathered by the caller), so that a
    resume at the same world size continues bit for bit."""

    def __init__(self, config: DdpConfig, seed: int) -> None:
        self.state = powerSGD_hook.PowerSGDState(
            process_group=dist.new_group(),  # a collective: every rank makes it at start-up
            matrix_approximation_rank=config.powersgd_rank,
            start_powerSGD_iter=config.powersgd_start_step,
            random_seed=seed,
        )

    @classmethod
    def of(cls, config: DdpConfig, seed: int) -> "PowerSGDCheckpoint | None":
        """The state to keep where the hook is PowerSGD; None for every other hook."""
        return cls(config, seed) if config.comm_hook == "powersgd" else None

    def local_errors(self) -> torch.Tensor:
        """This rank's error feedback, its buckets' in order, as one flat tensor (empty
        before PowerSGD starts): the same size on every rank."""
        errors = [self.state.error_dict[index].flatten() for index in sorted(self.state.error_dict)]
        return torch.cat(errors) if errors else torch.zeros(0)

    def tree(self, errors: torch.Tensor) -> dict[str, Any]:
        """The saved form; `errors` is every rank's `local_errors`, `[world_size, numel]`."""
        generator = self.state.rng.get_state()
        return {
            "iter": self.state.iter,
            # P's and Q's presence marks a bucket as warm (powerSGD_hook reuses Q, else draws
            # a new one from the generator); both are all-reduced, so alike on every rank
            "p": {index: tensor.cpu() for index, tensor in self.state.p_memory_dict.items()},
            "q": {index: tensor.cpu() for index, tensor in self.state.q_memory_dict.items()},
            "error_shapes": {index: list(t.shape) for index, t in sorted(self.state.error_dict.items())},
            "errors": errors,
            "rng_keys": torch.from_numpy(generator[1].astype(np.int64)),
            "rng_pos": int(generator[2]),
            "rng_gauss": [int(generator[3]), float(generator[4])],
        }

    def load(self, tree: dict[str, Any], rank: int | None, device: torch.device) -> None:
        """Restore the shared state and, where `rank` is given (the same world size as
        saved), that rank's error feedback; otherwise the error feedback starts at zero."""
        state = self.state
        state.iter = tree["iter"]
        state.p_memory_dict = {index: p.to(device) for index, p in tree["p"].items()}
        state.q_memory_dict = {index: q.to(device) for index, q in tree["q"].items()}
        keys = tree["rng_keys"].numpy().astype(np.uint32)
        state.rng.set_state(("MT19937", keys, tree["rng_pos"], *tree["rng_gauss"]))
        state.error_dict = {}
        if rank is None:
            return
        offset, errors = 0, tree["errors"][rank]
        for index, shape in tree["error_shapes"].items():
            numel = int(np.prod(shape))
            state.error_dict[index] = errors[offset : offset + numel].view(shape).clone().to(device)
            offset += numel
