"""Hugging Face models (and nn.TransformerEncoder) trained through the pipeline in one process (a
thread per rank) equal plain single-process training: 2 stages x 2 replicas and 4 stages, gpipe
and 1f1b. Tied embeddings cut apart stay bit-identical after every step; batches padded to
different lengths train too. (The same under real processes: tests/runtime/test_hf_launch.py.)"""

from __future__ import annotations

import pytest
import torch

from hybridpipe.pipeline.tied import tied_ranks
from tests.pipeline.harness import data_for, make_plan, max_diff, train_pipeline, train_reference
from tests.pipeline.hf_models import BY_NAME, CASES, GPT2_PADDED, QWEN2, Case
from tests.profiles.user_models import ragged_tokens

pytest.importorskip("transformers")

STEPS = 3
LAYOUTS = {"2x2": [2, 2], "4": [1, 1, 1, 1]}
# one case per model in the default suite (every layout and schedule among them) but llama and encoder; the
# rest: make test-slow
# (llama: its stages built and run from a saved directory in tests/runtime/test_hf_format.py; encoder: bert's
# path with torch's own layers)
FAST = {("gpt2", "2x2", "1f1b"), ("bert", "2x2", "gpipe"), ("t5", "4", "1f1b"), ("vit", "2x2", "1f1b")}


def plan_for(case: Case, layout: str, schedule: str, spec: str | None = None):
    cuts = case.two if layout == "2x2" else case.four
    return make_plan(spec or case.spec, cuts, LAYOUTS[layout], schedule=schedule, micro_batches=4, batch_size=2,
                     shared_capture=True)


def matrix():
    for case in CASES:
        for layout in LAYOUTS:
            for schedule in ("gpipe", "1f1b"):
                slow = () if (case.name, layout, schedule) in FAST else (pytest.mark.slow,)
                yield pytest.param(case, layout, schedule, marks=slow, id=f"{case.name}-{layout}-{schedule}")


@pytest.mark.parametrize("case,layout,schedule", list(matrix()))
def test_pipeline_equals_one_process(case, layout, schedule):
    plan = plan_for(case, layout, schedule)
    if case.tied:                                   # the embedding and the head land in different stages
        assert [g.param for g in plan.tied] == [case.tied] and len(plan.tied[0].stages) >= 2
    else:
        assert plan.tied == ()
    ours, losses = train_pipeline(plan, STEPS, shared_capture=True)
    assert all(torch.isfinite(torch.tensor(v)).all() for v in losses.values()) and len(losses) == STEPS
    assert max_diff(ours, train_reference(plan, STEPS)) <= 1e-5


@pytest.mark.slow
def test_qwen2_with_its_default_kv_cache_trains_through_the_pipeline():
    """Qwen2's forward returns a DynamicCache unless told otherwise; the capture switches it off."""
    plan = plan_for(BY_NAME["llama"], "4", "1f1b", spec=QWEN2)
    assert max_diff(train_pipeline(plan, 2, shared_capture=True)[0], train_reference(plan, 2)) <= 1e-5


def tied_copies(plan, steps: int, *, tied_sync: bool = True):
    """Every rank's copy of the plan's (first) tied weight after every step: {(step, rank): tensor},
    and the merged weights."""
    group = plan.tied[0]
    copies: dict[tuple[int, int], torch.Tensor] = {}

    def observe(rank: int, step: int, stage) -> None:
        if plan.stage_of_rank(rank)[0].index in group.stages:
            copies[(step, rank)] = stage.captured.module.get_parameter(group.param).detach().clone()

    merged, _ = train_pipeline(plan, steps, shared_capture=True, observe=observe, tied_sync=tied_sync)
    return group, copies, merged


@pytest.mark.parametrize("name,layout", [("gpt2", "4"), pytest.param("llama", "2x2", marks=pytest.mark.slow),
                                         pytest.param("t5", "4", marks=pytest.mark.slow)])
def test_tied_copies_are_bit_identical_after_every_step_and_equal_one_process(name, layout):
    plan = plan_for(BY_NAME[name], layout, "1f1b")
    group, copies, _ = tied_copies(plan, STEPS)
    reference: dict[int, torch.Tensor] = {}
    train_reference(plan, STEPS, observe=lambda k, model: reference.__setitem__(
        k, model.get_parameter(group.param).detach().clone()))
    ranks = tied_ranks(plan, group)
    assert len(ranks) >= 2 and {plan.stage_of_rank(r)[0].index for r in ranks} == set(group.stages)
    for k in range(STEPS):
        held = [copies[(k, r)] for r in ranks]
        assert all(torch.equal(held[0], c) for c in held[1:]), f"step {k}: the copies differ"
        assert float((held[0] - reference[k]).abs().max()) <= 1e-5
        if k:
            assert not torch.equal(held[0], copies[(k - 1, ranks[0])])       # it does train


def test_without_the_tied_gradient_sum_the_copies_drift_apart():
    """The check above can fail: with a tied sync that sums nothing, each copy follows its own
    stage's gradient only, and neither equals the single-process weight."""
    plan = plan_for(BY_NAME["gpt2"], "4", "1f1b")
    group, copies, _ = tied_copies(plan, STEPS, tied_sync=False)
    first, last = tied_ranks(plan, group)
    for k in range(STEPS):
        assert not torch.equal(copies[(k, first)], copies[(k, last)])
    reference = train_reference(plan, STEPS)[group.param]
    for rank in (first, last):
        assert float((copies[(STEPS - 1, rank)] - reference).abs().max()) > 1e-4


@pytest.mark.parametrize("layout,schedule", [("2x2", "1f1b"), pytest.param("4", "gpipe", marks=pytest.mark.slow)])
def test_batches_padded_to_different_lengths_train_and_equal_one_process(layout, schedule):
    """A dataset of 16..64-token sequences whose collate_fn pads each batch to its longest: every
    micro-batch has its own length; the pipeline equals one process accumulating the micro-batches."""
    dataset = ragged_tokens(n=STEPS * 4 * 2)
    plan = plan_for(BY_NAME["gpt2"], layout, schedule, spec=GPT2_PADDED)
    data = data_for(plan, STEPS, dataset=dataset)
    lengths = [data.input(k, m)["input_ids"].shape[1] for k in range(STEPS) for m in range(plan.micro_batches)]
    assert len(set(lengths)) >= 6 and 16 <= min(lengths) and max(lengths) <= 64, lengths
    ours, _ = train_pipeline(plan, STEPS, dataset=dataset, shared_capture=True)
    reference = train_reference(plan, STEPS, dataset=dataset, accumulate=True)
    assert max_diff(ours, reference) <= 1e-5
