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
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (emit_result, log, machine, pyplot, require_emulation, result_paths, run_workers,
                               setup_logging, summary, write_results)

SYSTEMS = ("ddp", "hdp")


# ---- the worker (one per emulated host) ------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hybridpipe.comm.hybrid_dp import HybridDataParallel
    from hybridpipe.profiles.zoo import resolve_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    control = dist.new_group(backend="gloo")
    g_ddp = dist.new_group(backend="gloo")
    g_hdp = dist.new_group(backend="gloo")
    spec = resolve_model(args.model)
    torch.manual_seed(0)
    base = spec.build()
    params = sum(p.numel() for p in base.parameters())
    t0 = time.perf_counter()
    ddp = DistributedDataParallel(base, process_group=g_ddp)
    ddp_setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    hdp = HybridDataParallel(copy.deepcopy(base), group=g_hdp, policy=args.policy, reduce="mean")
    hdp_setup = time.perf_counter() - t0
    opts = {"ddp": torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9),
            "hdp": torch.optim.SGD(hdp.parameters(), lr=args.lr, momentum=0.9)}
    wrapped = {"ddp": ddp, "hdp": hdp}

    counters = {s: 0 for s in SYSTEMS}

    def step(system: str, x, y) -> None:
        model, opt = wrapped[system], opts[system]
        counters[system] += 1
        torch.manual_seed(counters[system] * 1000 + rank)   # the same dropout masks in both systems
        loss = spec.loss(model(x), y)
        loss.backward()
        if system == "hdp":
            model.finish()
        opt.step()
        opt.zero_grad(set_to_none=False)

    def compute_only(x, y) -> None:
        """Forward + backward without communication or update (DDP's weights stay as they are)."""
        with ddp.no_sync():
            spec.loss(ddp(x), y).backward()
        opts["ddp"].zero_grad(set_to_none=False)

    def timed_block(run, steps: int) -> float:
        """Wall time per step of ``steps`` consecutive steps, the slowest rank's."""
        dist.barrier(group=control)
        t = time.perf_counter()
        for _ in range(steps):
            run()
        per_step = torch.tensor([(time.perf_counter() - t) / steps], dtype=torch.float64)
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX, group=control)
        return per_step.item()

    rows = []
    gen = torch.Generator().manual_seed(1000 + rank)
    for bs in [int(b) for b in args.batches.split(",")]:
        x = spec.example_input(bs, gen)
        y = spec.example_target(bs, gen)
        for system in SYSTEMS:                       # warm-up: allocators, hooks, buckets
            for _ in range(args.warmup):
                step(system, x, y)
        times = {s: [] for s in SYSTEMS}
        for rep in range(args.reps):                 # alternate which system goes first
            order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
            for system in order:
                times[system].append(timed_block(lambda: step(system, x, y), args.steps))
                if rank == 0:
                    print(f"batch {bs} {system} rep {rep}: {times[system][-1]:.3f} s/step", file=sys.stderr,
                          flush=True)
        compute = timed_block(lambda: compute_only(x, y), 1) if args.compute_steps else None
        row = {"batch_per_worker": bs, "global_batch": bs * world,
               **{f"{s}_s": summary(times[s]) for s in SYSTEMS}, "compute_s": compute}
        row["ratio_hdp_over_ddp"] = row["hdp_s"]["median"] / row["ddp_s"]["median"]
        rows.append(row)
    grads_equal = _same_weights(ddp.module, getattr(hdp, "module", hdp))
    if rank == 0:
        emit_result({"world": world, "parameters": params, "ddp_setup_s": ddp_setup, "hdp_setup_s": hdp_setup,
                     "rows": rows, "same_weights_after_training": grads_equal,
                     "hdp_choices": _choices(hdp)})
    dist.barrier(group=control)
    dist.destroy_process_group()


def _same_weights(a, b) -> dict:
    """Both systems trained on the same data from the same start: their weights must agree."""
    import torch
    pairs = list(zip(a.parameters(), b.parameters()))
    diff = max(float((p - q).abs().max()) for p, q in pairs)
    return {"equal": all(torch.allclose(p, q, rtol=1e-3, atol=1e-5) for p, q in pairs), "max_abs_diff": diff}


def _choices(hdp) -> dict | None:
    """The per-layer algorithm HDP chose, if it tells."""
    for attr in ("choices", "algorithms", "plan"):
        value = getattr(hdp, attr, None)
        if isinstance(value, dict):
            return {str(k): str(v) for k, v in value.items()}
    return None


# ---- the driver ------------------------------------------------------------------------------

def plot(data: dict):
    plt = pyplot()
    rows = data["rows"]
    bs = [r["batch_per_worker"] for r in rows]
    xs = range(len(rows))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    w = 0.38
    ax.bar([i - w / 2 for i in xs], [r["ddp_s"]["median"] for r in rows], w, label="torch DDP (gloo)")
    ax.bar([i + w / 2 for i in xs], [r["hdp_s"]["median"] for r in rows], w, label="HybridDataParallel (hybrid)")
    comp = [r["compute_s"] for r in rows]
    if all(c is not None for c in comp):
        ax.plot(list(xs), comp, "k:", marker="_", ms=20, label="compute alone")
    ax.axhline(data["ring_bound_s"], color="grey", ls="--", lw=1, label="ring bound 2(n-1)/n S / link")
    ax.set_xticks(list(xs), [str(b) for b in bs])
    ax.set_xlabel("batch per worker")
    ax.set_ylabel("seconds per step (median)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    ax2.bar(list(xs), [r["ratio_hdp_over_ddp"] for r in rows], 0.5, color="tab:green")
    ax2.axhline(1.0, color="k", lw=0.8)
    for i, r in zip(xs, rows):
        ax2.text(i, r["ratio_hdp_over_ddp"], f"{r['ratio_hdp_over_ddp']:.3f}", ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(list(xs), [str(b) for b in bs])
    ax2.set_xlabel("batch per worker")
    ax2.set_ylabel("HDP step / DDP step")
    fig.suptitle(f"{data['settings']['model']} on {data['settings']['hosts']} emulated hosts at "
                 f"{data['settings']['rate_gbps']:g} Gbit/s", fontsize=10)
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="batch 32,128 and fewer steps (a few minutes)")
    p.add_argument("--batches", default=None, help="batch sizes per worker (default 128,192,256,512)")
    p.add_argument("--image", type=int, default=64, help="input image side (default 64; the paper: 224)")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", type=float, default=1.0, help="link rate in Gbit/s (default 1)")
    p.add_argument("--policy", default="hybrid")
    p.add_argument("--steps", type=int, default=None, help="steps per timed block (default 2; quick 1)")
    p.add_argument("--reps", type=int, default=None, help="timed blocks per system (default 3; quick 2)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--no-compute", dest="compute_steps", action="store_false",
                   help="skip the compute-alone reference step")
    p.add_argument("--timeout", type=float, default=3000.0)
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.model = args.model or f"alexnet[image={args.image}]"
    if args.worker:
        worker(args)
        return 0
    quick = args.quick
    batches = args.batches or ("32,128" if quick else "128,192,256,512")
    steps = args.steps or (1 if quick else 2)
    reps = args.reps or (2 if quick else 3)
    setup_logging()
    require_emulation()
    from tools.emucluster import EmulatedCluster
    json_path, png_path = result_paths("hdp_vs_ddp", quick, args.out)
    started = time.monotonic()
    worker_args = ["--model", args.model, "--batches", batches, "--steps", str(steps), "--reps", str(reps),
                   "--warmup", str(args.warmup), "--lr", str(args.lr), "--policy", args.policy]
    if not args.compute_steps:
        worker_args.append("--no-compute")
    log.info("%s, %d hosts at %g Gbit/s, batches %s", args.model, args.hosts, args.rate, batches)
    with EmulatedCluster(args.hosts, args.rate) as cluster:
        out = run_workers(cluster, __file__, worker_args, timeout_s=args.timeout)
    grad_bytes = out["parameters"] * 4
    ring_bound = 2 * (args.hosts - 1) / args.hosts * grad_bytes * 8 / (args.rate * 1e9 * 1448 / 1514)
    data = {"benchmark": "hdp_vs_ddp", "quick": quick, "machine": machine(),
            "settings": {"model": args.model, "hosts": args.hosts, "rate_gbps": args.rate, "batches": batches,
                         "steps_per_block": steps, "blocks": reps, "warmup": args.warmup, "policy": args.policy,
                         "optimizer": f"SGD lr={args.lr} momentum=0.9", "threads_per_worker": 1,
                         "input": f"3x{args.image}x{args.image} (paper: 3x224x224)"},
            "parameters": out["parameters"], "gradient_bytes": grad_bytes, "ring_bound_s": ring_bound,
            "ddp_setup_s": out["ddp_setup_s"], "hdp_setup_s": out["hdp_setup_s"],
            "same_weights_after_training": out["same_weights_after_training"], "hdp_choices": out["hdp_choices"],
            "rows": out["rows"], "duration_s": time.monotonic() - started}
    for r in data["rows"]:
        log.info("batch %4d: DDP %.2f s, HDP %.2f s, HDP/DDP %.3f, compute %s", r["batch_per_worker"],
                 r["ddp_s"]["median"], r["hdp_s"]["median"], r["ratio_hdp_over_ddp"],
                 f"{r['compute_s']:.2f} s" if r["compute_s"] is not None else "-")
    write_results(json_path, data, plot(data), png_path)
    log.info("done in %.0f s", data["duration_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
