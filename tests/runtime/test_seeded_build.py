"""Each rank builds only its own stages of a model initialised from the seed (runtime/seeded.py,
profiles/replay.py): every stage's parameters and buffers bitwise those of the whole model built
on the CPU after the same ``torch.manual_seed``, the other stages' parameters never materialized;
a construction that cannot be replayed a part at a time is built whole, saying so."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from hybridpipe.pipeline import build_stage_index
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.parts import build_model
from hybridpipe.runtime.seeded import build_stages
from tests.pipeline.harness import make_plan
from tests.pipeline.hf_models import T5

SEED = 5
LLAMA = ("hf:LlamaForCausalLM[num_hidden_layers=4,hidden_size=32,intermediate_size=64,num_attention_heads=4,"
         "num_key_value_heads=2,vocab_size=128,seq=8]")
MODELS = {                                   # model -> cuts into 4 stages (blocks)
    "gpt[layers=3,width=16,heads=2,seq=8,vocab=64]": [0, 2, 4],
    "tests.runtime.seeded_models:initialised": [0, 1, 2],   # orthogonal_, trunc_normal_, random buffers
    "hf:gpt2[n_layer=4,n_embd=32,n_head=2,vocab_size=128,seq=8]": [1, 4, 6],       # tied embedding
    LLAMA: [1, 3, 5],                                                                 # rotary buffer
    T5: [3, 6, 9],                        # a constant the forward makes (torch.tensor(0)), held by the graph
}
SLOW = {"gpt[layers=3,width=16,heads=2,seq=8,vocab=64]",      # 8-20 s each (the captures); the zoo's
        "hf:gpt2[n_layer=4,n_embd=32,n_head=2,vocab_size=128,seq=8]", LLAMA, T5}   # multi-stage launch tests run it


def whole(name: str) -> torch.nn.Module:
    """What one process builds."""
    spec = resolve_model(name)           # (a factory is called once here to learn its example)
    torch.manual_seed(SEED)
    return spec.build()


def stage_of(model, plan, index):
    return build_stage_index(model.captured, [(s.first_node, s.last_node) for s in plan.stages], index).module


def each_rank(name: str, cuts: list[int]):
    """The plan, and per rank: the model after it built its own stage, and that stage."""
    plan = make_plan(name, cuts, [1, 1, 1, 1], batch_size=2)
    built = build_model(resolve_model(name), plan, seed=SEED)
    assert built.recipe is not None and all(p.is_meta for p in built.module.parameters())
    out = []
    for rank in range(4):
        model = copy.deepcopy(built)
        model.materialize(plan, [rank])
        out.append((model, stage_of(model, plan, rank)))
    return plan, out


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in MODELS])
def test_each_rank_builds_its_stage_with_the_values_of_one_process(name):
    expected = whole(name)
    params, buffers = dict(expected.named_parameters()), dict(expected.named_buffers())
    _, ranks = each_rank(name, MODELS[name])
    held = set()
    for model, stage in ranks:
        real = {n for n, p in model.module.named_parameters() if not p.is_meta}
        assert real == {n for n, _ in stage.named_parameters()}          # its stage's, nothing else
        held |= real
        for n, p in stage.named_parameters():
            assert p.dtype == params[n].dtype and torch.equal(p, params[n]), n
        for n, b in stage.named_buffers():
            if n in buffers:            # else a constant the graph made itself (T5's), not the model's
                assert b.dtype == buffers[n].dtype and torch.equal(b, buffers[n]), n
    assert held == set(params)                   # every parameter on some rank


def test_a_construction_that_reads_another_stage_is_built_whole_there(caplog):
    """The last layer copies the first's weights: the rank that holds the last and not the first
    builds the whole model (one line), with the same values."""
    name = "tests.runtime.seeded_models:copying"
    expected = dict(whole(name).named_parameters())
    with caplog.at_level(logging.WARNING):
        _, ranks = each_rank(name, [0, 1, 2])
    assert caplog.text.count("builds the whole of") == 1 and "Cannot copy out of meta tensor" in caplog.text
    for _, stage in ranks:
        for n, p in stage.named_parameters():
            assert torch.equal(p, expected[n]), n


def test_the_ranks_digests_tell_an_initialisation_that_depends_on_the_meta_device():
    """Replayed without an error but with other draws: the digests of the random draws differ
    between ranks (launch then builds the whole model on every rank); they agree for a model
    that replays."""
    for name, same in (("tests.runtime.seeded_models:initialised", True),
                       ("tests.runtime.seeded_models:device_dependent", False)):
        plan = make_plan(name, [0, 1, 2], [1, 1, 1, 1], batch_size=2)
        built = build_model(resolve_model(name), plan, seed=SEED)
        digests = set()
        for rank in (0, 3):
            model = copy.deepcopy(built)
            digests.add(build_stages(model.module, model.captured, model.recipe, plan, [rank]))
        assert (len(digests) == 1) == same, name
    expected = dict(whole(name).named_parameters())
    model = copy.deepcopy(built)
    build_stages(model.module, model.captured, model.recipe, plan, [2], whole=True)
    for n, p in stage_of(model, plan, 2).named_parameters():
        assert torch.equal(p, expected[n]), n


def test_init_from_replaces_the_seeded_initialisation(tmp_path):
    """--init-from on a model built a stage at a time: the ranks read their stages from the file."""
    from hybridpipe.runtime.hf_export import save_safetensors

    plan = make_plan("mlp", [3], [1, 1], batch_size=4)
    model = build_model(resolve_model("mlp"), plan, seed=SEED)
    assert model.recipe is not None
    other = whole("mlp")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    save_safetensors(other.state_dict(), tmp_path / "start.safetensors")
    model.start_from(str(tmp_path / "start.safetensors"))
    model.materialize(plan, [1])
    stage = stage_of(model, plan, 1)
    assert [n for n, _ in stage.named_parameters()]
    for n, p in stage.named_parameters():
        assert torch.equal(p, other.get_parameter(n)), n


def test_a_model_that_cannot_be_built_on_the_meta_device_is_built_whole_on_every_rank(caplog):
    name = "tests.runtime.seeded_models:reading"
    plan = make_plan(name, [0, 1, 2], [1, 1, 1, 1], batch_size=2)
    with caplog.at_level(logging.WARNING):
        model = build_model(resolve_model(name), plan, seed=SEED)
    assert model.recipe is None and not any(p.is_meta for p in model.module.parameters())
    assert caplog.text.count("every rank builds the whole of") == 1
    assert "cannot be built and captured with its parameters on the meta device" in caplog.text
    expected = whole(name)
    for n, p in model.module.named_parameters():
        assert torch.equal(p, expected.get_parameter(n)), n


@pytest.mark.slow
@pytest.mark.parametrize("name", ["initialised", "device_dependent"])
def test_under_launch_each_rank_builds_its_stage_and_trains_as_one_process(tmp_path, name):
    """2 ranks, 3 SGD steps: equal to one process. ``device_dependent`` replays without an error
    but with other draws on each rank: the ranks' digests differ and every rank builds it whole,
    saying so."""
    from hybridpipe.partitioner.plan import save_plan
    from hybridpipe.runtime.merged import merge_stages
    from tests.runtime.jobs import launch, max_diff, train_reference

    plan = make_plan(f"tests.runtime.seeded_models:{name}", [1], [1, 1], micro_batches=2, batch_size=4)
    save_plan(plan, tmp_path / "plan.json")
    done = launch(["--plan", str(tmp_path / "plan.json"), "--steps", "3", "--lr", "0.05", "--momentum", "0.5",
                   "--checkpoint-dir", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run"), "--timeout", "120",
                   "--no-progress", "--no-trace"], plan.world_size, timeout=300)
    assert all(d.returncode == 0 for d in done), done
    whole = [d.stderr.count("every rank builds the whole of") for d in done]
    assert whole == ([1, 1] if name == "device_dependent" else [0, 0]), done
    merged, _ = merge_stages(tmp_path / "ckpt", 3)
    assert max_diff(merged, train_reference(plan, 3, lr=0.05, momentum=0.5, seed=0)) <= 1e-6
