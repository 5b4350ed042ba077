"""runtime/training_config.py: the one training configuration of the Trainer and launch. Every field
documented and on the command line, parsed back to itself, each bad value one line, the plan's
defaults filled in and its schedule checked in one place; the Trainer takes it (or its field names)
and the run summary records it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import fields

import pytest
import torch.distributed as dist

from hybridpipe.argtypes import Parser
from hybridpipe.errors import UserError
from hybridpipe.runtime.config import build_parser
from hybridpipe.runtime.summary import RankReport, summarize
from hybridpipe.runtime.training_config import TrainingConfig, with_settings
from tests.pipeline.harness import make_plan

NAMES = [f.name for f in fields(TrainingConfig)]

# per field: its command-line words and the value they give, both not the default
NON_DEFAULT = {
    "seed": (["--seed", "7"], 7),
    "optimizer": (["--optimizer", "adamw"], "adamw"),
    "lr": (["--lr", "0.5"], 0.5),
    "momentum": (["--momentum", "0"], 0.0),
    "weight_decay": (["--weight-decay", "0.01"], 0.01),
    "clip_grad_norm": (["--clip-grad-norm", "1.5"], 1.5),
    "precision": (["--precision", "bf16"], "bf16"),
    "loss_scale": (["--loss-scale", "1024"], 1024.0),
    "reduce_dtype": (["--reduce-dtype", "fp16"], "fp16"),
    "loss_normalization": (["--loss-normalization", "tokens"], "tokens"),
    "skip_nonfinite": (["--skip-nonfinite"], True),
    "memory_every": (["--memory-every", "1"], 1),
    "cpu_allocator": (["--cpu-allocator", "system"], "system"),
    "comm_mode": (["--comm-mode", "sra"], "sra"),
    "allreduce": (["--allreduce", "ring"], "ring"),
    "calibrations": (["--calibration", "a.json", "--calibration", "b.json"], ("a.json", "b.json")),
    "aggregator": (["--aggregator", "agg.local:29600"], "agg.local:29600"),
    "backend": (["--backend", "gloo"], "gloo"),
    "timeout": (["--timeout", "60"], 60.0),
    "in_place": (["--in-place"], True),
}


@pytest.fixture(scope="module")
def plan():
    return make_plan("mlp", [3], [1, 1], micro_batches=2, batch_size=4)


def parser() -> Parser:
    p = Parser(prog="t")
    p.raise_errors = True
    TrainingConfig.add_arguments(p)
    return p


def test_every_field_has_one_line_of_help_and_a_known_group():
    for f in fields(TrainingConfig):
        help_ = f.metadata["help"]
        assert help_ and "\n" not in help_ and len(help_) > 10, f.name
        assert f.metadata["group"] in ("data", "training", "communication"), f.name


def test_defaults_and_every_non_default_value_round_trip_through_the_command_line():
    assert set(NON_DEFAULT) == set(NAMES), "give each new field a non-default value here"
    assert TrainingConfig.from_args(parser().parse_args([])) == TrainingConfig()
    for name, (words, value) in NON_DEFAULT.items():
        got = TrainingConfig.from_args(parser().parse_args(words))
        assert got == TrainingConfig(**{name: value}) != TrainingConfig(), name
        assert getattr(got, name) == value, name


def test_launch_takes_its_flags_and_defaults_from_the_config():
    """One default per setting: launch's parser without arguments gives TrainingConfig()."""
    assert TrainingConfig.from_args(build_parser().parse_args([])) == TrainingConfig()
    args = build_parser().parse_args([w for words, _ in NON_DEFAULT.values() for w in words])
    assert TrainingConfig.from_args(args) == TrainingConfig(**{n: v for n, (_, v) in NON_DEFAULT.items()})


@pytest.mark.parametrize("name, value, says", [
    ("lr", 0.0, "lr must be greater than 0"), ("lr", float("nan"), "lr must be a finite number"),
    ("lr", "0.1", "lr must be a number"), ("lr", True, "lr must be a number"),
    ("momentum", -0.5, "momentum must be >= 0"), ("weight_decay", float("inf"), "weight_decay must be a finite"),
    ("clip_grad_norm", 0, "clip_grad_norm must be greater than 0"), ("loss_scale", -1.0, "loss_scale must be"),
    ("seed", -1, "seed must be between 0 and"), ("seed", 1.5, "seed must be a whole number"),
    ("timeout", 0.5, "timeout must be between 1 and"), ("precision", "fp8", "unknown precision 'fp8'; choose one of"),
    ("reduce_dtype", "fp8", "unknown reduce_dtype"), ("optimizer", "lamb", "unknown optimizer 'lamb'"),
    ("comm_mode", "udp", "unknown comm_mode"), ("allreduce", "tree", "unknown allreduce"),
    ("loss_normalization", "sum", "unknown loss_normalization"), ("backend", "mpi", "unknown backend"),
    ("aggregator", "nohost", "aggregator: expected HOST:PORT"), ("calibrations", "cal.json", "calibrations must be"),
    ("calibrations", [3], "calibrations must be"), ("skip_nonfinite", 1, "skip_nonfinite must be True or False"),
    ("in_place", "yes", "in_place must be True or False"), ("optimizer", print, "optimizer must be a string"),
    ("memory_every", -1, "memory_every must be >= 0"), ("cpu_allocator", "jemalloc", "unknown cpu_allocator"),
])
def test_each_bad_value_is_one_line_naming_the_field(name, value, says):
    with pytest.raises(UserError, match=says) as e:
        TrainingConfig(**{name: value})
    assert "\n" not in str(e.value)


def test_python_values_are_taken_as_the_command_line_takes_them():
    assert TrainingConfig(calibrations=["a.json"]).calibrations == ("a.json",)      # a list: frozen as a tuple
    assert TrainingConfig(lr=1).lr == 1 and TrainingConfig(timeout=60).timeout == 60


def test_settings_replace_fields_and_an_unknown_one_names_the_valid_ones():
    base = TrainingConfig(lr=0.5)
    assert with_settings(base, {"momentum": 0.0}) == TrainingConfig(lr=0.5, momentum=0.0)
    assert with_settings(None, {}) == TrainingConfig()
    with pytest.raises(UserError, match="unknown training setting.* lrate; the settings are seed, optimizer, lr,"):
        with_settings(base, {"lrate": 0.1})
    with pytest.raises(UserError, match="lr must be greater than 0"):
        with_settings(base, {"lr": -1.0})


def test_the_plan_fills_the_none_defaults_and_its_schedule_is_checked_once(plan):
    flushed = plan
    plan = dataclasses.replace(plan, precision="bf16", optimizer="adam", loss_normalization="tokens",
                               reduce_dtype="bf16")
    done = TrainingConfig().for_plan(plan)
    assert (done.optimizer, done.precision, done.loss_normalization, done.reduce_dtype) == \
        ("adam", "bf16", "tokens", "bf16")
    told = TrainingConfig(optimizer="sgd", precision="fp32", loss_normalization="micro-batch",
                          reduce_dtype="fp32").for_plan(plan)
    assert (told.optimizer, told.precision, told.loss_normalization, told.reduce_dtype) == \
        ("sgd", "fp32", "micro-batch", "fp32")
    pipedream = dataclasses.replace(flushed, schedule="pipedream")
    for bad, says in [({"clip_grad_norm": 1.0}, r"clip_grad_norm \(--clip-grad-norm\) needs a global step"),
                      ({"precision": "fp16"}, "fp16's loss scaler"), ({"skip_nonfinite": True}, "skip_nonfinite"),
                      ({"in_place": True}, r"in_place \(--in-place\) needs a schedule that flushes"),
                      ({"loss_normalization": "tokens"}, "pipedream updates each stage")]:
        with pytest.raises(UserError, match=says):
            TrainingConfig(**bad).for_plan(pipedream)
    with pytest.raises(UserError, match="in_place .* and aggregator h:1"):
        TrainingConfig(in_place=True, aggregator="h:1").for_plan(flushed)
    with pytest.raises(UserError, match="in_place .* cannot re-form token-weighted"):
        TrainingConfig(in_place=True).for_plan(plan)


def test_trainer_refuses_an_unknown_or_bad_setting_before_building_anything(plan):
    from hybridpipe.runtime.trainer import Trainer

    with pytest.raises(UserError, match="unknown training setting.* lrate; the settings are"):
        Trainer("mlp", plan, lrate=0.1)
    with pytest.raises(UserError, match="unknown precision 'fp8'"):
        Trainer("mlp", plan, TrainingConfig(lr=0.5), precision="fp8")
    with pytest.raises(UserError, match="clip_grad_norm"):
        Trainer("mlp", dataclasses.replace(plan, schedule="pipedream"), clip_grad_norm=1.0)


@pytest.mark.skipif(dist.is_initialized(), reason="needs to make its own job of one")
def test_a_trainer_of_one_rank_runs_its_config():
    """The config (and the settings over it) reach the optimizer; trainer.config has the plan's
    defaults filled in."""
    from hybridpipe.runtime.trainer import Trainer

    plan = make_plan("mlp", [], [1], micro_batches=2, batch_size=4)
    with Trainer("mlp", plan, TrainingConfig(lr=0.5, weight_decay=0.01), momentum=0.25, timeout=60) as trainer:
        group = trainer.optimizer.param_groups[0]
        assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.5, 0.25, 0.01)
        assert trainer.config == TrainingConfig(lr=0.5, weight_decay=0.01, momentum=0.25, timeout=60,
                                                optimizer=plan.optimizer, precision=plan.precision,
                                                loss_normalization=plan.loss_normalization,
                                                reduce_dtype=plan.reduce_dtype)
    with Trainer("mlp", plan, optimizer="adam", timeout=60) as trainer:
        assert type(trainer.optimizer).__name__ == "Adam" and trainer.config.optimizer == "adam"


def test_the_summary_records_every_setting(plan):
    config = TrainingConfig(lr=0.5, allreduce="ring", calibrations=("c.json",)).for_plan(plan)
    reports = [RankReport(0, 0, 0, step_ms={0: 1.0}), RankReport(1, 1, 0, step_ms={0: 1.0}, losses={0: {0: 1.0}})]
    s = summarize(reports, plan, steps=1, first_step=0, run_dir="r", trace_dir=None, schedule="1f1b", config=config)
    assert s["training"] == dataclasses.asdict(config) and s["training"]["lr"] == 0.5
    assert (s["allreduce"], s["comm_mode"], s["precision"]) == ("ring", "sa", "fp32")
    assert json.loads(json.dumps(s))["training"]["calibrations"] == ["c.json"]
