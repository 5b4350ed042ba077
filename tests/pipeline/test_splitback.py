"""The split backward (splitback.py, weightgrads.py) against a plain ``backward()`` on a deep copy
of the same stage: input and parameter gradients bit for bit, post-accumulate-grad hooks once per
parameter per micro-batch, and what the input half keeps for the weight half."""

from __future__ import annotations

import copy
import weakref
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpipe.pipeline import splitback
from hybridpipe.pipeline.splitplan import SplitPlans


class _GPT2Blocks(nn.Module):
    """A GPT-2 block stage: Hugging Face's decoder layers (Conv1D's addmm, layer norm, attention, GELU)."""

    def __init__(self, layers: int):
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        super().__init__()
        cfg = GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=64, resid_pdrop=0, embd_pdrop=0,
                         attn_pdrop=0, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
        self.h = nn.ModuleList(GPT2Block(cfg, layer_idx=i) for i in range(layers))

    def forward(self, x):
        for block in self.h:
            x = block(x)
            x = x[0] if isinstance(x, tuple) else x
        return x


def _compare(split: nn.Module, run, micro_batches: int = 2, one_pass: bool = False,
             tol: float = 0.0, module=lambda m: m, plans: SplitPlans | None = None) -> list[int]:
    """``run(model, seed) -> (outputs, output_grads, inputs)``: the split backward on ``split``
    and a plain one on its deep copy, ``micro_batches`` times accumulated; the gradients must
    agree and every parameter's post-accumulate hook fire once per micro-batch (``module``: the
    module holding the parameters; ``plans``: the cut plans kept across micro-batches). Returns
    each micro-batch's groups left to autograd."""
    plain = copy.deepcopy(split)
    split_model, plain_model = module(split), module(plain)
    fired: dict[str, int] = {}
    plain_fired: dict[str, int] = {}
    for counts, m in ((fired, split_model), (plain_fired, plain_model)):
        for name, p in m.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _p, n=name, c=counts: c.__setitem__(n, c.get(n, 0) + 1))
    works = []
    for mb in range(micro_batches):
        outs, grads, ins = run(plain, mb)
        plain_before = dict(plain_fired)
        torch.autograd.backward(outs, grads)
        want_in = [t.grad for t in ins]
        outs, grads, ins = run(split, mb)
        work = splitback.backward_input(outs, grads, ins, list(split_model.parameters()), one_pass=one_pass,
                                        plans=plans)
        assert all(p.grad is None for p in split_model.parameters()) if mb == 0 else True
        for t, w in zip(ins, want_in, strict=True):
            assert (t.grad is None) == (w is None)
            if w is not None:
                torch.testing.assert_close(t.grad, w, rtol=0, atol=tol)
        before = dict(fired)
        works.append(len(work.groups))
        splitback.backward_weight(work)
        # once per parameter the micro-batch reaches, as the plain backward's hooks fire
        want = {n: plain_fired[n] - plain_before.get(n, 0) for n in plain_fired}
        assert set(want.values()) <= {0, 1}
        assert {n: fired.get(n, 0) - before.get(n, 0) for n in want} == want
    assert set(fired) <= set(plain_fired)
    for (name, p), q in zip(split_model.named_parameters(), plain_model.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=tol, msg=name)
    return works


def test_gpt2_block_stage_equals_a_plain_backward_through_the_formulas():
    torch.manual_seed(0)
    model = _GPT2Blocks(2)

    def run(module, mb):
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(mb)).requires_grad_()
        out = module(x)
        return [out], [torch.randn(out.shape, generator=torch.Generator().manual_seed(10 + mb))], [x]
    # every intermediate of the decoder blocks (Conv1D's addmm, layer norm) has a formula: the
    # weight half is one autograd pass and the input half keeps no graph; the cut is found once and
    # kept: the second micro-batch reuses it, equal bit for bit
    plans = SplitPlans()
    assert _compare(model, run, plans=plans) == [0, 0]
    assert (plans.misses, plans.hits) == (1, 1)


class _Tied(nn.Module):
    """A weight read by two matrix products (one a Linear, one addmm as HF's Conv1D) and by an
    element-wise product (no formula: its group keeps the graph), a bias beside the input path."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.w = nn.Parameter(torch.randn(6, 6) / 3)
        self.b = nn.Parameter(torch.randn(6))
        self.scale = nn.Parameter(torch.randn(6))
        self.pos = nn.Parameter(torch.randn(6))

    def forward(self, x):
        h = torch.tanh(self.lin(self.ln(x)))
        h = torch.addmm(self.b, h, self.w) + self.lin(h * 2)
        return [h * self.scale * self.w[0] + self.pos * 3, torch.relu(self.pos) * 2]     # the second: no input


@pytest.mark.parametrize("stage0", [False, True])
def test_a_shared_weight_used_twice_and_a_stage_without_input_grads(stage0):
    torch.manual_seed(0)
    model = _Tied()

    def run(module, mb):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(mb)).requires_grad_(not stage0)
        outs = module(x)
        g = torch.Generator().manual_seed(10 + mb)
        return outs, [torch.randn(o.shape, generator=g) for o in outs], [x]
    plans = SplitPlans()
    works = _compare(model, run, plans=plans)
    assert (plans.misses, plans.hits) == (1, 1)
    if not stage0:
        # the element-wise products have no formula: `scale`'s group and `w`'s (merged from its two
    # uses) keep the graph; the Linear used twice and the layer norm need none
        assert works == [2, 2]


def test_a_recomputing_stage_is_one_pass_and_equal():
    torch.manual_seed(0)
    model = _Tied()

    def run(module, mb):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(mb)).requires_grad_()
        outs = torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False)
        return outs, [torch.ones_like(o) for o in outs], [x]
    _compare(model, run, one_pass=True)


def test_a_recomputing_stage_takes_layer_norms_gradients_in_the_input_half_too():
    """One pass (a recomputing stage) records nothing for a layer norm whose weight and bias the input
    half takes (as without recomputation, which the profile measures): the recorded gradients are the
    two products' output gradients only, and every gradient equals a plain backward's bit for bit,
    each parameter's hook once (the one pass runs the input path again through the layer norm: the
    taken gradients are accumulated in their own pass, not twice)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(approximate="tanh"), nn.Linear(16, 8))
    plain = copy.deepcopy(model)
    fired: dict[str, int] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: fired.__setitem__(name, fired.get(name, 0) + 1))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    g = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    xs, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = torch.utils.checkpoint.checkpoint(model, xs, use_reentrant=False)
    work = splitback.backward_input([out], [g], [xs], list(model.parameters()), one_pass=True)
    taken = {id(acc.variable) for acc, _ in work.early}
    assert len(work.early) == 2 and taken == {id(model[0].weight), id(model[0].bias)}
    assert sum(t.numel() for t in work.recorded()) == 8 + 8 + 4 * 16 + 4 * 8     # taken + the products' output grads
    splitback.backward_weight(work)
    torch.autograd.backward(plain(xp), g)
    assert torch.equal(xs.grad, xp.grad)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert fired == {name: 1 for name, _ in model.named_parameters()}


def test_the_input_half_frees_the_graph_as_it_goes():
    """A plain backward frees every saved tensor as it goes; the input half used to keep the whole
    graph (retain_graph) until the weight half: memory the allocator had to map afresh. Now the
    weight half holds only what its formulas read (``work.held()``), as tensors, not the graph."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(approximate="tanh"), nn.Linear(16, 8))
    boxes: list[weakref.ref] = []

    def pack(t):
        box = _Box(t)
        boxes.append(weakref.ref(box))
        return box
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.value):
        out = model(x)
    want = torch.autograd.grad(out, list(model.parameters()), torch.ones_like(out), retain_graph=True)
    work = splitback.backward_input([out], [torch.ones_like(out)], [x], list(model.parameters()))
    assert boxes and all(r() is None for r in boxes)
    # the 2 Linear inputs (layer norm's weight and bias, and the biases, were taken in the input half)
    assert not work.groups and len(work.held()) == 2 and len(work.early) == 4
    splitback.backward_weight(work)
    for p, w in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=1e-6)


class _Box:
    __slots__ = ("value", "__weakref__")

    def __init__(self, value):
        self.value = value


def test_a_convolution_stage_equals_a_plain_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, stride=2), nn.ReLU(), nn.Conv2d(4, 4, 3, groups=2),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4, 5))

    def run(module, mb):
        x = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(mb)).requires_grad_()
        out = module(x)
        return [out], [torch.randn(out.shape, generator=torch.Generator().manual_seed(10 + mb))], [x]
    # the convolutions have no formula (their weight's layout would be read): they keep the graph
    assert _compare(model, run) == [2, 2]


def test_a_changed_graph_gets_a_fresh_plan_not_a_stale_one():
    """Plans are kept by the graph's structure: a micro-batch whose graph differs (another path
    with as many outputs, an input that needs no gradient, the parameters in another order) gets
    its own plan, and every way stays equal to a plain backward."""
    torch.manual_seed(0)
    model = _Tied()
    plans = SplitPlans()
    ways = [(False, False), (True, False), (False, True), (False, False)]   # (skip the Linear, stage 0)

    def run(module, mb):
        skip, stage0 = ways[mb]
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(mb)).requires_grad_(not stage0)
        outs = ([torch.addmm(module.b, x, module.w) * module.scale + module.pos, torch.relu(module.pos) * 2]
                if skip else module(x))
        g = torch.Generator().manual_seed(10 + mb)
        return outs, [torch.randn(o.shape, generator=g) for o in outs], [x]
    _compare(model, run, micro_batches=len(ways), plans=plans)
    assert (plans.misses, plans.hits) == (3, 1)
    # the same structure with the parameters listed in another order: another key, a fresh plan
    x = torch.randn(5, 6, requires_grad=True)
    outs = model(x)
    params = list(model.parameters())[::-1]
    grads = [torch.ones_like(o) for o in outs]
    want = torch.autograd.grad(outs, params, grads, retain_graph=True)
    for p in params:
        p.grad = None
    splitback.backward_weight(splitback.backward_input(outs, grads, [x], params, plans=plans))
    assert (plans.misses, plans.hits) == (4, 1)
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=0)


class _Ops(TorchDispatchMode):
    """Counts the aten ops run under it, by name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_gradients_costing_no_product_are_taken_in_the_input_half():
    """Layer norm's weight and bias gradients (its kernel makes them in the call that makes the
    input's) and the products' biases (sums) are taken by the input half: layer norm's backward runs
    once per layer norm over both halves, as in a plain backward (it ran once in each half), and
    between the halves a GPT-2 block stage holds each product's input and output gradient and the
    taken gradients (parameter-sized): not layer norm's input, statistics and output gradient."""
    torch.manual_seed(0)
    layers, rows = 2, 16
    model = _GPT2Blocks(layers)
    plain = copy.deepcopy(model)
    x = torch.randn(2, 8, 32, requires_grad=True)
    g = torch.randn(2, 8, 32)
    with _Ops() as ops:
        torch.autograd.backward(plain(x), g)
    assert ops.ops["native_layer_norm_backward"] == 2 * layers
    leaf = x.detach().requires_grad_()
    out = model(leaf)
    with _Ops() as first:
        work = splitback.backward_input([out], [g], [leaf], list(model.parameters()))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (*work.held(), *work.recorded())}
    products = [m for m in model.modules() if type(m).__name__ == "Conv1D"]
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    want = sum(rows * (m.nx + m.nf) + m.nf for m in products) + sum(2 * m.normalized_shape[0] for m in norms)
    assert sum(storages.values()) == 4 * want
    assert {d.node.name() for d in work.direct} == {"AddmmBackward0"} and len(work.held()) == len(products)
    with _Ops() as second:
        splitback.backward_weight(work)
    assert (first.ops["native_layer_norm_backward"], second.ops["native_layer_norm_backward"]) == (2 * layers, 0)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_a_tensor_hook_on_a_parameter_runs_once():
    """A parameter with a tensor hook is accumulated by the weight half from its product's gradient:
    the hook runs once (on a gradient the input half took it would run there, then again on
    accumulating); the plan made before the hook was registered is not reused after."""
    torch.manual_seed(0)
    model = _GPT2Blocks(1)

    def run(module, mb):
        if mb == 1:
            module.h[0].ln_1.weight.register_hook(lambda grad: grad * 3)
            module.h[0].attn.c_attn.bias.register_hook(lambda grad: grad * 3)
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(mb)).requires_grad_()
        out = module(x)
        return [out], [torch.randn(out.shape, generator=torch.Generator().manual_seed(10 + mb))], [x]
    plans = SplitPlans()
    _compare(model, run, micro_batches=3, plans=plans)
    assert (plans.misses, plans.hits) == (2, 1)
