"""`train.compile`: the model's forward compiled in place, with DDP wrapped around it.

Where the compile goes. `torch.compile(DDP(model))` lets dynamo's DDPOptimizer split the
graph at DDP's bucket boundaries so that each bucket's all-reduce can start while the
backward pass goes on; the price is a graph break per bucket (more graphs, less fusion,
longer compiles), a compiled wrapper whose keys are `_orig_mod.module.*`, and a
`bucket_cap_mb` below the first parameter that splits nothing. `DDP(compiled)` keeps DDP's
C++ reducer outside the graph: its hooks fire on each parameter's AccumulateGrad as in
eager mode, `no_sync()` is the plain flag it always is, and the bucket sizes are DDP's
alone. Its cost: a whole model compiled (`model`) is one backward node, so every bucket is
ready when it ends and no all-reduce overlaps it; with `blocks` each block's backward ends
on its own and the all-reduces overlap the backward block by block, as torchtitan compiles
its transformer blocks. The two are
measured side by side in `python -m benchmarks.compile` (docs/performance.md, "Compile").

How. The *forward method* is compiled and set on the module itself. `nn.Module.compile()`
compiles `_call_impl` instead, and dynamo skips that frame for torch's own module classes,
so a bare `nn.Sequential` or `nn.TransformerEncoderLayer` "compiled" that way runs eager
(checked: no graph is captured). `torch.compile(module)` would return a wrapper whose
state_dict keys gain `_orig_mod.`. A compiled forward on the module keeps every key as it
was: a checkpoint written compiled loads eager, and the other way round.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from trainer.config import ConfigError

MODES = ("off", "model", "blocks")


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The model's blocks: the largest run of two or more modules of one class, each with
    layers of its own, held in one `nn.ModuleList` or `nn.Sequential` (a transformer's
    layers); none where no container holds such a run."""
    best: list[nn.Module] = []
    for container in module.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = [child for child in container.children() if next(child.children(), None) is not None]
        kind, count = next(iter(Counter(type(child) for child in children).most_common(1)), (None, 0))
        if count >= 2 and count > len(best):
            best = [child for child in children if type(child) is kind]
    return best


def compile_in_place(module: nn.Module, mode: str, model_name: str) -> int:
    """Compile `module`'s forward (`model`) or each block's (`blocks`) in place; returns
    how many forwards were compiled. Nothing runs until the first step: the compile happens
    there. Raises ConfigError for `blocks` on a model without blocks."""
    if mode == "off":
        return 0
    targets = [module] if mode == "model" else repeated_blocks(module)
    if not targets:
        raise ConfigError(
            "train.compile",
            mode,
            f"model.name={model_name!r} has no blocks to compile one by one (a ModuleList or "
            "Sequential holding two or more like modules with layers of their own); use "
            "train.compile=model",
        )
    for target in targets:
        target.forward = torch.compile(target.forward)
    return len(targets)


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def graph_breaks() -> Counter[str]:
    """Why dynamo broke graphs in this process, and how often."""
    return Counter(dict(torch._dynamo.utils.counters["graph_break"]))
