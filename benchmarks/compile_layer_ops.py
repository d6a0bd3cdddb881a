"""Can torch.compile run memkern's layers through their C++ autograd nodes (issue 33)? Each chain
of test_nn_compile.py's saved-bytes test, on the CPU, compiled two ways: through memkern.nn
(its compile path: the norms' Python autograd.Functions and the MLP/SwiGLU layer ops inside
selective-checkpoint regions, Linear's layer op as it is) and through the layer ops alone
(torch.ops.memkern.*_layer: AOTAutograd traces the C++ node registered on the op's Autograd key
into the inner ops). Prints per chain the bytes saved for backward in eager mode (memkern.nn,
and the layer ops without a norm recipe) and under each compiled path, with the gradients'
largest relative error against eager memkern.nn. Then the linear cross-entropy (one C++ node,
traced into its two loop ops) for float32/bfloat16, "mean"/"none", with and without a bias: the
bytes saved for backward in eager mode and compiled (parameters not counted).

    python benchmarks/compile_layer_ops.py
"""
from __future__ import annotations

import torch
from torch import nn

import memkern as mk
from memkern.profile import saved_bytes


class OpsChain(nn.Module):
    """The chain of `mods` run as the layer ops (torch.ops.memkern.*_layer), no recipes."""

    def __init__(self, mods):
        super().__init__()
        self.mods = nn.ModuleList(mods)

    def forward(self, x):
        for m in self.mods:
            if isinstance(m, mk.nn.LayerNorm):
                x = torch.ops.memkern.norm_layer(x, m.weight, m.bias, 1, m.eps, False)
            elif isinstance(m, mk.nn.RMSNorm):
                x = torch.ops.memkern.norm_layer(x, m.weight, None, 1, m.eps or 1e-6, True)
            elif isinstance(m, mk.nn.Linear):
                x = torch.ops.memkern.linear_layer(x, m.weight, m.bias, False)
            elif isinstance(m, mk.nn.MLP):
                x = torch.ops.memkern.mlp_layer(x, m.fc1.weight, m.fc1.bias, m.fc2.weight,
                                                m.fc2.bias, m.activation, m.recompute, False)
            elif isinstance(m, mk.nn.SwiGLU):
                x = torch.ops.memkern.swiglu_layer(
                    x, m.gate_proj.weight, m.gate_proj.bias, m.up_proj.weight, m.up_proj.bias,
                    m.down_proj.weight, m.down_proj.bias, m.recompute)
            else:
                raise TypeError(m)
        return x


CHAINS = {
    "LayerNorm>Linear": lambda: [mk.nn.LayerNorm(64), mk.nn.Linear(64, 33)],
    "RMSNorm>Linear": lambda: [mk.nn.RMSNorm(64), mk.nn.Linear(64, 33)],
    "LayerNorm>MLP": lambda: [mk.nn.LayerNorm(64), mk.nn.MLP(64, 160)],
    "MLP-full": lambda: [mk.nn.MLP(64, 160, activation="silu", recompute="full")],
    "SwiGLU": lambda: [mk.nn.SwiGLU(64, 160)],
    "SwiGLU-full": lambda: [mk.nn.SwiGLU(64, 160, recompute="full")],
}


def main() -> None:
    for name, make in CHAINS.items():
        torch._dynamo.reset()
        mods = make()
        seq = nn.Sequential(*mods)
        ops = OpsChain(mods)
        x = torch.randn(3, 37, 64, requires_grad=True)
        eager = saved_bytes(seq, x)
        eager_ops = saved_bytes(ops, x)
        row = [name, eager, eager_ops]
        for label, module in (("nn", seq), ("ops", ops)):
            torch._dynamo.reset()
            try:
                compiled = torch.compile(module, fullgraph=True)
                compiled(x)
                saved = saved_bytes(compiled, x)
                out = compiled(x)
                grads = torch.autograd.grad(out.square().sum(), [x, *seq.parameters()],
                                            allow_unused=True)
                want = torch.autograd.grad(seq(x).square().sum(), [x, *seq.parameters()],
                                           allow_unused=True)
                err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(grads, want)
                          if b is not None)
                row.append(f"{label}: saved {saved} B, grad rel err {err:.1e}")
            except Exception as exc:  # noqa: BLE001 (a path that fails is reported, not fatal)
                row.append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        print(" | ".join(str(c) for c in row), flush=True)


def linear_cross_entropy_rows() -> None:
    """Per case, saved bytes of mk.nn.LinearCrossEntropy at 37 tokens, 24 features, 53
    classes: eager and compiled (inductor), and the compiled loss's relative error."""
    for dtype in (torch.float32, torch.bfloat16):
        for reduction in ("mean", "none"):
            for bias in (False, True):
                torch._dynamo.reset()
                module = mk.nn.LinearCrossEntropy(24, 53, bias=bias, reduction=reduction,
                                                  dtype=dtype)
                x = torch.randn(37, 24, dtype=dtype, requires_grad=True)
                t = torch.randint(0, 53, (37,))
                compiled = torch.compile(module, fullgraph=True)
                err = float((compiled(x, t) - module(x, t)).detach().abs().max())
                print(f"LinearCrossEntropy {str(dtype)[6:]} {reduction} bias={bias} | eager "
                      f"{saved_bytes(module, x, t)} B | compiled {saved_bytes(compiled, x, t)} B, "
                      f"loss abs err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
    linear_cross_entropy_rows()
