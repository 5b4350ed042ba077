"""Kill -9 of one rank of a real launch.py job: every other rank stops, naming it, in time.

Plan: stage 0 replicated on ranks 0 and 1, stage 1 on rank 2, stage 2 on rank 3 (first stage,
a replica, middle and last stage). Ten jobs (slow) kill the ranks in turn at a seeded random
moment mid-run; each time every other rank must exit with EXIT_PEER_LOST naming the victim
within 3 x --peer-timeout (no hang). The default run has one case in test_resume.py.
"""

from __future__ import annotations

import random
import time

import pytest

from hybridpipe.partitioner.plan import save_plan
from hybridpipe.runtime.failure import EXIT_PEER_LOST
from tests.pipeline.harness import make_plan
from tests.runtime.rank_procs import Job
from tests.runtime.test_resume import PEER_TIMEOUT, worker_args

DESCRIBE = {0: "rank 0 (stage 0 replica 0)", 1: "rank 1 (stage 0 replica 1)", 2: "rank 2 (stage 1 replica 0)",
            3: "rank 3 (stage 2 replica 0)"}


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    save_plan(make_plan("mlp", [3, 6], [2, 1, 1], schedule="1f1b", micro_batches=4, batch_size=4), path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(10))
def test_kill_any_rank_mid_run(plan_file, tmp_path, attempt):
    victim = attempt % 4
    delay = random.Random(attempt).uniform(0.0, 0.3)
    args = worker_args(plan_file, tmp_path, "--checkpoint-every", "0")
    args[args.index("--steps") + 1] = "400"            # long enough to be killed mid-run
    with Job(None, None, 4, launch=args) as job:
        metrics = tmp_path / "run" / "metrics" / "rank-00003.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.stat().st_size > 0):
            assert time.monotonic() < deadline and not job.poll(), job.wait(1)
            time.sleep(0.01)
        time.sleep(delay)
        assert not job.poll(), "the run ended before the kill"
        killed_at = job.kill(victim)
        results = job.wait(timeout=3 * PEER_TIMEOUT)
    for r in results:
        if r.rank == victim:
            assert r.returncode == -9
            continue
        assert r.returncode == EXIT_PEER_LOST, r
        assert f"{DESCRIBE[victim]} failed first" in r.stderr, r
    latest = max(r.ended for r in results if r.rank != victim) - killed_at
    print(f"killed rank {victim} {delay:.2f} s into training: all others stopped {latest:.2f} s later")
