"""Capturing a model (torch.export, torch.fx as the fallback) and grouping it into blocks: the
nodes of a profile are named after the model's modules, the graph keeps its skip connections,
the capture is deterministic and free of side effects, and a custom autograd Function keeps its
own backward (or the capture is refused)."""

from __future__ import annotations

import functools

import networkx as nx
import pytest
import torch
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.pipeline.stage import build_stage_index
from hybridpipe.profiles.blocks import is_operation
from hybridpipe.profiles.capture import capture_model
from hybridpipe.profiles.graphinfo import graph_edges, node_infos
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.models import Reused
from tests.profiles.user_models import Gate

GPT = "gpt[layers=2,width=32,heads=4,seq=16,vocab=50]"
ALEXNET_PAPER = {"conv1": 34_944, "conv2": 614_656, "conv3": 885_120, "conv4": 1_327_488, "conv5": 884_992,
                 "fc1": 37_752_832, "fc2": 16_781_312, "fc3": 4_097_000}


@functools.cache
def captured(spec: str, granularity: str | int = "blocks", batch: int = 2, leaves=None):
    """The capture of a zoo model built from seed 0 (one per arguments: the tests only read it)."""
    return fresh_capture(spec, granularity, batch, leaves)


def fresh_capture(spec: str, granularity: str | int = "blocks", batch: int = 2, leaves=None):
    ms = resolve_model(spec)
    torch.manual_seed(0)
    model = ms.build()
    return capture_model(model, ms.example_input(batch), granularity=granularity,
                         leaf_modules=ms.leaf_modules if leaves is None else leaves)


def digraph(c) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(range(len(c.blocks)))
    g.add_edges_from(graph_edges(c))
    return g


def skip_edges(g: nx.DiGraph) -> list[tuple[int, int]]:
    """Edges (u, v) where v is also reachable from u by a longer path: a skip connection."""
    out = []
    for u, v in g.edges:
        h = g.copy()
        h.remove_edge(u, v)
        if nx.has_path(h, u, v):
            out.append((u, v))
    return out


def first_op(c, i: int) -> str:
    node = next(n for n in c.graph.graph.nodes if n.name == c.blocks[i].nodes[0])
    return str(node.target)


def test_blocks_are_the_models_layers_named_by_module_path():
    assert [b.name for b in captured(GPT).blocks] == ["embed", "drop", "blocks.0", "blocks.1", "ln", "head"]
    assert [b.name for b in captured("mlp").blocks] == [str(i) for i in range(9)]
    res = captured("resnet-small")
    assert [b.name for b in res.blocks] == ["stem.0", "stem.1", "relu", "blocks.0", "blocks.1", "blocks.2",
                                           "avgpool", "flatten", "fc"]
    assert [b.type for b in res.blocks][3:6] == ["BasicBlock"] * 3


def test_alexnet_paper_layers_appear_with_their_sizes():
    c = captured("alexnet[image=64]")
    assert c.front_end == "export"
    sizes = {i.name: sum(c.module.get_parameter(p).numel() for p in i.params) for i in node_infos(c)}
    assert {k: v for k, v in sizes.items() if v} == ALEXNET_PAPER
    assert [i.type for i in node_infos(c) if i.name in ALEXNET_PAPER] == ["Conv2d"] * 5 + ["Linear"] * 3


def test_granularity_depth_modules_and_ops():
    assert [b.name for b in captured(GPT, 1).blocks] == ["embed", "drop", "blocks", "ln", "head"]
    modules = captured(GPT, "modules")
    assert [b.name for b in modules.blocks][2:10] == ["blocks.0.ln1", "blocks.0.attn.qkv", "blocks.0.attn.proj",
                                                       "blocks.0.ln2", "blocks.0.fc", "blocks.0.gelu",
                                                       "blocks.0.out", "blocks.0.drop"]
    embed = node_infos(modules)[0]            # the zoo keeps Embeddings whole (a leaf module)
    assert embed.name == "embed" and set(embed.params) == {"embed.tokens.weight", "embed.positions"}
    ops = captured(GPT, "ops")
    assert all(len(b.nodes) == 1 for b in ops.blocks) and "blocks.0.attn:scaled_dot_product_attention" in {
        b.name for b in ops.blocks}
    for bad in ("layers", 0, "-1"):
        with pytest.raises(UserError, match="granularity"):
            captured(GPT, bad)


def test_leaf_keeps_a_module_whole_by_class_name_or_type():
    from hybridpipe.profiles.zoo.gpt import Block

    for leaf in ("Block", Block):
        names = [b.name for b in captured(GPT, "modules", leaves=(leaf,)).blocks]
        assert names == ["embed.tokens", "drop", "blocks.0", "blocks.1", "ln", "head"]
    with pytest.raises(UserError, match="leaf module 'Blok' is not a module class of GPT; its classes are: Block"):
        captured(GPT, leaves=("Blok",))


def test_every_operation_is_in_one_block_and_blocks_follow_the_graph_order():
    for granularity in ("blocks", "modules", "ops"):
        c = captured("resnet-small", granularity)
        order = [n.name for n in c.graph.graph.nodes if is_operation(n)]
        assert [name for b in c.blocks for name in b.nodes] == order
        assert len({b.name for b in c.blocks}) == len(c.blocks)


def test_edges_follow_the_values_and_go_forward():
    c = captured("resnet-small", "modules")
    block = {name: i for i, b in enumerate(c.blocks) for name in b.nodes}
    expected = sorted({(block[n.name], block[u.name]) for n in c.graph.graph.nodes for u in n.users
                       if n.name in block and u.name in block and block[n.name] != block[u.name]})
    assert graph_edges(c) == expected and all(s < d for s, d in expected)


def check_residual_adds(spec: str, adds_expected: int, identity: int, long_branch: int) -> None:
    """Every residual add joins a short branch (the shortcut) and a long one (the convolutions);
    ``identity`` of them take the block's input itself: a skip edge of the graph."""
    c = captured(spec, "ops")
    g = digraph(c)
    adds = [i for i in g.nodes if first_op(c, i) == "aten.add.Tensor"]
    assert len(adds) == adds_expected and all(g.in_degree(n) == 2 for n in adds)
    assert len(skip_edges(g)) == identity
    for v in adds:
        a, b = g.predecessors(v)
        fork = nx.lowest_common_ancestor(g, a, b)
        branches = sorted(nx.shortest_path_length(g, fork, p) for p in (a, b))
        assert branches[0] <= 3 and branches[1] >= long_branch, (v, branches)
    assert nx.is_directed_acyclic_graph(g)


def test_resnet_has_a_skip_connection_into_every_residual_add():
    check_residual_adds("resnet-small[norm=none]", 3, 1, 3)      # blocks 1 and 2 project their shortcut


@pytest.mark.slow
def test_resnet50_has_a_skip_connection_into_every_residual_add():
    # 3 + 4 + 6 + 3 bottleneck blocks; identity shortcuts: all blocks but the 4 projecting ones
    check_residual_adds("resnet50[image=32,classes=10]", 16, 12, 8)


def test_plain_chain_has_no_skip_edges():
    g = digraph(captured("alexnet-small"))
    assert skip_edges(g) == [] and all(d <= 1 for _, d in g.in_degree())


def test_gpt_graph_has_residuals_and_multi_input_attention():
    c = captured(GPT, "ops")
    g = digraph(c)
    attention = [i for i in g.nodes if first_op(c, i) == "aten.scaled_dot_product_attention.default"]
    assert len(attention) == 2 and all(g.in_degree(n) == 3 for n in attention)      # q, k, v
    residual = [i for i in g.nodes if first_op(c, i) == "aten.add.Tensor" and c.blocks[i].name.startswith("blocks.")]
    assert len(residual) == 4 and len(skip_edges(g)) >= 4


def test_capture_is_deterministic_across_fresh_models():
    a, b = fresh_capture(GPT, "modules"), fresh_capture(GPT, "modules")
    assert node_infos(a) == node_infos(b) and graph_edges(a) == graph_edges(b)
    assert [blk.nodes for blk in a.blocks] == [blk.nodes for blk in b.blocks] and a.graph.code == b.graph.code


def test_every_parameter_is_owned_by_exactly_one_node_and_reuse_is_shared():
    c = captured("resnet-small", "modules")
    owned = [p for info in node_infos(c) for p in info.params]
    assert sorted(owned) == sorted(name for name, _ in c.module.named_parameters())
    reused = capture_model(Reused(), torch.randn(4, 8), granularity="modules")
    infos = node_infos(reused)
    assert [i.name for i in infos] == ["shared", "mid", "shared#2"]
    assert infos[0].params == ("shared.weight", "shared.bias") and infos[2].params == ()
    assert set(infos[2].shared) == {"shared.weight", "shared.bias"}


class _Reverse(torch.autograd.Function):
    """Identity forward, negated gradient: a gradient reversal layer."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return -grad


class Reversal(nn.Module):
    def forward(self, x):
        return _Reverse.apply(x)


class Adversarial(nn.Module):
    def __init__(self, reverse: bool = True):
        super().__init__()
        self.features, self.head = nn.Linear(8, 8), nn.Linear(8, 3)
        self.reverse = Reversal() if reverse else nn.Identity()

    def forward(self, x):
        return self.head(self.reverse(torch.tanh(self.features(x))))


def _grads(model: nn.Module, x, y, c=None) -> dict[str, torch.Tensor]:
    model.zero_grad()
    if c is None:
        out = model(x)
    else:                                      # the captured graph cut into two stages, run as a pipeline
        ranges = [(0, 1), (2, len(c.blocks) - 1)]
        first, second = (build_stage_index(c, ranges, i, loss=nn.functional.cross_entropy) for i in range(2))
        a = first.forward(first.data_inputs(x))
        b = second.forward({k: v.detach() for k, v in a.outputs.items()}, target=y)
        first.backward(a, second.backward(b))
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    nn.functional.cross_entropy(out, y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_custom_autograd_function_keeps_its_backward_or_is_refused():
    torch.manual_seed(0)
    model, x, y = Adversarial(), torch.randn(4, 8), torch.randint(0, 3, (4,))
    with pytest.raises(UserError) as err:
        capture_model(model, x)
    assert "custom torch.autograd.Function _Reverse (in Reversal.forward)" in str(err.value)
    assert "--leaf Reversal" in str(err.value) and "\n" not in str(err.value)
    c = capture_model(model, x, leaf_modules=("Reversal",))        # exported, the leaf one call of the module
    assert c.front_end == "export" and [b.name for b in c.blocks] == ["features", "reverse", "head"]
    expected = _grads(model, x, y)
    got = _grads(model, x, y, c)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])
    plain = Adversarial(reverse=False)                   # the reversal matters: without it the features'
    plain.load_state_dict(model.state_dict())            # gradient has the other sign
    torch.testing.assert_close(_grads(plain, x, y)["features.weight"], -expected["features.weight"])


def test_custom_autograd_function_outside_the_leaves_is_refused():
    class Outside(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.head = Gate(8), nn.Linear(8, 3)

        def forward(self, x):
            return self.head(_Reverse.apply(self.gate(x)))

    with pytest.raises(UserError, match="_Reverse outside the leaf modules \\(Gate\\)"):
        capture_model(Outside(), torch.randn(4, 8), leaf_modules=("Gate",))


@pytest.mark.parametrize("model", [
    nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3)),            # export
    nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), Gate(8), nn.Linear(8, 3)),   # fx fallback
], ids=["export", "fx"])
def test_capture_leaves_the_buffers_as_they_were(model):
    """Batch norm's running statistics are what a fresh model has: the fx fallback runs the graph
    once (to record the values between nodes), which must not count as a training step."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    c = capture_model(model, torch.randn(4, 8))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert c.front_end == ("fx" if any(isinstance(m, Gate) for m in model) else "export")
