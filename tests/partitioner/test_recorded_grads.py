"""The gradients a stage's input half records (partitioner/search/recorded.py): a block that depends on
none of the stage's inputs records only where its values leave the stage or meet the input path."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.profiles.format import Profile, ProfileNode, ProfileValue


def _profile(n: int, values: list[ProfileValue], edges: list[tuple[int, int]], wh: list[int]) -> Profile:
    cut_grad = [sum(v.bytes for v in values if v.grad and v.producer <= k < v.last_use) for k in range(n)]
    nodes = tuple(ProfileNode(id=k, name=f"n{k}", op="module", target=f"n{k}", type="", cut_bytes=1,
                              cut_grad_bytes=cut_grad[k], weight_half_bytes=0, weight_half_saves=(),
                              weight_half_grad_bytes=wh[k]) for k in range(n))
    return Profile(model="m", batch_size=1, input_shape=(1,), input_dtype="int64", dtype="float32", device="cpu",
                   torch_version="", nodes=nodes, edges=tuple(edges), values=tuple(values))


def bart_like() -> Profile:
    """n0 the encoder's embedding (x 400 B to n1; the decoder's ids, needing no gradient, to n2 and n4),
    n1 the encoder (its output 1000 B, relayed to n4), n2 the decoder's embedding (emb 200 B; a mask
    300 B that needs none; alone it records 200 B), n3 a layer norm (h 200 B; alone: 150 B at its
    intermediates), n4 a decoder layer reading the encoder's output, h and the mask (alone: 900 B)."""
    values = [ProfileValue("ids", -1, 0, 64, 0, False), ProfileValue("x", 0, 1, 400, 1, True),
              ProfileValue("dec_ids", 0, 4, 64, 2, False), ProfileValue("enc", 1, 4, 1000, 3, True),
              ProfileValue("emb", 2, 3, 200, 4, True), ProfileValue("mask", 2, 4, 300, 5, False),
              ProfileValue("h", 3, 4, 200, 6, True)]
    return _profile(5, values, [(0, 1), (0, 2), (0, 4), (1, 4), (2, 3), (2, 4), (3, 4)], [700, 600, 200, 150, 900])


def test_a_stage_of_blocks_independent_of_its_inputs_records_its_outputs_gradients_only():
    """Stage 2..3 (BART's stage 2) relays the encoder's output and computes nothing from it: its input
    half records nothing, its weight half runs n2 and n3 whole; held until W: h's gradient (200 B), not
    each block's alone (350 B). With n4 in the stage, h meets the input path there: h's gradient and
    n4's own."""
    costs = model_costs(bart_like())
    assert costs.recorded_bytes(2, 3) == 200
    assert costs.recorded_bytes(2, 2) == 200            # emb leaves the stage
    assert costs.recorded_bytes(2, 4) == 200 + 900
    assert costs.recorded_bytes(3, 4) == 150 + 900      # n3 reads emb, a stage input needing a gradient
    assert costs.recorded_bytes(1, 4) == 600 + 200 + 900
    assert costs.recorded_bytes(4, 4) == 900
    assert costs.recorded_bytes(0, 4) == costs.cut_grad_bytes[4] == 0    # the first stage: its outputs'


def test_a_block_independent_of_the_stage_inputs_holds_all_it_saved_until_the_weight_half():
    """Its block alone, measured with its inputs needing a gradient, holds less for W (layer norm's
    input not at all: splitback.py's input half takes its weight's gradient); in a stage that computes
    nothing from its inputs the weight half runs its whole backward, so all it saved stays. n2 saves
    500 B, n3 120 B, each 0 for its weight half alone: stage 2..3 holds both (its stash), stage 3..4
    (n3 reads emb, a stage input) and 4..4 hold none of it. Before: 0 held for 2..3 (7.9% under on
    BART's stage 2 once layer norm's input left the weight half)."""
    prof = bart_like()
    inner = {2: 500, 3: 120}
    nodes = tuple(dataclasses.replace(nd, saved_bytes=inner.get(nd.id, 0)) for nd in prof.nodes)
    costs = model_costs(dataclasses.replace(prof, nodes=nodes))
    held = costs.half_table() - costs.recorded_table()
    assert held[2, 3] == costs.stash_bytes(2, 3)
    assert held[2, 3] - 500 - 120 == model_costs(prof).half_table()[2, 3] - model_costs(prof).recorded_table()[2, 3]
    assert held[3, 4] == model_costs(prof).half_table()[3, 4] - model_costs(prof).recorded_table()[3, 4]


def test_a_profile_without_the_grad_flags_counts_every_block():
    """An older profile (values without ``grad``): every block's measured gradients, as before."""
    prof = bart_like()
    older = dataclasses.replace(prof, values=tuple(dataclasses.replace(v, grad=None) for v in prof.values))
    costs = model_costs(older)
    assert costs.recorded_bytes(2, 3) == 350 and costs.recorded_bytes(2, 4) == 1250


@st.composite
def graphs(draw) -> Profile:
    n = draw(st.integers(2, 7))
    values = []
    for k in range(draw(st.integers(1, 9))):
        p = draw(st.integers(-1, n - 2))
        q = draw(st.integers(p + 1, n - 1))
        values.append(ProfileValue(f"v{k}", p, q, draw(st.integers(1, 1000)), k, p >= 0 and draw(st.booleans())))
    # every value read by its last user, maybe by nodes between
    edges = {(v.producer, v.last_use) for v in values if v.producer >= 0}
    edges |= {(v.producer, r) for v in values if v.producer >= 0 for r in range(v.producer + 1, v.last_use)
              if draw(st.booleans())}
    return _profile(n, values, sorted(edges), [draw(st.integers(0, 500)) for _ in range(n)])


def brute_recorded(prof: Profile, i: int, j: int) -> float:
    """By the definition, one stage at a time: a node depends on the stage's inputs if an edge from
    before the stage or from a dependent node of it can carry a gradient (its source makes a value
    needing one that is read as late as it); dependent nodes record their own; an independent one the
    gradients of its values that are read after j or as late as a dependent node of the stage it feeds."""
    def carries(s: int, k: int) -> bool:
        return any(v.grad and v.producer == s and v.last_use >= k for v in prof.values)

    dep: dict[int, bool] = {}
    for k in range(i, j + 1):
        dep[k] = any(carries(s, k) and (s < i or dep[s]) for s, d in prof.edges if d == k)
    total = 0.0
    for k in range(i, j + 1):
        if dep[k]:
            total += prof.nodes[k].weight_half_grad_bytes or 0
            continue
        readers = [d for s, d in prof.edges if s == k and d <= j and dep[d] and carries(k, d)]
        total += sum(v.bytes for v in prof.values if v.grad and v.producer == k
                     and (v.last_use > j or any(d <= v.last_use for d in readers)))
    return total


@settings(max_examples=60, deadline=None)
@given(graphs())
def test_recorded_equals_the_definition(prof):
    costs = model_costs(prof)
    table = costs.recorded_table()
    for i in range(costs.n):
        for j in range(i, costs.n):
            idle = i == 0 or costs.cut_grad_bytes[i - 1] == 0
            expected = costs.cut_grad_bytes[j] if idle else brute_recorded(prof, i, j)
            assert table[i, j] == expected, (i, j)
    assert np.array_equal(table, np.triu(table))
