"""torch.fx's tracer, the capture's fallback (profiles/trace.py): it computes the model, is
deterministic, keeps leaf modules as single calls, falls back to one call per child of an
nn.Sequential, and names what it cannot trace. (The structure of the captured graph that profiles
record -- blocks, edges, skip connections -- is tested on the torch.export capture: test_capture.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.profiles.trace import trace_model
from hybridpipe.profiles.zoo import resolve_model
from tests.profiles.user_models import Gate, Gated


def traced(spec: str):
    ms = resolve_model(spec)
    model = ms.build()
    return ms, model, trace_model(model, ms.leaf_modules)


def calls(gm) -> list[tuple[str, str]]:
    """(fx op, target) of every node but the placeholders and the output."""
    return [(n.op, str(n.target)) for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


@pytest.mark.parametrize("spec", ["resnet-small[norm=none]", "gpt[layers=2,width=32,heads=4,seq=16,vocab=50]",
                                  "alexnet-small[dropout=0]"])
def test_traced_graph_computes_the_model(spec):
    ms, model, gm = traced(spec)
    x = ms.example_input(3)
    torch.testing.assert_close(gm(x), model(x))


def test_tracing_is_deterministic_across_fresh_models():
    a = trace_model(resolve_model("resnet-small").build())
    b = trace_model(resolve_model("resnet-small").build())
    assert a.code == b.code and [n.name for n in a.graph.nodes] == [n.name for n in b.graph.nodes]


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
        assert [n.name for n in gm.graph.nodes] == ["x", "inp", "relu", "gate", "head", "output"]
        assert ("call_module", "gate") in calls(gm)
        x = torch.randn(3, 8)
        torch.testing.assert_close(gm(x), model(x))


def test_unknown_leaf_name_lists_the_model_classes():
    with pytest.raises(UserError, match="'Gat' is not a module class of Gated; its classes are: Gate, Gated, Linear"):
        trace_model(Gated(), ("Gat",))


def test_sequential_of_untraceable_children_falls_back_to_one_call_per_child():
    model = nn.Sequential(nn.Linear(8, 8), Gate(8), Gate(8), nn.Linear(8, 3))
    gm = trace_model(model)
    assert calls(gm) == [("call_module", str(i)) for i in range(4)]
    assert [type(gm.get_submodule(str(i))).__name__ for i in range(4)] == ["Linear", "Gate", "Gate", "Linear"]
    assert dict(gm.named_parameters()).keys() == dict(model.named_parameters()).keys()
    x = torch.randn(2, 8)
    torch.testing.assert_close(gm(x), model(x))
