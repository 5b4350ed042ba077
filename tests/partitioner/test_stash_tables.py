"""The n x n activation-memory tables of modelcosts.py against a brute force over value sets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.profiles.format import Profile, ProfileNode, ProfileValue


@st.composite
def profiles(draw) -> Profile:
    n = draw(st.integers(2, 7))
    values: list[ProfileValue] = []
    saves: list[list[str]] = [[] for _ in range(n)]
    for k in range(draw(st.integers(1, 8))):         # each its own storage (views: the test below)
        p = draw(st.integers(-1, n - 2))
        q = draw(st.integers(p + 1, n - 1))
        name = f"v{k}"
        values.append(ProfileValue(name, p, q, draw(st.integers(1, 1000)), len(values)))
        for node in range(max(p, 0), q + 1):
            if draw(st.booleans()):
                saves[node].append(name)
    nodes = tuple(ProfileNode(id=i, name=f"n{i}", op="ops", target="", type="", saved_bytes=draw(st.integers(0, 99)),
                              saves=tuple(saves[i]), activation_bytes=draw(st.integers(0, 99))) for i in range(n))
    return Profile(model="m", batch_size=1, input_shape=(1,), input_dtype="float32", dtype="float32", device="cpu",
                   torch_version="", nodes=nodes, edges=(), values=tuple(values),
                   loss_saved_bytes=draw(st.integers(0, 50)))


def brute_force(prof: Profile, i: int, j: int) -> tuple[float, float, float]:
    """(stash, kept, rerun) of stage i..j from the definition: storages held, each once."""
    n = len(prof.nodes)
    held, kept, anew = set(), set(), set()
    for v in prof.values:
        saved_here = any(v.name in prof.nodes[s].saves for s in range(i, j + 1))
        is_input = v.producer < i <= v.last_use
        is_output = i <= v.producer <= j < v.last_use
        if is_input or is_output or (i <= v.producer <= j and saved_here):
            held.add(v.alias)
        if is_input or is_output:
            kept.add(v.alias)
        if is_output and saved_here:
            anew.add(v.alias)
    size = {v.alias: v.bytes for v in prof.values}
    last = prof.nodes[-1].activation_bytes + prof.loss_saved_bytes if j == n - 1 else 0
    inner = sum(nd.saved_bytes for nd in prof.nodes[i:j + 1])
    stash = inner + sum(size[a] for a in held) + last
    keep = sum(size[a] for a in kept) + last
    rerun = max(stash - keep + sum(size[a] for a in anew) - (prof.loss_saved_bytes if j == n - 1 else 0), 0)
    return stash, keep, rerun


@settings(max_examples=150, deadline=None)
@given(profiles())
def test_tables_equal_the_brute_force(prof):
    costs = model_costs(prof)
    n = costs.n
    for i in range(n):
        for j in range(i, n):
            expected = brute_force(prof, i, j)
            got = (costs.stash_bytes(i, j), costs.kept_bytes(i, j), costs.rerun_bytes(i, j))
            assert np.allclose(got, expected), (i, j, got, expected)


def test_a_tensor_two_nodes_save_is_counted_once_and_a_stages_input_once():
    # node 0 makes v (100 bytes), nodes 0 and 1 both save it; node 1 makes w (10), node 2 saves w
    v, w = ProfileValue("v", 0, 1, 100, 0), ProfileValue("w", 1, 2, 10, 1)
    nodes = (ProfileNode(0, "a", "ops", "", "", saves=("v",)), ProfileNode(1, "b", "ops", "", "", saves=("v",)),
             ProfileNode(2, "c", "ops", "", "", saves=("w",), activation_bytes=1))
    prof = Profile(model="m", batch_size=1, input_shape=(1,), input_dtype="float32", dtype="float32", device="cpu",
                   torch_version="", nodes=nodes, edges=(), values=(v, w))
    costs = model_costs(prof)
    assert costs.stash_bytes(0, 2) == 100 + 10 + 1          # the per-node sum would say 100 + 100 + 10 + 1
    assert costs.stash_bytes(1, 2) == 100 + 10 + 1          # v is the stage's input and saved by node 1: once
    assert costs.kept_bytes(1, 2) == 100 + 1                # recomputing: its input and the model's output
    assert costs.stash_bytes(0, 0) == costs.kept_bytes(0, 0) == 100     # v sent on


def test_a_view_of_a_value_is_the_same_storage():
    # node 0 makes v (100 bytes), node 1 reads it and hands on a view of it (w), which node 2 saves
    v, w = ProfileValue("v", 0, 1, 100, 0), ProfileValue("w", 1, 2, 100, 0)
    nodes = (ProfileNode(0, "a", "ops", "", ""), ProfileNode(1, "b", "ops", "", ""),
             ProfileNode(2, "c", "ops", "", "", saves=("w",)))
    prof = Profile(model="m", batch_size=1, input_shape=(1,), input_dtype="float32", dtype="float32", device="cpu",
                   torch_version="", nodes=nodes, edges=(), values=(v, w))
    costs = model_costs(prof)
    assert costs.stash_bytes(0, 2) == costs.stash_bytes(0, 1) == costs.stash_bytes(1, 2) == 100


@st.composite
def measured_profiles(draw) -> Profile:
    """:func:`profiles` with what each node holds after a split backward's input half (a part of its
    saved bytes and values; sometimes none: a node whose input half keeps the graph), the gradients
    it records for the weight half, and which cuts carry a gradient."""
    prof = draw(profiles())
    nodes = []
    for nd in prof.nodes:
        keeps = draw(st.sampled_from([False, False, False, True]))
        nodes.append(dataclasses.replace(
            nd, weight_half_bytes=None if keeps else draw(st.integers(0, nd.saved_bytes)),
            weight_half_saves=None if keeps else tuple(name for name in nd.saves if draw(st.booleans())),
            weight_half_grad_bytes=draw(st.integers(0, 500)),
            cut_bytes=1, cut_grad_bytes=draw(st.sampled_from([0, 7, 7]))))
    return dataclasses.replace(prof, nodes=tuple(nodes))


def half_brute_force(prof: Profile, i: int, j: int) -> float:
    """Between B and W: the stage's inputs and outputs, the values its nodes' weight halves keep, their
    inner bytes, the model's output (the loss's freed); a stage whose inputs need no gradient holds
    its stash (its input half computes nothing), and so does one holding a node without the fields
    (its input half keeps the graph); on top, the gradients its nodes' input halves record, or where
    its inputs need none, its outputs' (the second of the pair)."""
    stash = brute_force(prof, i, j)[0]
    idle = i == 0 or prof.nodes[i - 1].cut_grad_bytes == 0
    recorded = prof.nodes[j].cut_grad_bytes if idle else sum(nd.weight_half_grad_bytes or 0
                                                             for nd in prof.nodes[i:j + 1])
    if idle or any(nd.weight_half_bytes is None for nd in prof.nodes[i:j + 1]):
        return stash + recorded, recorded
    held = set()
    for v in prof.values:
        saved_here = any(v.name in (prof.nodes[s].weight_half_saves or ()) for s in range(i, j + 1))
        if v.producer < i <= v.last_use or i <= v.producer <= j < v.last_use or (i <= v.producer <= j and saved_here):
            held.add(v.alias)
    size = {v.alias: v.bytes for v in prof.values}
    last = prof.nodes[-1].activation_bytes if j == len(prof.nodes) - 1 else 0
    inner = sum(nd.weight_half_bytes or 0 for nd in prof.nodes[i:j + 1])
    return min(stash, inner + sum(size[a] for a in held) + last) + recorded, recorded


@settings(max_examples=40, deadline=None)
@given(measured_profiles())
def test_half_table_equals_the_brute_force(prof):
    costs = model_costs(prof)
    assert costs.half is not None and costs.recorded is not None
    table, recorded = costs.half_table(), costs.recorded_table()
    for i in range(costs.n):
        for j in range(i, costs.n):
            half, grads = half_brute_force(prof, i, j)
            assert costs.half_bytes(i, j) == pytest.approx(half) == table[i, j], (i, j)
            assert costs.recorded_bytes(i, j) == grads == recorded[i, j], (i, j)
    # a profile made before the recorded gradients were measured: every stage holds its stash until W
    older = model_costs(dataclasses.replace(prof, nodes=tuple(
        dataclasses.replace(nd, weight_half_grad_bytes=None) for nd in prof.nodes)))
    assert older.half is None and older.recorded is None
    assert np.array_equal(older.half_table(), costs.stash_table()[0])
    assert not older.recorded_table().any()
