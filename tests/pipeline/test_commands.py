"""`hybridpipe simulate` and `hybridpipe schedule` end to end through the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hybridpipe.cli import main
from hybridpipe.partitioner.plan import save_plan
from tests.pipeline.harness import make_plan


@pytest.fixture()
def plan_file(tmp_path):
    plan = make_plan("mlp", [2, 5], [1, 2, 1], schedule="1f1b", micro_batches=4,
                     times=[(1.0, 2.0), (2.0, 4.0), (1.0, 2.0)], send_ms=0.1)
    plan = dataclasses.replace(plan, predicted_step_ms=20.0)
    return save_plan(plan, tmp_path / "plan.json")


def test_simulate_prints_step_time_utilisation_and_writes_a_trace(plan_file, tmp_path, capsys):
    trace, png = tmp_path / "sim.json", tmp_path / "sim.png"
    assert main(["simulate", str(plan_file), "--trace", str(trace), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "predicted step time:" in out and "samples/s" in out and "utilisation" in out
    assert "partitioner's prediction: 20.00 ms" in out
    assert json.loads(trace.read_text())["traceEvents"] and png.stat().st_size > 1000
    assert main(["simulate", str(plan_file), "--schedule", "pipedream", "--steps", "6"]) == 0
    assert "schedule pipedream" in capsys.readouterr().out


def test_schedule_prints_every_rank_and_one_rank_in_full(plan_file, tmp_path, capsys):
    assert main(["schedule", str(plan_file)]) == 0
    out = capsys.readouterr().out
    assert all(f"rank {r} (stage" in out for r in range(4)) and "step(x0.25)" in out
    assert main(["schedule", str(plan_file), "--rank", "2", "--schedule", "pipedream",
                 "--png", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    assert "SyncStart(micro_batch=1, stage=1)" in out and "steady step" in out and "draining step" in out
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_zb_h1_is_listed_drawn_and_simulated(plan_file, tmp_path, capsys):
    assert main(["schedule", str(plan_file), "--schedule", "zb-h1", "--png", str(tmp_path / "zb.png")]) == 0
    out = capsys.readouterr().out
    assert "Bi0" in out and "W0" in out and "every step" in out       # the split backward's halves
    assert (tmp_path / "zb.png").stat().st_size > 1000
    assert main(["simulate", str(plan_file), "--schedule", "zb-h1"]) == 0
    assert "schedule zb-h1" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["simulate", "{plan}", "--steps", "0"], "--steps: must be >= 1, got 0"),
    (["simulate", "{plan}", "--micro-batches", "1"], "use --micro-batches >= 2"),
    (["simulate", "{plan}", "--schedule", "pipedream", "--micro-batches", "3"], "multiple of every stage's replica"),
    (["simulate", "{untimed}"], "has no per-stage times"),
    (["simulate", "{missing}"], "does not exist"),
    (["schedule", "{plan}", "--rank", "7"], "rank 7 is not in the plan"),
    (["schedule", "{plan}", "--micro-batches", "0"], "--micro-batches: must be >= 1, got 0"),
])
def test_bad_requests_end_with_one_line(argv, message, plan_file, tmp_path, capsys):
    untimed = save_plan(make_plan("mlp", [2], [1, 1]), tmp_path / "untimed.json")
    paths = {"plan": plan_file, "untimed": untimed, "missing": tmp_path / "nope.json"}
    assert main([a.format(**paths) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
