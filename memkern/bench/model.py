"""The small GPT of ``memkern bench``, in plain torch.nn (GPT-2's layout: pre-norm blocks of
causal self-attention and a GELU MLP, learned positions, tied input/output embeddings).

It is written the way users write models, so that ``memkern.patch`` converts it like theirs.
``forward(idx, targets)`` returns the mean next-token loss; when the head is a
:class:`memkern.nn.LinearCrossEntropy` the logits are never materialised.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from memkern.bench.data import VOCAB


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    layers: int
    width: int
    heads: int
    seq: int = 256
    vocab: int = VOCAB
    dropout: float = 0.0


SIZES = {
    "tiny": GPTConfig(layers=2, width=64, heads=2),
    "small": GPTConfig(layers=4, width=256, heads=4),
    "medium": GPTConfig(layers=6, width=384, heads=6),
    "gpt2-small": GPTConfig(layers=12, width=768, heads=12, seq=1024, vocab=50304),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * cfg.width, cfg.width), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.width % cfg.heads:
            raise ValueError(f"width {cfg.width} is not a multiple of heads {cfg.heads}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.width)
        self.wpe = nn.Embedding(cfg.seq, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq:
            raise ValueError(f"sequence of {t} tokens is longer than the model's {self.cfg.seq}")
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x).flatten(0, 1)
        if hasattr(self.head, "num_classes"):  # memkern.nn.LinearCrossEntropy: fused head + loss
            return self.head(x, targets.flatten())
        return F.cross_entropy(self.head(x).float(), targets.flatten())
