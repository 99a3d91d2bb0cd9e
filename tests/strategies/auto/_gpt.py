"""A small GPT-2-like LightningModule made of ``torch.nn`` layers alone, trained with AdamW: no download."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm causal self-attention and a 4x MLP, as in GPT-2."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT2(L.LightningModule):
    """Token and position embeddings, ``layers`` blocks, a final norm and a head tied to the embedding.

    With the defaults: 218,496 float32 parameters (853.5 KiB), each block 195.25 KiB.
    """

    def __init__(self, vocab: int = 256, context: int = 16, width: int = 64, layers: int = 4, heads: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = batch[0] if isinstance(batch, (list, tuple)) else batch
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)


def token_batch(rows: int = 2, context: int = 16, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, context + 1), generator=torch.Generator().manual_seed(0))
