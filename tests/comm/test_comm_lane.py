"""The background communication lane: order, results, errors, a broken lane, closing."""

from __future__ import annotations

import threading
import time

import pytest

from hybridpipe.comm.engine import CommLane, LaneBroken


def test_jobs_run_in_order_off_the_caller_thread() -> None:
    lane = CommLane("test-lane")
    seen = []
    handles = [lane.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i * i) for i in range(20)]
    assert [h.wait(10) for h in handles] == [i * i for i in range(20)]
    assert [i for i, _ in seen] == list(range(20))
    assert {name for _, name in seen} == {"test-lane"}
    lane.close()


def test_submit_returns_before_the_job_runs_and_wait_times_out() -> None:
    lane = CommLane()
    gate = threading.Event()
    handle = lane.submit(gate.wait, 10)
    assert not handle.done()
    with pytest.raises(TimeoutError, match="still running"):
        handle.wait(0.05)
    gate.set()
    assert handle.wait(10) is True
    lane.close()


def test_a_failed_job_breaks_the_lane_for_every_later_job() -> None:
    lane = CommLane()

    def boom() -> None:
        raise ConnectionError("peer 3 is gone")

    first = lane.submit(boom)
    later = lane.submit(lambda: "never")
    with pytest.raises(ConnectionError, match="peer 3"):
        first.wait(10)
    with pytest.raises(LaneBroken, match="peer 3 is gone"):
        later.wait(10)
    lane.close()


def test_close_runs_what_is_queued_then_refuses() -> None:
    lane = CommLane()
    done = []
    for i in range(3):
        lane.submit(lambda i=i: (time.sleep(0.01), done.append(i)))
    lane.close(10)
    assert done == [0, 1, 2]
    with pytest.raises(RuntimeError, match="closed"):
        lane.submit(lambda: None)
