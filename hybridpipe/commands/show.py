"""``hybridpipe show FILE``: print a profile, plan, calibration or cluster file as tables.

The file's ``"kind"`` header picks the reader; each is validated by its own loader, so a
malformed file ends in one line naming the defect (exit 2).
"""

from __future__ import annotations

import argparse
import json
import re

from hybridpipe.argtypes import nonneg_int
from hybridpipe.errors import UserError
from hybridpipe.jsonfile import read_json
from hybridpipe.partitioner.cost.calibration import CALIBRATION_KIND, Calibration, LinkFit
from hybridpipe.partitioner.cost.cluster import CLUSTER_KIND, Cluster
from hybridpipe.partitioner.plan import PLAN_KIND, Plan, SearchRecord
from hybridpipe.profiles.format import PROFILE_KIND, Profile, ProfileNode

JSON_TYPES = {list: "list", str: "string", int: "number", float: "number", bool: "true/false", type(None): "null"}
SORT_KEYS = {
    "id": lambda n: n.id,
    "forward": lambda n: -n.forward_ms,
    "backward": lambda n: -n.backward_ms,
    "compute": lambda n: -n.compute_ms,
    "params": lambda n: -n.param_count,
    "activation": lambda n: -n.activation_bytes,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a profile, plan, calibration or cluster JSON file")
    parser.add_argument("--sort", choices=sorted(SORT_KEYS), default="id",
                        help="profile: order nodes by this column, largest first (default: graph order)")
    parser.add_argument("--top", type=nonneg_int, default=0, metavar="N",
                        help="profile: show only the first N nodes (0, the default: all)")
    parser.add_argument("--layers", action="store_true", help="plan: also list every layer's all-reduce choice")


def run(args: argparse.Namespace) -> int:
    data = read_json(args.file, "input")
    source = str(args.file)
    expected = f"expected a {PROFILE_KIND}, {PLAN_KIND}, {CALIBRATION_KIND} or {CLUSTER_KIND} file"
    if not isinstance(data, dict):
        raise UserError(f"{source}: holds a {JSON_TYPES.get(type(data), type(data).__name__)}, not a JSON object; "
                        f"{expected}")
    kind = data.get("kind")
    if kind == PROFILE_KIND:
        text = render_profile(Profile.from_dict(data, source), sort=args.sort, top=args.top)
    elif kind == PLAN_KIND:
        text = render_plan(Plan.from_dict(data, source), layers=args.layers)
    elif kind == CALIBRATION_KIND:
        text = render_calibration(Calibration.from_dict(data, source))
    elif kind == CLUSTER_KIND or kind is None and "levels" in data:
        text = render_cluster(Cluster.from_dict(data, source))
    else:
        raise UserError(f"{source}: not a file hybridpipe can show (its \"kind\" is {json.dumps(kind)[:60]}); "
                        f"{expected}")
    print(text)
    return 0


def table(headers: list[str], rows: list[list[object]]) -> str:
    """Plain-text table: numbers right-aligned, text left-aligned, columns two spaces apart."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [bool(rows) and all(isinstance(r[i], (int, float)) or _looks_numeric(str(r[i])) for r in rows)
               for i in range(len(headers))]

    def line(values: list[str]) -> str:
        cols = zip(values, widths, numeric, strict=True)
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in cols).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


_NUMBER = re.compile(r"^-?[\d,]+(\.\d+)?( ?[KMG]?i?B|%)?$|^-?$")


def _looks_numeric(text: str) -> bool:
    """A number, possibly with thousands commas and a byte unit or %, or a placeholder dash."""
    return bool(_NUMBER.match(text))


def human_bytes(n: float) -> str:
    """Bytes in binary units (B, KiB, MiB, GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def render_profile(p: Profile, *, sort: str = "id", top: int = 0) -> str:
    """A profile's header, one row per node, and the totals."""
    inputs: dict[int, list[int]] = {n.id: [] for n in p.nodes}
    for src, dst in p.edges:
        inputs[dst].append(src)
    nodes: list[ProfileNode] = sorted(p.nodes, key=SORT_KEYS[sort])
    shown = nodes[:top] if top > 0 else nodes
    rows = [[n.id, n.name, n.type, f"{n.forward_ms:.3f}", f"{n.backward_ms:.3f}", human_bytes(n.activation_bytes),
             f"{n.param_count:,}", ",".join(map(str, inputs[n.id])) or "-"] for n in shown]
    t = p.totals
    head = [f"profile of {p.model}: batch {p.batch_size}, input {list(p.input_shape)} {p.input_dtype}, "
            f"{p.dtype} on {p.device}, torch {p.torch_version}, median of {p.repeats}",
            f"{len(p.nodes)} nodes, {len(p.edges)} edges, signature {p.signature()}"
            + (f", created {p.created}" if p.created else "")]
    foot = [f"shown {len(shown)} of {len(nodes)} nodes (sorted by {sort})" if len(shown) < len(nodes) else "",
            f"total: forward {t.forward_ms:.2f} ms, backward {t.backward_ms:.2f} ms, "
            f"sum {t.forward_ms + t.backward_ms:.2f} ms; measured forward+backward {t.measured_ms:.2f} ms "
            f"(node sum / measured = {t.ratio:.2f})",
            f"parameters {t.param_count:,} ({human_bytes(t.param_bytes)}), "
            f"activations {human_bytes(t.activation_bytes)}"]
    foot += [f"note: {x}" for x in p.notes]
    return "\n".join(head + ["", table(["id", "name", "type", "fwd ms", "bwd ms", "activation", "params", "inputs"],
                                       rows), ""] + [x for x in foot if x])


def render_plan(plan: Plan, *, layers: bool = False) -> str:
    """A plan's header and one row per stage (and optionally per layer's all-reduce choice)."""
    head = [f"plan for {plan.model}: global batch {plan.batch_size * plan.micro_batches} = {plan.micro_batches} "
            f"micro-batches x {plan.batch_size} samples, "
            f"schedule {plan.schedule}, strategy {plan.strategy}, optimizer {plan.optimizer}, "
            f"{plan.world_size} workers",
            f"cluster: {cluster_line(plan.cluster)}",
            f"predicted step {plan.predicted_step_ms:.2f} ms, {plan.predicted_samples_per_s:.1f} samples/s"
            + (f", created {plan.created}" if plan.created else "")]
    head += [search_line(plan.search)] if plan.search else []
    rows = [[s.index, f"{s.first_node}-{s.last_node}", s.replicas, ",".join(map(str, s.ranks)),
             f"{s.compute_ms:.2f}", f"{s.sync_ms:.2f}", f"{s.send_ms:.2f}", human_bytes(s.memory_bytes)]
            for s in plan.stages]
    out = head + ["", table(["stage", "nodes", "replicas", "ranks", "compute ms", "sync ms", "send ms", "memory"],
                            rows)]
    if layers:
        out += ["", layer_table(plan)]
    return "\n".join(out)


def layer_table(plan: Plan) -> str:
    """Every replicated layer's all-reduce: its gradient bytes, the algorithm, its predicted and exposed time."""
    rows = [[s.index, lv.layer, human_bytes(lv.bytes), lv.algorithm, f"{lv.predicted_ms:.3f}", f"{lv.exposed_ms:.3f}"]
            for s in plan.stages for lv in s.layers]
    if not rows:
        return "no stage is replicated: nothing to all-reduce"
    return table(["stage", "layer", "gradient", "all-reduce", "predicted ms", "exposed ms"], rows)


def search_line(search: SearchRecord) -> str:
    """How the optimal strategy's search ended, and what it proves about the plan."""
    budget = f" of the {search.budget_s:g} s --time-budget" if search.budget_s is not None else ""
    if search.complete:
        return f"search: the optimum (searched to the end in {search.seconds:.2f} s{budget})"
    proof = (f" is at most {100 * search.gap:.2f}% slower than the optimum (no plan is below "
             f"{search.lower_bound_ms:.1f} ms/step)" if search.gap is not None else
             "; no lower bound on the optimum was proven yet")
    return (f"search: stopped after {search.seconds:.1f} s{budget}: the best plan found ({search.objective_ms:.1f} "
            f"ms/step in steady state){proof}; raise --time-budget to close the gap")


def render_calibration(cal: Calibration) -> str:
    """A calibration's setting and its fitted cost per algorithm."""
    def fit_row(name: str, fit: LinkFit) -> list[object]:
        gbps = 8 / fit.beta_s_per_byte / 1e9 if fit.beta_s_per_byte > 0 else float("inf")
        return [name, f"{fit.alpha_s * 1e6:.1f}", f"{gbps:.3f}", f"{fit.rel_error * 100:.1f}%"]

    head = [f"calibration: {cal.world_size} ranks on {cal.hosts} hosts, {cal.backend} on {cal.device}"
            + (f", level {cal.level}" if cal.level else ""),
            f"reduction: {cal.gamma_s_per_byte * 1e9:.3f} ns/byte; {len(cal.samples)} samples"
            + (f", created {cal.created}" if cal.created else "")]
    rows = [fit_row("p2p", cal.p2p)] + [fit_row(k, v) for k, v in sorted(cal.algorithms.items())]
    learnt = []
    if cal.refined:
        learnt.append(f"refined from {len(cal.refined_from)} run(s): compute {cal.compute_slowdown:.2f}x the "
                      f"profile, {cal.step_overhead_ms:.1f} ms per step beyond the model")
        learnt += [f"  all-reduce of ~{human_bytes(b)}: {f:.2f}x the model" for b, f in cal.allreduce_slowdown]
        learnt += [f"  over {g} ranks: " + ", ".join(f"~{human_bytes(b)} {f:.2f}x" for b, f in pts)
                   for g, pts in cal.allreduce_slowdown_groups]
    return "\n".join(head + ["", table(["algorithm", "alpha us", "Gbit/s (1/beta)", "fit error"], rows)]
                     + learnt + [f"note: {x}" for x in cal.notes])


def render_cluster(cluster: Cluster) -> str:
    """A cluster's size and one row per level."""
    rows = [[i, lv.name, lv.workers, f"{lv.bandwidth_gbps:g}", f"{lv.latency_us:g}"]
            for i, lv in enumerate(cluster.levels)]
    return "\n".join([f"cluster: {cluster.total_workers} workers, {cluster.memory_gb:g} GB memory each", "",
                      table(["level", "name", "workers", "Gbit/s", "latency us"], rows)])


def cluster_line(cluster: Cluster, memory_gb: float | None = None) -> str:
    """The cluster's levels on one line, with the memory per worker (``memory_gb``, default the cluster's)."""
    levels = ", ".join(f"{lv.name} x{lv.workers} @ {lv.bandwidth_gbps:g} Gbit/s" for lv in cluster.levels)
    return f"{levels}; {cluster.memory_gb if memory_gb is None else memory_gb:g} GB per worker"
