"""Two Trainer jobs must never write one checkpoint directory (runtime/dirlock.py, as launch's
``--checkpoint-dir``): the Trainer locks a directory at its first ``save`` there and holds it until
``close``. Before, ``Trainer.save`` took no lock: a second job saving the same step number set the
first job's checkpoint aside (``step-000002.skipped-1``: "an unusable checkpoint was in the way")
and committed its own in its place, and the first job's ``load`` then resumed silently from the
other job's weights (another seed: every weight differed). One rank each, real processes: 6-7 s
(make test-slow)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hybridpipe.partitioner.plan import save_plan
from hybridpipe.runtime.checkpoint_files import step_dir
from tests.pipeline.harness import make_plan
from tests.runtime.rank_procs import Job

RANKS = Path(__file__).with_name("dirlock_ranks.py")


@pytest.mark.slow
def test_a_second_trainer_job_on_a_used_checkpoint_dir_is_refused_and_the_first_resumes_its_own(tmp_path):
    plan = save_plan(make_plan("mlp", [], [1], micro_batches=2, batch_size=4), tmp_path / "plan.json")
    ckpt, markers = tmp_path / "ckpt", tmp_path
    args = (str(plan), str(ckpt), str(markers))
    with Job(RANKS, "first", 1, args) as a:
        deadline = time.monotonic() + 120
        while not (markers / "first-saved").exists():
            assert time.monotonic() < deadline and not a.poll(), a.wait(1)
            time.sleep(0.05)
        with Job(RANKS, "second", 1, args) as b:
            [second] = b.wait(timeout=120)
        [first] = a.wait(timeout=120)
    assert first.returncode == 0 and second.returncode == 0, (first, second)
    assert first.value == {"step": 2, "same": True}
    assert second.value.startswith(f"--checkpoint-dir {ckpt} is in use by another job"), second.value
    assert "\n" not in second.value
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == [step_dir(ckpt, 2).name]


@pytest.mark.slow
def test_a_fresh_trainer_refuses_to_save_among_another_runs_checkpoints(tmp_path):
    """As launch without --resume: a Trainer that did not load a directory's checkpoints never saves
    among them. Before, a fresh run's first save (step 1) went in beside an ended run's step 2 and
    its restart's ``load`` resumed from the other run's step 2 without a word."""
    plan = save_plan(make_plan("mlp", [], [1], micro_batches=2, batch_size=4), tmp_path / "plan.json")
    ckpt = tmp_path / "ckpt"
    with Job(RANKS, "fresh_after", 1, (str(plan), str(ckpt))) as job:
        [result] = job.wait(timeout=120)
    assert result.returncode == 0, result
    value = result.value
    assert value["refused"].startswith(f"{ckpt} already holds checkpoints ({step_dir(ckpt, 2).name})"), value
    assert "\n" not in value["refused"]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == [step_dir(ckpt, 2).name]
