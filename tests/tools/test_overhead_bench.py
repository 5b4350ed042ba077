"""benchmarks/overhead.py's smoke test: the probes, the no-framework baseline and the per-run
arithmetic in-process on a tiny plan (seconds); one whole run on 2 processes is slow-marked."""

from __future__ import annotations

import json
import threading
import time

import pytest

from benchmarks import overhead_threads
from benchmarks.overhead import main, per_run
from benchmarks.overhead_probes import KINDS, Tally, baseline, run_steps
from benchmarks.vs_torch_pipelining import make_plan

MODEL = "mlp[features=4,hidden=4,layers=4]"


def test_probes_count_cpu_only_while_on_and_by_the_kind_the_call_names():
    tally = Tally()

    def spin(n: int) -> int:
        t0 = time.thread_time()
        while time.thread_time() - t0 < n * 1e-3:
            pass
        return n
    fixed = tally.probe("forward", spin)
    named = tally.probe(lambda n: ("send" if n > 1 else "recv", 0.5), spin)
    fixed(1)                                     # off: not counted
    totals = run_steps(lambda k: (fixed(2), named(2), named(1)), steps=3, warmup=1, tally=tally)
    assert totals["steps"] == 2
    assert totals["count"] == {"forward": 2, "send": 1.0, "recv": 1.0}
    assert totals["cpu_s"]["forward"] == pytest.approx(4e-3, rel=0.5)
    assert totals["cpu_s"]["send"] > totals["cpu_s"]["recv"] > 0
    assert totals["thread_s"] >= sum(totals["cpu_s"].values())


def test_baseline_and_per_run_on_a_tiny_plan(tmp_path):
    make_plan(MODEL, 2, 2, 2, tmp_path / "plan.json")
    base = baseline(str(tmp_path / "plan.json"), repeats=3)
    assert len(base) == 2 and all(b["forward_s"] > 0 and b["backward_s"] > 0 for b in base)
    rank = {"thread_s": 0.01, "process_s": 0.012, "wall_s": 0.02, "steps": 2,
            "cpu_s": {"forward": 0.002, "backward": 0.002, "send": 0.001, "recv": 0.001, "data": 0.001, "step": 0.001},
            "count": {"forward": 4, "backward": 4, "send": 4, "recv": 4, "data": 4, "step": 2}}
    out = per_run([rank, rank], base, micro_batches=2)
    assert set(out["us_per_instruction"]) == set(KINDS)
    assert out["us_per_instruction"]["send"] == pytest.approx(250.0)
    assert out["dispatch_us_per_step"] == pytest.approx((0.02 - 0.016) / 2 * 1e6)
    assert out["background_us_per_step"] == pytest.approx(0.004 / 2 * 1e6)
    compute = sum(b["forward_s"] + b["backward_s"] for b in base) * 2
    assert out["framework_cpu_us_per_instruction"] == pytest.approx(((0.024 - 0.002) / 2 - compute) / 16 * 1e6)
    # send + receive charged every thread: their probes plus all the other threads' CPU, per send or receive
    assert out["comm_all_threads_us_per_instruction"] == pytest.approx((0.004 + 0.004) / 16 * 1e6)


@pytest.mark.slow
def test_a_whole_quick_run_writes_its_results(tmp_path):
    assert main(["--model", MODEL, "--stages", "2", "--micro-batches", "2", "--steps", "3", "--warmup", "1",
                 "--alternations", "2", "--schedules", "1f1b", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "overhead.json").exists() and (tmp_path / "overhead.png").exists()
    result = json.loads((tmp_path / "overhead.json").read_text())
    spread = result["paired_ratios"]["1f1b"]["framework_cpu_us_per_instruction"]
    assert len(spread["ratios"]) == 2 and spread["ci95"][0] <= spread["median"] <= spread["ci95"][1]
    assert [r["round"] for r in result["runs"]["ours-1f1b"]] == [0, 1]
    for system in ("ours-1f1b", "torch-1f1b"):
        counts = result["counts"][system]["per_instruction"]
        assert all(counts[what]["forward"] > 0 and counts[what]["backward"] > 0
                   for what in ("python_calls", "c_calls", "aten_ops"))



@pytest.mark.skipif(not overhead_threads.snapshot(), reason="needs Linux /proc/<pid>/task/<tid>/schedstat")
def test_thread_cpu_and_wakeups_are_counted_per_thread_label():
    go, spun, done = threading.Event(), threading.Event(), threading.Event()

    def receiver() -> None:         # blocks and is woken 5 times, spins ~30 ms of CPU, waits to end
        for _ in range(5):
            go.wait()
            go.clear()
            spun.set()
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.03:
            pass
        spun.set()
        done.wait()

    t = threading.Thread(target=receiver, name="p2p-sa-3-12-recv")
    t.start()
    before = overhead_threads.snapshot()
    for _ in range(5):
        _until_blocked(t.native_id)
        go.set()
        spun.wait()
        spun.clear()
    spun.wait()
    after = overhead_threads.snapshot()
    done.set()
    t.join()
    assert before[t.native_id][3] == after[t.native_id][3] == "p2p recv"
    got = overhead_threads.delta(before, after, steps=2)
    assert got["p2p recv"]["threads"] == 1 and got["step"]["threads"] == 1
    assert got["p2p recv"]["cpu_us"] >= 0.02 / 2 * 1e6         # 30 ms over 2 steps, less the clock's slack
    assert got["p2p recv"]["wakeups"] >= 5 / 2


def _until_blocked(tid: int) -> None:
    """Wait (at most 5 s) until thread ``tid`` sleeps: setting its event then is a wake-up."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/self/task/{tid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "S":
                return
        time.sleep(0.0005)
