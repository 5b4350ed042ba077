"""The plan is the contract for gradient sync: launch runs each layer's algorithm, sync unit and
lane as the plan writes them (hand-edited ones included), says so in the run summary, refuses
what it cannot run with one line, and prints what a launch override changes. Real processes:
2 stages x 2 replicas of the tiny MLP; the weights still equal single-process training's."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hybridpipe.launch import main
from hybridpipe.partitioner.cost.syncunits import LayerSync
from hybridpipe.partitioner.plan import Plan, load_plan, save_plan
from hybridpipe.profiles.graphinfo import node_infos
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import capture, make_plan
from tests.runtime.jobs import final_weights, launch, max_diff, train_reference

STEPS, LR, MOMENTUM, SEED = 4, 0.05, 0.5, 3
# stage 0 holds nodes 0 and 2, stage 1 nodes 4, 6 and 8 (the MLP's five Linear layers)
HAND = {"0": ("ring", None, 0), "2": ("native", None, 0),
        "4": ("butterfly", 7, 0), "6": ("butterfly", 7, 0), "8": ("ring", None, 1)}   # 4+6 one all-reduce


def hand_edited_plan() -> Plan:
    """The MLP cut after node 2 on 2 x 2 ranks, every layer's sync written by hand (HAND)."""
    plan = make_plan("mlp", [2], [2, 2], micro_batches=4, batch_size=4)
    captured = capture(resolve_model("mlp"), 4)
    sizes = {n: p.numel() * p.element_size() for n, p in captured.module.named_parameters()}
    nodes = node_infos(captured)
    stages = []
    for s in plan.stages:
        layers = []
        for info in nodes[s.first_node:s.last_node + 1]:
            if info.params:
                algorithm, unit, lane = HAND[info.name]
                layers.append(LayerSync(info.name, info.params, sum(sizes[p] for p in info.params), algorithm,
                                        unit=unit, lane=lane))
        stages.append(dataclasses.replace(s, layers=tuple(layers)))
    return dataclasses.replace(plan, stages=tuple(stages))


def run(tmp_path, plan: Plan, *extra: str):
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    ckpt, rundir = tmp_path / "ckpt", tmp_path / "run"
    done = launch(["--plan", str(path), "--steps", str(STEPS), "--lr", str(LR), "--momentum", str(MOMENTUM),
                   "--seed", str(SEED), "--checkpoint-dir", str(ckpt), "--run-dir", str(rundir), "--timeout", "60",
                   "--no-progress", "--no-trace", *extra], plan.world_size, timeout=150)
    assert all(d.returncode == 0 for d in done), done
    summary = json.loads((rundir / "summary.json").read_text())
    reference = train_reference(plan, STEPS, lr=LR, momentum=MOMENTUM, seed=SEED)
    assert max_diff(final_weights(ckpt, STEPS), reference) <= 1e-5
    assert all(summary["replicas_identical"].values())
    return done, summary


def test_hand_edited_algorithms_run_as_written(tmp_path):
    plan = hand_edited_plan()
    assert load_plan(save_plan(plan, tmp_path / "p.json")) == plan               # units and lanes round-trip
    done, summary = run(tmp_path, plan)
    ran = {e["layer"]: e["algorithm"] for layers in summary["sync"].values() for e in layers}
    assert ran == {name: algorithm for name, (algorithm, _, _) in HAND.items()}
    assert set(summary["sync"]) == {"0", "1"} and summary["sync_as_planned"] is True
    assert all(e["planned"] == e["algorithm"] for layers in summary["sync"].values() for e in layers)
    reporter = done[2].stdout                                                   # the last stage's first rank
    assert "all-reduce: as the plan says (5 layers in 2 replicated stage(s)" in reporter, reporter
    assert not any("overrides the plan" in d.stdout for d in done)


@pytest.mark.slow
def test_an_override_prints_what_it_changes_and_the_summary_says_so(tmp_path):
    done, summary = run(tmp_path, hand_edited_plan(), "--allreduce", "ring")
    lines = {d.rank: [ln for ln in d.stdout.splitlines() if "--allreduce ring" in ln] for d in done}
    assert lines[1] == lines[3] == []                                           # the stages' first ranks only
    assert lines[0] == ["launch.py: stage 0: --allreduce ring overrides the plan: 1 of 2 layers change algorithm: "
                        "2 native->ring; sync units 2->1"], lines            # small layers fused for ring
    assert lines[2] == ["launch.py: stage 1: --allreduce ring overrides the plan: 2 of 3 layers change algorithm: "
                        "4 butterfly->ring, 6 butterfly->ring; sync units 2->1; layers on the second lane 1->0"]
    assert all(e["algorithm"] == "ring" for layers in summary["sync"].values() for e in layers)
    assert summary["sync_as_planned"] is False and summary["allreduce"] == "ring"
    assert "all-reduce: NOT as the plan says: stage 0 2 ring (plan: native)" in done[2].stdout


@pytest.mark.parametrize("edit,expected", [
    ({"algorithm": "telepathy"}, "unknown all-reduce algorithm 'telepathy'; use one of ring, butterfly"),
    ({"algorithm": "native", "lane": 1}, "native cannot run on sync lane 1"),
    ({"params": ["0.weight", "nonexistent.bias"]}, "the plan syncs parameter 'nonexistent.bias'"),
    pytest.param({"params": ["0.weight"]}, "the plan's layers do not sync parameter '0.bias'",
                 marks=pytest.mark.slow),
])
def test_what_launch_cannot_run_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, edit, expected):
    path = save_plan(hand_edited_plan(), tmp_path / "plan.json")
    data = json.loads(path.read_text())
    data["stages"][0]["layers"][0].update(edit)
    path.write_text(json.dumps(data))
    if "params" in edit:      # found when every rank checks the model against the plan, before the job forms
        done = launch(["--plan", str(path), "--steps", "1", "--timeout", "60", "--no-progress", "--no-trace",
                       "--run-dir", str(tmp_path / "run")], 4, timeout=120)
        assert {d.returncode for d in done} == {2}, done                # every rank, before the job forms
        lines = [ln for d in done for ln in d.stderr.strip().splitlines()]
        assert len(lines) == 1 and expected in lines[0], done              # once per host
        return
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert main(["--plan", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


@pytest.mark.slow
def test_a_plan_without_layers_gets_the_partitioners_choice(tmp_path):
    """A replicated stage whose plan lists no layers (a hand-made plan) syncs every parameter by
    the partitioner's policy on the plan's cluster; the summary names them by module path."""
    plan = make_plan("mlp", [4], [2, 2], micro_batches=4, batch_size=4)     # nodes 0-4 | 5-8
    _, summary = run(tmp_path, plan)
    assert {s: [e["layer"] for e in summary["sync"][s]] for s in ("0", "1")} == {"0": ["0", "2", "4"],
                                                                                 "1": ["6", "8"]}
    assert all(e["planned"] is None and e["algorithm"] for s in ("0", "1") for e in summary["sync"][s])
    assert summary["sync_as_planned"] is False
