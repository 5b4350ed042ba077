"""Planning at start for the world that is there (runtime/replan.py) and the restart records
(runtime/restarts.py): no processes."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.cluster import load_cluster
from hybridpipe.partitioner.planner import Request, partition
from hybridpipe.profiles.format import save_profile
from hybridpipe.runtime.config import build_parser, resolve
from hybridpipe.runtime.replan import agree_plan, plan_for_world
from hybridpipe.runtime.restarts import append_log, first_step_done, note_exit, read_log, read_notes, restart_entry
from tests.badinput import run
from tests.partitioner.synth import make_profile

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "examples" / "clusters" / "local4.json"
LAYERS = [(6.0, 12.0, 30_000, 140_000), (4.0, 8.0, 10_000, 350_000), (3.0, 6.0, 1_600, 150_000),
          (2.0, 4.0, 400, 16_000)]


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    return save_profile(make_profile(LAYERS, model="convfc"), tmp_path_factory.mktemp("p") / "convfc.json")


def launch_args(profile: Path, *extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["--profile", str(profile), "--cluster", str(CLUSTER), "--micro-batches", "12",
                                      "--no-progress", *extra])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_plan_at_start_is_the_partitioners_for_the_first_world_size_workers(profile, world):
    from hybridpipe.profiles.format import load_profile

    args = launch_args(profile)
    plan, problem, seconds = agree_plan(args, world)         # no process group: this process is rank 0
    assert problem is None and plan is not None and seconds >= 0
    expected = partition(load_profile(profile), load_cluster(CLUSTER), Request(workers=world, micro_batches=12)).plan
    assert plan.world_size == world and plan.micro_batches == 12
    assert [(s.first_node, s.last_node, s.ranks) for s in plan.stages] == [
        (s.first_node, s.last_node, s.ranks) for s in expected.stages]


def test_a_profile_of_another_model_or_a_world_past_the_cluster_is_one_line(profile):
    with pytest.raises(UserError, match="is a profile of 'convfc', not 'mlp'"):
        plan_for_world(launch_args(profile, "--model", "mlp"), 2)
    plan, problem, _ = agree_plan(launch_args(profile), 5)
    assert plan is None and problem is not None and "describes 4" in problem and "\n" not in problem


def test_plan_or_profile_exactly_one(profile, tmp_path):
    both = build_parser().parse_args(["--plan", "p.json", "--profile", str(profile), "--cluster", str(CLUSTER)])
    with pytest.raises(UserError, match="not both"):
        resolve(both, 1)
    with pytest.raises(UserError, match="no plan: give --plan"):
        resolve(build_parser().parse_args([]), 1)
    with pytest.raises(UserError, match="--profile needs --cluster"):
        resolve(build_parser().parse_args(["--profile", str(profile)]), 1)


def test_launch_with_a_profile_and_no_cluster_is_one_line_on_every_rank(profile, monkeypatch):
    """Rank 0 plans before the arguments are checked together: the missing --cluster must be its
    one-line problem (shared with every rank), not a TypeError on each."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    outcome = run(["--profile", str(profile), "--micro-batches", "4"], launch=True)
    outcome.check_one_line_or_ok()
    assert outcome.code == 2 and "--profile needs --cluster C.json" in outcome.err, outcome.err


def test_exit_notes_become_one_restart_record(tmp_path):
    assert restart_entry(read_notes(tmp_path), world_size=3, resumed_from=20, started=0.0, planning_s=0.1,
                         load_s=0.2) is None
    note_exit(tmp_path, 0, 4, 27)
    note_exit(tmp_path, 2, 4, 26)
    notes = read_notes(tmp_path)
    failed = min(n["time"] for n in notes)
    entry = restart_entry(notes, world_size=3, resumed_from=20, started=failed + 9.0, planning_s=0.1, load_s=0.2)
    assert entry is not None
    assert (entry["world_size_before"], entry["world_size_after"], entry["resumed_from_step"],
            entry["steps_redone"]) == (4, 3, 20, 7)
    assert entry["seconds_to_worker_start"] == pytest.approx(9.0, abs=1e-3)
    done = first_step_done(entry, 0.5, now=failed + 12.0)
    assert done["seconds_to_first_step"] == pytest.approx(12.0, abs=1e-3) and done["first_step_s"] == 0.5
    assert append_log(tmp_path, done) == [done] and read_notes(tmp_path) == []
    assert read_log(tmp_path) == [done]
