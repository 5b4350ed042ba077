"""Reproduction (seed 003): the p2p channel modes side by side, per-tensor vs sa vs sra.

A pipeline of stage ranks moves AlexNet-like activation sets (activations + labels forward,
gradients backward) through a 1F1B schedule with a flush per step; compute is emulated with
sleeps (the 2-core machine cannot run 4 AlexNet stages), so what differs between the modes is
only how the channels move the tensors. Topologies:

* ``chain2``: ranks 0 -> 1, cut after conv2 (B x 256 x 13 x 13);
* ``chain4``: ranks 0 -> 1 -> 2 -> 3, cuts after conv1, conv2 and conv5;
* ``fanin4``: seed 003's AlexNet case, stage 0 replicated on ranks 0-2 (round-robin
  micro-batches) feeding rank 3, cut after conv5 (every message into rank 3 shares its link).

For each topology and mode: the median step time (slowest rank), its ratio to per-tensor, and
the p2p threads per rank. The same sra orders every rank derives from the schedule
(``link_orders``) are what a runtime would pass.

    sudo .venv/bin/python benchmarks/p2p_modes.py --quick             # about 2 minutes
    sudo .venv/bin/python benchmarks/p2p_modes.py                     # about 5 minutes
    .venv/bin/python benchmarks/p2p_modes.py --loopback --quick        # local processes only, no root

Regimes (``--regimes``, NETWORK:BATCH:FORWARD_MS): by default emulated 1 Gbit/s hosts with
batch 32 and 20 ms forward compute per micro-batch (compute and transfers comparable), the same
without compute (transfers only), and local processes on 127.0.0.1 with batch 2 and no compute
(per-message overheads and thread contention on the 2 cores).

Writes benchmarks/results/p2p_modes[_loopback][_quick].{json,png}.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    REPO,
    emit_result,
    log,
    machine,
    pyplot,
    read_result,
    require_emulation,
    result_paths,
    run_workers,
    setup_logging,
    summary,
    write_results,
)

MODES = ("per-tensor", "sa", "sra")
CUTS = {"conv1": (96, 27, 27), "conv2": (256, 13, 13), "conv5": (256, 6, 6)}
TOPOLOGIES = {                       # stages as lists of ranks, and the cut after each stage
    "chain2": ([[0], [1]], ["conv2"]),
    "chain4": ([[0], [1], [2], [3]], ["conv1", "conv2", "conv5"]),
    "fanin4": ([[0, 1, 2], [3]], ["conv5"]),
}


# ---- schedules (pure) ------------------------------------------------------------------------

def programs(stages: list[list[int]], micro: int) -> dict[int, list[tuple]]:
    """Per rank, one step of 1F1B: ("fwd"|"bwd", m) compute and ("send"|"recv", peer, key).

    Micro-batch m runs on replica m % r of a stage with r replicas; a rank warms up with as
    many forwards as stages follow it, then alternates one forward and one backward.
    """
    progs: dict[int, list[tuple]] = {}
    for s, ranks in enumerate(stages):
        for i, rank in enumerate(ranks):
            progs[rank] = _rank_ops(stages, s, [m for m in range(micro) if m % len(ranks) == i])
    return progs


def _rank_ops(stages: list[list[int]], s: int, mine: list[int]) -> list[tuple]:
    """One rank of stage ``s``'s step, running micro-batches ``mine``."""
    n = len(stages)
    ops: list[tuple] = []

    def fwd(m: int) -> None:
        if s > 0:
            ops.append(("recv", stages[s - 1][m % len(stages[s - 1])], f"act{s - 1}/{m}"))
        ops.append(("fwd", m))
        if s < n - 1:
            ops.append(("send", stages[s + 1][m % len(stages[s + 1])], f"act{s}/{m}"))

    def bwd(m: int) -> None:
        if s < n - 1:
            ops.append(("recv", stages[s + 1][m % len(stages[s + 1])], f"grad{s}/{m}"))
        ops.append(("bwd", m))
        if s > 0:
            ops.append(("send", stages[s - 1][m % len(stages[s - 1])], f"grad{s - 1}/{m}"))

    warm = min(n - s - 1, len(mine))
    for m in mine[:warm]:
        fwd(m)
    for k, m in enumerate(mine[warm:]):
        fwd(m)
        bwd(mine[k])
    for m in mine[len(mine) - warm:] if warm else []:
        bwd(m)
    return ops


def comm_only(progs: dict[int, list[tuple]]) -> dict[int, list[tuple]]:
    return {r: [op for op in p if op[0] in ("send", "recv")] for r, p in progs.items()}


# ---- the worker (one process per rank) -------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from hybridpipe.comm.p2p import Channels, link_orders, pair_groups
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    control = dist.new_group(backend="gloo")
    stages, cuts = TOPOLOGIES[args.topology]
    progs = programs(stages, args.micro)
    orders = link_orders(comm_only(progs))
    edges = sorted({tuple(sorted((r, p))) for r, prog in comm_only(progs).items() for _, p, _ in prog})
    b = args.batch
    acts = {f"act{s}": {"act": torch.randn(b, *CUTS[c]), "labels": torch.randint(0, 1000, (b,))}
            for s, c in enumerate(cuts)}
    grads = {f"grad{s}": {"grad": torch.randn(b, *CUTS[c])} for s, c in enumerate(cuts)}
    tensors = {**acts, **grads}
    compute = {"fwd": args.compute_ms / 1e3, "bwd": 2 * args.compute_ms / 1e3}
    modes = args.modes.split(",")
    # all modes open at once and take turns step by step, so drifting load hits them alike
    channels, threads = {}, {}
    for mode in modes:
        groups = pair_groups(edges, lanes=2 if mode == "per-tensor" else 1)
        before = sum(t.name.startswith("p2p-") for t in threading.enumerate())
        channels[mode] = Channels(groups, mode, timeout=args.timeout, order=orders[rank] if mode == "sra" else None)
        threads[mode] = sum(t.name.startswith("p2p-") for t in threading.enumerate()) - before
    times: dict[str, list[float]] = {m: [] for m in modes}
    for step in range(args.warmup + args.steps):
        for mode in modes:
            ch = channels[mode]
            dist.barrier(group=control)
            t0 = time.perf_counter()
            for op in progs[rank]:
                if op[0] in compute:
                    time.sleep(compute[op[0]])
                elif op[0] == "send":
                    ch.send(op[1], op[2], tensors[op[2].split("/")[0]])
                else:
                    ch.recv(op[1], op[2])
            ch.flush()
            if step >= args.warmup:
                times[mode].append(time.perf_counter() - t0)
    rows = []
    for mode in modes:
        channels[mode].close()
        slowest = torch.tensor(times[mode], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=control)
        nthreads = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(nthreads, torch.tensor([threads[mode]]), group=control)
        rows.append({"mode": mode, "times_s": slowest.tolist(), **{f"{k}_s": v for k, v in
                     summary(slowest.tolist()).items() if k in ("median", "min", "max")},
                     "p2p_threads": [int(t) for t in nthreads]})
        if rank == 0:
            print(f"{args.topology:>7} {mode:>10} {rows[-1]['median_s'] * 1e3:8.1f} ms/step", file=sys.stderr,
                  flush=True)
    if rank == 0:
        emit_result({"world": world, "rows": rows})
    dist.barrier(group=control)
    dist.destroy_process_group()


# ---- the driver ------------------------------------------------------------------------------

def run_local(world: int, worker_args: list[str], timeout_s: float) -> dict:
    """Run the workers as local processes on 127.0.0.1 (env://); return rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", *worker_args], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, text=True, cwd=REPO) for r in range(world)]
    try:
        out = procs[0].communicate(timeout=timeout_s)[0]
        for p in procs[1:]:
            p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return read_result(out)


def analyse(regime: dict, topology: str, rows: list[dict]) -> dict:
    """Ratios to per-tensor of the median and of the fastest step (the latter is the steadier
    estimate of a mode's own cost where the shared machine's load makes steps noisy)."""
    base = next((r for r in rows if r["mode"] == "per-tensor"), None)
    for r in rows:
        r["ratio_to_per_tensor"] = r["median_s"] / base["median_s"] if base else None
        r["min_ratio_to_per_tensor"] = r["min_s"] / base["min_s"] if base else None
    return {**regime, "topology": topology, "rows": rows}


def parse_regime(text: str) -> dict:
    """``emulated:32:20`` -> network, samples per micro-batch, emulated forward ms."""
    try:
        net, batch, compute = text.split(":")
        assert net in ("emulated", "loopback")
        return {"network": net, "batch": int(batch), "compute_ms": float(compute)}
    except (ValueError, AssertionError):
        raise SystemExit(f"cannot read regime {text!r}; write NETWORK:BATCH:COMPUTE_MS with NETWORK "
                         "emulated or loopback, e.g. emulated:32:20") from None


def regime_label(r: dict, rate: str) -> str:
    net = f"{rate} emulated" if r["network"] == "emulated" else "loopback"
    return f"{net}, batch {r['batch']}, fwd {r['compute_ms']:g} ms"


def plot(results: list[dict], regimes: list[dict], rate: str):
    plt = pyplot()
    fig, axes = plt.subplots(1, len(regimes), figsize=(4.6 * len(regimes), 3.8), squeeze=False)
    width = 0.8 / len(MODES)
    for ax, regime in zip(axes[0], regimes, strict=True):
        mine = [r for r in results if all(r[k] == regime[k] for k in regime)]
        for j, mode in enumerate(MODES):
            xs, ys, labels = [], [], []
            for i, res in enumerate(mine):
                row = next((r for r in res["rows"] if r["mode"] == mode), None)
                if row and row["ratio_to_per_tensor"] is not None:
                    xs.append(i + (j - 1) * width)
                    ys.append(row["ratio_to_per_tensor"])
                    labels.append(f"{row['median_s'] * 1e3:.0f} ms")
            bars = ax.bar(xs, ys, width, label=mode)
            ax.bar_label(bars, labels, fontsize=6, rotation=90, padding=2)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(mine)), [r["topology"] for r in mine])
        ax.set_ylim(0, max(1.5, ax.get_ylim()[1] * 1.2))
        ax.set_title(regime_label(regime, rate), fontsize=8)
    axes[0][0].set_ylabel("1F1B step time / per-tensor")
    axes[0][0].legend(fontsize=7, ncol=3, loc="upper left")
    fig.suptitle("p2p channel modes (median step, slowest rank; labels: absolute)", fontsize=9)
    return fig


DEFAULT_REGIMES = "emulated:32:20,emulated:32:0,loopback:2:0"
LOOPBACK_STEP_FACTOR = 6        # loopback steps take milliseconds and are noisy: take more of them


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps (about two minutes)")
    p.add_argument("--loopback", action="store_true", help="only the loopback regimes (needs no root)")
    p.add_argument("--regimes", default=DEFAULT_REGIMES,
                   help=f"NETWORK:BATCH:FORWARD_MS,... (default {DEFAULT_REGIMES}); backward is twice forward")
    p.add_argument("--topologies", default=",".join(TOPOLOGIES))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--micro", type=int, default=6, help="micro-batches per step (default 6)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"timed steps per mode (default 10; quick 4; loopback regimes x{LOOPBACK_STEP_FACTOR})")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rate", default="1gbit", help="emulated link rate (default 1gbit)")
    p.add_argument("--timeout", type=float, default=120.0, help="channel timeout in seconds")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--topology", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--compute-ms", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    steps = args.steps or (4 if args.quick else 10)
    regimes = [parse_regime(t) for t in args.regimes.split(",")]
    if args.loopback:
        regimes = [r for r in regimes if r["network"] == "loopback"] or [parse_regime("loopback:2:0")]
    setup_logging()
    if any(r["network"] == "emulated" for r in regimes):
        require_emulation()
    json_path, png_path = result_paths("p2p_modes" + ("_loopback" if args.loopback else ""), args.quick, args.out)
    started = time.monotonic()
    results = []
    for regime in regimes:
        for topology in args.topologies.split(","):
            world = 1 + max(r for stage in TOPOLOGIES[topology][0] for r in stage)
            n = steps * (LOOPBACK_STEP_FACTOR if regime["network"] == "loopback" else 1)
            wargs = ["--topology", topology, "--modes", args.modes, "--batch", str(regime["batch"]), "--micro",
                     str(args.micro), "--compute-ms", str(regime["compute_ms"]), "--steps", str(n),
                     "--warmup", str(args.warmup), "--timeout", str(args.timeout)]
            budget = 600.0 + 60 * steps
            if regime["network"] == "loopback":
                out = run_local(world, wargs, budget)
            else:
                from tools.emucluster import EmulatedCluster
                with EmulatedCluster(world, args.rate) as cluster:
                    out = run_workers(cluster, __file__, wargs, timeout_s=budget)
            res = analyse(regime, topology, out["rows"])
            results.append(res)
            log.info("%s, %s: %s", regime_label(regime, args.rate), topology, ", ".join(
                f"{r['mode']} {r['median_s'] * 1e3:.1f} ms ({r['ratio_to_per_tensor']:.2f}x; fastest step "
                f"{r['min_ratio_to_per_tensor']:.2f}x)" for r in res["rows"]))
    data = {"benchmark": "p2p_modes", "quick": args.quick, "machine": machine(),
            "settings": {"regimes": regimes, "rate": args.rate, "micro_batches": args.micro, "steps": steps,
                         "warmup": args.warmup, "cuts": {t: TOPOLOGIES[t][1] for t in args.topologies.split(",")},
                         "activation_shapes": CUTS, "compute": "time.sleep, backward = 2 x forward",
                         "latency_emulation": "none (netem unavailable; tbf only)"},
            "duration_s": time.monotonic() - started, "results": results}
    write_results(json_path, data, plot(results, regimes, args.rate), png_path)
    log.info("done in %.0f s", data["duration_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
