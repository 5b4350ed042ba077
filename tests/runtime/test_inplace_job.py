"""A lost replica under ``launch --in-place`` (issue 31 item 7): SIGKILL of one replica's process
mid-run; the survivors re-form in the same processes (no restart), redo the step, finish every
step, and the final weights equal a plain single-process loop. A stage left without a replica
falls back to the restart (exit 75).

Plan: stage 0 on ranks 0 and 1, stage 1 on ranks 2 and 3 (rank 2 reports the summary: killing it
moves the report to rank 3). The default test runs the ranks as torchrun's agent would (the test
hosts the store, tests/runtime/rank_procs.py) and rank 2 SIGKILLs itself in a forward; the slow
one goes through real torchrun agents, one per host on loopback (tests/runtime/elastic.py), and
kills a host's agent and worker from outside. Where a kill lands decides the outcome: one inside a
step's final all-reduce (the commit point) may leave the survivors a step apart, and then the job
restarts by design (runtime/inplace.py; test_inplace.py). So the slow test kills the host only
once its worker sleeps inside a forward of step k (Fault's ``pause``) and every other rank has
recorded exactly k steps: each survivor then reports k, and in place is the one right outcome.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from hybridpipe.partitioner.plan import Plan, save_plan
from hybridpipe.runtime.failure import EXIT_PEER_LOST
from tests.pipeline.harness import make_plan
from tests.profiles.user_models import PAUSE_DIR
from tests.runtime.elastic import ElasticJob
from tests.runtime.jobs import train_reference
from tests.runtime.rank_procs import Job

ROOT = Path(__file__).resolve().parents[2]
STEPS, LR, MOMENTUM, SEED = 16, 0.05, 0.9, 3
FAULTY = "tests.profiles.user_models:faulty[{},leaf=Fault]"     # nodes 0-2 | 3-5 | 6-9, a Fault in each


def plan_of(replicas: list[int]) -> Plan:
    return make_plan("mlp", [3], replicas, schedule="1f1b", micro_batches=4, batch_size=4)


def args(plan_file: Path, out: Path, *extra: str) -> list[str]:
    return [str(ROOT / "launch.py"), "--plan", str(plan_file), "--steps", str(STEPS), "--seed", str(SEED), "--lr",
            str(LR), "--momentum", str(MOMENTUM), "--checkpoint-dir", str(out / "ckpt"), "--checkpoint-every", "0",
            "--run-dir", str(out / "run"), "--timeout", "60", "--peer-timeout", "10", "--no-progress", "--no-trace",
            "--in-place", *extra]


def final_state(ckpt: Path) -> dict[str, torch.Tensor]:
    from hybridpipe.runtime.merged import merge_stages
    merged, _ = merge_stages(ckpt, STEPS)
    return merged


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def training(out: Path, rank: int, steps: int = 2) -> bool:
    metrics = out / "run" / "metrics" / f"rank-{rank:05d}.jsonl"
    return metrics.exists() and len(metrics.read_text().splitlines()) >= steps


def check_in_place(out: Path, killed_at: float, victim: int, expected: dict[str, torch.Tensor]) -> dict:
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["world_size"] == 3, summary
    (event,) = summary["restarts"]
    assert event["kind"] == "in place" and event["lost_ranks"] == [victim], event
    assert event["world_size_before"] == 4 and event["world_size_after"] == 3, event
    assert json.loads((out / "ckpt" / "restarts.json").read_text())["restarts"] == summary["restarts"]
    lost = event["failure_detected_at"] + event["seconds_to_first_step"] - killed_at
    assert lost <= 3.0 + event["first_step_s"], event            # seconds lost: <= 3 s + the redone step
    assert max_diff(final_state(out / "ckpt"), expected) <= 1e-5
    return event


def killing_itself(argv: list[str], victim: int) -> tuple[list, float]:
    """Launch's 4 ranks on ``argv`` until they end: their results, and when ``victim`` (a Fault that
    kills itself) was seen gone, the others still running."""
    with Job(None, None, 4, launch=argv) as job:
        deadline = time.monotonic() + 300
        while victim not in job.poll():
            assert time.monotonic() < deadline and len(job.poll()) == 0, job.wait(1)
            time.sleep(0.005)
        killed_at = time.time()
        return job.wait(timeout=240), killed_at


def test_a_killed_replica_is_taken_over_in_place_and_training_ends_as_one_process(tmp_path):
    # rank 2 (stage 1's first replica: the rank that reports) SIGKILLs itself in its 5th forward
    # (step 2), never inside the step's final all-reduce (the commit point, where a kill may leave
    # the survivors a step apart: then the job restarts, test_inplace.py)
    plan = make_plan(FAULTY.format("victim=2,phase=forward,at=5"), [5], [2, 2], micro_batches=4, batch_size=4)
    save_plan(plan, tmp_path / "plan.json")
    results, killed_at = killing_itself(args(tmp_path / "plan.json", tmp_path)[1:], 2)
    assert results[2].returncode == -9
    assert [r.returncode for r in results if r.rank != 2] == [0, 0, 0], results
    event = check_in_place(tmp_path, killed_at, 2, train_reference(plan, STEPS, lr=LR, momentum=MOMENTUM, seed=SEED))
    print(f"in place: {event}")


@pytest.mark.slow
def test_checkpoints_saved_before_an_in_place_recovery_are_still_among_the_kept(tmp_path):
    """--checkpoint-every 1 --keep-checkpoints 2 across an in-place recovery (rank 2 killed in step 4):
    the run ends holding its 2 newest steps and ends as one process. Before, the re-formed trainer's
    new checkpointer started a new lineage, so steps 2 and 3 (the old one's) were never pruned: 4 step
    directories at the end, and one more pair per recovery."""
    plan = make_plan(FAULTY.format("victim=2,phase=forward,at=9"), [5], [2, 2], micro_batches=4, batch_size=4)
    save_plan(plan, tmp_path / "plan.json")
    argv = args(tmp_path / "plan.json", tmp_path)[1:]
    argv[argv.index("--checkpoint-every") + 1] = "1"
    results, killed_at = killing_itself([*argv, "--keep-checkpoints", "2"], 2)
    assert [r.returncode for r in results] == [0, 0, -9, 0], results
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-000015", "step-000016"]
    check_in_place(tmp_path, killed_at, 2, train_reference(plan, STEPS, lr=LR, momentum=MOMENTUM, seed=SEED))


@pytest.mark.slow
def test_a_stage_left_without_a_replica_restarts(tmp_path):
    save_plan(plan_of([3, 1]), tmp_path / "plan.json")
    with Job(None, None, 4, launch=args(tmp_path / "plan.json", tmp_path)[1:]) as job:
        deadline = time.monotonic() + 300
        while not training(tmp_path, 3):
            assert time.monotonic() < deadline and not job.poll(), job.wait(1)
            time.sleep(0.01)
        job.kill(3)
        results = job.wait(timeout=60)
    for r in results[:3]:
        assert r.returncode == EXIT_PEER_LOST, r
        assert "no in-place recovery: stage 1 lost every replica" in r.stderr, r
    assert not (tmp_path / "run" / "summary.json").exists()


def steps_recorded(out: Path, rank: int) -> int:
    metrics = out / "run" / "metrics" / f"rank-{rank:05d}.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


@pytest.mark.slow
def test_a_killed_host_under_torchrun_goes_on_in_place_and_its_agents_exit_at_once(tmp_path):
    plan = make_plan(FAULTY.format("phase=pause"), [5], [2, 2], micro_batches=4, batch_size=4)
    save_plan(plan, tmp_path / "plan.json")
    pause = tmp_path / "pause"
    pause.mkdir()
    with ElasticJob(tmp_path / "logs", args(tmp_path / "plan.json", tmp_path), hosts=4, min_hosts=3,
                    max_restarts=0, env={PAUSE_DIR: str(pause)}) as job:
        job.wait_for(lambda: training(tmp_path, 3), timeout=300)
        victim = job.worker_rank(3)              # which rank host 3 runs is torchrun's choice
        (pause / f"pause-{victim}").touch()
        job.wait_for(lambda: (pause / f"paused-{victim}").exists(), timeout=60)
        # the victim sleeps in a forward of step k: no rank can pass step k's final all-reduce without
        # it, and each finishes step k - 1 (the victim did: every rank's flag reached that all-reduce)
        k = steps_recorded(tmp_path, victim)
        others = [r for r in range(4) if r != victim]
        job.wait_for(lambda: all(steps_recorded(tmp_path, r) >= k for r in others), timeout=60)
        assert [steps_recorded(tmp_path, r) for r in others] == [k] * 3, k
        job.kill_host(3)
        killed_at = job.killed[3]
        job.wait_for(lambda: (tmp_path / "run" / "summary.json").exists(), timeout=240)
        summary_at = time.time()
        results = job.wait(60)
    logs = "\n".join(f"--- agent {h} rc={rc}\n{out[-3000:]}" for h, (rc, out) in enumerate(results))
    assert [rc for rc, _ in results[:3]] == [0, 0, 0], logs
    assert time.time() - summary_at < 30, logs       # torchrun's exit barrier released for the lost agent
    assert "restart" not in "".join(out for _, out in results[:3]).lower().replace("restarts", ""), logs
    event = check_in_place(tmp_path, killed_at, victim, train_reference(plan, STEPS, lr=LR, momentum=MOMENTUM,
                                                                        seed=SEED))
    assert event["steps_done"] == k, (event, k)
