"""``memkern.patch(model)``: swap a model's layers for memkern ones, in place.

What is swapped (each family can be turned off by its keyword):

* ``linear``: ``nn.Linear`` -> :class:`memkern.nn.Linear`; GPT-2's ``Conv1D``
  (``transformers.pytorch_utils.Conv1D``) -> a memkern ``Conv1D``.
* ``norm``: ``nn.LayerNorm`` -> :class:`memkern.nn.LayerNorm`, ``nn.RMSNorm`` ->
  :class:`memkern.nn.RMSNorm`, Llama-style ``*RMSNorm`` of ``transformers`` (the
  ``LlamaRMSNorm`` formula: float32 statistics, ``weight * normalised.to(input dtype)``);
  diffusers' adaLN-Zero (DiT's ``AdaLayerNormZero``, its ``BasicTransformerBlock``'s MLP
  modulation and ``DiTTransformer2DModel``'s output layer) through memkern's modulated
  LayerNorm (:mod:`memkern.nn.modulated_norm`).
* ``dropout``: ``nn.Dropout`` -> :class:`memkern.nn.Dropout`.
* ``mlp``: MLP blocks run as one memkern MLP with ``recompute``, recognised by structure:
  ``fc -> activation -> proj (-> dropout)`` — ``nn.Sequential(Linear, GELU/ReLU/SiLU, Linear[,
  Dropout])``, or any module holding exactly two linear layers and an activation (and a
  dropout) that its forward calls in that order (GPT-2's, ViT's, DeiT's MLP); diffusers'
  ``FeedForward`` with a GELU projection (DiT); the post-LN MLP that BERT-family layers split
  in two modules (:mod:`memkern.nn.split_mlp`); and Llama style ``down(silu(gate(x)) * up(x))``
  (``LlamaMLP``, ``MistralMLP``, ``Qwen2MLP``). The fused block reads its linear layers'
  weights; a layer replaced after ``patch`` (a LoRA adapter wrapping it) or given a hook makes
  the block run its own forward, so the adapter or hook is never skipped — a Llama-style MLP
  calls its three layers with memkern's gated unit between them
  (:mod:`memkern.nn.swiglu_unit`). Blocks are recognised through LoRA adapters.
* ``lora``: PEFT's LoRA layers around linear layers (``peft.tuners.lora.Linear`` and its
  bitsandbytes kin, recognised by structure: ``base_layer``, the per-adapter ``lora_A``,
  ``lora_B``, ``lora_dropout``, ``scaling``, ``use_dora``) add their plain adapters through
  :mod:`memkern.nn.lora` (which saves nothing after a norm and keeps no dropout mask); the
  adapters' own layers are left as PEFT made them, and the wrapped layer is patched like any
  other (a 4-bit one is left to bitsandbytes). ``patch`` before or after PEFT's
  ``get_peft_model`` gives the same layers: a LoRA layer put into a patched model is patched
  as it is put in (a module registration hook, process-wide, installed by the first ``patch``
  call). Given a PEFT model, the attention and loss parts apply to the model it wraps
  (``get_base_model()``); an output layer carrying an adapter keeps its logits and loss
  unfused (the fused loss would skip the adapter), as the report says.
* ``attention``: a ``transformers`` model whose attention implementation is SDPA runs it with
  its ``[batch, heads, tokens, tokens]`` probabilities recomputed in backward wherever SDPA
  would keep them (its math kernel: on the CPU, attention dropout on), the dropout mask
  replayed (:mod:`memkern.nn.hf_attention`).
* ``loss``: a ``transformers`` causal LM whose forward computes its loss from ``lm_head``
  through ``self.loss_function`` trains through memkern's fused linear cross-entropy whenever
  it is in training mode and ``labels`` are given: no ``[tokens, vocab]`` logits, and the
  output's ``logits`` is None in those calls (:mod:`memkern.nn.causal_lm_loss`); a masked LM
  the same way, on its labelled rows only (:mod:`memkern.nn.masked_lm_loss`). Without
  labels, or in eval mode, the model computes its logits and loss as before.

How: each module's class is replaced by a memkern subclass of it (``module.__class__ = ...``),
so the module object, its parameters (identity, values, names, dtype, device,
``requires_grad``), buffers, hooks, ``state_dict`` keys and ``isinstance`` checks are all
unchanged; only ``forward`` differs. Only exact classes are swapped (a subclass of
``nn.Linear`` may have its own forward: a 4-bit layer's), PEFT's LoRA layers aside, whose
structure is read. Patching twice changes nothing.

``patch`` returns the model; :func:`patch_report` (or ``verbose=True``) tells what was swapped
and what was recognised but left alone, and why.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap

import torch
from torch import nn

from memkern import _fake
from memkern.nn import dropout as _dropout_mod
from memkern.nn import hf_attention as _hf_attention
from memkern.nn import linear as _linear_mod
from memkern.nn import lora as _lora
from memkern.nn import modulated_norm as _modulated_norm
from memkern.nn import norm as _norm_mod
from memkern.nn import split_mlp as _split_mlp
from memkern.nn.causal_lm_loss import CausalLMHead, MemkernCausalLMHead, fuse_causal_lm_loss
from memkern.nn.linear import linear as _linear
from memkern.nn.masked_lm_loss import fuse_masked_lm_loss
from memkern.nn.mlp import RECOMPUTE
from memkern.nn.mlp import mlp as _mlp
from memkern.nn.norm import rms_norm as _rms_norm
from memkern.nn.swiglu import swiglu as _swiglu
from memkern.nn.swiglu_unit import swiglu_unit as _swiglu_unit

_MARK = "_memkern_patched"


@dataclasses.dataclass
class PatchReport:
    swapped: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    """(module name, old class, new class) for each module swapped."""
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(module name, reason) for recognised modules left as they were."""

    def __str__(self) -> str:
        lines = [f"memkern.patch: swapped {len(self.swapped)} module(s)"]
        lines += [f"  {n or '<model>'}: {old} -> {new}" for n, old, new in self.swapped]
        if self.skipped:
            lines.append(f"left alone {len(self.skipped)}:")
            lines += [f"  {n or '<model>'}: {why}" for n, why in self.skipped]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# forwards of the patched classes


def _conv1d_forward(self, x):
    return _linear(x, self.weight, self.bias, transposed=True)


def _hf_rms_norm_forward(self, hidden_states):
    w = self.weight
    y = _rms_norm(hidden_states, (w.shape[-1],), w, self.variance_epsilon)
    return y.to(torch.promote_types(hidden_states.dtype, w.dtype))


def _fused_over(*layers: nn.Module) -> bool:
    """Whether the fused MLP may read ``layers``' weights instead of calling them: each is still
    a plain linear layer (``nn.Linear``, ``Conv1D``, patched or not) with no hook
    (:func:`memkern.nn.split_mlp.fused_over` says why)."""
    return all(_linear_like(m) is not None and not _split_mlp.hooked(m) for m in layers)


def _gpt2_mlp_forward(self, hidden_states):
    cfg = self._memkern_mlp
    fc, proj = self.get_submodule(cfg["fc"]), self.get_submodule(cfg["proj"])
    if not _fused_over(fc, proj):
        return self._memkern_base.forward(self, hidden_states)
    y = _mlp(hidden_states, fc.weight, fc.bias, proj.weight, proj.bias,
             activation=cfg["activation"], recompute=cfg["recompute"], transposed=cfg["transposed"])
    drop = cfg.get("dropout")
    return self.get_submodule(drop)(y) if drop is not None else y


def _llama_mlp_forward(self, x):
    cfg = self._memkern_mlp
    if not _fused_over(self.gate_proj, self.up_proj, self.down_proj):
        # its layers called (LoRA adapters, hooks), memkern's gated unit between them: the
        # down projection then keeps gate and up, which the unit keeps, not its input
        return self.down_proj(_swiglu_unit(self.gate_proj(x), self.up_proj(x)))
    return _swiglu(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                   self.gate_proj.bias, self.up_proj.bias, self.down_proj.bias,
                   recompute=cfg["recompute"])


class SequentialMLP(nn.Sequential):
    """A patched ``nn.Sequential(Linear, activation, Linear[, Dropout])``: indexing, names and
    ``state_dict`` are those of the Sequential; forward is one memkern MLP call."""

    _memkern_base = nn.Sequential  # its own forward: when a layer was replaced after patch

    forward = _gpt2_mlp_forward


_FORWARDS = {
    "conv1d": _conv1d_forward,
    "rms_norm": _hf_rms_norm_forward,
    "gpt2_mlp": _gpt2_mlp_forward,
    "llama_mlp": _llama_mlp_forward,
    "split_mlp_layer": _split_mlp.layer_forward,
    "split_mlp_intermediate": _split_mlp.intermediate_forward,
    "split_mlp_output": _split_mlp.output_forward,
    "ada_norm_zero": _modulated_norm.norm_forward,
    "ada_norm_zero_block": _modulated_norm.block_forward,
    "ada_norm_zero_model": _modulated_norm.model_forward,
    "lora_linear": _lora.peft_lora_forward,
}

# transformers classes recognised by name: class name -> kind of patched forward
_HF_CLASSES = {
    "Conv1D": "conv1d",
    "LlamaRMSNorm": "rms_norm", "MistralRMSNorm": "rms_norm", "Qwen2RMSNorm": "rms_norm",
    "LlamaMLP": "llama_mlp", "MistralMLP": "llama_mlp", "Qwen2MLP": "llama_mlp",
}

# ----------------------------------------------------------------------------------------------
# memkern subclasses of third-party classes, created on demand and picklable: the name encodes
# the base class, and this module's __getattr__ rebuilds the class from it in a new process.

_PREFIX = "Memkern__"
_classes: dict[tuple[type, str], type] = {}


def _escape(text: str) -> str:
    return text.replace("_", "_U").replace(".", "_D")


def _encode(base: type, kind: str) -> str:
    return _PREFIX + _escape(kind) + "_K" + _escape(f"{base.__module__}.{base.__qualname__}")


def _decode(name: str) -> tuple[str, str, str]:
    """(kind, module, qualname) of a class name made by :func:`_encode`."""
    kind, _, path = name[len(_PREFIX):].partition("_K")
    kind, path = (t.replace("_D", ".").replace("_U", "_") for t in (kind, path))
    module, _, qualname = path.rpartition(".")
    return kind, module, qualname


def _patched_class(base: type, kind: str) -> type:
    if (base, kind) not in _classes:
        name = _encode(base, kind)
        # _memkern_base: the class patched, for forwards that call its own (a wrapper that
        # subclasses modules dynamically, FSDP2's FSDP<cls>, puts its class in front: the
        # patched class's base is not type(m).__mro__[1] there)
        cls = type(name, (base,), {"forward": _FORWARDS[kind], _MARK: True, "__module__": __name__,
                                   "__qualname__": name, "_memkern_base": base})
        _classes[base, kind] = cls
        globals()[name] = cls
    return _classes[base, kind]


def __getattr__(name: str):  # PEP 562: unpickling a patched model in a fresh process
    if name.startswith(_PREFIX):
        kind, module, qualname = _decode(name)
        base = importlib.import_module(module)
        for part in qualname.split("."):
            base = getattr(base, part)
        return _patched_class(base, kind)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------
# recognition


def _from_transformers(m: nn.Module) -> bool:
    return type(m).__module__.startswith("transformers.")


def _hf_kind(m: nn.Module) -> str | None:
    return _HF_CLASSES.get(type(m).__name__) if _from_transformers(m) else None


def _diffusers_class(m: nn.Module, name: str) -> bool:
    return type(m).__name__ == name and type(m).__module__.startswith("diffusers.")


def _ada_norm_zero_kind(m: nn.Module) -> tuple[str, str | None] | None:
    """(the kind of patched forward, None or why it is left alone) for diffusers'
    ``AdaLayerNormZero``, its adaLN-Zero ``BasicTransformerBlock`` and
    ``DiTTransformer2DModel``; None for anything else."""
    if _diffusers_class(m, "AdaLayerNormZero"):
        kind, layout = "ada_norm_zero", _modulated_norm.norm_layout
    elif (_diffusers_class(m, "BasicTransformerBlock")
          and getattr(m, "norm_type", None) == "ada_norm_zero"):
        kind, layout = "ada_norm_zero_block", _modulated_norm.block_layout
    elif _diffusers_class(m, "DiTTransformer2DModel"):
        kind, layout = "ada_norm_zero_model", _modulated_norm.model_layout
    else:
        return None
    return kind, _modulated_norm.diffusers_version_known() or layout(m)


def _activation_kind(act: nn.Module) -> str | None:
    t = type(act)
    if t is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    if t is nn.ReLU:
        return "relu"
    if t is nn.SiLU:
        return "silu"
    if _from_transformers(act):
        return {"NewGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh",
                "PytorchGELUTanh": "gelu_tanh", "FastGELUActivation": "gelu_tanh",
                "GELUActivation": "gelu", "SiLUActivation": "silu"}.get(t.__name__)
    return None


def _is_patched(m: nn.Module) -> bool:
    return getattr(type(m), _MARK, False) or type(m).__module__.startswith("memkern.")


def _linear_like(m: nn.Module) -> tuple[bool, bool] | None:
    """(is a linear layer, stores its weight [in, out]) for nn.Linear / Conv1D (patched or not)."""
    if isinstance(m, nn.Linear) and type(m) in (nn.Linear, _linear_mod.Linear):
        return True, False
    if (type(m) is _linear_mod.Conv1D
            or (type(m).__name__ == "Conv1D" and _from_transformers(m))
            or (_is_patched(m) and getattr(m, "_memkern_base", type(m)).__name__ == "Conv1D")):
        return True, True
    return None


def _lora_base(m: nn.Module) -> nn.Module | None:
    """The layer a PEFT LoRA layer wraps, when that is a linear layer (``nn.Linear`` or a
    subclass of it — bitsandbytes' 4-bit and 8-bit layers are —, or GPT-2's ``Conv1D``),
    recognised by structure: ``base_layer``; the per-adapter ``lora_A``, ``lora_B`` and
    ``lora_dropout`` module dicts; the ``scaling`` and ``use_dora`` dicts (PEFT's
    ``LoraLayer``). None for anything else."""
    base = m._modules.get("base_layer")
    if base is None or not all(isinstance(m._modules.get(n), nn.ModuleDict)
                               for n in ("lora_A", "lora_B", "lora_dropout")):
        return None
    if not all(isinstance(m.__dict__.get(n), dict) for n in ("scaling", "use_dora")):
        return None
    return base if isinstance(base, nn.Linear) or _linear_like(base) is not None else None


def _linear_seen_through(m: nn.Module) -> tuple[bool, bool] | None:
    """:func:`_linear_like` of ``m``, or of the layer it wraps when it is a PEFT LoRA layer: what
    a block's structure is made of (a fused block still reads weights only of plain layers,
    :func:`_fused_over`, and runs its own forward otherwise)."""
    base = _lora_base(m)
    return _linear_like(m if base is None else base)


def _describe(cls: type) -> str:
    if cls.__name__.startswith(_PREFIX):
        base = cls._memkern_base
        return f"memkern subclass of {base.__module__}.{base.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _swap(m: nn.Module, new_cls: type, name: str, report: PatchReport) -> None:
    old = _describe(type(m))
    m.__class__ = new_cls
    report.swapped.append((name, old, _describe(new_cls)))


def _forward_calls(m: nn.Module, names: list[str]) -> bool:
    """Whether ``m``'s forward calls ``self.<name>(`` for each of ``names``, in that order (read
    from its source: the structure says which layers a block has, its forward in which order
    it runs them)."""
    try:
        source = inspect.getsource(type(m).forward)
    except (OSError, TypeError):
        return False
    at = -1
    for name in names:
        at = source.find(f"self.{name}(", at + 1)
        if at < 0:
            return False
    return True


def _chain(node: ast.expr, current: str) -> list[str] | None:
    """The ``self.<name>`` calls of ``self.c(self.b(self.a(current)))``, innermost first; None
    for any other expression."""
    if isinstance(node, ast.Name):
        return [] if node.id == current else None
    if (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords
            and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"):
        inner = _chain(node.args[0], current)
        return None if inner is None else [*inner, node.func.attr]
    return None


def _runs_only(m: nn.Module, names: list[str]) -> bool:
    """Whether ``m``'s forward is nothing but ``names``' layers applied one after the other to
    its input (``x = self.fc(x); x = self.act(x); ...; return x``, or nested calls): no other
    operation that a fused block would drop."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(m).forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    fn = tree.body[0]
    if not isinstance(fn, ast.FunctionDef) or len(fn.args.args) != 2:
        return False
    body = fn.body[1:] if (fn.body and isinstance(fn.body[0], ast.Expr)
                           and isinstance(fn.body[0].value, ast.Constant)) else fn.body
    current, calls = fn.args.args[1].arg, []
    for i, stmt in enumerate(body):
        last = i == len(body) - 1
        if isinstance(stmt, ast.Return) and last and stmt.value is not None:
            target, value = None, stmt.value
        elif (isinstance(stmt, (ast.Assign, ast.AnnAssign)) and not last and stmt.value is not None
              and len(getattr(stmt, "targets", [getattr(stmt, "target", None)])) == 1):
            target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
            if not isinstance(target, ast.Name):
                return False
            value = stmt.value
        else:
            return False
        applied = _chain(value, current)
        if applied is None:
            return False
        calls += applied
        if target is not None:
            current = target.id
    return calls == names


_PROBE_ROWS = 3


def _same_on_a_probe(m: nn.Module, cfg: dict) -> bool:
    """Whether ``m``'s own forward and the fused MLP agree on a random input (``_PROBE_ROWS``
    rows, the block in its mode, its dropout off): for a block whose forward is not a plain chain of
    its layers (diffusers' ``TimestepEmbedding`` skips absent ones under ``if``), that it adds
    nothing the fused block would drop. Fake or meta weights hold no values: taken as they are."""
    fc = m.get_submodule(cfg["fc"])
    w = fc.weight
    if _fake.is_fake(w) or w.is_meta:
        return True
    features = _features(fc, cfg["transposed"])[0]
    g = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(_PROBE_ROWS, features, generator=g, device=w.device, dtype=w.dtype)
    drop = m.get_submodule(cfg["dropout"]) if cfg["dropout"] else None
    training = drop is not None and drop.training
    if drop is not None:
        drop.eval()  # the block in its own mode, its dropout off
    try:
        with torch.no_grad():
            own = type(m).forward(m, x)
            m._memkern_mlp = cfg
            fused = _gpt2_mlp_forward(m, x)
    except Exception:  # noqa: BLE001 - a forward that fails on the probe is not this MLP
        return False
    finally:
        m.__dict__.pop("_memkern_mlp", None)
        if drop is not None:
            drop.train(training)
    tol = 1e-3 if w.dtype in (torch.float16, torch.bfloat16) else 1e-5
    return isinstance(own, torch.Tensor) and own.shape == fused.shape and bool(
        torch.allclose(own.float(), fused.float(), rtol=tol, atol=tol * float(own.abs().max())))


def _features(m: nn.Module, transposed: bool) -> tuple[int, int]:
    """(in, out) features of a linear-like layer."""
    rows, cols = m.weight.shape
    return (rows, cols) if transposed else (cols, rows)


def _is_dropout(m: nn.Module) -> bool:
    return type(m) in (nn.Dropout, _dropout_mod.Dropout)


def _is_layer_norm(m: nn.Module) -> bool:
    return type(m) in (nn.LayerNorm, _norm_mod.LayerNorm)


def _only_children(m: nn.Module) -> dict[str, nn.Module] | None:
    """``m``'s children by name, if ``m`` holds no parameters or buffers of its own."""
    if (next(m.parameters(recurse=False), None) is not None
            or next(m.buffers(recurse=False), None) is not None):
        return None
    return dict(m.named_children())


def _mlp_layout(m: nn.Module):
    """(fc, activation, proj, dropout or None, whether its forward is a plain chain of them:
    :func:`_runs_only`) for a block that is exactly two linear layers with an activation
    between them (and a dropout after), run in that order."""
    kids = _only_children(m)
    if kids is None:
        return None
    lin = [n for n, c in kids.items() if _linear_seen_through(c)]
    act = [n for n, c in kids.items() if _activation_kind(c) is not None]
    drop = [n for n, c in kids.items() if _is_dropout(c)]
    if len(lin) != 2 or len(act) != 1 or len(drop) > 1 or len(kids) != 3 + len(drop):
        return None
    orders = [(fc, act[0], proj, drop[0] if drop else None) for fc, proj in (lin, lin[::-1])]
    for order in orders:  # a plain chain: its calls say the order, nested ones included
        if _runs_only(m, [n for n in order if n is not None]):
            return (*order, True)
    for order in orders:  # else the order of the calls in the source, checked on a probe
        if _forward_calls(m, [n for n in order if n is not None]):
            return (*order, False)
    return None


def _mlp_config(m: nn.Module, recompute: str):
    """The memkern MLP configuration for a GPT-2-style block (``nn.Sequential(Linear, act,
    Linear[, Dropout])``, or any module holding exactly those layers and calling them in that
    order: GPT-2's, ViT's, DeiT's MLP), or a reason it is not one, or None."""
    if isinstance(m, nn.Sequential):
        mods = list(m)
        names = list(m._modules.keys())
        if len(mods) not in (3, 4) or (len(mods) == 4 and not isinstance(mods[3], nn.Dropout)):
            return None
        n_fc, n_act, n_proj = names[:3]
        n_drop = names[3] if len(mods) == 4 else None
        chain = True
    else:
        layout = _mlp_layout(m)
        if layout is None:
            return None
        n_fc, n_act, n_proj, n_drop, chain = layout
    fc, act, proj = getattr(m, n_fc), getattr(m, n_act), getattr(m, n_proj)
    lf, lp = _linear_seen_through(fc), _linear_seen_through(proj)
    kind = _activation_kind(act)
    if lf is None or lp is None or kind is None:
        return None
    if lf[1] != lp[1]:
        return "mixed Linear and Conv1D layers"
    if _features(fc, lf[1])[1] != _features(proj, lp[1])[0]:
        return None
    cfg = {"fc": n_fc, "act": n_act, "proj": n_proj, "dropout": n_drop, "activation": kind,
           "recompute": recompute, "transposed": lf[1]}
    if not chain and not _same_on_a_probe(m, cfg):
        return ("its forward computes more than its layers fc -> activation -> proj (its output "
                "differs from theirs on a probe input), which the fused MLP would drop")
    return cfg


def _feed_forward_config(m: nn.Module, recompute: str):
    """diffusers' ``FeedForward`` with a GELU projection: ``net = [GELU(proj: Linear), Dropout,
    Linear(, Dropout)]`` run in order; the inner dropout must have p = 0 (DiT's default), as
    the fused MLP has no dropout between its GEMMs. The config, a reason, or None."""
    kids = _only_children(m)
    net = kids.get("net") if kids is not None and len(kids) == 1 else None
    if type(net) is not nn.ModuleList or len(net) not in (3, 4):
        return None
    first, inner, proj, *rest = net
    gelu = _only_children(first)
    if not (type(first).__name__ == "GELU" and type(first).__module__.startswith("diffusers.")
            and gelu is not None and list(gelu) == ["proj"]
            and _linear_seen_through(first.proj) == (True, False)
            and _is_dropout(inner) and _linear_seen_through(proj) == (True, False)
            and all(_is_dropout(d) for d in rest)):
        return None
    if inner.p != 0:
        return f"dropout p={inner.p} between the GEMMs (the fused MLP has none there)"
    kind = {"none": "gelu", "tanh": "gelu_tanh"}.get(getattr(first, "approximate", None))
    if kind is None:
        return None
    return {"fc": "net.0.proj", "proj": "net.2", "dropout": "net.3" if rest else None,
            "activation": kind, "recompute": recompute, "transposed": False}


def _intermediate_layout(m: nn.Module):
    """(dense, activation) names of a module that is exactly ``act(dense(x))``."""
    kids = _only_children(m)
    if kids is None or len(kids) != 2:
        return None
    lin = [n for n, c in kids.items() if _linear_seen_through(c) == (True, False)]
    act = [n for n, c in kids.items() if _activation_kind(c) is not None]
    if len(lin) == 1 and len(act) == 1 and _forward_calls(m, [lin[0], act[0]]):
        return lin[0], act[0]
    return None


def _residual_norm_layout(m: nn.Module):
    """(dense, dropout, norm) names of a module that is exactly ``forward(h, x) =
    norm(dropout(dense(h)) + x)`` (BERT's output modules)."""
    kids = _only_children(m)
    if kids is None or len(kids) != 3:
        return None
    lin = [n for n, c in kids.items() if _linear_seen_through(c) == (True, False)]
    drop = [n for n, c in kids.items() if _is_dropout(c)]
    norm = [n for n, c in kids.items() if _is_layer_norm(c)]
    try:
        two_inputs = len(inspect.signature(m.forward).parameters) == 2
    except (TypeError, ValueError):
        return None
    if (len(lin) == 1 and len(drop) == 1 and len(norm) == 1 and two_inputs
            and _forward_calls(m, [lin[0], drop[0], norm[0]])):
        return lin[0], drop[0], norm[0]
    return None


def _split_mlp_config(layer: nn.Module, recompute: str):
    """(intermediate module, output module, their :class:`split_mlp.SplitMLPCall`) of a layer
    whose MLP is split in two child modules (BERT family), or None."""
    if _split_mlp.is_fused(layer) or _is_patched(layer):
        return None
    kids = dict(layer.named_children())
    inter = [(c, lay) for c in kids.values()
             if not _is_patched(c) and (lay := _intermediate_layout(c))]
    out = [(c, lay) for c in kids.values()
           if not _is_patched(c) and (lay := _residual_norm_layout(c))]
    if len(inter) != 1 or len(out) != 1:
        return None
    (im, (fc, act)), (om, (proj, drop, norm)) = inter[0], out[0]
    kind = _activation_kind(getattr(im, act))
    d_in, d_hidden = _features(getattr(im, fc), False)
    if _features(getattr(om, proj), False) != (d_hidden, d_in):
        return None
    return im, om, _split_mlp.SplitMLPCall(im, fc, kind, proj, drop, norm, recompute)


@dataclasses.dataclass
class _Options:
    """What :func:`patch` was asked to swap (its keywords)."""
    linear: bool
    norm: bool
    mlp: bool
    dropout: bool
    lora: bool
    recompute: str


def _patch_modules(modules: list[tuple[str, nn.Module]], opts: _Options,
                   report: PatchReport) -> None:
    """Swap each of ``modules`` (name, module; parents before their children) that ``opts``
    asks for and :func:`patch`'s recognisers take."""
    adapters: set[int] = set()  # PEFT LoRA layers' adapter modules: their forward reads them
    for name, m in modules:
        if id(m) in adapters:
            continue
        if _lora_base(m) is not None:
            adapters.update(id(c) for c in _lora.adapter_modules(m))
        if _is_patched(m) or type(m) is SequentialMLP:
            continue
        t = type(m)
        hf = _hf_kind(m)
        if opts.lora and _lora_base(m) is not None:
            _swap(m, _patched_class(t, "lora_linear"), name, report)
        elif opts.linear and t is nn.Linear:
            _swap(m, _linear_mod.Linear, name, report)
        elif opts.linear and hf == "conv1d":
            _swap(m, _patched_class(t, "conv1d"), name, report)
        elif opts.norm and t is nn.LayerNorm:
            _swap(m, _norm_mod.LayerNorm, name, report)
        elif opts.norm and t is nn.RMSNorm:
            _swap(m, _norm_mod.RMSNorm, name, report)
        elif opts.norm and hf == "rms_norm":
            w = getattr(m, "weight", None)
            if isinstance(w, nn.Parameter) and w.dim() == 1 and hasattr(m, "variance_epsilon"):
                _swap(m, _patched_class(t, "rms_norm"), name, report)
            else:
                report.skipped.append((name, f"{t.__name__} does not have the LlamaRMSNorm layout"))
        elif opts.norm and (ada := _ada_norm_zero_kind(m)) is not None:
            kind, why = ada
            if why is None:
                _swap(m, _patched_class(t, kind), name, report)
            else:
                report.skipped.append((name, f"{t.__name__}: {why}"))
        elif opts.dropout and t is nn.Dropout:
            _swap(m, _dropout_mod.Dropout, name, report)
        elif opts.mlp and (cfg := _mlp_config(m, opts.recompute)
                           or _feed_forward_config(m, opts.recompute)):
            if isinstance(cfg, dict):
                m._memkern_mlp = cfg
                _swap(m, SequentialMLP if t is nn.Sequential else _patched_class(t, "gpt2_mlp"),
                      name, report)
            else:
                report.skipped.append((name, f"{t.__name__}: {cfg}"))
        elif opts.mlp and (split := _split_mlp_config(m, opts.recompute)) is not None:
            im, om, call = split
            prefix = name + "." if name else ""
            names = {c: prefix + n for n, c in m.named_children()}
            _swap(m, _patched_class(t, "split_mlp_layer"), name, report)
            _swap(im, _patched_class(type(im), "split_mlp_intermediate"), names[im], report)
            _swap(om, _patched_class(type(om), "split_mlp_output"), names[om], report)
            _split_mlp.fuse(m, im, om, call)
        elif opts.mlp and hf == "llama_mlp":
            act = getattr(m, "act_fn", None)
            # linear layers: read by the fused block when plain, else called (4-bit layers,
            # LoRA layers around any)
            ok = all(isinstance(c := getattr(m, n, None), nn.Linear) or (
                         isinstance(c, nn.Module) and _lora_base(c) is not None)
                     for n in ("gate_proj", "up_proj", "down_proj"))
            if ok and act is not None and _activation_kind(act) == "silu":
                m._memkern_mlp = {"recompute": opts.recompute}
                _swap(m, _patched_class(t, "llama_mlp"), name, report)
            else:
                report.skipped.append((name, f"{t.__name__}: not a silu gate/up/down MLP"))


# ----------------------------------------------------------------------------------------------
# LoRA layers put into a patched model (PEFT's get_peft_model after patch): each module of a
# patched model carries (its _PatchedTree, its name), and a module registration hook (torch's,
# process-wide, installed by the first patch call) patches a PEFT LoRA layer as it is put into
# such a module, with the model's keywords: so patch before or after get_peft_model gives the
# same layers. Any other registration costs the hook one dict lookup.

_TREE = "_memkern_patched_tree"
_LORA_HEAD = ("loss not fused: the output layer carries a LoRA adapter, which the fused loss "
              "would skip; the model computes its logits and loss as without memkern")


@dataclasses.dataclass
class _PatchedTree:
    opts: _Options
    report: PatchReport


def _mark(modules: list[tuple[str, nn.Module]], tree: _PatchedTree) -> None:
    for name, m in modules:
        m.__dict__[_TREE] = (tree, name)


def _on_registration(parent: nn.Module, name: str, module: nn.Module | None) -> None:
    mark = parent.__dict__.get(_TREE)
    if mark is None or module is None or _lora_base(module) is None or _is_patched(module):
        return None
    tree, parent_name = mark
    modules = list(module.named_modules(prefix=f"{parent_name}.{name}" if parent_name else name))
    _patch_modules(modules, tree.opts, tree.report)
    _mark(modules, tree)
    if isinstance(module.base_layer, (CausalLMHead, MemkernCausalLMHead)):
        tree.report.skipped.append(("", _LORA_HEAD))  # its fused calls no longer open
    return None


_registration_hook = None


def _install_registration_hook() -> None:
    global _registration_hook
    if _registration_hook is None:
        _registration_hook = torch.nn.modules.module.register_module_module_registration_hook(
            _on_registration)


def _base_model(model: nn.Module) -> nn.Module:
    """The model a wrapper that exposes it through ``get_base_model()`` wraps (PEFT's
    ``PeftModel``), ``model`` itself otherwise: where the model-level parts (attention, fused
    loss) are installed."""
    inner = getattr(model, "get_base_model", None)
    base = inner() if callable(inner) else model
    return base if isinstance(base, nn.Module) else model


def patch(model: nn.Module, *, linear: bool = True, norm: bool = True, mlp: bool = True,
          dropout: bool = True, lora: bool = True, attention: bool = True, loss: bool = True,
          recompute: str = "activation", verbose: bool = False) -> nn.Module:
    """Swap ``model``'s layers for memkern ones in place (see the module docstring); returns
    ``model``. ``attention``: recompute a ``transformers`` model's SDPA attention probabilities
    in backward. ``loss``: fuse a ``transformers`` causal or masked LM's output layer and
    training loss. ``lora``: PEFT's LoRA layers through :mod:`memkern.nn.lora`, now and when
    ``get_peft_model`` puts them into the model later.
    ``recompute`` is the policy of the swapped MLP blocks ("none" | "activation" | "full")."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"memkern.patch: model must be an nn.Module, got {type(model).__name__}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"memkern.patch: recompute={recompute!r} is not one of {RECOMPUTE}")
    report = PatchReport()
    opts = _Options(linear, norm, mlp, dropout, lora, recompute)
    modules = list(model.named_modules())
    _patch_modules(modules, opts, report)
    inner = _base_model(model)
    if attention and hasattr(getattr(inner, "config", None), "_attn_implementation"):
        before = inner.config._attn_implementation
        why = _hf_attention.install(inner)
        if why is not None:
            report.skipped.append(("", f"attention not recomputed: {why}"))
        elif before != _hf_attention.NAME:
            report.swapped.append(("", f"attention implementation {before!r}",
                                   f"{_hf_attention.NAME!r} (memkern.nn.hf_attention)"))
    head = getattr(inner, "get_output_embeddings", None)
    if loss and callable(head) and isinstance(h := head(), nn.Module) and _lora_base(h) is not None:
        report.skipped.append(("", _LORA_HEAD))
        loss = False
    fused = (fuse_masked_lm_loss(inner) or fuse_causal_lm_loss(inner)) if loss else None
    if isinstance(fused, tuple):
        report.swapped.append(fused)
    elif fused is not None:
        report.skipped.append(("", f"loss not fused: {fused}"))
    previous = model.__dict__.get("_memkern_patch_report")
    if previous is not None:  # the report accumulates the swaps of every call
        report.swapped = previous.swapped + report.swapped
    model.__dict__["_memkern_patch_report"] = report
    _mark(modules, _PatchedTree(opts, report))
    _install_registration_hook()
    if verbose:
        print(report)
    return model


def patch_report(model: nn.Module) -> PatchReport:
    """What :func:`patch` did to ``model`` (empty if it was never patched); for a PEFT model
    around a patched model (``get_peft_model`` after ``patch``), what it did to that model,
    the LoRA layers ``get_peft_model`` put into it included."""
    return (model.__dict__.get("_memkern_patch_report")
            or _base_model(model).__dict__.get("_memkern_patch_report") or PatchReport())
