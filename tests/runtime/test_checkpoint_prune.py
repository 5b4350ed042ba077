"""Pruning keeps the newest *good* checkpoints (runtime/checkpoint_prune.py): the choice against brute
force, the files in one process, and a resumed job past a corrupt newest step."""

from __future__ import annotations

import json
from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.partitioner.plan import save_plan
from hybridpipe.runtime.checkpoint import Checkpointer
from hybridpipe.runtime.checkpoint_files import complete_steps, stage_file, step_dir
from hybridpipe.runtime.checkpoint_prune import choose, prune
from tests.pipeline.harness import make_plan
from tests.runtime.test_checkpoint import make_opt, stage_module
from tests.runtime.test_checkpoint import make_plan as one_stage_plan
from tests.runtime.test_hardening import _flip, one_rank


def brute_force(good: dict[int, bool], keep: int) -> tuple[set[int], set[int]]:
    """(kept, deleted) by the rule itself: of every way to keep a set of steps and delete a set,
    the one that keeps only good steps, at most ``keep``, never deletes a good step newer than a
    kept one or while fewer than ``keep`` are kept, and deletes nothing bad newer than a kept one;
    the rest of the bad steps are set aside."""
    steps = sorted(good)
    goods = [s for s in steps if good[s]]
    options = []
    for n in range(min(keep, len(goods)) + 1):
        for kept in combinations(goods, n):
            oldest = min(kept) if len(kept) == keep else None
            deleted = {s for s in steps if oldest is not None and s < oldest}
            fine = all(s in kept or s in deleted for s in goods) and all(
                not good[s] for s in steps if s not in kept and s not in deleted)
            if fine:
                options.append((set(kept), deleted))
    assert len(options) == 1, options           # the rule leaves exactly one choice
    return options[0]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(1, 40), st.booleans(), max_size=9), st.integers(1, 5))
def test_the_choice_is_the_only_one_the_rule_allows_and_checks_only_what_it_keeps(good, keep):
    checked: list[int] = []

    def problem(step: int) -> str:
        checked.append(step)
        return "" if good[step] else "corrupt"

    got = choose(list(good), keep, problem)
    kept, deleted = brute_force(good, keep)
    assert set(got.kept) == kept and set(got.deleted) == deleted
    assert {s for s, _ in got.aside} == set(good) - kept - deleted and all(not good[s] for s, _ in got.aside)
    assert not set(checked) & deleted            # deleted unread
    assert choose(list(good), 0, problem).kept == tuple(sorted(good, reverse=True))      # keep 0: everything


def test_a_corrupt_newest_step_is_set_aside_and_never_counted(tmp_path):
    plan = one_stage_plan(((0,),))
    module = stage_module(0)
    first = Checkpointer(tmp_path, plan=plan, rank=0, every=1, keep=0)
    for step in (2, 4):
        first.save(step, module=module, optimizer=make_opt(module))
    _flip(step_dir(tmp_path, 4) / stage_file(0))             # same size: only the digest tells
    second = Checkpointer(tmp_path, plan=plan, rank=0, every=1, keep=1)
    restored = second.restore(module)
    assert restored is not None and restored.step == 2 and restored.skipped[0].startswith("step-000004:")
    second.save(3, module=module, optimizer=make_opt(module))
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
    assert names == ["step-000003", "step-000004.corrupt-1"], names      # before: step-000004 alone (3 deleted)
    assert complete_steps(tmp_path, verify=True) == [3]
    assert prune(tmp_path, 1, first.lineage, second.trusted).deleted == ()   # nothing more to do


def test_a_job_resumed_past_a_corrupt_step_keeps_its_good_steps(tmp_path):
    save_plan(make_plan("mlp", [], [1], micro_batches=2, batch_size=4), tmp_path / "plan.json")
    ckpt = tmp_path / "ckpt"

    def run(*extra: str):
        return one_rank(["--plan", str(tmp_path / "plan.json"), "--checkpoint-dir", str(ckpt), "--resume",
                         "--run-dir", str(tmp_path / "run"), "--no-progress", *extra])

    done = run("--steps", "4", "--checkpoint-every", "2")
    assert done.returncode == 0 and complete_steps(ckpt) == [2, 4], done
    _flip(step_dir(ckpt, 4) / stage_file(0))
    resumed = run("--steps", "3", "--keep-checkpoints", "1")     # from step 2; its final save is step 3
    assert resumed.returncode == 0, resumed
    assert "continuing from" in resumed.stdout and "(skipped: step-000004: rank 0: checkpoint file stage-0.pt is " \
                                                  "corrupt" in resumed.stdout, resumed
    [line] = [x for x in resumed.stderr.splitlines() if "corrupt-1" in x]
    assert line.endswith("failed verification, moved aside (never deleted, not one of the 1 kept): step-000004 "
                         "to step-000004.corrupt-1 (stage-0.pt is corrupt (its SHA-256 differs from the "
                         "manifest's))"), line
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step")) == [
        "step-000003", "step-000004.corrupt-1"]
    assert complete_steps(ckpt, verify=True) == [3]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["first_step"] == 2
