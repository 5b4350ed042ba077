"""Tracing: graph structure (skip connections, multi-input ops), determinism, leaves, fallback, errors."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.profiles.trace import graph_edges, node_infos, to_digraph, trace_model
from hybridpipe.profiles.zoo import resolve_model
from tests.profiles.user_models import Gate, Gated


def traced(spec: str):
    ms = resolve_model(spec)
    model = ms.build()
    return ms, model, trace_model(model, ms.leaf_modules)


def skip_edges(g: nx.DiGraph) -> list[tuple[int, int]]:
    """Edges (u, v) where v is also reachable from u by a longer path: a skip connection."""
    out = []
    for u, v in g.edges:
        h = g.copy()
        h.remove_edge(u, v)
        if nx.has_path(h, u, v):
            out.append((u, v))
    return out


def test_resnet50_has_a_skip_connection_into_every_block_add():
    _, _, gm = traced("resnet50")
    g = to_digraph(gm)
    adds = [n for n, d in g.nodes(data=True) if d["type"] == "add"]
    assert len(adds) == 16                         # 3 + 4 + 6 + 3 bottleneck blocks
    assert all(g.in_degree(n) == 2 for n in adds)
    assert len(skip_edges(g)) == 12                # identity shortcuts: all blocks but the 4 projecting ones
    for v in adds:                                 # every add joins a short branch and the residual branch
        a, b = g.predecessors(v)
        fork = nx.lowest_common_ancestor(g, a, b)
        branches = sorted(nx.shortest_path_length(g, fork, p) for p in (a, b))
        assert branches[0] <= 2 and branches[1] >= 8, (v, branches)
    assert nx.is_directed_acyclic_graph(g)


def test_plain_chain_has_no_skip_edges():
    _, _, gm = traced("alexnet-small")
    g = to_digraph(gm)
    assert skip_edges(g) == [] and all(d <= 1 for _, d in g.in_degree())


def test_gpt_graph_has_residuals_and_multi_input_attention():
    _, _, gm = traced("gpt[layers=2,width=32,heads=4,seq=16,vocab=50]")
    g = to_digraph(gm)
    kinds = nx.get_node_attributes(g, "type")
    attention = [n for n, t in kinds.items() if t == "scaled_dot_product_attention"]
    assert len(attention) == 2 and all(g.in_degree(n) == 3 for n in attention)
    residual_adds = [n for n, t in kinds.items() if t == "add"]
    assert len(residual_adds) == 4 and len(skip_edges(g)) >= 4
    assert "get_attr" not in {d["op"] for _, d in g.nodes(data=True)}    # embeddings are one leaf node
    assert kinds[1] == "Embeddings" and set(g.nodes[1]["params"]) == {"embed.tokens.weight", "embed.positions"}


@pytest.mark.parametrize("spec", ["resnet-small[norm=none]", "gpt[layers=2,width=32,heads=4,seq=16,vocab=50]",
                                  "alexnet-small[dropout=0]"])
def test_traced_graph_computes_the_model(spec):
    ms, model, gm = traced(spec)
    x = ms.example_input(3)
    torch.testing.assert_close(gm(x), model(x))


def test_tracing_is_deterministic_across_fresh_models():
    a = trace_model(resolve_model("resnet-small").build())
    b = trace_model(resolve_model("resnet-small").build())
    assert node_infos(a) == node_infos(b) and graph_edges(a) == graph_edges(b)


def test_graph_edges_follow_node_inputs_and_go_forward():
    _, _, gm = traced("resnet-small[blocks=2]")
    infos = node_infos(gm)
    index = {info.name: i for i, info in enumerate(infos)}
    expected = sorted({(index[src], i) for i, info in enumerate(infos) for src in info.inputs})
    assert graph_edges(gm) == expected and all(s < d for s, d in expected)
    assert infos[0].op == "placeholder" and infos[-1].op == "output"


def test_every_parameter_is_owned_by_exactly_one_node():
    _, model, gm = traced("resnet-small")
    owned = [p for info in node_infos(gm) for p in info.params]
    assert sorted(owned) == sorted(name for name, _ in model.named_parameters())


def test_untraceable_module_error_names_the_module_the_line_and_the_fix():
    with pytest.raises(UserError) as err:
        trace_model(Gated())
    msg = str(err.value)
    assert "'gate' (Gate)" in msg and "user_models.py" in msg and "if x.sum() > 0:" in msg
    assert "--leaf Gate" in msg and "\n" not in msg


def test_untraceable_top_level_forward_suggests_a_submodule_or_sequential():
    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return sum(self.lin(row) for row in x)

    with pytest.raises(UserError, match=r"in Loop.forward .*for row in x.*nn.Sequential"):
        trace_model(Loop())


def test_leaf_by_type_or_by_name_makes_it_traceable():
    model = Gated()
    for leaf in (Gate, "Gate", "tests.profiles.user_models.Gate"):
        gm = trace_model(model, (leaf,))
        assert [i.name for i in node_infos(gm)] == ["x", "inp", "relu", "gate", "head", "output"]
        x = torch.randn(3, 8)
        torch.testing.assert_close(gm(x), model(x))


def test_unknown_leaf_name_lists_the_model_classes():
    with pytest.raises(UserError, match="'Gat' is not a module class of Gated; its classes are: Gate, Gated, Linear"):
        trace_model(Gated(), ("Gat",))


def test_sequential_of_untraceable_children_falls_back_to_one_node_per_child():
    model = nn.Sequential(nn.Linear(8, 8), Gate(8), Gate(8), nn.Linear(8, 3))
    gm = trace_model(model)
    infos = node_infos(gm)
    assert [i.op for i in infos] == ["placeholder"] + ["call_module"] * 4 + ["output"]
    assert [i.type for i in infos[1:-1]] == ["Linear", "Gate", "Gate", "Linear"]
    assert infos[2].params == ("1.linear.weight", "1.linear.bias")
    assert graph_edges(gm) == [(i, i + 1) for i in range(5)]
    x = torch.randn(2, 8)
    torch.testing.assert_close(gm(x), model(x))
