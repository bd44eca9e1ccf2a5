"""`transformer`: a small decoder-only language model that declares its training FLOPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ConfigError, ModelConfig
from trainer.data.base import DataSpec
from trainer.models.base import require


class CausalSelfAttention(nn.Module):
    """Multi-head attention through PyTorch's fused scaled-dot-product kernel."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """Pre-norm residual block: attention, then a 4x MLP."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads, dropout)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DecoderLM(nn.Module):
    """Token and position embeddings, `depth` blocks, a head tied to the token embedding."""

    def __init__(self, vocab: int, seq_len: int, width: int, depth: int, heads: int, dropout: float):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq_len, width)
        self.blocks = nn.Sequential(*(Block(width, heads, dropout) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight
        for embedding in (self.tokens, self.positions):  # small, so initial logits are near uniform
            nn.init.normal_(embedding.weight, std=0.02)
        self.flops_per_sample = self._training_flops(seq_len, width, depth)

    def _training_flops(self, seq_len: int, width: int, depth: int) -> float:
        """Forward+backward FLOPs per sequence: 6 per parameter per token (position
        embeddings are a lookup, not a matmul) plus attention's QK^T and AV, 12*L*d*T per token."""
        matmul_params = sum(p.numel() for p in self.parameters()) - self.positions.weight.numel()
        per_token = 6 * matmul_params + 12 * depth * width * seq_len
        return float(per_token * seq_len)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        return self.head(self.norm(self.blocks(x)))


def build_transformer(config: ModelConfig, spec: DataSpec) -> nn.Module:
    """Sized by `width` (model dim), `depth` (blocks) and `heads`; vocab and length from the data."""
    require(spec, "transformer", "language_modeling", input_rank=1)
    if config.width % config.heads:
        raise ConfigError("model.heads", config.heads, f"must divide model.width={config.width}")
    return DecoderLM(
        spec.num_classes, spec.input_shape[0], config.width, config.depth, config.heads, config.dropout
    )
