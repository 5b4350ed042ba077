"""observed.py: which steps of a run count (the steps where a host stalled left out on request)."""

from __future__ import annotations

import statistics

from hybridpipe.partitioner.refine.observed import RankEvents, observe_run, settling_steps, stalled_steps


def _x(name: str, step: int, ms: float, mb: int = 0) -> dict:
    return {"ph": "X", "name": name, "cat": "phase", "ts": 0.0, "dur": ms * 1e3, "args": {"step": step,
                                                                                         "micro_batch": mb}}


def _rank(rank: int, stage: int, compute_ms: dict[int, float]) -> RankEvents:
    events = [e for step, ms in compute_ms.items() for mb in range(2)
              for e in (_x("run_for", step, ms / 4, mb), _x("run_back", step, ms / 4, mb))]
    return RankEvents(rank, stage, 0, events)


def _run(stall_limit: float | None):
    # two stages; rank 1 computed step 3 at 1.5x its other steps (a stalled host), and the job's step 3 was long
    ranks = [_rank(0, 0, {s: 100.0 for s in range(6)}),
             _rank(1, 1, {s: 150.0 if s == 3 else 100.0 + s for s in range(6)})]
    summary = {"stages": [[0, 0, 1], [1, 1, 1]], "micro_batches": 2, "schedule": "1f1b", "warmup_steps": 1,
               "measured_step_ms": 300.0,
               "job_step_ms": {"0": 900.0, "1": 200.0, "2": 210.0, "3": 400.0, "4": 300.0, "5": 320.0}}
    return observe_run("run", summary, ranks, stall_limit)


def test_a_step_where_a_host_computed_far_above_its_median_is_stalled():
    ranks = [_rank(0, 0, {s: 100.0 for s in range(6)}), _rank(1, 1, {1: 100.0, 2: 104.0, 3: 130.0, 4: 96.0})]
    assert stalled_steps(ranks, {1, 2, 3, 4}, 1.25) == {3}
    assert stalled_steps(ranks, {1, 2, 3, 4}, 1.3) == set()
    assert stalled_steps(ranks, {3}, 1.0) == set()          # never every step: nothing would be left


def test_the_stalled_steps_leave_the_measured_step_and_the_stages_medians():
    kept = _run(1.25)
    assert kept.step_times_ms == (200.0, 210.0, 300.0, 320.0)
    assert kept.measured_step_ms == 255.0                   # the median of the steps kept, not the summary's
    assert kept.stages[1].forward_ms == (102 + 104) / 2 / 4     # the median micro-batch of steps 1, 2, 4, 5
    every = _run(None)                                      # without the rule: as the summary says
    assert every.step_times_ms == (200.0, 210.0, 400.0, 300.0, 320.0)
    assert every.measured_step_ms == 300.0
    assert every.stages[1].forward_ms == 104 / 4


def _replica(rank: int, replica: int, backward_end_ms: float, wait_ms: float, steps: int = 4) -> RankEvents:
    events = []
    for step in range(steps):
        t0 = step * 10_000.0
        events.append({"ph": "X", "name": "run_back", "cat": "phase", "ts": (t0 + backward_end_ms - 50) * 1e3,
                       "dur": 50e3, "args": {"step": step, "micro_batch": replica}})
        events.append({"ph": "X", "name": "sync", "cat": "phase", "ts": (t0 + backward_end_ms) * 1e3,
                       "dur": wait_ms * 1e3, "args": {"step": step, "micro_batch": -1}})
    return RankEvents(rank, 0, replica, events)


def test_a_replicated_stage_waits_what_the_replica_that_freed_its_gradients_last_waited():
    # replica 0 ends its backward 500 ms before replica 1 and waits for it: 700 ms; replica 1 waits 200 ms for
    # the all-reduces' tail. The all-reduces took 200 ms past the last gradient; the rest was the replicas' skew.
    ranks = [_replica(0, 0, 1000.0, 700.0), _replica(1, 1, 1500.0, 200.0)]
    summary = {"stages": [[0, 0, 2]], "micro_batches": 2, "schedule": "1f1b", "warmup_steps": 1,
               "measured_step_ms": 1800.0}
    assert observe_run("run", summary, ranks).stages[0].sync_wait_ms == 200.0


def test_the_leading_steps_still_warming_up_are_settling():
    assert settling_steps([2000.0, 1500.0, 1000.0, 1010.0, 990.0, 1005.0]) == 2
    assert settling_steps([1300.0, 1000.0, 1100.0, 990.0]) == 1
    assert settling_steps([1190.0, 1000.0, 1100.0, 990.0]) == 0          # within 1.2x the steps after it
    assert settling_steps([1000.0, 1500.0, 1000.0, 1000.0]) == 0          # a slow step later is no warm-up
    assert settling_steps([5000.0, 4000.0, 3000.0, 1000.0]) == 2          # at most half of them (and two) left
    assert settling_steps([3000.0, 1000.0]) == 0 and settling_steps([]) == 0


def _warming(steps: range, slow: set[int]):
    # two stages over ``steps``; in ``slow`` every rank computed 1.5x and the job's step took 1.6x
    ranks = [_rank(0, 0, {s: 150.0 if s in slow else 100.0 + s for s in steps}),
             _rank(1, 1, {s: 180.0 if s in slow else 120.0 - s for s in steps})]
    jobs = {str(s): 1600.0 if s in slow else 1000.0 + 3 * s for s in steps}
    summary = {"stages": [[0, 0, 1], [1, 1, 1]], "micro_batches": 2, "schedule": "1f1b", "warmup_steps": 1,
               "measured_step_ms": statistics.median(list(jobs.values())[1:]), "job_step_ms": jobs}  # as launch.py
    return observe_run("run", summary, ranks)


def test_a_run_still_warming_up_after_its_warm_up_is_observed_as_if_it_had_not_run_those_steps():
    warm = _warming(range(6), {0, 1})               # the summary leaves out step 0; step 1 is still warming up
    settled = _warming(range(1, 6), {1})            # the same run with step 1 as its warm-up
    assert warm.step_times_ms == settled.step_times_ms == (1006.0, 1009.0, 1012.0, 1015.0)
    assert warm.measured_step_ms == settled.measured_step_ms == 1010.5     # not warm's summary's 1009
    assert warm.stages == settled.stages
    assert warm.stages[0].forward_ms == (103 + 104) / 2 / 4                 # steps 2-5 only
