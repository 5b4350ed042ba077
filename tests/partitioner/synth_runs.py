"""Synthetic runs for the refinement tests: the timelines and summary a run of given stages would
write if its nodes computed ``node_factor`` times the profile, its all-reduces took
``allreduce_factor(bytes) * group_factor(replicas)`` times the model and its p2p transfers ``p2p_factor`` times.

The truth is built from the cost model's own parts (the lane of layersync.py for the sync wait),
so recovering the factors checks the inversion in refine/refinement.py, not the model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from hybridpipe.jsonfile import write_json
from hybridpipe.partitioner.cost.cluster import Cluster
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.planner import priced_tied
from hybridpipe.partitioner.refine.observed import RankEvents, RunObservation, observe_run
from hybridpipe.partitioner.refine.sync import lane_wait_ms
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.objective import StageSpec, overhead_ms
from hybridpipe.profiles.format import Profile


def _x(name: str, cat: str, ts: float, ms: float, **args) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "pid": 0, "tid": 0, "ts": ts, "dur": ms * 1e3, "args": args}


def synthetic_run(profile: Profile, cluster: Cluster, stages: Sequence[StageSpec], *, micro_batches: int = 8,
                  steps: int = 6, node_factor: Callable[[int], float] = lambda i: 1.0,
                  allreduce_factor: Callable[[float], float] = lambda b: 1.0, p2p_factor: float = 1.0,
                  name: str = "run", calibrations=(), measured_step_ms: float | None = None,
                  optimizer_factor: float = 1.0, tied_factor: float = 1.0, drain_ms: float = 0.0,
                  sender_ratio: float | None = None, first_step_factor: float = 1.0,
                  warmup_steps: int = 1, interference_s_per_byte: float = 0.0,
                  write_to: Path | None = None, group_factor: Callable[[int], float] = lambda g: 1.0,
                  replica_factor: Callable[[int], float] = lambda r: 1.0, accumulate_ms_per_byte: float = 0.0
                  ) -> RunObservation:
    """The observation of a synthetic run (see the module docstring); 1f1b, one sync per step.

    Each stage's ``step`` phase is ``optimizer_factor`` times the model's optimizer step for its
    parameters plus, per tied group it takes part in, ``tied_factor`` times the group's price
    and, on all but the group's first stage (the last to arrive in 1f1b), ``drain_ms`` of wait.
    Each message is recorded by its receiver at ``p2p_factor`` times the model's wire time and by
    its sender at ``sender_ratio`` times (a send that returns once the socket took it) or, when
    None, at ``p2p_factor`` too. Step 0 computes ``first_step_factor`` times slower (warm-up).
    Each stage's compute also loses what the model's ``overhead_ms`` charges for its link bytes
    at ``interference_s_per_byte`` (spread over its micro-batches, forward and backward alike).
    A stage of r replicas computes ``replica_factor(r)`` times what its nodes do (cost/computeterms.py), and
    each backward after a step's first takes ``accumulate_ms_per_byte`` times its parameter bytes longer."""
    model = CostModel(cluster, list(calibrations))
    nodes = profile.nodes
    costs = model_costs(profile)
    opt = costs.optimizer_ms("sgd")
    tied = [0.0] * len(stages)
    for g in priced_tied(profile, stages, model):
        for k in g.stages:
            tied[k] += tied_factor * g.predicted_ms + (drain_ms if k != min(g.stages) else 0.0)
    events: dict[int, list[dict]] = {r: [] for st in stages for r in st.ranks}
    for k, st in enumerate(stages):
        ids = range(st.first, st.last + 1)
        rho = replica_factor(len(st.ranks))
        fwd = [nodes[i].forward_ms * node_factor(i) * rho for i in ids]
        bwd = [nodes[i].backward_ms * node_factor(i) * rho for i in ids]
        accumulate = accumulate_ms_per_byte * sum(nodes[i].param_bytes for i in ids)
        sync = [0.0 if nodes[i].param_bytes == 0 or len(st.ranks) < 2 else
                model.fastest_allreduce(nodes[i].param_bytes, st.ranks)[1] * 1e3
                * allreduce_factor(nodes[i].param_bytes) * group_factor(len(st.ranks)) for i in ids]
        k_mb = micro_batches // len(st.ranks)
        a_in, g_out = costs.input_bytes(st.first)
        a_out, g_in = costs.output_bytes(st.last) if k < len(stages) - 1 else (0.0, 0.0)
        lost = overhead_ms(0.0, float(costs.param_bytes[st.first:st.last + 1].sum()), (a_in + g_out + a_out + g_in) / 2,
                           len(st.ranks), k_mb, 1, interference_s_per_byte) / k_mb
        grow = 1 + lost / (sum(fwd) + sum(bwd))
        fwd, bwd = [x * grow for x in fwd], [x * grow for x in bwd]
        wait = lane_wait_ms(sync, bwd, fwd)
        out_bytes = nodes[st.last].cut_bytes if k < len(stages) - 1 else 0
        step_ms = optimizer_factor * float(opt[st.first:st.last + 1].sum()) + tied[k]
        for rank in st.ranks:
            mine, t = events[rank], 0.0
            for step in range(steps):
                slow = first_step_factor if step == 0 else 1.0
                for mb in range(micro_batches // len(st.ranks)):
                    mine.append(_x("run_for", "phase", t, sum(fwd) * slow, step=step, micro_batch=mb))
                    mine.append(_x("run_back", "phase", t, sum(bwd) * slow + (accumulate if mb else 0.0),
                                   step=step, micro_batch=mb))
                    if out_bytes:
                        peer = stages[k + 1].ranks[0]
                        seconds = model.p2p_seconds(out_bytes, model.level_between(rank, peer))
                        sent = seconds * (p2p_factor if sender_ratio is None else sender_ratio)
                        mine.append(_x(f"act/{mb}", "transfer", t, sent * 1e3, step=step, peer=peer, bytes=out_bytes))
                        events[peer].append(_x(f"act/{mb}", "transfer", t, seconds * p2p_factor * 1e3, step=step,
                                               peer=rank, bytes=out_bytes))
                    t += 1e4
                if len(st.ranks) > 1:
                    mine.append(_x("sync", "phase", t, wait, step=step, micro_batch=0))
                mine.append(_x("step", "phase", t, step_ms, step=step, micro_batch=-1))
    ranks_events = [RankEvents(rank, k, replica, events[rank]) for k, st in enumerate(stages)
                    for replica, rank in enumerate(st.ranks)]
    summary = {"stages": [[s.first, s.last, len(s.ranks)] for s in stages], "micro_batches": micro_batches,
               "schedule": "1f1b", "warmup_steps": warmup_steps, "measured_step_ms": measured_step_ms,
               "predicted_step_ms": None, "sync": {}}
    if write_to is not None:         # a run directory as launch writes it (summary.json, trace/rank-*.json)
        write_json(write_to / "summary.json", summary)
        for r in ranks_events:
            meta = {"kind": "rank-trace", "format": 1, "rank": r.rank, "stage": r.stage, "replica": r.replica,
                    "world_size": cluster.total_workers, "anchor_wall_s": 0.0}
            write_json(write_to / "trace" / f"rank-{r.rank:05d}.json",
                       {"traceEvents": list(r.events), "otherData": {"hybridpipe": meta}})
    return observe_run(name, summary, ranks_events)
