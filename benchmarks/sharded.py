"""Sharded replicas (issue 29 item 5): hybridpipe's ZeRO-1/2 (comm/sharded + ShardedOptimizer) next to
the replicated stage (HybridDataParallel) and torch's own FSDP2 (``fully_shard`` per layer and on the
root, ``reshard_after_forward=False``: ZeRO-2's memory in forward/backward) on the same stage module
and replica group: R gloo processes on loopback, AdamW, M micro-batches accumulated per step (as a
pipeline stage runs them: only the last one syncs, but ZeRO-2 reduce-scatters every one).

Per system: the median step time, the process's peak resident memory (``ru_maxrss``, each system in
its own processes, so the peaks are the system's own), the optimizer-state and weight bytes a rank
holds between steps, and the largest difference of its final weights from the replicated run's
(all train the same data from the same weights). Systems run in turns, ``--rounds`` times, so each
sees the machine's load alike.

    .venv/bin/python benchmarks/sharded.py --quick      # 2 ranks, 8 x 512-wide layers, about a minute

    sudo .venv/bin/python benchmarks/sharded.py --network emulated --rate 1gbit --ranks 4   # 4 emulated hosts

Systems run in ABBA order (reversed every other round); the JSON has every round's step (the noise:
``round_spread``), the load at the start and end, and each system's speed relative to FSDP2's.
On emulated hosts the run holds ``--lock`` (default /tmp/hybridpipe-bench.lock) while it measures.
Writes benchmarks/results/sharded[_emulated][_quick].{json,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    bench_lock,
    emit_result,
    log,
    machine,
    pyplot,
    require_emulation,
    result_paths,
    run_workers,
    setup_logging,
    write_results,
)

SYSTEMS = ("replicated", "zero1", "zero2", "fsdp2")


def _build(width: int, layers: int):
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
                                 for _ in range(layers)])


def _worker(rank: int, world: int, system: str, args: argparse.Namespace, port: int | None, out: dict) -> None:
    import torch
    import torch.distributed as dist

    from hybridpipe.comm.allreduce.transport import GroupTransport
    from hybridpipe.comm.hybrid_dp import HybridDataParallel, UnitChoice, model_layers
    from hybridpipe.comm.sharded import ShardedReplicas
    from hybridpipe.runtime.sharded_optimizer import ShardedOptimizer

    if port is not None:                  # loopback; an emulated host's environment names its master itself
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _build(args.width, args.layers)
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)   # noqa: E731
    M = args.micro_batches
    units = [UnitChoice(layer.param_names, "ring", 0, layer.name) for layer in model_layers(model)]
    sync = None
    if system == "replicated":
        sync = HybridDataParallel(model, reduce="sum", units=units)
        opt = make(list(model.parameters()))
    elif system in ("zero1", "zero2"):
        sync = ShardedReplicas(model, GroupTransport(None), units, "optimizer" if system == "zero1" else "gradients")
        opt = ShardedOptimizer(model.parameters(), make)
        opt.bind([sync])
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for block in model:
            fully_shard(block, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        opt = make(list(model.parameters()))
    gen = torch.Generator().manual_seed(1)
    batches = [[torch.randn(args.batch, args.width, generator=gen) for _ in range(M * world)]
               for _ in range(args.steps + 2)]
    times = []
    for k, step in enumerate(batches):
        t0 = time.perf_counter()
        for m in range(M):
            last = m == M - 1
            x = step[m * world + rank]
            if system == "fsdp2":
                model.set_requires_gradient_sync(last)     # type: ignore[operator]
                (model(x).square().mean() / M).backward()  # FSDP2 averages over the replicas itself
            elif sync is not None and not last and system != "zero2":
                with sync.no_sync():
                    (model(x).square().mean() / (M * world)).backward()
            else:
                (model(x).square().mean() / (M * world)).backward()
        if sync is not None:
            sync.finish()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if k >= 2:
            times.append(time.perf_counter() - t0)
    state = [t.to_local() if hasattr(t, "to_local") else t
             for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}
    if rank == 0:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out.update(step_s=statistics.median(times), peak_rss_mb=rss,
                   state_mb=sum(t.numel() * t.element_size() for t in state) / 2**20,
                   weights_mb=sum(t.numel() * t.element_size() for t in local) / 2**20,
                   weights={n: t for n, t in full.items()})
    if sync is not None:
        sync.close()
    dist.destroy_process_group()


def _run(system: str, args: argparse.Namespace, port: int, cluster=None) -> dict:
    """One system's run: ``--ranks`` local processes on loopback, or one per emulated host (``cluster``)."""
    if cluster is not None:
        import torch
        with tempfile.TemporaryDirectory(prefix="sharded.") as tmp:
            weights = Path(tmp) / "weights.pt"
            out = run_workers(cluster, __file__, [*_worker_argv(args), "--system", system,
                                                  "--weights-out", str(weights)], timeout_s=900)
            return {**out, "weights": torch.load(weights)}
    import torch.multiprocessing as mp
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_spawned, args=(args.ranks, system, args, port, out), nprocs=args.ranks)
        return dict(out)


def _spawned(rank: int, world: int, system: str, args: argparse.Namespace, port: int, out: dict) -> None:
    """A loopback rank: :func:`_worker`, then exit without the interpreter's teardown (a rank of 4 aborted
    there now and then: "terminate called without an active exception", after its step times were in)."""
    _worker(rank, world, system, args, port, out)
    sys.stdout.flush()
    os._exit(0)


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """The model and step options a host's ``--worker`` process is given."""
    return ["--ranks", str(args.ranks), "--width", str(args.width), "--layers", str(args.layers), "--batch",
            str(args.batch), "--micro-batches", str(args.micro_batches), "--steps", str(args.steps)]


def _host(args: argparse.Namespace) -> None:
    """One emulated host's process (``--worker``): its rank from the cluster's environment; rank 0 saves
    the final weights for the driver and hands back the rest."""
    import torch
    out: dict = {}
    _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.system, args, None, out)
    if out:
        torch.save(out.pop("weights"), args.weights_out)
        emit_result(out)
    sys.stdout.flush()
    os._exit(0)             # no interpreter teardown (as _spawned)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2, help="rounds of every system, in ABBA order")
    p.add_argument("--network", choices=("loopback", "emulated"), default="loopback",
                   help="local processes on 127.0.0.1 (default), or one emulated host per rank (root)")
    p.add_argument("--rate", default="1gbit", help="emulated link rate (tc tbf; default 1gbit)")
    p.add_argument("--lock", default="/tmp/hybridpipe-bench.lock",
                   help="benchmark lock held while measuring on emulated hosts ('' for none)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--weights-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _host(args)
        return 0
    if args.quick:
        args.width, args.steps = 512, 6
    setup_logging()
    rows: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    port = 29700 + os.getpid() % 200
    with contextlib.ExitStack() as stack:
        cluster = None
        if args.network == "emulated":
            require_emulation()
            from tools.emucluster import EmulatedCluster
            cluster = stack.enter_context(EmulatedCluster(args.ranks, rate=args.rate))
            stack.enter_context(bench_lock(args.lock))
        load = os.getloadavg()[0]
        for r in range(args.rounds):
            for i, system in enumerate(SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]):    # ABBA: alike load
                rows[system].append(_run(system, args, port + 7 * r + i, cluster))
                log.info("round %d %s: %.1f ms/step", r, system, rows[system][-1]["step_s"] * 1e3)
        load_end = os.getloadavg()[0]
    ref = rows["replicated"][0]["weights"]
    network = "loopback" if args.network == "loopback" else f"emulated {args.ranks} hosts at {args.rate}"
    result = {"command": " ".join(["benchmarks/sharded.py", *(argv or sys.argv[1:])]), "machine": machine(),
              "load_at_start": load, "load_at_end": load_end, "network": network,
              "args": {k: v for k, v in vars(args).items() if k not in ("worker", "system", "weights_out")},
              "systems": {}}
    for system, runs in rows.items():
        w = runs[0]["weights"]
        rounds = [x["step_s"] for x in runs]
        result["systems"][system] = {
            "step_s": statistics.median(rounds), "step_s_per_round": rounds,
            "round_spread": max(rounds) / min(rounds) - 1,
            "step_vs_replicated": statistics.median(x["step_s"] for x in runs)
            / statistics.median(x["step_s"] for x in rows["replicated"]),
            "peak_rss_mb": max(x["peak_rss_mb"] for x in runs),
            "optimizer_state_mb_per_rank": runs[0]["state_mb"], "weights_mb_per_rank": runs[0]["weights_mb"],
            "max_weight_diff_vs_replicated": max(float((w[n] - ref[n]).abs().max()) for n in ref)}
    fsdp = result["systems"]["fsdp2"]["step_s"]
    for v in result["systems"].values():
        v["speed_vs_fsdp2"] = fsdp / v["step_s"]
    json_path, png_path = result_paths("sharded" + ("_emulated" if cluster is not None else ""), args.quick)
    plt = pyplot()
    figure = None
    if plt is not None:
        figure, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
        names = list(result["systems"])
        a.bar(names, [result["systems"][s]["step_s"] * 1e3 for s in names])
        a.set_ylabel("step time (ms, median)")
        b.bar(names, [result["systems"][s]["peak_rss_mb"] for s in names])
        b.set_ylabel("peak RSS per rank (MB)")
        figure.suptitle(f"{args.ranks} ranks ({network}), {args.layers} x Linear({args.width}), AdamW, "
                        f"M={args.micro_batches}")
        figure.tight_layout()
    write_results(json_path, result, figure, png_path)
    for s, v in result["systems"].items():
        print(f"{s:11s} step {v['step_s'] * 1e3:7.1f} ms ({v['step_vs_replicated']:.2f}x)  "
              f"peak RSS {v['peak_rss_mb']:6.0f} MB  state {v['optimizer_state_mb_per_rank']:6.1f} MB  "
              f"weights {v['weights_mb_per_rank']:6.1f} MB  diff {v['max_weight_diff_vs_replicated']:.1e}  "
              f"rounds differ {v['round_spread']:.0%}  {v['speed_vs_fsdp2']:.2f}x FSDP2's speed")
    print(f"{network}; load {load:.1f} at the start, {load_end:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
