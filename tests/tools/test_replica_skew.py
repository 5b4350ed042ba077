"""benchmarks/replica_skew.py: the replicas' skew and the last backward's stretch, on hand-made traces."""

import pytest

from benchmarks.replica_skew import micro_batch_cv, run_skew, stage_step
from hybridpipe.partitioner.refine.observed import RankEvents


def back(step: int, mb: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "phase", "name": "run_back", "ts": ts, "dur": dur,
            "args": {"step": step, "micro_batch": mb}}


def replica(rank: int, last_start: float, last_dur: float, steps=(0, 1)) -> RankEvents:
    events = [e for s in steps for e in (back(s, 0, 1000.0 * s, 100.0), back(s, 1, 1000.0 * s + 100, 100.0),
                                            back(s, 2, 1000.0 * s + last_start, last_dur))]
    return RankEvents(rank, 0, rank, events)


def test_the_first_and_last_replica_to_finish_and_the_skew_in_backwards():
    early, late = replica(0, 200.0, 100.0), replica(1, 400.0, 150.0)      # ends 300 and 550 after the step's start
    row = stage_step([late, early], 1)
    assert row == pytest.approx({"first_stretch": 0.0, "last_stretch": 0.5, "skew": 2.5})
    rows, cvs = run_skew([early, late, RankEvents(2, 1, 0, [back(1, 0, 0.0, 50.0)])], warmup=1)
    assert rows == [pytest.approx(row)]                   # step 0 left out, the one-replica stage too
    assert cvs[0] == pytest.approx(0.0) and cvs[1] == pytest.approx(micro_batch_cv(late, 1))
    assert stage_step([early], 1) is None


def test_micro_batch_variation_sums_each_micro_batch_forward_and_backward():
    forward = {"ph": "X", "name": "run_for", "ts": 0.0, "dur": 100.0, "args": {"step": 1, "micro_batch": 0}}
    r = RankEvents(0, 0, 0, [back(1, 0, 0.0, 100.0), back(1, 1, 100.0, 200.0), forward])
    assert micro_batch_cv(r, 1) == pytest.approx(0.0)                 # 100 + 100 and 200
    assert micro_batch_cv(RankEvents(0, 0, 0, [back(1, 0, 0.0, 100.0), back(1, 1, 100.0, 300.0)]), 1) == \
        pytest.approx(0.7071067811865476)                             # stdev(100, 300) / 200
