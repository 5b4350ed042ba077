"""hybridpipe.launch end to end on 4 rank processes, and its refusals of bad arguments and plans."""

from __future__ import annotations

import json

import pytest

from hybridpipe.launch import main
from hybridpipe.partitioner.plan import save_plan
from hybridpipe.runtime.metrics import read_metrics
from tests.pipeline.harness import make_plan
from tests.runtime.jobs import final_weights, launch, max_diff, train_reference


def test_four_workers_train_report_and_end_with_one_process_weights(tmp_path):
    """4 workers, 1f1b, stage 0 replicated: trains, reports, writes metrics and timeline, and
    ends with single-process training's weights. (As torchrun's workers, with its environment;
    torchrun itself runs launch.py in test_preempt.py and ``-m hybridpipe.launch`` in test_hardening.py.)"""
    plan = make_plan("mlp", [3, 6], [2, 1, 1], schedule="1f1b", micro_batches=4, batch_size=8)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    done = launch(["--plan", str(path), "--steps", "6", "--lr", "0.05", "--momentum", "0.5", "--seed", "1",
                   "--run-dir", str(run), "--checkpoint-dir", str(ckpt), "--timeout", "60"], 4)
    assert all(r.returncode == 0 for r in done), done
    stdout = "".join(r.stdout for r in done)
    assert "loss: step 0:" in stdout and "step time: measured" in stdout, done
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_run"] == 6 and summary["replicas_identical"] == {"0": True}
    assert summary["measured_step_ms"] > 0
    for rank in range(4):
        records = read_metrics(run / "metrics" / f"rank-{rank:05d}.jsonl")
        assert [r["step"] for r in records] == list(range(6))
        assert ("loss" in records[0]) == (rank == 3)
        assert (run / "trace" / f"rank-{rank:05d}.json").is_file()
    reference = train_reference(plan, 6, lr=0.05, momentum=0.5, seed=1)
    assert max_diff(final_weights(ckpt, 6), reference) <= 1e-5


@pytest.fixture
def plan_file(tmp_path, monkeypatch):
    plan = make_plan("mlp", [3], [2, 1], micro_batches=4, batch_size=8)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return path


@pytest.mark.parametrize("extra,expected", [
    (["--model", "alexnet-small"], "the plan was made for model 'mlp', not 'alexnet-small'"),
    (["--micro-batch-size", "16"], "the plan was made for batch size 8, not 16"),
    (["--micro-batches", "1"], "use --micro-batches >= 2"),
    (["--schedule", "pipedream", "--micro-batches", "3"], "must be a multiple of every stage's replica count"),
    (["--resume"], "need --checkpoint-dir"),
    (["--steps", "0"], "--steps: must be >= 1, got 0"),
    (["--calibration", "/nonexistent/cal.json"], "calibration file /nonexistent/cal.json does not exist"),
    (["--lr", "nan"], "--lr: must be a finite number"),
    (["--lr", "inf"], "--lr: must be a finite number"),
    (["--lr", "0"], "--lr: must be greater than 0"),
    (["--timeout", "nan"], "--timeout: must be a finite number"),
    (["--timeout", "0.001"], "--timeout: must be between 1 and 1e+06"),
    (["--peer-timeout", "nan"], "--peer-timeout: must be a finite number"),
    (["--peer-timeout", "-1"], "--peer-timeout: must be between 1 and 1e+06"),
    (["--peer-timeout", "inf"], "--peer-timeout: must be a finite number"),
    (["--seed", "-1"], "--seed: must be between 0 and"),
    (["--momentum", "nan"], "--momentum: must be a finite number"),
    (["--aggregator", "host"], "--aggregator: expected HOST:PORT"),
    (["--skip-nonfinite", "--schedule", "pipedream", "--micro-batches", "4"],
     "skip_nonfinite (--skip-nonfinite) needs a schedule"),
    (["--batch-size", "8", "--micro-batch-size", "4"], "give only --micro-batch-size"),
])
def test_bad_arguments_end_with_one_line(plan_file, capsys, extra, expected):
    assert main(["--plan", str(plan_file), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybridpipe.launch: error: ") and expected in err[0], err


def test_batch_size_is_a_deprecated_alias_of_micro_batch_size(tmp_path, capsys, monkeypatch):
    """A job of one in this process: the old option still works, with one warning line."""
    save_plan(make_plan("mlp", [], [1], micro_batches=2, batch_size=4), tmp_path / "one.json")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    args = ["--plan", str(tmp_path / "one.json"), "--steps", "2", "--run-dir", str(tmp_path / "run"), "--no-progress"]
    assert main([*args, "--batch-size", "4"]) == 0
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == ["hybridpipe.launch: warning: --batch-size is deprecated (it always meant "
                                        "samples per micro-batch); use --micro-batch-size"]
    assert "global batch 8 = 2 micro-batches x 4 samples" in out
    assert main([*args, "--batch-size", "16"]) == 2
    assert "the plan was made for batch size 4, not 16" in capsys.readouterr().err


def test_plan_for_another_world_size_is_refused(plan_file, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["--plan", str(plan_file)]) == 2
    assert "the plan needs 3 workers but the job has 4" in capsys.readouterr().err


@pytest.mark.parametrize("other,expected", [
    ({"signature": "0123456789abcdef"}, "the model's traced graph differs from the one the plan was made for"),
    ({"n_nodes": 11}, "the plan covers 11 graph nodes but the model has 9"),     # mlp: 9 blocks
])
def test_plan_for_another_graph_is_refused(tmp_path, capsys, monkeypatch, other, expected):
    plan = make_plan("mlp", [3], [1, 1], **other)
    save_plan(plan, tmp_path / "plan.json")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--plan", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_missing_or_broken_plan(tmp_path, capsys):
    assert main(["--plan", str(tmp_path / "nope.json")]) == 2
    (tmp_path / "bad.json").write_text("{")
    assert main(["--plan", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "does not exist" in err[0] and "not valid JSON" in err[1]
    assert all(line.startswith("hybridpipe.launch: error: ") for line in err)
