"""Kill -9 of one rank of a real launch.py job: every other rank stops, naming it, in time.

Plan: stage 0 replicated on ranks 0 and 1, stage 1 on rank 2, stage 2 on rank 3 (first stage,
a replica, middle and last stage). Ten jobs (slow) kill the ranks in turn at a seeded random
moment mid-run; each time every other rank must exit with EXIT_PEER_LOST naming the victim
within 3 x --peer-timeout (no hang). The default run has one case in test_resume.py.

The fault matrix (slow): a kill in the forward, the backward, the optimizer step (by the model's own
hand: tests/profiles/user_models.py's ``faulty``), in p2p or the all-reduce (from outside, while the
victim waits on a peer slowed down on purpose) and while a checkpoint is written; and under torchrun,
whose agent SIGTERMs the survivors of a killed worker at once.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridpipe.partitioner.plan import save_plan
from hybridpipe.runtime.failure import EXIT_PEER_LOST
from tests.pipeline.harness import make_plan
from tests.runtime.jobs import ROOT, _env
from tests.runtime.rank_procs import Job
from tests.runtime.test_resume import PEER_TIMEOUT, worker_args, worker_pids

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


# ---- the fault matrix: a kill in each phase names the killed rank -----------------------------------
FAULTY = "tests.profiles.user_models:faulty[{},leaf=Fault]"     # nodes 0-2 | 3-5 | 6-9: a Fault in every stage
PHASES = {      # phase -> victim, the model's arguments, how it dies (None: by its own hand, see user_models.Fault)
    "forward": (2, "victim=2,phase=forward,at=22", None),               # step 5, micro-batch 2
    "backward": (3, "victim=3,phase=backward,at=22", None),
    "optimizer": (1, "victim=1,phase=optimizer,at=6", None),            # a replica, before its 6th step
    "p2p": (3, "slow=0,slow_ms=40", "training"),            # rank 3 waits in its recv for the slowed rank 0
    "all-reduce": (1, "slow=0,slow_ms=40,slow_in=backward", "training"),   # rank 1 waits in the all-reduce for rank 0
    "checkpoint write": (2, "slow=-1", "saving"),           # a checkpoint every step: killed while one is written
}


def _kill_when(job: Job, tmp_path: Path, victim: int, moment: str, seed: int) -> float:
    """SIGKILL ``victim`` once training runs (after a seeded random delay) or a checkpoint is being written."""
    deadline = time.monotonic() + 300
    metrics = tmp_path / "run" / "metrics" / "rank-00003.jsonl"
    while True:
        assert time.monotonic() < deadline and not job.poll(), job.wait(1)
        if moment == "training" and metrics.exists() and metrics.stat().st_size > 0:
            time.sleep(random.Random(seed).uniform(0.2, 0.6))
            break
        if moment == "saving" and any(any(d.iterdir()) for d in (tmp_path / "ckpt").glob(".step-*.tmp")
                                      if d.is_dir()) and (tmp_path / "ckpt" / "step-000001").exists():
            break
        time.sleep(0.002)
    assert not job.poll(), "the run ended before the kill"
    return job.kill(victim)


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(PHASES))
def test_a_kill_in_each_phase_is_named_by_every_other_rank(tmp_path, phase):
    victim, model_args, moment = PHASES[phase]
    save_plan(make_plan(FAULTY.format(model_args), [2, 5], [2, 1, 1], micro_batches=4, batch_size=4),
              tmp_path / "plan.json")
    args = worker_args(tmp_path / "plan.json", tmp_path, "--checkpoint-every", "1" if moment == "saving" else "0",
                       "--keep-checkpoints", "2")
    args[args.index("--steps") + 1] = "400"
    with Job(None, None, 4, launch=args) as job:
        if moment is not None:
            _kill_when(job, tmp_path, victim, moment, seed=len(phase))
        results = job.wait(timeout=300 if moment is None else 3 * PEER_TIMEOUT)
    assert results[victim].returncode == -9, results
    for r in results:
        if r.rank != victim:
            assert r.returncode == EXIT_PEER_LOST and f"{DESCRIBE[victim]} failed first" in r.stderr, r


@pytest.mark.slow
@pytest.mark.parametrize("victim", [2, 3])
def test_under_torchrun_a_rank_killed_while_writing_a_checkpoint_is_named_not_the_ranks_the_agent_stopped(
        tmp_path, victim):
    """torchrun's agent SIGTERMs the survivors of a killed worker within --monitor-interval: each of
    them names the killed one (before, the first survivor to leave, often rank 0, was named)."""
    save_plan(make_plan("mlp", [3, 6], [2, 1, 1], schedule="1f1b", micro_batches=4, batch_size=4),
              tmp_path / "plan.json")
    args = worker_args(tmp_path / "plan.json", tmp_path, "--checkpoint-every", "1", "--keep-checkpoints", "2")
    args[args.index("--steps") + 1] = "400"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "launch.py"), *args]
    with open(tmp_path / "torchrun.log", "w+") as log:
        agent = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while not (any(any(d.iterdir()) for d in (tmp_path / "ckpt").glob(".step-*.tmp") if d.is_dir())
                       and (tmp_path / "ckpt" / "step-000001").exists()):
                assert time.monotonic() < deadline and agent.poll() is None
                time.sleep(0.002)
            os.kill(worker_pids(agent.pid)[victim], signal.SIGKILL)
            agent.wait(3 * PEER_TIMEOUT)
        finally:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(10)
        log.seek(0)
        text = log.read()
    lines = [x for x in text.splitlines() if x.startswith("hybridpipe rank")]
    assert len(lines) == 3 and all(f"{DESCRIBE[victim]} failed first" in x for x in lines), text
