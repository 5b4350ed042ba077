"""The worker's pure parts: configuration against the plan, metrics lines, the summary."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import Plan, save_plan
from hybridpipe.runtime.config import build_parser, resolve
from hybridpipe.runtime.metrics import MetricsWriter, read_metrics, step_record
from hybridpipe.runtime.parts import NoParameters, buffers_digest, make_optimizer, seed_rank, weights_digest
from hybridpipe.runtime.summary import RankReport, format_summary, loss_rows, step_losses, summarize, warmup_steps
from hybridpipe.runtime.training_config import TrainingConfig
from tests.pipeline.harness import make_plan


@pytest.fixture
def plan(tmp_path):
    p = make_plan("mlp", [3], [2, 1], schedule="1f1b", micro_batches=4, batch_size=8)
    save_plan(p, tmp_path / "plan.json")
    return p


def parse(tmp_path, *extra):
    return build_parser().parse_args(["--plan", str(tmp_path / "plan.json"), *extra])


def test_plan_values_are_the_defaults(tmp_path, plan):
    cfg = resolve(parse(tmp_path), world_size=3)
    assert (cfg.model, cfg.batch_size, cfg.micro_batches, cfg.schedule, cfg.optimizer) == \
        ("mlp", 8, 4, "1f1b", "sgd")
    assert cfg.global_batch == 32 and cfg.trace_dir is None and cfg.training.comm_mode == "sa"


def test_overrides_reach_the_effective_plan(tmp_path, plan):
    cfg = resolve(parse(tmp_path, "--micro-batches", "6", "--schedule", "gpipe", "--optimizer", "adam",
                        "--model", "mlp", "--batch-size", "8", "--no-trace"), world_size=3)
    assert (cfg.plan.micro_batches, cfg.plan.schedule, cfg.plan.optimizer) == (6, "gpipe", "adam")
    assert cfg.plan.stages == plan.stages and cfg.trace_dir == ""


def test_checkpoint_options_need_a_directory(tmp_path, plan):
    with pytest.raises(UserError, match="--checkpoint-dir"):
        resolve(parse(tmp_path, "--checkpoint-every", "2"), world_size=3)
    cfg = resolve(parse(tmp_path, "--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path / "c")), world_size=3)
    assert cfg.checkpoint_every == 2


def test_optimizers():
    w = torch.nn.Parameter(torch.ones(2))
    assert isinstance(make_optimizer("sgd", [w], lr=0.1, momentum=0.9), torch.optim.SGD)
    assert isinstance(make_optimizer("adam", [w], lr=0.1), torch.optim.Adam)
    empty = make_optimizer("sgd", [], lr=0.1)          # a stage without parameters
    assert isinstance(empty, NoParameters) and empty.state_dict() == {}


def test_weights_digest_sees_every_bit_of_the_parameters():
    a = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    b = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    b.load_state_dict(a.state_dict())
    assert weights_digest(a) == weights_digest(b)
    assert buffers_digest(a) == buffers_digest(b)
    b[1].running_mean[1] = torch.nextafter(b[1].running_mean[1], torch.tensor(1.0))   # the buffers' own digest
    assert weights_digest(a) == weights_digest(b) and buffers_digest(a) != buffers_digest(b)
    with torch.no_grad():
        b[0].bias[0] = torch.nextafter(b[0].bias[0], torch.tensor(1.0))
    assert weights_digest(a) != weights_digest(b)


def test_ranks_get_their_own_random_streams():
    draws = []
    for rank in (0, 1, 0):
        seed_rank(7, rank)
        draws.append(torch.rand(3))
    assert torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[1])


def test_metrics_lines(tmp_path):
    w = MetricsWriter(tmp_path, 2)
    w.write(step_record(0, 0.5, 64, [2.0, 3.0]))
    w.write(step_record(1, 0.25, 64, []))
    w.close()
    with w.path.open("a") as f:
        f.write('{"step": 2, "st')             # a crash mid-line
    records = read_metrics(tmp_path / "metrics" / "rank-00002.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["loss"] == 2.5 and records[0]["samples_per_s"] == 128.0 and records[0]["step_ms"] == 500.0
    assert "loss" not in records[1] and records[1]["samples_per_s"] == 256.0


def test_warmup_steps():
    assert [warmup_steps(n) for n in (0, 1, 2, 5, 10, 11, 100)] == [0, 0, 1, 1, 2, 2, 20]


def test_step_losses_join_the_replicas_of_the_last_stage():
    a = RankReport(1, 1, 0, losses={0: {0: 1.0, 2: 3.0}, 1: {0: 5.0, 2: 5.0}})
    b = RankReport(2, 1, 1, losses={0: {1: 2.0, 3: 4.0}})            # step 1 of this replica missing
    assert step_losses([a, b], micro_batches=4) == {0: 2.5}


def test_summary(plan, tmp_path):
    plan = type(plan)(**{**plan.__dict__, "predicted_step_ms": 100.0})
    combined = {0: [f"bn{i}.{b}" for i in range(5) for b in ("running_mean", "running_var", "num_batches_tracked")]}
    reports = [RankReport(0, 0, 0, step_ms={0: 900, 1: 110, 2: 120, 3: 100, 4: 90}, digest="x", buffers="b",
                          combined=combined),
               RankReport(1, 0, 1, step_ms={0: 800, 1: 100, 2: 130, 3: 95, 4: 95}, digest="x", buffers="b",
                          combined=combined),
               RankReport(2, 1, 0, step_ms={0: 700, 1: 105, 2: 125, 3: 99, 4: 80},
                          losses={k: {m: 3.0 - k * 0.1 for m in range(4)} for k in range(5)})]
    s = summarize(reports, plan, steps=5, first_step=0, run_dir=str(tmp_path), trace_dir=None, schedule="1f1b",
                  config=TrainingConfig(allreduce="hybrid"))
    assert s["warmup_steps"] == 1
    assert s["job_step_ms"] == {"0": 900, "1": 110, "2": 130, "3": 100, "4": 95}
    assert s["measured_step_ms"] == 105.0 and s["measured_over_predicted"] == pytest.approx(1.05)
    assert s["samples_per_s"] == pytest.approx(32 / 0.105)
    assert s["replicas_identical"] == {"0": True}
    assert s["loss"]["4"] == pytest.approx(2.6)
    json.dumps(s)
    text = format_summary(s)
    assert "measured 105.0 ms" in text and "plan predicted 100.0 ms" in text and "step 0: 3.0000" in text
    assert "identical weights and buffers in every replicated stage (running statistics combined across replicas: " \
        "stage 0: bn0, bn1, bn2 and 2 more)" in text
    assert s["buffers_combined"] == {"0": combined[0]}
    reports[1].buffers = "c"
    s = summarize(reports, plan, steps=5, first_step=0, run_dir="r", trace_dir="r/trace", schedule="1f1b",
                  config=TrainingConfig(allreduce="ring"))
    assert s["replicas_identical"] == {"0": False} and "BUFFERS DIFFER between the replicas of stage 0" in \
        format_summary(s)
    reports[1].digest = "y"
    s = summarize(reports, plan, steps=5, first_step=0, run_dir="r", trace_dir="r/trace", schedule="1f1b",
                  config=TrainingConfig(allreduce="ring"))
    assert s["replicas_differ"] == {"0": "weights and buffers"} and "WEIGHTS AND BUFFERS DIFFER" in format_summary(s)


def test_the_summary_compares_memory_like_for_like(plan, tmp_path):
    """The CPU meter counts the tensors a stage holds; the plan's memory_bytes also holds its kernels'
    temporaries (transient_bytes), which only an allocator's peak (CUDA) sees: each peak is set
    against the prediction it measures, the left-out transient said beside it."""
    MiB = 2**20
    stages = tuple(dataclasses.replace(s, memory_bytes=100 * MiB, transient_bytes=30 * MiB) for s in plan.stages)
    plan = dataclasses.replace(plan, stages=stages)
    cpu, cuda = RankReport(0, 0, 0, peak_memory_bytes=70 * MiB), RankReport(2, 1, 0, peak_memory_bytes=90 * MiB,
                                                                              allocator_peak=True)
    s = summarize([cpu, cuda], plan, steps=1, first_step=0, run_dir=str(tmp_path), trace_dir=None,
                  schedule="1f1b", config=TrainingConfig())
    held, allocator = s["memory"]
    assert (held["predicted_bytes"], held["transient_bytes_not_counted"], held["counts"]) == \
        (70 * MiB, 30 * MiB, "tensors held")
    assert (allocator["predicted_bytes"], allocator["transient_bytes_not_counted"]) == (100 * MiB, 0)
    assert "peak 90.0 MiB on rank 2 (stage 1), plan predicted 100.0 MiB" in format_summary(s)
    cuda.peak_memory_bytes = 10 * MiB
    s = summarize([cpu, cuda], plan, steps=1, first_step=0, run_dir=str(tmp_path), trace_dir=None,
                  schedule="1f1b", config=TrainingConfig())
    assert "peak 70.0 MiB on rank 0 (stage 0), plan predicted 70.0 MiB held (+30.0 MiB of kernels' temporaries" \
        in format_summary(s)
    d = plan.to_dict()
    assert Plan.from_dict(d).stages[0].transient_bytes == 30 * MiB
    for st in d["stages"]:
        del st["transient_bytes"]                   # a plan written before the field
    assert Plan.from_dict(d).stages[0].transient_bytes == 0


def test_loss_rows_spread_over_the_run():
    losses = {str(k): float(k) for k in range(20)}
    rows = loss_rows(losses, rows=5)
    assert rows[0] == (0, 0.0) and rows[-1] == (19, 19.0) and len(rows) == 5
    assert loss_rows({"0": 1.0, "1": 0.5}) == [(0, 1.0), (1, 0.5)]


def test_the_summary_names_a_thread_count_the_profile_did_not_measure(plan, tmp_path):
    """The plan's times are the profile's setting: ranks computing with other intra-op thread counts
    (torchrun gives each of several workers on a host 1) are named with the fix; equal counts, a GPU
    profile (0) or GPU ranks say nothing."""
    def text(profile_threads: int, rank_threads: list[int]) -> str:
        p = type(plan)(**{**plan.__dict__, "predicted_step_ms": 100.0, "profile_threads": profile_threads})
        reports = [RankReport(r, 0 if r < 2 else 1, r % 2, step_ms={0: 100, 1: 100}, digest="x", buffers="b",
                              threads=t) for r, t in enumerate(rank_threads)]
        s = summarize(reports, p, steps=2, first_step=0, run_dir=str(tmp_path), trace_dir=None, schedule="1f1b")
        json.dumps(s)
        return format_summary(s)

    note = ("note: the ranks computed with 1 intra-op CPU thread(s), the profile measured with 2: the plan priced "
            "another setting (profile with --threads 1 for this one)")
    assert note in text(2, [1, 1, 1])
    assert "1/4 intra-op" in text(2, [1, 4, 1])
    for quiet in (text(1, [1, 1, 1]), text(0, [1, 1, 1]), text(2, [0, 0, 0])):
        assert "intra-op" not in quiet
