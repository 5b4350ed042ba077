"""Leaf modules (--leaf CLASS) inside torch.export: each call one node that runs the module as written
(data-dependent routing, .tolist(), loops, custom autograd Functions), the rest of the model exported;
the error for what export cannot capture names the class to leaf, and following it works; a leaf's
node is timed and what it saves for the backward is counted."""

from __future__ import annotations

import json
import re

import torch

from hybridpipe.cli import main
from hybridpipe.profiles.capture import capture_model
from hybridpipe.profiles.leaves import leaf_paths, size_sources
from tests.profiles.moe_models import TinyMoE, moe

MOE = "tests.profiles.moe_models:moe"
QUICK = ["--batch-size", "4", "--repeats", "1", "--warmup", "0", "-q"]


def test_following_the_suggested_leaf_profiles_the_model(tmp_path, capsys):
    """The suggestion of the error is the fix: profile fails naming Experts, --leaf Experts profiles
    it, the experts one node each, timed, and what they save for the backward counted (measured
    here on the module itself, eagerly)."""
    assert main(["profile", MOE, *QUICK, "-o", str(tmp_path / "no.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "(in Experts.forward)" in err, err
    leaves = re.findall(r"--leaf (\w+)", err)
    assert leaves == ["Experts"], err
    out = tmp_path / "moe.json"
    assert main(["profile", MOE, "--leaf", leaves[0], "--granularity", "modules", *QUICK, "-o", str(out)]) == 0
    profile = json.loads(out.read_text())
    assert profile["front_end"] == "export" and profile["model"] == f"{MOE}[leaf=Experts]"
    nodes = {n["name"]: n for n in profile["nodes"]}
    experts = [n for n in profile["nodes"] if n["type"] == "Experts"]
    assert [n["name"] for n in experts] == ["blocks.0.experts", "blocks.1.experts"]
    assert all(n["forward_ms"] > 0 and n["backward_ms"] > 0 for n in experts)
    assert nodes["blocks.0.experts"]["param_count"] == sum(
        p.numel() for p in TinyMoE().blocks[0].experts.parameters())
    assert nodes["blocks.0.experts"]["saved_bytes"] == _saved_inside_experts()


def _saved_inside_experts() -> int:
    """Bytes autograd keeps for the backward inside ``blocks.0.experts`` (its input, output and
    parameters not counted: the profile counts those elsewhere), the model built as profile does."""
    torch.manual_seed(0)
    model, x = moe()
    experts = model.blocks[0].experts
    seen: dict[str, torch.Tensor] = {}
    handle = experts.register_forward_hook(lambda m, a, o: seen.setdefault("x", a[0].detach().clone()))
    with torch.no_grad():
        model(x)
    handle.remove()
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x_in = seen["x"].requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = experts(x_in)
    skip = {t.untyped_storage().data_ptr() for t in (*experts.parameters(), x_in, out)}
    return sum(size for ptr, size in kept.items() if ptr not in skip)


def test_a_leaf_runs_as_written_for_other_batch_sizes_and_keeps_its_own_backward():
    """Dynamic shapes survive a leaf (its output follows its input's size), and its custom autograd
    Function's backward (which halves the routing weights' gradient) is the one autograd runs."""
    torch.manual_seed(0)
    model, x = moe()
    c = capture_model(model, x, leaf_modules=("Experts",))
    assert [str(n.target) for n in c.graph.graph.nodes if n.op == "call_module"] == ["blocks.0.experts",
                                                                                     "blocks.1.experts"]
    for rows in (4, 7):
        batch = torch.randn(rows, 12, generator=torch.Generator().manual_seed(rows))
        model.zero_grad()
        c.graph(batch)[0].square().sum().backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        model(batch).square().sum().backward()
        assert all(torch.equal(got[n], p.grad) for n, p in model.named_parameters())


def test_only_the_outermost_leaves_are_calls_and_output_sizes_follow_the_inputs():
    model = TinyMoE()
    assert leaf_paths(model, ("Experts",)) == ["blocks.0.experts", "blocks.1.experts"]
    assert leaf_paths(model, ("MoEBlock", "Experts")) == ["blocks.0", "blocks.1"]
    assert leaf_paths(model, (TinyMoE,)) == []                        # the model itself is never a leaf
    hidden, chosen = (6, 16), (6, 2)                                  # tokens x width, tokens x top-k
    assert size_sources((6, 16), [hidden, chosen]) == [(0, 0), (0, 1)]
    assert size_sources((6, 2), [hidden, chosen]) == [(0, 0), (1, 1)]
    assert size_sources((6, 4), [hidden, chosen]) == [(0, 0), 4]      # no input has 4 there: a constant
    assert size_sources((3, 6), [hidden, chosen]) == [3, 6]           # 6 at another position: a constant
    assert size_sources((2, 6, 16), [(2, 6, 16), (6, 16)]) == [(0, 0), (0, 1), (0, 2)]   # the same rank first
