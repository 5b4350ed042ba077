"""A run resumed from a mid-run checkpoint ends where the uninterrupted run ends; a dead rank
stops the job with one line naming it (through launch.py, real processes)."""

from __future__ import annotations

import shutil
import signal
import time

import pytest

from hybridpipe.partitioner.plan import save_plan
from hybridpipe.runtime.checkpoint_files import step_dir
from hybridpipe.runtime.failure import EXIT_PEER_LOST
from tests.pipeline.harness import make_plan
from tests.runtime.jobs import final_weights, launch, max_diff


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_resume_from_mid_run_checkpoint(tmp_path, schedule):
    plan = make_plan("mlp", [3, 6], [2, 1, 1], schedule=schedule, micro_batches=4, batch_size=4)
    save_plan(plan, tmp_path / "plan.json")
    ckpt = tmp_path / "ckpt"
    args = ["--plan", str(tmp_path / "plan.json"), "--steps", "6", "--checkpoint-dir", str(ckpt), "--lr", "0.05",
            "--timeout", "60", "--no-progress", "--no-trace"]
    done = launch([*args, "--checkpoint-every", "3", "--run-dir", str(tmp_path / "a")], 4)
    assert all(d.returncode == 0 for d in done), done
    straight = final_weights(ckpt, 6)
    shutil.rmtree(step_dir(ckpt, 6))           # as if the job had died after step 5
    done = launch([*args, "--resume", "--run-dir", str(tmp_path / "b")], 4)
    assert all(d.returncode == 0 for d in done), done
    assert "3 steps of mlp" in done[3].stdout, done[3]
    assert max_diff(final_weights(ckpt, 6), straight) <= 1e-6


@pytest.mark.slow
def test_a_killed_rank_is_named_by_the_others(tmp_path):
    plan = make_plan("mlp[hidden=512]", [3, 6], [2, 1, 1], micro_batches=4, batch_size=64)
    save_plan(plan, tmp_path / "plan.json")
    args = ["--plan", str(tmp_path / "plan.json"), "--steps", "100000", "--timeout", "60", "--peer-timeout", "10",
            "--no-progress", "--no-trace", "--run-dir", str(tmp_path / "run")]
    procs_seen = {}

    def kill_rank_2_after_some_steps(procs):
        metrics = tmp_path / "run" / "metrics" / "rank-00002.jsonl"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
            time.sleep(0.2)
        procs[2].send_signal(signal.SIGKILL)
        procs_seen["killed"] = True

    done = launch(args, 4, timeout=150, on_start=kill_rank_2_after_some_steps)
    assert procs_seen.get("killed")
    for d in (done[0], done[1], done[3]):
        assert d.returncode == EXIT_PEER_LOST, d
        last = d.stderr.strip().splitlines()[-1]
        assert "rank 2 (stage 1 replica 0) failed first" in last, d
