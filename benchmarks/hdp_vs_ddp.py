"""Reproduction 2 (seed 000): hybrid layer-wise all-reduce vs PyTorch DDP, AlexNet, 4 hosts at 1 Gbit/s.

The paper's AlexNet (Table 1 layers: 62,378,344 parameters, 249.5 MB of float32 gradients) on
4 emulated hosts with 1 Gbit/s links, batch sizes 128/192/256/512 per worker, SGD. Each worker
holds two identical copies of the model: one wrapped in ``HybridDataParallel(policy="hybrid")``,
one in ``torch.nn.parallel.DistributedDataParallel`` (gloo), each on its own process group.
Blocks of training steps of the two alternate in one run, so both see the same machine load;
the result is the ratio of their step times per batch size. Compute alone (DDP under
``no_sync``: forward + backward, no communication, no update) and the ring bound
2(n-1)/n * S / link rate are measured and computed for reference: an overlapped
data-parallel step cannot be shorter than max(compute, ring time).

The input is reduced to 3x64x64 (``--image``) so that four workers' compute on 2 cores stays
in proportion to the paper's GPUs against 1 Gbit/s (the adaptive pool keeps fc1 at 9216 inputs,
so the parameters, and with them the communication, are exactly the paper's).

    sudo .venv/bin/python benchmarks/hdp_vs_ddp.py --quick     # batch 32, 128; a few minutes
    sudo .venv/bin/python benchmarks/hdp_vs_ddp.py             # batch 128, 192, 256, 512

Writes benchmarks/results/hdp_vs_ddp[_quick].{json,png}.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    emit_result,
    log,
    machine,
    pyplot,
    require_emulation,
    result_paths,
    run_workers,
    setup_logging,
    summary,
    write_results,
)
from hybridpipe.jsonfile import write_json

SYSTEMS = ("ddp", "hdp", "hdp-1lane", "hdp-step")
DEFAULT_SYSTEMS = "ddp,hdp,hdp-1lane"
CALIBRATED = ("native", "ring", "butterfly", "hierarchical", "torus2d", "aggregator")   # the policy's candidates
CALIBRATION_SIZES = "4K..16M"


# ---- the worker (one per emulated host) ------------------------------------------------------

class System:
    """One way of training the model: a wrapped copy, its optimizer, and how to end a timed block."""

    def __init__(self, name: str, model, optimizer, flush=None):
        self.name, self.model, self.optimizer = name, model, optimizer
        self.flush = flush or (lambda: None)
        self.steps = 0


def build_systems(names: list[str], base, groups: dict, costs, lr: float, policy: str,
                  downs: dict | None = None) -> tuple[dict, dict]:
    """``ddp``: torch DDP. ``hdp``: HybridDataParallel + LayerwiseOptimizer, each layer's sync may
    run until its next forward (the paper's full window), urgent layers on a second lane.
    ``hdp-1lane``: the same on one lane (every sync in backward's order). ``hdp-step``:
    HybridDataParallel with one SGD; every sync ends before ``step()``. Returns the systems and
    their setup seconds."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from hybridpipe.comm.hybrid_dp import HybridDataParallel, LayerwiseOptimizer

    def sgd(params):
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    systems, setup = {}, {}
    for name in names:
        t0 = time.perf_counter()
        model = copy.deepcopy(base)
        if name == "ddp":
            ddp = DistributedDataParallel(model, process_group=groups[name])
            systems[name] = System(name, ddp, sgd(ddp.parameters()))
        elif name == "hdp":
            hdp = HybridDataParallel(model, group=groups[name], policy=policy, reduce="mean", costs=costs,
                                     downward=(downs or {}).get(name))
            opt = LayerwiseOptimizer(hdp, sgd)
            systems[name] = System(name, hdp, opt, flush=opt.flush)
        elif name == "hdp-1lane":
            hdp = HybridDataParallel(model, group=groups[name], policy=policy, reduce="mean", costs=costs, lane=3,
                                     two_lanes=False, downward=(downs or {}).get(name))
            opt = LayerwiseOptimizer(hdp, sgd)
            systems[name] = System(name, hdp, opt, flush=opt.flush)
        elif name == "hdp-step":
            hdp = HybridDataParallel(model, group=groups[name], policy=policy, reduce="mean", costs=costs, lane=2,
                                     downward=(downs or {}).get(name))
            opt = sgd(hdp.parameters())
            hdp.attach_optimizer(opt)                   # step() waits for every sync first
            systems[name] = System(name, hdp, opt)
        else:
            raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
        setup[name] = time.perf_counter() - t0
    return systems, setup


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from hybridpipe.comm.allreduce import GroupCosts
    from hybridpipe.partitioner.cost.cluster import load_cluster
    from hybridpipe.partitioner.cost.costmodel import CostModel
    from hybridpipe.profiles.zoo import resolve_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    control = dist.new_group(backend="gloo")
    names = args.systems.split(",")
    groups = {name: dist.new_group(backend="gloo") for name in names}   # each system on its own group
    downs = {name: dist.new_group(backend="gloo") for name in names if name != "ddp"}   # a connection per direction
    t0 = time.perf_counter()
    calibration = worker_calibration(args)
    calibration_s = time.perf_counter() - t0
    costs = GroupCosts(CostModel(load_cluster(args.cluster_file), calibration), tuple(range(world)))
    spec = resolve_model(args.model)
    torch.manual_seed(0)
    base = spec.build()
    params = sum(p.numel() for p in base.parameters())
    systems, setup = build_systems(names, base, groups, costs, args.lr, args.policy, downs)
    del base

    def step(system: System, x, y) -> None:
        system.steps += 1
        torch.manual_seed(system.steps * 1000 + rank)       # the same dropout masks in every system
        loss = spec.loss(system.model(x), y)
        loss.backward()
        system.optimizer.step()
        system.optimizer.zero_grad(set_to_none=False)

    def compute_only(x, y) -> None:
        """Forward + backward of an unwrapped copy: no communication, no update."""
        spec.loss(plain(x), y).backward()
        plain.zero_grad(set_to_none=False)

    def timed_block(run, steps: int, end=lambda: None) -> float:
        """Wall time per step of ``steps`` consecutive steps (plus ``end``), the slowest rank's."""
        dist.barrier(group=control)
        t = time.perf_counter()
        for _ in range(steps):
            run()
        end()
        per_step = torch.tensor([(time.perf_counter() - t) / steps], dtype=torch.float64)
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX, group=control)
        return per_step.item()

    plain = copy.deepcopy(getattr(systems[names[0]].model, "module", systems[names[0]].model))
    rows = []
    gen = torch.Generator().manual_seed(1000 + rank)
    for bs in [int(b) for b in args.batches.split(",")]:
        x = spec.example_input(bs, gen)
        y = spec.example_target(bs, gen)
        for system in systems.values():              # warm-up: allocators, hooks, buckets
            for _ in range(args.warmup):
                step(system, x, y)
            system.flush()
        times = {name: [] for name in names}
        for rep in range(args.reps):                 # rotate which system goes first
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                system = systems[name]
                times[name].append(timed_block(functools.partial(step, system, x, y), args.steps, system.flush))
                if rank == 0:
                    print(f"batch {bs} {name} rep {rep}: {times[name][-1]:.3f} s/step", file=sys.stderr, flush=True)
        compute = timed_block(functools.partial(compute_only, x, y), 1) if args.compute_steps else None
        row = {"batch_per_worker": bs, "global_batch": bs * world, "compute_s": compute,
               **{f"{n}_s": summary(times[n]) for n in names}}
        for n in names:
            if n != "ddp" and "ddp" in names:
                row[f"ratio_{n}_over_ddp"] = row[f"{n}_s"]["median"] / row["ddp_s"]["median"]
                row[f"ratio_min_{n}_over_ddp"] = row[f"{n}_s"]["min"] / row["ddp_s"]["min"]   # least disturbed
        rows.append(row)
    reference = getattr(systems[names[0]].model, "module", systems[names[0]].model)
    agree = {n: _same_weights(reference, getattr(s.model, "module", s.model)) for n, s in systems.items()
             if n != names[0]}
    choices = {n: s.model.choices for n, s in systems.items() if hasattr(s.model, "choices")}
    plans = {n: s.model.plan for n, s in systems.items() if hasattr(s.model, "plan")}
    if rank == 0:
        from hybridpipe.comm.allreduce.bench import fits_summary
        emit_result({"world": world, "parameters": params, "setup_s": setup, "rows": rows,
                     "weights_agree_with_" + names[0]: agree, "hdp_choices": choices, "hdp_plans": plans,
                     "calibration": fits_summary(calibration) if calibration else None,
                     "calibration_s": calibration_s if calibration else None})
    for s in systems.values():
        if hasattr(s.model, "close"):
            s.model.close()
    dist.barrier(group=control)
    dist.destroy_process_group()


def worker_calibration(args: argparse.Namespace):
    """The calibration the hybrid policy prices with: a file, measured here first, or none."""
    from hybridpipe.comm.allreduce.bench import calibrate_group
    from hybridpipe.partitioner.cost.calibration import load_calibration
    if args.calibration_file:
        return load_calibration(args.calibration_file)
    if args.calibrate:
        from hybridpipe.units import parse_sizes
        return calibrate_group(CALIBRATED, parse_sizes(CALIBRATION_SIZES, 4), reps=3, budget_s=0.1,
                               notes=("measured by hdp_vs_ddp before training",))
    return None


def _same_weights(a, b) -> dict:
    """Both systems trained on the same data from the same start: their weights must agree."""
    import torch
    pairs = list(zip(a.parameters(), b.parameters(), strict=True))
    diff = max(float((p - q).abs().max()) for p, q in pairs)
    return {"equal": all(torch.allclose(p, q, rtol=1e-3, atol=1e-5) for p, q in pairs), "max_abs_diff": diff}


# ---- the driver ------------------------------------------------------------------------------

LABELS = {"ddp": "torch DDP (gloo)", "hdp": "HDP hybrid, layer-wise updates, two lanes",
          "hdp-1lane": "HDP hybrid, layer-wise updates, one lane", "hdp-step": "HDP hybrid, all syncs before step()"}


def plot(data: dict):
    """Step times per batch size (with compute alone and the ring bound), and the ratios to DDP."""
    plt = pyplot()
    rows, names = data["rows"], data["settings"]["systems"]
    xs = list(range(len(rows)))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    w = 0.8 / len(names)
    for k, name in enumerate(names):
        ax.bar([i + (k - (len(names) - 1) / 2) * w for i in xs], [r[f"{name}_s"]["median"] for r in rows], w,
               label=LABELS.get(name, name))
    if all(r["compute_s"] is not None for r in rows):
        ax.plot(xs, [r["compute_s"] for r in rows], "k:", marker="_", ms=20, label="compute alone")
    ax.axhline(data["ring_bound_s"], color="grey", ls="--", lw=1, label="ring bound 2(n-1)/n S / goodput")
    ax.set_xticks(xs, [str(r["batch_per_worker"]) for r in rows])
    ax.set_xlabel("batch per worker")
    ax.set_ylabel("seconds per step (median)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    others = [n for n in names if n != "ddp"]
    w2 = 0.8 / max(1, len(others))
    for k, name in enumerate(others):
        ratios = [r.get(f"ratio_{name}_over_ddp") for r in rows]
        if None in ratios:
            continue
        pos = [i + (k - (len(others) - 1) / 2) * w2 for i in xs]
        ax2.bar(pos, ratios, w2, label=LABELS.get(name, name))
        for x, v in zip(pos, ratios, strict=True):
            ax2.text(x, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_xticks(xs, [str(r["batch_per_worker"]) for r in rows])
    ax2.set_xlabel("batch per worker")
    ax2.set_ylabel("step time / DDP step time")
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    fig.suptitle(f"{data['settings']['model']} on {data['settings']['hosts']} emulated hosts at "
                 f"{data['settings']['rate_gbps']:g} Gbit/s (gloo, 1 thread per worker)", fontsize=10)
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="batch 32,128 and fewer steps (a few minutes)")
    p.add_argument("--batches", default=None, help="batch sizes per worker (default 128,192,256,512)")
    p.add_argument("--image", type=int, default=64, help="input image side (default 64; the paper: 224)")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", type=float, default=1.0, help="link rate in Gbit/s (default 1)")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"from {', '.join(SYSTEMS)} (default {DEFAULT_SYSTEMS})")
    p.add_argument("--policy", default="hybrid")
    p.add_argument("--latency-us", type=float, default=50.0,
                   help="per-message latency in the cluster description HDP's policy prices with (default 50)")
    p.add_argument("--steps", type=int, default=None, help="steps per timed block (default 2; quick 1)")
    p.add_argument("--reps", type=int, default=None, help="timed blocks per system (default 3)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--no-compute", dest="compute_steps", action="store_false",
                   help="skip the compute-alone reference step")
    p.add_argument("--timeout", type=float, default=3000.0)
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--calibration", default=None,
                   help="the policy prices with this calibration (hybridpipe bench-allreduce output)")
    p.add_argument("--calibrate", action="store_true",
                   help=f"the policy prices with a calibration measured on the cluster first ({CALIBRATION_SIZES})")
    p.add_argument("--tag", default="", help="suffix of the result files' names")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cluster-file", help=argparse.SUPPRESS)
    p.add_argument("--calibration-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.model = args.model or f"alexnet[image={args.image}]"
    if args.worker:
        worker(args)
        return 0
    quick = args.quick
    batches = args.batches or ("32,128" if quick else "128,192,256,512")
    steps = args.steps or (1 if quick else 2)
    reps = args.reps or 3
    names = args.systems.split(",")
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise SystemExit(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    setup_logging()
    require_emulation()
    from tools.emucluster import EmulatedCluster
    if args.calibration and args.calibrate:
        raise SystemExit("give --calibration FILE or --calibrate, not both")
    if args.calibration:
        from hybridpipe.partitioner.cost.calibration import load_calibration
        load_calibration(args.calibration)            # fail here, not in every worker
    json_path, png_path = result_paths("hdp_vs_ddp" + (f"_{args.tag}" if args.tag else ""), quick, args.out)
    started = time.monotonic()
    load_before = [round(x, 2) for x in os.getloadavg()]
    log.info("%s, %d hosts at %g Gbit/s, batches %s, systems %s", args.model, args.hosts, args.rate, batches,
             args.systems)
    with EmulatedCluster(args.hosts, args.rate) as cluster:
        cluster_file = Path(cluster.log_dir) / "cluster.json"
        write_json(cluster_file, cluster.cluster_json(latency_us=args.latency_us))
        worker_args = ["--model", args.model, "--batches", batches, "--steps", str(steps), "--reps", str(reps),
                       "--warmup", str(args.warmup), "--lr", str(args.lr), "--policy", args.policy,
                       "--systems", args.systems, "--cluster-file", str(cluster_file)]
        if not args.compute_steps:
            worker_args.append("--no-compute")
        if args.calibration:
            worker_args += ["--calibration-file", str(Path(args.calibration).resolve())]
        elif args.calibrate:
            worker_args.append("--calibrate")
        out = run_workers(cluster, __file__, worker_args, timeout_s=args.timeout)
    grad_bytes = out["parameters"] * 4
    ring_bound = 2 * (args.hosts - 1) / args.hosts * grad_bytes * 8 / (args.rate * 1e9 * 1448 / 1514)
    data = {"benchmark": "hdp_vs_ddp", "quick": quick, "machine": machine(),
            "settings": {"model": args.model, "hosts": args.hosts, "rate_gbps": args.rate, "batches": batches,
                         "systems": names, "steps_per_block": steps, "blocks": reps, "warmup": args.warmup,
                         "policy": args.policy, "policy_prices_with": f"cluster description: link rate, "
                         f"latency_us={args.latency_us:g}" + (f"; calibration {args.calibration}" if args.calibration
                                                              else "; calibration measured first" if args.calibrate
                                                              else ""), "optimizer": f"SGD lr={args.lr} momentum=0.9",
                         "threads_per_worker": 1, "input": f"3x{args.image}x{args.image} (paper: 3x224x224)"},
            "parameters": out["parameters"], "gradient_bytes": grad_bytes, "ring_bound_s": ring_bound,
            "setup_s": out["setup_s"], "hdp_choices": out["hdp_choices"], "hdp_plans": out.get("hdp_plans"),
            "calibration": out.get("calibration"), "calibration_s": out.get("calibration_s"),
            **{k: v for k, v in out.items() if k.startswith("weights_agree_with_")},
            "rows": out["rows"], "duration_s": time.monotonic() - started, "load_average_before": load_before}
    for n, plan in (data["hdp_plans"] or {}).items():
        log.info("%s: %s", n, ", ".join(f"{u['unit']} {u['algorithm']}@lane{u['lane']}" for u in plan))
    for r in data["rows"]:
        log.info("batch %4d: %s; compute alone %s", r["batch_per_worker"],
                 ", ".join(f"{n} {r[f'{n}_s']['median']:.2f} s" for n in names)
                 + "".join(f", {n}/ddp {r[f'ratio_{n}_over_ddp']:.3f}" for n in names if f"ratio_{n}_over_ddp" in r),
                 f"{r['compute_s']:.2f} s" if r["compute_s"] is not None else "-")
    write_results(json_path, data, plot(data), png_path)
    log.info("done in %.0f s", data["duration_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
