"""The GPT-2 block written twice over, for comparing what torch.nn and memkern.nn save."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

import memkern as mk


class GPT2Block(nn.Module):
    """A GPT-2 block, pre-LN causal SDPA attention + pre-LN MLP with residual dropouts, built
    from torch.nn modules (``memkern=False``) or memkern.nn ones with ``recompute``: the block
    the saved-bytes claims are measured on (tests/test_nn_memory.py, bench_modules.py).
    State-dict keys differ only in the MLP: torch's ``mlp.0``/``mlp.2`` are memkern's
    ``mlp.fc1``/``mlp.fc2``."""

    def __init__(self, d: int, heads: int, p: float, memkern: bool, recompute: str = "activation"):
        super().__init__()
        lin = mk.nn.Linear if memkern else nn.Linear
        ln = mk.nn.LayerNorm if memkern else nn.LayerNorm
        drop = mk.nn.Dropout if memkern else nn.Dropout
        self.heads = heads
        self.ln_1, self.c_attn = ln(d), lin(d, 3 * d)
        self.c_proj, self.resid_dropout = lin(d, d), drop(p)
        self.ln_2 = ln(d)
        if memkern:
            self.mlp = mk.nn.MLP(d, 4 * d, activation="gelu_tanh", dropout=p, recompute=recompute)
        else:
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"),
                                     nn.Linear(4 * d, d), nn.Dropout(p))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.resid_dropout(self.c_proj(a))
        return x + self.mlp(self.ln_2(x))
