"""``--loss-normalization``: recorded in the plan (old plans load as micro-batch), set by
``partition``, overridden by launch, refused with pipedream in one line; the summary's step loss
weighs the micro-batches by their tokens."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hybridpipe.cli import main
from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import Plan, load_plan, save_plan
from hybridpipe.profiles.format import save_profile
from hybridpipe.runtime.config import build_parser, resolve
from hybridpipe.runtime.metrics import step_record
from hybridpipe.runtime.summary import RankReport, format_summary, step_losses, summarize
from tests.partitioner.synth import make_profile
from tests.partitioner.test_partition_cli import CLUSTERS, LAYERS
from tests.pipeline.harness import make_plan


def test_the_plan_records_it_and_old_plans_are_micro_batch(tmp_path):
    plan = make_plan("mlp", [3], [1, 1], micro_batches=2, batch_size=4)
    assert plan.loss_normalization == "micro-batch"
    data = plan.to_dict()
    del data["loss_normalization"]                   # a plan written before the field existed
    assert Plan.from_dict(data).loss_normalization == "micro-batch"
    save_plan(dataclasses.replace(plan, loss_normalization="tokens"), tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json").loss_normalization == "tokens"
    with pytest.raises(UserError, match="loss_normalization"):
        Plan.from_dict({**data, "loss_normalization": "per-sample"})


def test_launch_runs_the_plans_normalization_unless_told_and_refuses_it_with_pipedream(tmp_path):
    plan = dataclasses.replace(make_plan("mlp", [3], [1, 1], micro_batches=2, batch_size=4),
                               loss_normalization="tokens")
    save_plan(plan, tmp_path / "plan.json")
    base = ["--plan", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "run")]
    assert resolve(build_parser().parse_args(base), 2).training.loss_normalization == "tokens"
    told = resolve(build_parser().parse_args([*base, "--loss-normalization", "micro-batch"]), 2)
    assert told.training.loss_normalization == told.plan.loss_normalization == "micro-batch"
    with pytest.raises(UserError, match="tokens divides the step's summed gradients .* pipedream updates each"):
        resolve(build_parser().parse_args([*base, "--schedule", "pipedream"]), 2)


def test_partition_writes_it_and_refuses_pipedream(tmp_path, capsys):
    profile = save_profile(make_profile(LAYERS, model="convfc"), tmp_path / "convfc.json")
    args = ["partition", str(profile), "--cluster", str(CLUSTERS / "4x1gbit.json"), "-q"]
    assert main([*args, "--loss-normalization", "tokens", "-o", str(tmp_path / "plan.json")]) == 0
    assert json.loads((tmp_path / "plan.json").read_text())["loss_normalization"] == "tokens"
    capsys.readouterr()
    assert main([*args, "--loss-normalization", "tokens", "--schedule", "pipedream"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pipedream updates each stage after each micro-batch" in err


def test_the_step_loss_weighs_micro_batches_by_their_tokens(tmp_path):
    """Two replicas of the last stage, micro-batch means 1.0 (3 tokens) and 2.0 (1 token), 4.0 and 0.0
    (2 tokens each): the step loss is (3 + 2 + 8 + 0) / 8, not the mean of the means (1.75)."""
    a = RankReport(rank=2, stage=1, replica=0, step_ms={0: 1.0}, losses={0: {0: 1.0, 2: 2.0}},
                   tokens={0: {0: 3.0, 2: 1.0}})
    b = RankReport(rank=3, stage=1, replica=1, step_ms={0: 1.0}, losses={0: {1: 4.0, 3: 0.0}},
                   tokens={0: {1: 2.0, 3: 2.0}})
    assert step_losses([a, b], 4) == {0: 13 / 8}
    plain = [dataclasses.replace(r, tokens={}) for r in (a, b)]
    assert step_losses(plain, 4) == {0: 1.75}
    assert step_record(0, 1.0, 8, [1.0, 2.0], weights=[3.0, 1.0])["loss"] == 1.25
    plan = dataclasses.replace(make_plan("mlp", [3], [1, 1], micro_batches=4, batch_size=4),
                               loss_normalization="tokens")
    summary = summarize([a, b], plan, steps=1, first_step=0, run_dir=str(tmp_path), trace_dir=None,
                        schedule="1f1b")
    assert summary["loss_normalization"] == "tokens" and summary["loss"] == {"0": 13 / 8}
    assert "(over the global batch's tokens)" in format_summary(summary)
