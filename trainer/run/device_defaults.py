"""What `auto` means once the device is known, and the CUDA math a run allows itself.

On CUDA the defaults are what nanoGPT and torchtitan train with: bf16 autocast (no loss
scaling needed, unlike fp16), the model compiled, and TF32 for what still runs in fp32
(`set_float32_matmul_precision("high")`: matmuls in TF32, about 8x an H100's fp32 rate,
with a 10-bit mantissa; cuDNN's convolutions likewise). On CPU, fp32 and eager: bf16 on CPU
is slow where the CPU lacks AMX, and inductor's C++ compile costs more than a demo's run.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from trainer.config import Config


def for_device(config: Config, device: torch.device) -> Config:
    """`config` with `train.amp` and `train.compile` resolved for `device`."""
    cuda = device.type == "cuda"
    train = config.train
    amp = ("bf16" if cuda else "off") if train.amp == "auto" else train.amp
    compile_mode = ("model" if cuda else "off") if train.compile == "auto" else train.compile
    return dataclasses.replace(config, train=dataclasses.replace(train, amp=amp, compile=compile_mode))


def set_math(config: Config, device: torch.device) -> None:
    """TF32 for fp32 matmuls and convolutions on CUDA, unless `train.tf32=false`; with
    `train.deterministic`, the algorithms that give the same bits every run (a restart's
    steps then repeat the lost ones exactly, on a GPU as on the CPU). cuBLAS reads its
    workspace setting when it first runs, so it is set before any matmul."""
    if config.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    if device.type != "cuda" or not config.train.tf32:
        return
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
