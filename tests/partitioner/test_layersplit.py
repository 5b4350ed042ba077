"""torchtitan's and Megatron-LM's layer-count splits: the counts those projects publish, the stack read from
node names, and the stages the strategies make from them."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridpipe.errors import UserError
from hybridpipe.partitioner.planner import Request, partition
from hybridpipe.partitioner.search.layersplit import (
    Stack,
    find_stack,
    layer_split_sizes,
    megatron_layers,
    stage_node_counts,
    torchtitan_layers,
)
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.strategies import baseline_stages
from hybridpipe.profiles.format import Profile
from tests.partitioner.synth import flat_cluster, make_profile

# the nodes `hybridpipe profile 'hf:llama[num_hidden_layers=6,...]'` writes (blocks granularity)
LLAMA6 = ["model.embed_tokens", "model.rotary_emb", *(f"model.layers.{k}" for k in range(6)), "model.norm", "lm_head"]


@pytest.mark.parametrize("stages,layers,first,last,expected", [
    (4, 32, 1, 1, [8, 9, 8, 7]),                       # Llama-3 8B on 4 stages: 34 effective layers, 8 each, 2 extra
    (8, 32, 1, 1, [4, 5, 4, 4, 4, 4, 4, 3]),           # ... on 8 stages: 4 each, 2 extra to stages 0 and 1
    (2, 8, 1, 1, [4, 4]),                              # a port's docstring: embeddings + layers 0-3 | 4-7 + output
    (2, 3, 2, 2, [2, 1]),                              # torchtitan's docstring: input and output weighing 2 layers each
    (4, 32, 0, 0, [8, 8, 8, 8]),                       # both weights 0: the plain layer count
    (8, 126, 1, 1, [15, 16, 16, 16, 16, 16, 16, 15]),  # Llama-3.1 405B on 8 stages: 128 effective, 16 each
    (1, 32, 1, 1, [32]),
])
def test_torchtitan_counts(stages, layers, first, last, expected):
    assert torchtitan_layers(stages, layers, first, last) == expected


@pytest.mark.parametrize("stages,layers,first,last,message", [
    (35, 32, 1, 1, "more than the 34 effective layers"),
    (4, 4, 2, 1, "more than the 1 layers a stage gets"),          # 7 effective // 4 = 1 < input weight 2
])
def test_torchtitan_refuses_as_torchtitan_does(stages, layers, first, last, message):
    with pytest.raises(UserError, match=message):
        torchtitan_layers(stages, layers, first, last)


@pytest.mark.parametrize("stages,layers,expected", [
    (16, 126, [7, *[8] * 14, 7]),                      # Megatron-Bridge's Llama-3.1 405B recipe: PP 16, both flags
    (8, 30, [3, 4, 4, 4, 4, 4, 4, 3]),
    (2, 32, [16, 16]),                                 # Llama-3 8B on 2 stages: 34 / 2 = 17, first and last one less
    (1, 32, [32]),                                     # one stage holds the embedding and the loss both
])
def test_megatron_counts(stages, layers, expected):
    assert megatron_layers(stages, layers) == expected


def test_megatron_flags_one_at_a_time_and_its_divisibility_check():
    assert megatron_layers(3, 32, embedding=True, loss=False) == [10, 11, 11]
    assert megatron_layers(3, 32, embedding=False, loss=True) == [11, 11, 10]
    with pytest.raises(UserError, match="34 must divide evenly .* not over 4; .* one of 1, 2, 17, 34 stages"):
        megatron_layers(4, 32)                         # Llama-3 8B over 4 or 8 stages: Megatron refuses both flags


@given(st.integers(1, 16), st.integers(0, 200), st.integers(0, 3), st.integers(0, 3))
def test_torchtitan_deals_every_layer_once(stages, layers, first, last):
    try:
        counts = torchtitan_layers(stages, layers, first, last)
    except UserError:
        assert stages > 1 and (stages > layers + first + last or max(first, last) > (layers + first + last) // stages)
        return
    assert len(counts) == stages and sum(counts) == layers and min(counts) >= 0
    if stages > 1:                                     # weighted, the stages differ by at most one layer
        weighted = [counts[0] + first, *counts[1:-1], counts[-1] + last]
        assert max(weighted) - min(weighted) <= 1 and weighted == sorted(weighted, reverse=True)


def test_the_stack_of_a_llama_profile_and_of_other_namings():
    assert find_stack(LLAMA6) == Stack(2, (1,) * 6, 2, "model.layers")
    gpt2 = ["transformer.wte", "transformer.wpe", "transformer.drop", *(f"transformer.h.{k}" for k in range(12)),
            "transformer.ln_f", "lm_head", "loss"]
    assert find_stack(gpt2) == Stack(3, (1,) * 12, 3, "transformer.h")
    modules = ["embed", "layers.0.attn", "layers.0.mlp", "layers.0_add", "layers.1.attn", "layers.1.mlp", "head"]
    assert find_stack(modules) == Stack(1, (3, 2), 1, "layers")   # a glue node belongs to the layer before it
    assert find_stack(["x", "l1", "l2", "output"]) == Stack(1, (1, 1), 1, None)


def test_nodes_per_stage_put_the_input_first_and_the_output_last():
    assert layer_split_sizes("torchtitan", LLAMA6, 2) == [2 + 3, 3 + 2]       # 6 + 2 = 8: 4 each, one less at each end
    assert layer_split_sizes("torchtitan", LLAMA6, 4) == [2 + 1, 2, 2, 1 + 2]
    assert layer_split_sizes("megatron", LLAMA6, 4) == [2 + 1, 2, 2, 1 + 2]   # 6 + 2 = 8 over 4
    with pytest.raises(UserError, match="without a node"):
        stage_node_counts(Stack(0, (1, 1), 1, "h"), [0, 2])


def llama_like(layers: int) -> Profile:
    """A synthetic chain named as an HF Llama profile: a heavy head, light layers."""
    base = make_profile([(0.1, 0.2, 1000, 4000), (0.0, 0.0, 1000, 0),
                         *[(1.0, 2.0, 1000, 4000)] * layers, (0.1, 0.1, 1000, 40), (9.0, 9.0, 4, 40000)])
    names = ["input", "model.embed_tokens", "model.rotary_emb", *(f"model.layers.{k}" for k in range(layers)),
             "model.norm", "lm_head", "loss"]
    return dataclasses.replace(base, nodes=tuple(dataclasses.replace(n, name=name)
                                                 for n, name in zip(base.nodes, names, strict=True)))


def test_strategies_make_the_rules_stages_with_replicas():
    costs = model_costs(llama_like(14))                # input, embed, rotary | 14 layers | norm, head, loss
    titan = baseline_stages("torchtitan", costs, 4)    # 16 effective over 4: [3, 4, 4, 3] layers
    assert [(s.first, s.last) for s in titan] == [(0, 5), (6, 9), (10, 13), (14, 19)]
    mega = baseline_stages("megatron", costs, 8, stages=4)
    assert [(s.first, s.last, s.ranks) for s in mega] == [(0, 5, (0, 1)), (6, 9, (2, 3)), (10, 13, (4, 5)),
                                                          (14, 19, (6, 7))]
    with pytest.raises(UserError, match="16 must divide evenly"):
        baseline_stages("megatron", costs, 3)


def test_optimal_beats_the_layer_counts_where_the_head_is_heavy():
    profile = llama_like(14)
    cluster = flat_cluster(4, gbps=100.0)
    best = partition(profile, cluster, Request(schedule="1f1b")).plan.predicted_step_ms
    for strategy in ("torchtitan", "megatron"):
        plan = partition(profile, cluster, Request(strategy=strategy, schedule="1f1b")).plan
        assert plan.strategy == strategy and [s.last_node for s in plan.stages][-1] == 19
        assert best < plan.predicted_step_ms
