"""Tiny transformers written in plain torch (no downloads): GPT-2-shaped and ViT-tiny-shaped.

The shapes follow GPT-2 small (pre-norm blocks, causal self-attention, a 4x MLP with tanh GELU,
learned positions added to token embeddings, a final LayerNorm and a language-model head) and
ViT-tiny (patch embedding, learned positions, pre-norm ``nn.TransformerEncoderLayer`` blocks
with GELU, a final LayerNorm, mean pooling over patches, a classifier head) at test sizes.
"""

from __future__ import annotations

import torch
from torch import nn


class GPT2Block(nn.Module):
    """``x + attn(ln_1(x))`` (causal), then ``x + mlp(ln_2(x))``, as in GPT-2."""

    def __init__(self, width: int, heads: int, context: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.register_buffer("mask", torch.ones(context, context, dtype=torch.bool).triu(1))
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width)
        )

    def forward(self, x):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TinyGPT2(nn.Module):
    """Token ids ``[B, context]`` to next-token logits ``[B, context, vocab]``."""

    def __init__(self, vocab=11, context=6, width=8, heads=2, layers=2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Parameter(0.1 * torch.randn(context, width))
        self.h = nn.Sequential(*(GPT2Block(width, heads, context) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe
        return self.lm_head(self.ln_f(self.h(x)))


class TinyViT(nn.Module):
    """Patch vectors ``[B, patches, patch_dim]`` to class logits ``[B, classes]``."""

    def __init__(self, patches=4, patch_dim=16, width=8, heads=2, layers=2, classes=3) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(patch_dim, width)
        self.pos_embed = nn.Parameter(0.1 * torch.randn(1, patches, width))
        self.blocks = nn.Sequential(
            *(
                nn.TransformerEncoderLayer(
                    width, heads, 4 * width, dropout=0.0, activation="gelu",
                    batch_first=True, norm_first=True,
                )
                for _ in range(layers)
            )
        )  # fmt: skip
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.patch_embed(x) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x.mean(dim=1))


def randomize_norms(module: nn.Module) -> nn.Module:
    """Non-trivial LayerNorm gains and shifts (torch initialises them to 1 and 0)."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)
    return module
