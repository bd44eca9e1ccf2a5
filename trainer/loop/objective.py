"""Cross-entropy for classification and next-token prediction, in one form for both."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def training_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every predicted element (a sample, or a token of a sequence).
    `flatten` returns 2-D logits and 1-D targets themselves, adding no autograd node."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def per_sample_terms(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed loss, correct predictions and predicted elements for each sample, so that
    evaluation can drop padded samples and still add up exactly across ranks."""
    losses = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none"
    ).view(targets.shape)
    correct = (logits.argmax(-1) == targets).to(torch.float64)
    if targets.dim() == 1:
        return losses.double(), correct, torch.ones_like(correct)
    per_sample = targets[0].numel()
    flat = (targets.shape[0], -1)
    counts = torch.full((targets.shape[0],), per_sample, dtype=torch.float64, device=targets.device)
    return losses.double().view(flat).sum(1), correct.view(flat).sum(1), counts
