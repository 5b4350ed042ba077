"""Hugging Face models (tiny configs, random weights, no downloads) and nn.TransformerEncoder as a
user gets them: profiled at block granularity their repeated blocks appear by module path beside
the embeddings and the head, tied weights are recorded, and `hybridpipe partition` writes plans
whose tied groups name the shared embedding when a cut separates its uses."""

from __future__ import annotations

import pytest
import torch

from hybridpipe.cli import main
from hybridpipe.partitioner.plan import load_plan
from hybridpipe.pipeline.plancheck import check_plan
from hybridpipe.profiles.capture import tied_parameters, training_switches
from hybridpipe.profiles.format import load_profile
from hybridpipe.profiles.graphinfo import node_infos
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import capture_copy
from tests.pipeline.hf_models import BY_NAME, CASES, QWEN2, Case

pytest.importorskip("transformers")

QUICK = ["--repeats", "1", "--warmup", "0", "-q"]
CLUSTER = "examples/clusters/local4.json"


def expected_blocks(case: Case, model: torch.nn.Module) -> list[str]:
    if case.blocks is not None:
        return list(case.blocks)
    layers = [name for name, m in model.named_modules() if type(m).__name__ == case.layer]
    return ["vit.embeddings", *layers, "vit.layernorm", "classifier"]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_blocks_are_the_models_layers_by_module_path(case):
    captured = capture_copy(resolve_model(case.spec), 2)
    model = captured.module
    names = [b.name for b in captured.blocks]
    assert names == expected_blocks(case, model) and captured.front_end == "export"
    layers = [name for name, m in model.named_modules() if type(m).__name__ == case.layer]
    assert len(layers) >= 2 and [b.name for b in captured.blocks if b.type == case.layer] == layers
    infos = node_infos(captured)
    owned = [p for i in infos for p in i.params]
    assert sorted(owned) == sorted(name for name, _ in model.named_parameters())    # each weight once
    if case.tied:
        assert any(case.tied in group for group in tied_parameters(model))
        owner = next(i for i in infos if case.tied in i.params)                     # the embedding owns it,
        assert owner.name.endswith("embed_tokens") or owner.name.endswith("wte")
        assert infos[-1].name == "lm_head" and len(infos[-1].shared) == 1          # the head reads it too
    else:
        assert all(not i.shared for i in infos)


def test_a_models_default_kv_cache_is_switched_off_for_training():
    """Qwen2 returns a DynamicCache unless told otherwise (torch.export refuses that output); the
    capture passes use_cache=False and its output is the model's own, loss and logits."""
    spec = resolve_model(QWEN2)
    model = spec.build()
    assert model.config.use_cache and training_switches(model) == {"use_cache": False}
    x = spec.example_input(2)
    assert type(model(**x).past_key_values).__name__ == "DynamicCache"
    captured = capture_copy(spec, 2)
    assert captured.front_end == "export" and captured.constants == {"use_cache": False}
    flat = captured.flatten_input(x)
    out = captured.rebuild_output(captured.graph(*(flat[n] for n in captured.inputs)))
    assert type(out).__name__ == "CausalLMOutputWithPast" and out.past_key_values is None
    torch.testing.assert_close(out.loss, captured.module(**x, use_cache=False).loss)


def profile(tmp_path, spec: str, name: str):
    path = tmp_path / f"{name}.json"
    assert main(["profile", spec, "-b", "2", *QUICK, "-o", str(path)]) == 0
    return path, load_profile(path)


def partition(tmp_path, profile_path, workers: int, stages: int, name: str):
    out = tmp_path / f"{name}.plan.json"
    assert main(["partition", str(profile_path), "--cluster", CLUSTER, "--workers", str(workers), "--strategy",
                 "uniform", "--stages", str(stages), "--micro-batches", "4", "-o", str(out)]) == 0
    return load_plan(out)


def check_profile_and_plans(tmp_path, case: Case, capsys):
    path, p = profile(tmp_path, case.spec, case.name)
    capsys.readouterr()
    model = resolve_model(case.spec).build()
    assert [n.name for n in p.nodes] == expected_blocks(case, model) and p.front_end == "export"
    assert p.model == case.spec and p.granularity == "blocks"
    tied = next(group for group in p.tied if case.tied in group)
    head = p.nodes[-1]
    assert head.name == "lm_head" and len(head.shared) == 1 and head.shared[0] in tied
    assert head.shared_bytes == (model.get_parameter(case.tied).numel() * 4,) and head.param_count == 0
    assert p.totals.param_count == sum(q.numel() for q in model.parameters())         # counted once
    assert all(n.forward_ms > 0 for n in p.nodes) and p.totals.measured_ms > 0
    captured = capture_copy(resolve_model(case.spec), 2)
    for workers, stages, name in [(2, 2, "two"), (4, 4, "four"), (4, 2, "two-by-two")]:
        plan = partition(tmp_path, path, workers, stages, f"{case.name}-{name}")
        assert len(plan.stages) == stages and all(s.replicas == workers // stages for s in plan.stages)
        first, last = plan.stages[0].last_node, plan.stages[-1].first_node
        assert first < len(p.nodes) - 1 < len(p.nodes) and last > 0
        (group,) = plan.tied                       # the embedding (stage 0) and the head (last stage) apart
        assert group.param == case.tied and group.stages[0] == 0 and group.stages[-1] == stages - 1
        assert group.bytes == model.get_parameter(case.tied).numel() * 4 and group.predicted_ms > 0
        check_plan(captured, plan)                 # the runtime's checks accept the plan


def test_gpt2_profile_records_the_tied_head_and_partition_writes_tied_groups(tmp_path, capsys):
    check_profile_and_plans(tmp_path, BY_NAME["gpt2"], capsys)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "t5"])
def test_profile_records_the_tied_head_and_partition_writes_tied_groups(tmp_path, capsys, name):
    check_profile_and_plans(tmp_path, BY_NAME[name], capsys)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "vit", "encoder"])
def test_untied_models_profile_by_block(tmp_path, name):
    case = BY_NAME[name]
    _, p = profile(tmp_path, case.spec, name)
    assert [n.name for n in p.nodes] == expected_blocks(case, resolve_model(case.spec).build())
    assert p.tied == () and all(not n.shared for n in p.nodes) and 0 < p.totals.ratio
