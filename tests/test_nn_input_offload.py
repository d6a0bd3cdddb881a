"""memkern.checkpoint(block, "full-host") (memkern/nn/input_offload.py): the gradients of policy
"full" and of the model without checkpointing, bit for bit; each block input copied to host
memory while the next block runs and brought back one block ahead of its backward (a trace of
the copies); at most two block inputs on the device (a record of every storage the ops make and
when it dies); host buffers of exactly the input's bytes (the CPU allocation trace).
"""
from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import memkern as mk
from memkern.nn import input_offload
from memkern.profile import allocation_stats


class Block(nn.Module):
    """x + dropout(tanh(fc(ln(x)))): a residual block whose every op "full" recomputes. Each run
    of its forward (in the forward pass, and recomputed in backward) is appended to ``log``."""

    def __init__(self, d: int, p: float, log: list | None = None, index: int = 0):
        super().__init__()
        self.ln, self.fc, self.drop = nn.LayerNorm(d), nn.Linear(d, d), nn.Dropout(p)
        self.log, self.index = log, index

    def forward(self, x):
        if self.log is not None:
            self.log.append(("run", self.index, x))
        return x + self.drop(torch.tanh(self.fc(self.ln(x))))


def _blocks(policy, n=5, d=19, p=0.3, log=None, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)  # the same weights for every policy
    blocks = nn.ModuleList([Block(d, p, log, i) for i in range(n)]).to(dtype)
    for b in blocks:
        mk.checkpoint(b, policy)
    return blocks


def _loss(blocks, x, w, seed, order=None):
    torch.manual_seed(seed)  # the same dropout masks for every policy
    h = x * 1.0  # the chain's input: held by nothing but the first block
    for i in order or range(len(blocks)):
        h = blocks[i](h)
    return (h * w).sum()


def _grads(blocks, x, w, seed=7, order=None):
    loss = _loss(blocks, x, w, seed, order)
    return [loss, *torch.autograd.grad(loss, [x, *blocks.parameters()])]


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def _data(shape=(3, 11, 19), dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, requires_grad=True), torch.randn(*shape, dtype=dtype)


def test_gradients_equal_full_and_unpatched_bit_for_bit():
    x, w = _data()
    got = _grads(_blocks("full-host"), x, w)
    assert _equal(got, _grads(_blocks("full"), x, w))
    assert _equal(got, _grads(_blocks(None), x, w))


def test_dropout_masks_are_replayed():
    """Different seeds give different gradients (dropout is live), the same seed the same."""
    x, w = _data()
    blocks = _blocks("full-host", p=0.5)
    a, b = _grads(blocks, x, w, seed=1), _grads(blocks, x, w, seed=2)
    assert not torch.equal(a[1], b[1])
    assert _equal(a, _grads(_blocks(None, p=0.5), x, w, seed=1))


class _Trace:
    """Which block's input is copied where, and when: wraps the policy's three steps."""

    def __init__(self, monkeypatch, log):
        self.log = log
        cls = input_offload._BlockInput
        for name, tag in (("offload", "to host"), ("fetch", "to device"),
                          ("backward_starts", "backward")):
            method = getattr(cls, name)

            def traced(call, method=method, tag=tag):
                self.log.append((tag, call.position))
                return method(call)

            monkeypatch.setattr(cls, name, traced)

    def events(self):
        return [(e[0], e[1]) for e in self.log]


def test_each_input_goes_to_host_during_the_next_forward_and_back_one_block_ahead(monkeypatch):
    log = []
    trace = _Trace(monkeypatch, log)
    blocks = _blocks("full-host", n=4, log=log)
    x, w = _data()
    for _ in range(2):  # the second step makes a chain of its own (positions from 0 again)
        log.clear()
        _grads(blocks, x, w)
        assert trace.events() == [
            ("run", 0), ("to host", 0), ("run", 1), ("to host", 1), ("run", 2), ("to host", 2),
            ("run", 3),  # the last block's input stays on the device
            ("backward", 3), ("to device", 2), ("run", 3),
            ("backward", 2), ("to device", 1), ("run", 2),
            ("backward", 1), ("to device", 0), ("run", 1),
            ("backward", 0), ("run", 0)]  # nothing after the first block


class _Storages(TorchDispatchMode):
    """Every storage the ops make, numbered, with its death (a weak reference): ``alive`` is
    the set of numbers alive now."""

    def __init__(self):
        super().__init__()
        self.number: dict[int, int] = {}  # id(storage) -> its number, while alive
        self.alive: set[int] = set()
        self._refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self.number:
                self._add(t.untyped_storage())
        return out

    def _add(self, storage):
        n, key = len(self._refs), id(storage)
        self.number[key] = n
        self.alive.add(n)

        def died(_, key=key, n=n):
            self.alive.discard(n)
            if self.number.get(key) == n:
                del self.number[key]

        self._refs.append(weakref.ref(storage, died))

    def of(self, t):
        return self.number.get(id(t.untyped_storage()))


class _Counting(list):
    """A blocks' log that records, at each block run, the storages alive and the run's input."""

    def __init__(self, storages):
        super().__init__()
        self.storages = storages
        self.inputs: set[int] = set()
        self.alive_at_runs: list[set[int]] = []

    def append(self, entry):
        self.inputs.add(self.storages.of(entry[2]))
        self.alive_at_runs.append(set(self.storages.alive))


@pytest.mark.parametrize("policy,retain,most", [("full-host", False, 2), ("full-host", True, 3),
                                                ("full", False, 6)])
def test_at_most_two_block_inputs_live_on_the_device(policy, retain, most):
    """Counted at every block run, forward and recomputed: the storages alive that are (or will
    be) some block's input. "full" keeps them all (so the count measures what it should). A
    retained graph keeps the last block's input, as "full" does, and no copy brought back."""
    storages = _Storages()
    log = _Counting(storages)
    blocks = _blocks(policy, n=6, log=log)
    x, w = _data()
    with storages:
        loss = _loss(blocks, x, w, 7)
        torch.autograd.grad(loss, [x, *blocks.parameters()], retain_graph=retain)
        del loss
    assert max(len(alive & log.inputs) for alive in log.alive_at_runs) == most
    assert not storages.alive & log.inputs  # all gone after the step


def test_host_buffers_hold_exactly_the_inputs_bytes():
    """An input of 3 * 11 * 19 float32 = 2508 bytes (the pinned caching allocator would take
    4096): after the first step the host buffers are all that stays allocated, L - 1 inputs'
    bytes; the next step allocates nothing that stays (the buffers are reused)."""
    n, shape = 5, (3, 11, 19)
    nbytes = 3 * 11 * 19 * 4
    blocks = _blocks("full-host", n=n, dtype=torch.float32)
    x, w = _data(shape, torch.float32)
    step = lambda: (_grads(blocks, x, w), None)[1]  # noqa: E731  (the gradients let go)
    first = allocation_stats(step)
    assert first.retained == (n - 1) * nbytes
    assert [b.forward.host_buffers.nbytes for b in blocks] == [nbytes] * (n - 1) + [0]
    assert allocation_stats(step).retained == 0


def test_gradient_accumulation_no_grad_and_eval(monkeypatch):
    log = []
    trace = _Trace(monkeypatch, log)
    x, w = _data()
    runs = {}
    for policy in ("full", "full-host"):
        blocks = _blocks(policy)
        for seed in (3, 4, 5):  # three micro-batches, .grad accumulated
            _loss(blocks, x, w, seed).backward()
            with torch.no_grad():  # an evaluation between micro-batches: plain forward
                evaluated = _loss(blocks, x, w, seed)
        blocks.eval()
        in_eval = _grads(blocks, x, w)
        runs[policy] = [x.grad, *(p.grad for p in blocks.parameters()), evaluated, *in_eval]
        x.grad = None
    assert _equal(runs["full-host"], runs["full"])
    fetched = [e for e in trace.events() if e[0] == "to device"]
    assert len(fetched) == 4 * 4  # 4 steps with grad, 4 inputs brought back each
    assert not _fetched_on_demand(trace.events())


def _fetched_on_demand(events):
    """Inputs fetched by their own block's backward (not one block ahead)."""
    return [b for a, b in zip(events, events[1:])
            if a[0] == "backward" and b == ("to device", a[1])]


def test_two_forwards_then_one_backward(monkeypatch):
    """Both micro-batches' blocks make one chain: the second's first block sends the first's
    last input to host memory, and the backward (second micro-batch first) brings each back
    one block ahead. A module alive in two calls at once has two host buffers."""
    log = []
    trace = _Trace(monkeypatch, log)
    x, w = _data()
    results = {}
    for policy in ("full", "full-host"):
        blocks = _blocks(policy, n=3)
        loss = _loss(blocks, x, w, 1) + _loss(blocks, x, w, 2)
        results[policy] = [loss, *torch.autograd.grad(loss, [x, *blocks.parameters()])]
    assert _equal(results["full-host"], results["full"])
    assert trace.events() == [
        ("to host", 0), ("to host", 1), ("to host", 2), ("to host", 3), ("to host", 4),
        ("backward", 5), ("to device", 4), ("backward", 4), ("to device", 3),
        ("backward", 3), ("to device", 2), ("backward", 2), ("to device", 1),
        ("backward", 1), ("to device", 0), ("backward", 0)]
    nbytes = x.numel() * 8
    assert [b.forward.host_buffers.nbytes for b in blocks] == [2 * nbytes, 2 * nbytes, nbytes]


def test_retained_graph_fetches_again_and_shared_module():
    """A module called twice in one chain (weights shared) and a graph backpropagated twice."""
    x, w = _data()
    results = {}
    for policy in ("full", "full-host"):
        blocks = _blocks(policy, n=2)
        loss = _loss(blocks, x, w, 1, order=[0, 1, 0, 1, 0])
        first = torch.autograd.grad(loss, [x, *blocks.parameters()], retain_graph=True)
        second = torch.autograd.grad(loss, [x, *blocks.parameters()])
        results[policy] = [loss, *first, *second]
    assert _equal(results["full-host"], results["full"])
    half = (len(results["full"]) - 1) // 2
    assert _equal(results["full-host"][1:1 + half], results["full-host"][1 + half:])


def test_backward_through_part_of_the_chain():
    """Gradients for the input of block 3 only: blocks 3 and 4 run backward; block 2's input,
    brought back when block 3's backward started, is let go unused with the graph."""
    x, w = _data()
    results = {}
    for policy in ("full", "full-host"):
        blocks = _blocks(policy)
        torch.manual_seed(7)
        h, inputs = x * 1.0, []
        for b in blocks:
            inputs.append(h)
            h = b(h)
        results[policy] = torch.autograd.grad((h * w).sum(), [inputs[3], *blocks[3:].parameters()])
        del h, inputs
    assert _equal(results["full-host"], results["full"])


def test_inside_an_outer_checkpoint():
    """Blocks under "full-host" inside a module under "full" (recomputed inside its backward)."""
    x, w = _data()
    results = {}
    for policy in ("full", "full-host"):
        blocks = _blocks(policy, n=4)
        outer = mk.checkpoint(nn.Sequential(*blocks[:2]), "full")
        torch.manual_seed(7)
        h = blocks[3](blocks[2](outer(x * 1.0)))
        loss = (h * w).sum()
        results[policy] = [loss, *torch.autograd.grad(loss, [x, *blocks.parameters()])]
    assert _equal(results["full-host"], results["full"])


def test_input_strides_come_back():
    """A permuted (dense, not contiguous) input is recomputed from a tensor of its strides."""
    log = []
    blocks = _blocks("full-host", n=3, log=log)
    x, w = _data((11, 3, 19))
    torch.manual_seed(0)
    h = (x * 1.0).transpose(0, 1)
    for b in blocks:
        h = b(h.transpose(0, 1).contiguous().transpose(0, 1))
    h.sum().backward()
    strides = {}
    for _, i, t in log:
        strides.setdefault(i, set()).add(t.stride())
    assert all(s == {(19, 57, 1)} for s in strides.values())


def test_hf_llama_decoder_layers_equal_full():
    """transformers' Llama, every decoder layer under the policy (its input the hidden states,
    the rotary embeddings and the mask passed by keyword), attention dropout on."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=48, intermediate_size=88, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=301,
                                   attention_dropout=0.2, attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 23))
    results = {}
    for policy in ("full", "full-host"):
        model = copy.deepcopy(ref)
        for layer in model.model.layers:
            mk.checkpoint(layer, policy)
        torch.manual_seed(1)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results[policy] = [loss, *(p.grad for p in model.parameters())]
    assert _equal(results["full-host"], results["full"])


class _Pair(nn.Module):
    def forward(self, pair):
        return pair[0] * pair[1]


def test_an_input_that_is_not_one_tensor_is_refused():
    m = mk.checkpoint(_Pair(), "full-host")
    a = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match="first positional argument must be the block's input, "
                                        "one tensor.*got tuple.*policy 'full'"):
        m((a, a))
    block = mk.checkpoint(Block(4, 0.0), "full-host")
    with pytest.raises(TypeError, match="got no positional argument"):
        block(x=a)


def test_under_torch_compile_the_block_runs_eagerly():
    """torch.compile of a model of full-host blocks: the graph breaks around each block, which
    runs as without compile (bit for bit), its input kept in host memory all the same."""
    x, w = _data()
    blocks = _blocks("full-host", n=3)
    compiled = torch.compile(_chain)
    torch.manual_seed(7)
    loss = (compiled(blocks, x * 1.0) * w).sum()
    got = [loss, *torch.autograd.grad(loss, [x, *blocks.parameters()])]
    assert _equal(got, _grads(_blocks("full", n=3), x, w))
    assert [b.forward.host_buffers.nbytes for b in blocks] == [x.numel() * 8] * 2 + [0]


def _chain(blocks, h):
    for b in blocks:
        h = b(h)
    return h


@pytest.mark.cuda
def test_on_cuda_pinned_exact_host_buffers_and_a_lower_peak():
    """On a GPU: the copies run on a side stream; the gradients equal "full"'s bit for bit; each
    host buffer is page-locked and of exactly one input's bytes; the step's peak is at least
    (n - 3) inputs under "full"'s (which keeps all n; this policy about three at its peak)."""
    n, shape = 6, (2, 509, 256)
    nbytes = 2 * 509 * 256 * 4
    x, w = (t.cuda() for t in _data(shape, torch.float32))
    x = x.detach().requires_grad_()
    peaks, results = {}, {}
    for policy in ("full", "full-host"):
        blocks = _blocks(policy, n=n, d=256, dtype=torch.float32).cuda()
        step = lambda blocks=blocks: _grads(blocks, x, w)  # noqa: E731
        step()  # warm-up: cuBLAS workspaces, the host buffers
        stats = allocation_stats(step, device="cuda")
        peaks[policy], results[policy] = stats.peak, stats.result
    assert _equal(results["full-host"], results["full"])
    buffers = [b for block in blocks for b in block.forward.host_buffers.free]
    assert len(buffers) == n - 1
    assert all(b.tensor.is_pinned() and b.tensor.numel() == nbytes for b in buffers)
    assert peaks["full"] - peaks["full-host"] >= (n - 3) * nbytes, peaks
