"""benchmarks/plans_terms.py's reading of a rank's timeline into step terms (plain events, no processes)."""

import pytest

from benchmarks.plans_terms import measured_terms, rank_terms
from hybridpipe.partitioner.refine.observed import RankEvents


def _phase(name, step, ts, dur_ms, mb=0):
    return {"ph": "X", "cat": "phase", "name": name, "ts": ts, "dur": dur_ms * 1e3,
            "args": {"step": step, "micro_batch": mb}}


def _step(step, dur_ms, backs=(10.0, 30.0), sync=50.0):
    events = [{"ph": "X", "cat": "step", "name": f"step {step}", "ts": 0, "dur": dur_ms * 1e3, "args": {"step": step}}]
    for m, b in enumerate(backs):
        events += [_phase("receive_for", step, 0, 1.0, m), _phase("run_for", step, 0, 5.0, m),
                   _phase("run_back", step, 0, b, m)]
    return [*events, _phase("sync", step, 0, sync, -1), _phase("step", step, 0, 7.0, -1)]


def test_a_rank_step_splits_into_compute_sync_optimizer_and_the_rest_waiting():
    events = _step(0, 500.0) + _step(1, 200.0) + _step(2, 200.0)
    t = rank_terms(events, {1, 2}, loads_input=False)
    assert t["compute"] == pytest.approx(2 * 5.0 + 10.0 + 30.0)
    assert (t["sync"], t["optimizer"], t["step"]) == pytest.approx((50.0, 7.0, 200.0))
    assert t["wait"] == pytest.approx(200.0 - 50.0 - 50.0 - 7.0)
    assert t["overlap_stretch"] == pytest.approx(20.0)          # the last backward, beside the all-reduces
    first = rank_terms(events, {1, 2}, loads_input=True)        # stage 0: loading the batch is compute
    assert first["compute"] == pytest.approx(t["compute"] + 2.0) and first["wait"] == pytest.approx(t["wait"] - 2.0)


def test_measured_terms_leave_out_the_first_step_and_take_the_median_over_replicas():
    slow = RankEvents(0, 0, 0, _step(0, 900.0, sync=800.0) + _step(1, 200.0, sync=40.0) + _step(2, 200.0, sync=40.0))
    fast = RankEvents(1, 0, 1, _step(0, 900.0, sync=800.0) + _step(1, 200.0, sync=60.0) + _step(2, 200.0, sync=60.0))
    (stage,) = measured_terms([slow, fast], warmup=0, stages=1)
    assert stage["sync"] == pytest.approx(50.0) and stage["step"] == pytest.approx(200.0)


def test_the_step_phase_wait_for_the_latest_rank_at_the_loss_check_is_wait_not_optimizer():
    # rank 0 enters its step phase at 100 ms and leaves at 430; rank 1 (the last stage's drain ends later) enters
    # at 400 and leaves at 430: both stepped for 30 ms once rank 1 reached the loss check; rank 0's other 300 ms
    # were the pipeline's drain
    def rank(r, start_ms):
        events = [{"ph": "X", "cat": "step", "name": f"step {s}", "ts": s * 1e6, "dur": 500e3, "args": {"step": s}}
                  for s in range(3)]
        events += [_phase("step", s, s * 1e6 + start_ms * 1e3, 430.0 - start_ms, -1) for s in range(3)]
        return RankEvents(r, r, 0, events)
    early, late = measured_terms([rank(0, 100.0), rank(1, 400.0)], warmup=0, stages=2)
    assert early["optimizer"] == pytest.approx(30.0) and late["optimizer"] == pytest.approx(30.0)
    assert early["wait"] == pytest.approx(500.0 - 30.0)
