"""Under torchrun: exact distributed evaluation of fixed data and models; rank 0 writes JSON.

Sizes are chosen so DistributedSampler must pad (37 and 23 samples over 2 or 3 ranks)."""

import json
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import DataConfig
from trainer.data import eval_loader
from trainer.loop.evaluate import evaluate


def datasets_and_models():
    generator = torch.Generator().manual_seed(0)
    images = torch.utils.data.TensorDataset(
        torch.randn(37, 5, generator=generator), torch.randint(0, 3, (37,), generator=generator)
    )
    tokens = torch.utils.data.TensorDataset(
        torch.randint(0, 7, (23, 4), generator=generator), torch.randint(0, 7, (23, 4), generator=generator)
    )
    torch.manual_seed(1)
    return {
        "classification": (images, nn.Linear(5, 3)),
        "tokens": (tokens, nn.Sequential(nn.Embedding(7, 8), nn.Linear(8, 7))),
    }


def main() -> None:
    dist.init_process_group("gloo")
    results = {}
    for name, (dataset, model) in datasets_and_models().items():
        loader = eval_loader(
            dataset,
            DataConfig(),
            batch_size=4,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            device=torch.device("cpu"),
        )
        results[name] = evaluate(model, loader, torch.device("cpu"), nullcontext())
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as handle:
            json.dump(results, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
