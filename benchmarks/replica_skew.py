"""The replicas' skew and the latest replica's last backward, from the recorded traces (issue 30 item 4; RESULTS 4e).

    python benchmarks/replica_skew.py --work /tmp/q4-llama8 --work /tmp/q2-a224 --out skew.json

For every run directory ``plans.py --trace`` left in the ``--work`` folders (``plans_prediction.run_dirs``' globs)
and every replicated stage, per steady step (the run's first and warm-up steps left out): when each replica ended
its last backward (the traces share a time origin), how much longer that last backward took than the replica's
other backwards of the step (a share of their median), and the spread of its micro-batches' forward + backward
(coefficient of variation). Reported as medians and quartiles: the stretch of the replica that finished first and
of the one that finished last (the latter's own all-reduce of the layers it already freed runs beside it, its peers
waiting), the skew (last minus first end, in the latest replica's backwards), and the per-rank variation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridpipe.partitioner.refine.observed import RankEvents


def _phases(r: RankEvents, name: str, step: int) -> list[dict]:
    return sorted((e for e in r.events if e.get("name") == name and e.get("args", {}).get("step") == step),
                  key=lambda e: e["ts"])


def stage_step(replicas: Sequence[RankEvents], step: int) -> dict[str, float] | None:
    """One replicated stage's step: stretch of the first and last replica to finish (share of their other backwards'
    median) and the skew (last minus first end of the last backward, in the last replica's backwards); None where
    fewer than two replicas ran two backwards."""
    ends = []
    for r in replicas:
        back = _phases(r, "run_back", step)
        if len(back) < 2:
            continue
        typical = statistics.median(e["dur"] for e in back[:-1])
        ends.append((back[-1]["ts"] + back[-1]["dur"], back[-1]["dur"] / typical - 1, typical))
    if len(ends) < 2:
        return None
    ends.sort()
    return {"first_stretch": ends[0][1], "last_stretch": ends[-1][1], "skew": (ends[-1][0] - ends[0][0]) / ends[-1][2]}


def micro_batch_cv(r: RankEvents, step: int) -> float | None:
    """The coefficient of variation of one rank's micro-batches' forward + backward in a step (None: < 2)."""
    per: dict[int, float] = {}
    for e in r.events:
        a = e.get("args", {})
        if e.get("name") in ("run_for", "run_back") and a.get("step") == step:
            per[a.get("micro_batch", 0)] = per.get(a.get("micro_batch", 0), 0.0) + e["dur"]
    xs = list(per.values())
    return statistics.stdev(xs) / statistics.mean(xs) if len(xs) >= 2 and statistics.mean(xs) > 0 else None


def run_skew(ranks: Sequence[RankEvents], warmup: int) -> tuple[list[dict[str, float]], list[float]]:
    """Every replicated stage-step of a run (:func:`stage_step`) and every rank-step's :func:`micro_batch_cv`."""
    steps = sorted({e["args"]["step"] for r in ranks for e in r.events if "step" in e.get("args", {})})
    steady = [s for s in steps if s > max(warmup - 1, 0)]
    stages: dict[int, list[RankEvents]] = {}
    for r in ranks:
        stages.setdefault(r.stage, []).append(r)
    rows = [row for rs in stages.values() if len(rs) > 1 for s in steady if (row := stage_step(rs, s))]
    cvs = [c for r in ranks for s in steady if (c := micro_batch_cv(r, s)) is not None]
    return rows, cvs


def quartiles(xs: Sequence[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "n": len(xs)}


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.plans_terms import run_ranks
    from hybridpipe.jsonfile import write_json
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True, type=Path, action="append", help="plans.py's --work folder (repeat)")
    p.add_argument("--out", type=Path, help="write the summary as JSON")
    a = p.parse_args(argv)
    rows: list[dict[str, float]] = []
    cvs: list[float] = []
    for work in a.work:
        for d in sorted([*work.glob("run-*"), *work.glob("autotune-*/runs/run-*"), *work.glob("pairs-*/pair-*")]):
            if d.is_dir() and (d / "summary.json").is_file():
                r, c = run_skew(*run_ranks(d))
                rows += r
                cvs += c
    if not rows:
        p.error("no replicated stage with two backwards per step in the traces of " + ", ".join(map(str, a.work)))
    out = {key: quartiles([r[key] for r in rows]) for key in ("first_stretch", "last_stretch", "skew")}
    out["micro_batch_cv"] = quartiles(cvs)
    for key, q in out.items():
        print(f"{key:15s} median {q['median']:+.3f}  quartiles {q['q1']:+.3f} .. {q['q3']:+.3f}  ({q['n']})")
    if a.out:
        write_json(a.out, {"benchmark": "replica_skew", "work": [str(w) for w in a.work], **out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
