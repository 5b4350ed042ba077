"""Property: a plan, profile, cluster or calibration whose figures are extreme (0, negative, 1e-300,
1e308, nan, inf, a node range past the graph) is refused in one line naming the field, or accepted
and run within a bound: never a traceback, never a hang (issue 31). Each command's main() runs in
this process on a valid file with one figure replaced.
"""

from __future__ import annotations

import json
import os
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
