"""Helpers for the bad-input tests (not a test file): run a command's main() in this process and
read what a user would see; valid files to start from; hypothesis strategies for random JSON and
for random argument values.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from hypothesis import strategies as st

from hybridpipe.cli import main as cli_main
from hybridpipe.launch import main as launch_main
from hybridpipe.partitioner.cost.calibration import Calibration, LinkFit, Sample, save_calibration
from hybridpipe.partitioner.plan import save_plan
from hybridpipe.runtime.checkpoint import Checkpointer
from hybridpipe.runtime.timeline import PHASES, TimelineRecorder


@dataclass
class Outcome:
    code: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return [x for x in self.err.splitlines() if x.strip()]

    def check_one_line_or_ok(self) -> None:
        """The contract: exit 0, or exit 2 with exactly one line on stderr; never a traceback."""
        assert "Traceback" not in self.err, self.err
        assert self.code in (0, 2), (self.code, self.err)
        if self.code == 2:
            assert len(self.err_lines) == 1, self.err


def run(argv: list[str], *, launch: bool = False) -> Outcome:
    """``hybridpipe ARGV`` (or ``hybridpipe.launch ARGV``) in this process; any exception other
    than SystemExit escapes (a traceback the user would have seen)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = (launch_main if launch else cli_main)(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return Outcome(code, out.getvalue(), err.getvalue())


# ---- valid files ---------------------------------------------------------------------------------
def cluster_dict(workers: int = 2) -> dict:
    return {"kind": "cluster", "format": 1, "memory_gb": 4,
            "levels": [{"name": "node", "workers": workers, "bandwidth_gbps": 100, "latency_us": 5}]}


def calibration() -> Calibration:
    samples = tuple(Sample(a, b, 1e-4 + b * 1e-9) for a in ("ring", "p2p") for b in (4096, 65536))
    return Calibration(world_size=2, hosts=1, backend="gloo", device="cpu", level="node", gamma_s_per_byte=1e-10,
                       p2p=LinkFit(5e-5, 8e-9), algorithms={"ring": LinkFit(1e-4, 8.4e-9, 0.05)}, samples=samples)


def write_rank_traces(run_dir: Path, world: int = 2) -> None:
    for rank in range(world):
        rec = TimelineRecorder(run_dir / "trace", rank=rank, stage=rank, replica=0, world_size=world, flush_every=0)
        for step in range(2):
            rec.begin_step(step)
            for i, phase in enumerate(PHASES):
                t0 = rec.clock()
                rec.record(phase, i % 2, t0, t0 + 1e-4)
            rec.end_step()
        rec.close()


def write_checkpoint(root: Path, plan) -> Path:
    """One complete checkpoint of a one-rank plan of ``mlp[layers=1]``-like shape."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 3))
    ck = Checkpointer(root, plan=plan, rank=0, every=1, keep=0)
    return ck.save(1, module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1))


def save_files(base: Path, profile_path: Path, plan) -> dict[str, Path]:
    """Every kind of file a command reads, valid, under ``base``."""
    base.mkdir(parents=True, exist_ok=True)
    paths = {"profile": profile_path, "plan": save_plan(plan, base / "plan.json"),
             "calibration": save_calibration(calibration(), base / "cal.json")}
    (base / "cluster.json").write_text(json.dumps(cluster_dict()))
    paths["cluster"] = base / "cluster.json"
    write_rank_traces(base / "run")
    paths["trace"] = base / "run" / "trace" / "rank-00000.json"
    return paths


# ---- strategies ----------------------------------------------------------------------------------
SCALARS = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.sampled_from([0, 1, -1, 2 ** 63])
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=4), max_leaves=12)


@st.composite
def mutated(draw, document):
    """``document`` with one place (at any depth) replaced by random JSON, deleted, or kept."""
    doc = json.loads(json.dumps(document))
    parent, key = None, None
    node = doc
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, draw(st.sampled_from(keys))
        node = node[key]
    if parent is None:
        return draw(JSON) if draw(st.booleans()) else doc
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[key]
    else:
        parent[key] = draw(JSON)
    return doc


def dumps(value) -> str:
    """JSON as a user's editor could leave it (NaN and Infinity included, as Python writes them)."""
    return json.dumps(value, allow_nan=True)


NUMBER_TEXT = st.one_of(
    st.integers(-5, 40).map(str),
    st.sampled_from(["0", "-1", "1e9", "1000000000", "99999999999999999999", "nan", "inf", "-inf", "0.001",
                     "1.5", "", "abc", "1e400", "-0", "2**3"]),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda x: repr(x) if math.isfinite(x) else str(x)),
    st.text(max_size=5),
)
