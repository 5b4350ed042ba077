"""The timeline: per-rank recorders (runtime/timeline.py), the merge, and ``hybridpipe timeline``.

The multi-rank case runs three real processes whose clocks are deliberately 1000 s apart,
passing messages through real p2p Channels while recording every phase; after the barrier
alignment the merged trace must respect causality (a message is received after it was sent).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybridpipe.cli import main
from hybridpipe.errors import UserError
from hybridpipe.runtime.timeline import (
    PHASES,
    TID_PHASES,
    TID_STEPS,
    TimelineRecorder,
    find_rank_traces,
    load_rank_trace,
    trace_dir,
    trace_path,
)
from hybridpipe.runtime.timeline_merge import merge_traces, phase_table, step_window

HERE = Path(__file__).resolve()


def _phase_events(trace: dict, pid: int | None = None) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["tid"] == TID_PHASES
            and (pid is None or e["pid"] == pid)]


# ---- one process -------------------------------------------------------------------------------
def test_recorder_writes_a_chrome_trace_with_its_rank_and_phases(tmp_path):
    rec = TimelineRecorder(tmp_path, rank=3, stage=1, replica=1, world_size=4, flush_every=0)
    for step in range(2):
        rec.begin_step(step)
        for i, phase in enumerate(PHASES):
            t0 = rec.clock()
            torch.randn(64, 64) @ torch.randn(64, 64)
            rec.record(phase, i % 2, t0, rec.clock())
        rec.on_transfer(2, "act/0", 1024, rec.clock(), rec.clock())
        rec.end_step()
    path = rec.close()
    assert path == trace_path(tmp_path, 3)
    t = load_rank_trace(path)
    assert (t.rank, t.meta["stage"], t.meta["replica"], t.meta["world_size"]) == (3, 1, 1, 4)
    data = json.loads(path.read_text())
    names = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 3: stage 1 replica 1"}
    events = _phase_events(data)
    assert [e["name"] for e in events] == list(PHASES) * 2
    assert all(e["dur"] >= 0 and e["pid"] == 3 for e in events)
    assert [e["args"]["step"] for e in events] == [0] * 8 + [1] * 8
    ts = [e["ts"] for e in events]
    assert ts == sorted(ts), "events of one thread must come out in time order"
    assert sum(e.get("cat") == "transfer" for e in data["traceEvents"]) == 2
    assert sum(e.get("tid") == TID_STEPS and e["ph"] == "X" for e in data["traceEvents"]) == 2


def test_a_rank_with_several_chunks_records_each_phase_s_stage(tmp_path):
    """Virtual stages: the rank's chunks in its metadata and table row, each phase's chunk in its args."""
    rec = TimelineRecorder(tmp_path, rank=0, stage=0, stages=[0, 3], flush_every=0)
    rec.begin_step(0)
    for stage, phase in ((0, "run_for"), (3, "run_for"), (3, "run_back"), (None, "step")):
        t0 = rec.clock()
        rec.record(phase, 0 if stage is not None else -1, t0, rec.clock(), stage)
    rec.end_step()
    trace = load_rank_trace(rec.close())
    assert trace.meta["stages"] == [0, 3]
    assert [e["args"].get("stage") for e in _phase_events(json.loads(trace_path(tmp_path, 0).read_text()))] == \
        [0, 3, 3, None]
    (row,) = phase_table(merge_traces([trace]))
    assert row.stage_label == "0,3"
    data = json.loads(trace_path(tmp_path, 0).read_text())
    data["otherData"]["hybridpipe"]["stages"] = [0, None]            # was a TypeError in phase_table
    trace_path(tmp_path, 0).write_text(json.dumps(data))
    with pytest.raises(UserError, match='every element of "stages" must be an integer'):
        load_rank_trace(trace_path(tmp_path, 0))


def test_unknown_phase_is_refused(tmp_path):
    rec = TimelineRecorder(tmp_path, rank=0, stage=0)
    with pytest.raises(ValueError, match="receive_for"):
        rec.record("forward", 0, 0.0, 1.0)


def test_memory_is_bounded_to_the_newest_steps(tmp_path):
    rec = TimelineRecorder(tmp_path, rank=0, stage=0, keep_steps=5, flush_every=7)
    rec.record("run_for", 0, rec.clock(), rec.clock())          # before the first step: kept as setup
    for step in range(100):
        rec.begin_step(step)
        rec.record("run_for", 0, rec.clock(), rec.clock())
        rec.end_step()
    t = load_rank_trace(rec.path)                                   # written by flush_every, not close
    assert (t.meta["first_step"], t.meta["last_step"], t.meta["steps_dropped"]) == (93, 97, 93)  # after 98 steps
    rec.close()
    t = load_rank_trace(rec.path)
    steps = [e["args"]["step"] for e in t.events if e.get("cat") == "phase"]
    assert steps == [None, 95, 96, 97, 98, 99]
    assert (t.meta["first_step"], t.meta["last_step"], t.meta["steps_dropped"]) == (95, 99, 95)


def test_wall_clock_merge_places_ranks_by_wall_time(tmp_path):
    # two "hosts" whose monotonic clocks disagree by 1000 s; no barrier: aligned by wall clock
    a = TimelineRecorder(tmp_path, rank=0, stage=0, world_size=2, clock=time.perf_counter)
    b = TimelineRecorder(tmp_path, rank=1, stage=1, world_size=2, clock=lambda: time.perf_counter() + 1000.0)
    a.begin_step(0)
    t0 = a.clock()
    time.sleep(0.02)
    a.record("send_for", 0, t0, a.clock())
    b.begin_step(0)
    t1 = b.clock()
    b.record("receive_for", 0, t1, b.clock())
    merged = merge_traces([load_rank_trace(a.close()), load_rank_trace(b.close())])
    assert merged["otherData"]["hybridpipe"]["clock"] == "wall clock"
    send, recv = _phase_events(merged, 0)[0], _phase_events(merged, 1)[0]
    assert recv["ts"] >= send["ts"] + send["dur"] - 5e3    # within the hosts' clock agreement (5 ms)
    assert recv["ts"] < 60e6


def test_traces_of_one_rank_twice_are_refused(tmp_path):
    a = TimelineRecorder(tmp_path / "a", rank=0, stage=0)
    b = TimelineRecorder(tmp_path / "b", rank=0, stage=0)
    with pytest.raises(UserError, match="two trace files"):
        merge_traces([load_rank_trace(a.close()), load_rank_trace(b.close())])


def test_timeline_command_errors_are_one_line(tmp_path, capsys):
    assert main(["timeline", str(tmp_path / "nowhere"), "-o", str(tmp_path / "t.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "rank-00000.json").write_text('{"traceEvents": [')
    assert main(["timeline", str(tmp_path), "-o", str(tmp_path / "t.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_the_pipeline_engine_fills_every_phase_of_the_timeline(tmp_path):
    """The real engine (threads, in-process transport) drives the recorders; a replicated stage syncs."""
    from hybridpipe.partitioner.cost.cluster import Cluster, Level
    from hybridpipe.partitioner.plan import Plan, Stage
    from hybridpipe.pipeline import MicroBatches, PipelineEngine, Topology, build_stage
    from hybridpipe.pipeline.inprocess import InProcessGradSync, InProcessNetwork, ReplicaGroup, run_ranks
    from hybridpipe.pipeline.stage import captured_signature
    from hybridpipe.profiles.data import resolve_dataset
    from hybridpipe.profiles.zoo import resolve_model
    from tests.pipeline.harness import capture

    spec = resolve_model("mlp")
    captured = capture(spec, 2)
    n_nodes, signature = len(captured.blocks), captured_signature(captured)
    stages = (Stage(0, 0, 2, 1, (0,)), Stage(1, 3, 5, 2, (1, 2)), Stage(2, 6, n_nodes - 1, 1, (3,)))
    plan = Plan(model="mlp", batch_size=2, input_shape=(2, 64), profile_signature=signature, strategy="uniform",
                cluster=Cluster((Level("node", 4, 100.0),), 16.0), schedule="1f1b", micro_batches=4,
                optimizer="sgd", stages=stages)
    network, groups = InProcessNetwork(timeout=30), [ReplicaGroup(s.replicas) for s in stages]
    data = MicroBatches(resolve_dataset("synthetic", spec, size=64, seed=0), 2, 4)

    def rank_fn(rank):
        stage = build_stage(capture(spec, 2), plan, rank, loss=spec.loss)
        st, replica = plan.stage_of_rank(rank)
        rec = TimelineRecorder(tmp_path / "trace", rank=rank, stage=st.index, replica=replica, world_size=4)
        engine = PipelineEngine(stage, Topology.from_plan(plan), rank, plan.kind, transport=network.transport(rank),
                                optimizer=torch.optim.SGD(stage.module.parameters(), lr=0.1), data=data,
                                sync=InProcessGradSync(stage.module, groups[st.index], replica), recorder=rec)

        def run():
            for step in range(2):
                rec.begin_step(step)
                engine.run_step(step)
                rec.end_step()
            rec.close()
        return run

    run_ranks({r: rank_fn(r) for r in range(4)}, network, groups)
    merged = merge_traces([load_rank_trace(p) for p in find_rank_traces(tmp_path)])
    assert {e["name"] for e in _phase_events(merged)} == set(PHASES)
    assert {e["name"] for e in _phase_events(merged, 1)} == set(PHASES)    # the middle stage does all eight
    rows = phase_table(merged)
    assert [(r.rank, r.stage, r.replica, r.steps) for r in rows] == [(0, 0, 0, 2), (1, 1, 0, 2), (2, 1, 1, 2),
                                                                      (3, 2, 0, 2)]


# ---- real ranks -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def three_rank_run(tmp_path_factory) -> Path:
    from tests.runtime.rank_procs import Job

    run_dir = tmp_path_factory.mktemp("run")
    with Job(HERE, "chain_with_timeline", 3, (str(run_dir), 3)) as job:
        results = job.wait(timeout=120)
    assert all(r.returncode == 0 for r in results), results
    return run_dir


@pytest.mark.slow
def test_merged_trace_holds_every_rank_and_phase_and_respects_causality(three_rank_run):
    merged = merge_traces([load_rank_trace(p) for p in find_rank_traces(three_rank_run)])
    info = merged["otherData"]["hybridpipe"]
    assert info["clock"] == "barrier" and info["missing_ranks"] == []
    assert {e["pid"] for e in merged["traceEvents"] if e["name"] == "process_name"} == {0, 1, 2}
    for r in range(3):
        present = {e["name"] for e in _phase_events(merged, r)}
        assert present == set(PHASES) - ({"receive_for", "send_back"} if r == 0 else set()) \
            - ({"send_for", "receive_back"} if r == 2 else set())
    # a message arrives after it was sent: rank r's send of micro-batch m ends before rank r+1's receive
    for step in range(3):
        for src, dst, sent, got in ((0, 1, "send_for", "receive_for"), (1, 2, "send_for", "receive_for"),
                                    (2, 1, "send_back", "receive_back"), (1, 0, "send_back", "receive_back")):
            for m in range(2):
                where = {"step": step, "micro_batch": m}
                s = next(e for e in _phase_events(merged, src) if e["name"] == sent and e["args"] == where)
                g = next(e for e in _phase_events(merged, dst) if e["name"] == got and e["args"] == where)
                assert g["ts"] + g["dur"] >= s["ts"] - 2e3, (s, g)   # barrier exits agree within ~2 ms
    assert max(e["ts"] for e in _phase_events(merged)) < 120e6     # 1000 s clock offsets were removed
    rows = phase_table(merged)
    assert [r.rank for r in rows] == [0, 1, 2] and all(r.steps == 3 and r.step_ms > 0 for r in rows)
    assert all(r.phase_ms["run_for"] > 0 for r in rows)
    assert step_window(merged, 2) == (1, 2)


@pytest.mark.slow
def test_timeline_command_writes_the_merged_trace_table_and_png(three_rank_run, tmp_path, capsys):
    out, png = tmp_path / "timeline.json", tmp_path / "timeline.png"
    assert main(["timeline", str(three_rank_run), "-o", str(out), "--png", str(png), "--png-steps", "2"]) == 0
    text = capsys.readouterr().out
    assert "merged 3 ranks (barrier aligned)" in text
    table = text.split("mean ms per step")[1]
    for phase in PHASES:
        assert phase in table
    assert len([line for line in table.splitlines() if line.strip()[:1].isdigit()]) == 3
    merged = json.loads(out.read_text())
    assert {e["name"] for e in _phase_events(merged)} == set(PHASES)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# ---- rank program -----------------------------------------------------------------------------
def chain_with_timeline(rank: int, world: int, run_dir: str, steps: int) -> None:
    """A 3-stage chain moving 2 micro-batches forward and back per step through real Channels."""
    from hybridpipe.comm.p2p import open_channels

    offset = 1000.0 * rank                  # clocks of different "hosts" disagree wildly
    rec = TimelineRecorder(trace_dir(run_dir), rank=rank, stage=rank, world_size=world,
                           clock=lambda: time.perf_counter() + offset)
    ch = open_channels([(0, 1), (1, 2)], mode="sa", timeout=60, on_transfer=rec.on_transfer,
                       clock=rec.clock)
    rec.align(dist.barrier)
    w = torch.randn(128, 128)

    @contextlib.contextmanager
    def timed(phase, m):
        t0 = rec.clock()
        yield
        rec.record(phase, m, t0, rec.clock())

    for step in range(steps):
        rec.begin_step(step)
        acts = {}
        for m in range(2):
            if rank > 0:
                with timed("receive_for", m):
                    x = ch.recv(rank - 1, f"act/{m}")["x"]
            else:
                x = torch.randn(16, 128)
            with timed("run_for", m):
                acts[m] = torch.tanh(x @ w)
            if rank < world - 1:
                with timed("send_for", m):
                    ch.send(rank + 1, f"act/{m}", {"x": acts[m]})
                    ch.flush(rank + 1)
        for m in range(2):
            if rank < world - 1:
                with timed("receive_back", m):
                    g = ch.recv(rank + 1, f"grad/{m}")["x"]
            else:
                g = torch.ones(16, 128)
            with timed("run_back", m):
                g = (g * (1 - acts[m] ** 2)) @ w.T
            if rank > 0:
                with timed("send_back", m):
                    ch.send(rank - 1, f"grad/{m}", {"x": g})
                    ch.flush(rank - 1)
        with timed("sync", 0):
            dist.all_reduce(w.sum().reshape(1))
        with timed("step", 0):
            w.mul_(0.999)
        rec.end_step()
    ch.close()
    rec.close()


def test_an_event_of_another_rank_is_named_in_one_line_before_any_arithmetic():
    """A trace file whose timed event carries another pid: the file is named, not a KeyError
    from the clock offsets (found by the bad-input property test at 3000 examples)."""
    from pathlib import Path

    from hybridpipe.errors import UserError
    from hybridpipe.runtime.timeline import RankTrace

    meta = {"rank": 0, "clock": "barrier", "anchor_wall_s": 0.0, "world_size": 1}
    events = [{"ph": "X", "pid": 0, "tid": 1, "ts": 0.0, "dur": 1.0, "name": "forward"},
              {"ph": "X", "pid": -1, "tid": 1, "ts": 2.0, "dur": 1.0, "name": "forward"}]
    with pytest.raises(UserError, match=r"rank-0\.json: an event has pid -1 but the file is rank 0's"):
        merge_traces([RankTrace(Path("rank-0.json"), meta, events)])


def test_each_all_reduce_is_an_event_of_its_own_thread(tmp_path):
    """``on_sync`` (HybridDataParallel's ``on_reduce``): the layer, its algorithm and bytes, on the
    "all-reduces" thread, in the step that was current when it ran."""
    from hybridpipe.runtime.timeline import TID_SYNCS

    rec = TimelineRecorder(tmp_path, rank=0, stage=0, flush_every=0)
    rec.begin_step(4)
    t0 = rec.clock()
    rec.on_sync("fc1+fc2", "ring", 4096, t0, t0 + 0.002)
    rec.end_step()
    data = json.loads(rec.close().read_text())
    (event,) = [e for e in data["traceEvents"] if e.get("cat") == "all-reduce"]
    assert (event["name"], event["tid"], event["dur"]) == ("fc1+fc2", TID_SYNCS, 2000.0)
    assert event["args"] == {"step": 4, "algorithm": "ring", "bytes": 4096}
    assert {"name": "all-reduces"} in [e["args"] for e in data["traceEvents"] if e["name"] == "thread_name"]
