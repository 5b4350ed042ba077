"""Property: a plan, profile, cluster or calibration whose figures are extreme (0, negative, 1e-300,
1e308, nan, inf, a node range past the graph) is refused in one line naming the field, or accepted
and run within a bound: never a traceback, never a hang (issue 31). Each command's main() runs in
this process on a valid file with one figure replaced.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hybridpipe.cli import main
from tests.badinput import dumps, run, save_files
from tests.pipeline.harness import make_plan

EXAMPLES = int(os.environ.get("HYBRIDPIPE_BAD_INPUT_EXAMPLES", "40"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("valid")
    profile = base / "profile.json"
    assert main(["profile", "mlp[layers=1,hidden=8]", "-b", "2", "--repeats", "1", "--warmup", "0", "-q",
                 "-o", str(profile)]) == 0
    plan = make_plan("mlp[layers=1,hidden=8]", [0], [1, 1], micro_batches=2, batch_size=2,
                     times=[(1.0, 2.0), (0.5, 1.0)])
    return save_files(base, profile, plan)


@SETTINGS
@given(last=st.integers(-3, 2 ** 40), stage=st.sampled_from([0, -1]), command=st.sampled_from(
    ["show", "simulate", "schedule"]))
def test_a_plan_whose_stages_do_not_cover_the_graph_exactly_is_refused(files, tmp_path_factory, last, stage,
                                                                        command):
    doc = json.loads(files["plan"].read_text())
    nodes = doc["graph_nodes"]
    doc["stages"][stage]["last_node"] = last
    path = tmp_path_factory.mktemp("case") / "plan.json"
    path.write_text(dumps(doc))
    outcome = run([command, str(path)])
    outcome.check_one_line_or_ok()
    covered = doc["stages"][-1]["last_node"] == nodes - 1 and doc["stages"][0]["last_node"] + 1 == doc["stages"][1][
        "first_node"]
    event("accepted" if outcome.code == 0 else outcome.err.split(": ", 2)[-1][:30])
    assert (outcome.code == 0) == covered, (last, stage, outcome.err)


EXTREMES = [0, -1, -0.0, 1e-300, 5e-324, 1e-6, 1e15, 1e16, 1e100, 1e308, 2 ** 63, 10 ** 400, math.nan, math.inf,
            -math.inf]
HANG_S = 60             # a run on these tiny files takes well under a second: this long is a hang


def number_paths(doc, path=()) -> list[tuple]:
    """Every place in ``doc`` (parsed JSON) that holds a number."""
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in number_paths(v, (*path, k))]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in number_paths(v, (*path, i))]
    return [path] if isinstance(doc, (int, float)) and not isinstance(doc, bool) else []


def _set(doc, path: tuple, value):
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


class Hang(Exception):
    pass


@contextlib.contextmanager
def bounded(seconds: float):
    """Raise Hang in this (the main) thread if the block runs longer than ``seconds``."""
    def ring(signum, frame):
        raise Hang(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _run_case(files, d: Path, kind: str, doc, command: str = "simulate"):
    """The command that reads ``kind`` on ``doc`` written in ``d`` (partition for its inputs, with
    the plan it wrote simulated again), bounded in time; its Outcome, checked: exit 0 or one line."""
    target = d / f"{kind}.json"
    target.write_text(dumps(doc))
    if kind == "plan":
        argv = [command, str(target)]
    else:
        inputs = {k: str(target if k == kind else files[k]) for k in ("profile", "cluster", "calibration")}
        argv = ["partition", inputs["profile"], "--cluster", inputs["cluster"], "--calibration",
                inputs["calibration"], "-o", str(d / "out.json"), "-q"]
    with bounded(HANG_S):
        outcome = run(argv)
        outcome.check_one_line_or_ok()
        if outcome.code == 0 and kind != "plan":            # the plan it wrote reads back and simulates
            again = run(["simulate", str(d / "out.json")])
            assert again.code == 0, again.err
    return outcome


@SETTINGS
@given(kind=st.sampled_from(["profile", "cluster", "calibration", "plan"]), data=st.data())
def test_an_extreme_figure_is_refused_in_one_line_or_runs(files, tmp_path_factory, kind, data):
    doc = json.loads(files[kind].read_text())
    path = data.draw(st.sampled_from(number_paths(doc)), label="path")
    _set(doc, path, data.draw(st.sampled_from(EXTREMES) | st.floats(), label="value"))
    command = data.draw(st.sampled_from(["show", "simulate", "schedule"]), label="command")
    outcome = _run_case(files, tmp_path_factory.mktemp("case"), kind, doc, command)
    event(f"{kind}: " + ("accepted" if outcome.code == 0 else "refused"))


def _every_node(doc, value):
    for node in doc["nodes"]:
        node["forward_ms"] = node["backward_ms"] = value


@pytest.mark.parametrize("kind, change, message", [
    ("profile", lambda d: _every_node(d, 1e308), 'field "forward_ms" must be <= 1e+15, got 1e+308'),
    ("profile", lambda d: _every_node(d, 1e15), None),
    ("profile", lambda d: _every_node(d, 1e-300), None),
    ("cluster", lambda d: d["levels"][0].update(bandwidth_gbps=1e-300), 'field "bandwidth_gbps" must be >= 1e-06'),
    ("cluster", lambda d: d["levels"][0].update(bandwidth_gbps=1e-6), None),
    ("cluster", lambda d: d.update(memory_gb=1e308), 'field "memory_gb" must be <= 1e+15'),
    ("cluster", lambda d: d["levels"][0].update(workers=10 ** 400), 'field "workers" must be <= 1e+15'),
    ("cluster", lambda d: d["levels"][0].update(latency_us=10 ** 400), 'field "latency_us" must be a finite number'),
    ("calibration", lambda d: d["p2p"].update(beta_s_per_byte=1e308), 'field "beta_s_per_byte" must be <= 1e+15'),
    ("plan", lambda d: d["stages"][0].update(forward_ms=1e308), 'field "forward_ms" must be <= 1e+100'),
    ("plan", lambda d: d.update(batch_size=10 ** 400), 'field "batch_size" must be <= 1e+15'),
    ("plan", lambda d: d.update(micro_batches=10 ** 400), 'field "micro_batches" must be <= 1e+15'),
    ("profile", lambda d: d.update(batch_size=10 ** 400), 'field "batch_size" must be <= 1e+15'),
])
def test_the_figures_of_issue_31(files, tmp_path, kind, change, message):
    """1e308 ms per node made partition search for ever (its sums overflowed to inf, then nan); a
    bandwidth of 1e-300 Gbit/s was accepted. Each is refused where the file is read, naming the
    field, or (at the ends of the ranges) planned and simulated within seconds."""
    doc = json.loads(files[kind].read_text())
    change(doc)
    outcome = _run_case(files, tmp_path, kind, doc)
    if message is None:
        assert outcome.code == 0, outcome.err
    else:
        assert outcome.code == 2 and message in outcome.err, outcome.err
