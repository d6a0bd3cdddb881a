"""adaLN's modulated LayerNorm, ``layer_norm(x) * (1 + scale) + shift`` with a per-sample scale
and shift (DiT's adaLN-Zero blocks), saving ``x`` and its row statistics only.

What is saved for backward: ``x``, its per-row ``mean`` and ``rstd``, and the ``[batch,
features]`` scale and shift — never the normalised input (torch's ``norm(x) * (1 + scale)``
keeps it for scale's gradient) nor the output: a memkern Linear/MLP consuming the output saves
the recipe's ``x``, scale and shift instead and rebuilds it in backward (csrc/autograd/
saved_input.h, kind :data:`memkern.ops._gemm_layer.MODULATED_LAYER_NORM`). The algorithm is
one op with C++ autograd, :mod:`memkern.ops.modulated_norm_layer`. Under autocast, or without
the compiled extension, it is torch's composition (what diffusers runs).
:func:`modulated_layer_norm` is ``memkern.nn.functional.modulated_layer_norm``.

Where it runs: diffusers' adaLN-Zero blocks (DiT's ``BasicTransformerBlock`` with
``norm_type="ada_norm_zero"`` and its ``AdaLayerNormZero``) and ``DiTTransformer2DModel``'s
output layer, with :func:`modulated_layer_norm` in place of diffusers' ``norm(x) * (1 + scale) +
shift``.

Saved for backward, per block, instead of torch's: the norms' inputs and row statistics and the
``[batch, features]`` scales and shifts — not the two normalised inputs (kept by the
multiplies for the scales' gradients) nor the two modulated outputs (kept by the attention's
projections and the MLP, which now save the norm's recipe and rebuild them in backward); the
same for the output layer's modulation and ``proj_out_2``. Everything else is diffusers'
computation, in its order: the loss and gradients are the unpatched model's.

The forwards below are :func:`memkern.nn.patch`'s for those classes; a module is patched only in
the configuration they cover (adaLN-Zero, self-attention only, no positional embedding in the
block: :func:`block_layout`, :func:`norm_layout`, :func:`model_layout` say why not), and a
call they do not cover (chunked feed-forward, cross-attention keyword arguments, gradient
checkpointing) runs diffusers' own forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memkern.nn import _autocast, _saved
from memkern.nn import norm as _norm_mod
from memkern.ops.modulated_norm_layer import modulated_norm_layer, modulated_norm_layer_entry


def _per_sample(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``[batch, features]`` viewed to broadcast over ``[batch, ..., features]``."""
    return t.view(t.shape[0], *[1] * (dim - 2), t.shape[1])


def _check(x, scale, shift) -> None:
    name = "memkern.nn.functional.modulated_layer_norm"
    if x.dim() < 2:
        raise ValueError(f"{name}: x has shape {tuple(x.shape)}; it must be [batch, ..., features]")
    want = (x.shape[0], x.shape[-1])
    for arg, t in (("scale", scale), ("shift", shift)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: {arg} has shape {tuple(t.shape)}, expected "
                             f"[batch, features] = {list(want)} for x of shape {tuple(x.shape)}")


def modulated_layer_norm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                         eps: float = 1e-6) -> torch.Tensor:
    """``F.layer_norm(x, (features,), eps=eps) * (1 + scale) + shift`` for ``x`` ``[batch, ...,
    features]`` and ``scale``, ``shift`` ``[batch, features]`` (broadcast over the dimensions
    between), saving ``x`` and its row statistics only (see the module docstring)."""
    if modulated_norm_layer_entry is not None and not torch.compiler.is_compiling():
        y = modulated_norm_layer_entry(x, scale, shift, float(eps))
        if y is not None:
            return y
    _check(x, scale, shift)
    if (modulated_norm_layer_entry is not None and scale.dtype == x.dtype == shift.dtype
            and not _autocast.autocast_enabled(x.device.type)):
        # compiled: the whole norm recomputed in backward (a consumer never saves its output)
        return _saved.compiled_region(modulated_norm_layer, x, scale, shift, float(eps))
    normed = F.layer_norm(x, (x.shape[-1],), eps=eps)
    return normed * (1 + _per_sample(scale, x.dim())) + _per_sample(shift, x.dim())


DIFFUSERS_SERIES = "0.42"
"""The diffusers release series whose forwards the ones below follow line for line (and the
tests compare against): under another, a patched block could silently compute something else,
so the modules are left alone with the reason."""


def diffusers_version_known() -> str | None:
    """None when the installed diffusers is of :data:`DIFFUSERS_SERIES`; else why not patched."""
    import diffusers

    version = diffusers.__version__
    if version == DIFFUSERS_SERIES or version.startswith(DIFFUSERS_SERIES + "."):
        return None
    return (f"diffusers {version}: memkern's adaLN-Zero forwards follow diffusers "
            f"{DIFFUSERS_SERIES}.x's")


def _is_plain_layer_norm(m) -> bool:
    """A LayerNorm without affine parameters over one dimension (torch's or memkern's)."""
    return (type(m) in (nn.LayerNorm, _norm_mod.LayerNorm) and m.weight is None and m.bias is None
            and len(m.normalized_shape) == 1)


def norm_layout(m: nn.Module) -> str | None:
    """None when ``m`` (an ``AdaLayerNormZero``) is ``linear(silu(emb))`` chunked in six, its
    norm a LayerNorm without affine parameters; else why not."""
    if not _is_plain_layer_norm(getattr(m, "norm", None)):
        return (f"its norm is {type(getattr(m, 'norm', None)).__name__}, not a LayerNorm "
                "without affine parameters")
    linear = getattr(m, "linear", None)
    if not (isinstance(linear, nn.Linear) and type(getattr(m, "silu", None)) is nn.SiLU
            and linear.out_features == 6 * m.norm.normalized_shape[0]):
        return "not linear(silu(emb)) with six chunks"
    return None


def block_layout(m: nn.Module) -> str | None:
    """None when ``m`` (a ``BasicTransformerBlock``) is an adaLN-Zero block that
    :func:`block_forward` runs (self-attention only, no positional embedding, a LayerNorm
    without affine parameters before the MLP); else why not."""
    if getattr(m, "attn2", None) is not None or getattr(m, "only_cross_attention", True):
        return "it has cross-attention"
    if getattr(m, "pos_embed", None) is not None:
        return "it has a positional embedding of its own"
    if not _is_plain_layer_norm(getattr(m, "norm3", None)):
        return "its norm3 is not a LayerNorm without affine parameters"
    return None


def model_layout(m: nn.Module) -> str | None:
    """None when ``m`` (a ``DiTTransformer2DModel``) ends with a LayerNorm without affine
    parameters modulated by ``proj_out_1``'s two chunks, then ``proj_out_2``; else why not."""
    if not _is_plain_layer_norm(getattr(m, "norm_out", None)):
        return "its norm_out is not a LayerNorm without affine parameters"
    if not all(isinstance(getattr(m, n, None), nn.Linear) for n in ("proj_out_1", "proj_out_2")):
        return "its proj_out_1 / proj_out_2 are not linear layers"
    return None


def norm_forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
    """``AdaLayerNormZero.forward``: the six chunks of ``linear(silu(emb))``, ``x`` through the
    modulated LayerNorm."""
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    emb = self.linear(self.silu(emb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    x = modulated_layer_norm(x, scale_msa, shift_msa, self.norm.eps)
    return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


def block_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                  encoder_attention_mask=None, timestep=None, cross_attention_kwargs=None,
                  class_labels=None, added_cond_kwargs=None):
    """``BasicTransformerBlock.forward`` for adaLN-Zero (see the module docstring): the MLP's
    modulation through the modulated LayerNorm."""
    if cross_attention_kwargs or self._chunk_size is not None:
        return self._memkern_base.forward(
            self, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
            timestep, cross_attention_kwargs, class_labels, added_cond_kwargs)
    norm_hidden, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(
        hidden_states, timestep, class_labels, hidden_dtype=hidden_states.dtype)
    attn_output = self.attn1(norm_hidden, encoder_hidden_states=None, attention_mask=attention_mask)
    hidden_states = gate_msa.unsqueeze(1) * attn_output + hidden_states
    if hidden_states.ndim == 4:
        hidden_states = hidden_states.squeeze(1)
    norm_hidden = modulated_layer_norm(hidden_states, scale_mlp, shift_mlp, self.norm3.eps)
    hidden_states = gate_mlp.unsqueeze(1) * self.ff(norm_hidden) + hidden_states
    if hidden_states.ndim == 4:
        hidden_states = hidden_states.squeeze(1)
    return hidden_states


def model_forward(self, hidden_states, timestep=None, class_labels=None,
                  cross_attention_kwargs=None, return_dict=True):
    """``DiTTransformer2DModel.forward``: the output layer's modulation through the modulated
    LayerNorm."""
    if torch.is_grad_enabled() and self.gradient_checkpointing:
        return self._memkern_base.forward(self, hidden_states, timestep, class_labels,
                                          cross_attention_kwargs, return_dict)
    hidden_states = self.pos_embed(hidden_states)
    for block in self.transformer_blocks:
        hidden_states = block(hidden_states, attention_mask=None, encoder_hidden_states=None,
                              encoder_attention_mask=None, timestep=timestep,
                              cross_attention_kwargs=cross_attention_kwargs,
                              class_labels=class_labels)
    conditioning = self.transformer_blocks[0].norm1.emb(timestep, class_labels,
                                                        hidden_dtype=hidden_states.dtype)
    shift, scale = self.proj_out_1(F.silu(conditioning)).chunk(2, dim=1)
    hidden_states = modulated_layer_norm(hidden_states, scale, shift, self.norm_out.eps)
    hidden_states = self.proj_out_2(hidden_states)
    # unpatchify, as diffusers does
    height = width = int(hidden_states.shape[1] ** 0.5)
    hidden_states = hidden_states.reshape(
        shape=(-1, height, width, self.patch_size, self.patch_size, self.out_channels))
    hidden_states = torch.einsum("nhwpqc->nchpwq", hidden_states)
    output = hidden_states.reshape(
        shape=(-1, self.out_channels, height * self.patch_size, width * self.patch_size))
    if not return_dict:
        return (output,)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=output)
