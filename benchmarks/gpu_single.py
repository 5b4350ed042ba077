"""One GPU: hybridpipe's Trainer (one stage, one rank, NCCL) vs a plain PyTorch loop on the same model.

    python benchmarks/gpu_single.py                       # on a machine with a CUDA GPU
    python benchmarks/gpu_single.py --device cpu --quick  # the same path on the CPU (gloo), to check it runs

What it shows on a GPU: the framework's cost where there is nothing to pipeline (a one-stage plan:
hybridpipe's engine, its capture of the model as a graph, its memory meter) against the loop a user
would write, fp32 and bf16 (``torch.autocast``), and the plan's predicted peak memory against CUDA's
``max_memory_allocated`` (less what was allocated before the side started: other objects the process
still holds, counted by ``torch.cuda.memory_allocated`` after a ``gc.collect()``). The plan comes from a
profile taken on the device in the side's precision (bf16: under ``torch.autocast``,
``profile_model(precision=)``) and predicts weights, gradients and optimizer state, the activations of
the micro-batches in flight and the kernels' transient bytes (``stagememory.transient_bytes``); the
breakdown is printed. On the CPU the Trainer's meter counts the tensors a stage holds, not temporaries:
compare it with ``predicted_held_bytes``. Both sides: the same model built from the same seed, AdamW,
``--micro-batches`` micro-batches of ``--batch-size`` accumulated per step, synthetic data; the plain
loop scales each micro-batch's loss by 1/M as hybridpipe does. Each side runs ``--steps`` steps per
round, ``--warmup`` untimed; the sides alternate for ``--rounds`` rounds (ABBA), and a side's figure is
the median over rounds of its median step (``torch.cuda.synchronize`` around each step). The weights
after the first round are compared (``max |ours - plain|``) so a fast wrong answer cannot pass.
Results: ``benchmarks/results/gpu_single[_quick].json`` / ``.png`` (the PNG only where matplotlib is).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import machine, result_paths, setup_logging, write_results  # noqa: E402
from hybridpipe.partitioner.cost.cluster import Cluster, Level  # noqa: E402
from hybridpipe.partitioner.planner import Request, partition  # noqa: E402
from hybridpipe.partitioner.search.modelcosts import model_costs  # noqa: E402
from hybridpipe.partitioner.search.options import OPTIMIZER_STATES  # noqa: E402
from hybridpipe.partitioner.search.stagememory import transient_bytes  # noqa: E402
from hybridpipe.pipeline import MicroBatches  # noqa: E402
from hybridpipe.profiles.data import resolve_dataset  # noqa: E402
from hybridpipe.profiles.profiler import profile_model  # noqa: E402
from hybridpipe.profiles.zoo import resolve_model  # noqa: E402
from hybridpipe.runtime.trainer import Trainer  # noqa: E402

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _residue(device: torch.device) -> int:
    """Bytes the process holds on the device before a side starts (0 on the CPU)."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_allocated(device))


def plain_side(spec, batches: MicroBatches, steps: int, precision: str, device: torch.device, lr: float):
    """The loop a user writes: the unsplit model, AdamW, M micro-batches accumulated per step."""
    torch.manual_seed(0)
    model = spec.build().to(device)
    loss_fn = spec.loss
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    times, peak = [], 0
    for k in range(steps):
        _peak_reset(device)
        _sync(device)
        t0 = time.perf_counter()
        xs, ys = batches.global_batch(k)
        for x, y in zip(torch.chunk(xs, batches.micro_batches), torch.chunk(ys, batches.micro_batches), strict=True):
            with torch.autocast(device.type, dtype=AUTOCAST[precision], enabled=AUTOCAST[precision] is not None):
                loss = loss_fn(model(x.to(device)), y.to(device)) / batches.micro_batches
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated(device))
    return times, peak, {n: p.detach().float().cpu() for n, p in model.named_parameters()}


def ours_side(spec_name: str, plan, batches: MicroBatches, steps: int, precision: str, backend: str, lr: float):
    """hybridpipe's Trainer on a one-stage plan (a job of one: no torchrun needed)."""
    trainer = Trainer(spec_name, plan, optimizer="adamw", lr=lr, precision=precision, backend=backend, timeout=300)
    device = trainer.proc.device
    times, peak = [], 0
    for k in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        trainer.train_step(*batches.global_batch(k))
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        peak = max(peak, trainer.last_peak_memory_bytes)
    weights = {n: p.detach().float().cpu() for n, p in trainer.model.captured.module.named_parameters()}
    trainer.close()
    return times, peak, weights


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt[layers=12,width=768,heads=12,seq=512,vocab=32000]")
    p.add_argument("--batch-size", type=int, default=8, help="samples per micro-batch")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="a small GPT, 4 steps, 1 round")
    p.add_argument("--out-dir")
    a = p.parse_args(argv)
    setup_logging()
    if a.quick:
        a.model, a.steps, a.warmup, a.rounds = "gpt[layers=2,width=64,heads=2,seq=32,vocab=256]", 8, 3, 2
    device = torch.device(a.device)
    backend = "nccl" if a.device == "cuda" else "gloo"
    spec = resolve_model(a.model)
    data = resolve_dataset("synthetic", spec, size=a.steps * a.batch_size * a.micro_batches)
    batches = MicroBatches(data, a.batch_size, a.micro_batches)
    out: dict = {"benchmark": "gpu_single", "machine": machine(), "command": " ".join(sys.argv), "model": a.model,
                 "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
                 "batch_size": a.batch_size, "micro_batches": a.micro_batches, "steps": a.steps,
                 "warmup": a.warmup, "rounds": a.rounds, "torch": torch.__version__, "precisions": {}}
    for q in ("fp32", "bf16"):
        profile = profile_model(spec, batch_size=a.batch_size, device=a.device, repeats=3, progress=False, precision=q)
        cluster = Cluster((Level("gpu", 1, 100.0, 1000.0),), 120.0)
        plan = partition(profile, cluster, Request(workers=1, strategy="dp", optimizer="adamw",
                                                   micro_batches=a.micro_batches, precision=q)).plan
        parts = _breakdown(profile, plan)
        del profile
        rounds: dict[str, list[float]] = {"ours": [], "plain": []}
        peaks: dict[str, int] = {}
        residues: dict[str, int] = {}
        diff = None
        for r in range(a.rounds):
            order = ("ours", "plain") if r % 2 == 0 else ("plain", "ours")
            got = {}
            for side in order:
                residue = _residue(device)
                residues[side] = max(residues.get(side, 0), residue)
                if side == "ours":
                    t, peak, w = ours_side(a.model, plan, batches, a.steps, q, backend, 1e-4)
                else:
                    t, peak, w = plain_side(spec, batches, a.steps, q, device, 1e-4)
                rounds[side].append(statistics.median(t[a.warmup:]))
                peaks[side] = max(peaks.get(side, 0), peak - residue if peak else 0)
                got[side] = w
            if diff is None:
                diff = max((got["ours"][n] - got["plain"][n]).abs().max().item() for n in got["plain"])
        med = {s: statistics.median(v) for s, v in rounds.items()}
        predicted = plan.stages[0].memory_bytes
        out["precisions"][q] = {"median_step_ms": med, "step_ms_per_round": rounds,
                                "ours_over_plain_step": med["ours"] / med["plain"],
                                "peak_memory_bytes": peaks, "residue_bytes_before_side": residues,
                                "predicted_memory_bytes": predicted, "predicted_parts_bytes": parts,
                                "predicted_held_bytes": predicted - parts["transient"],
                                "measured_over_predicted_memory": peaks["ours"] / predicted if peaks["ours"] else None,
                                "max_weight_diff_after_round_1": diff}
        print(f"{q}: ours {med['ours']:.1f} ms/step, plain {med['plain']:.1f} ms/step "
              f"({med['ours'] / med['plain']:.3f}x); peak ours {peaks['ours'] / 2**20:.0f} MiB, plain "
              f"{peaks['plain'] / 2**20:.0f} MiB, predicted {predicted / 2**20:.0f} MiB "
              f"(measured/predicted {peaks['ours'] / predicted:.3f}; residue before the sides "
              f"{max(residues.values()) / 2**20:.0f} MiB, not counted); max weight diff {diff:.2e}", flush=True)
        sizes = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in parts.items() if isinstance(v, (int, float)))
        print(f"{q}: predicted parts (MiB): {sizes}; transient at node {parts['transient_node']}", flush=True)
    json_path, png_path = result_paths("gpu_single", a.quick, a.out_dir)
    try:
        figure = _figure(out)
    except ImportError:
        figure = None
    write_results(json_path, out, figure, png_path)
    print(f"wrote {json_path}")
    return 0


def _breakdown(profile, plan) -> dict:
    """The one-stage plan's predicted bytes by part (stagememory.memory_bytes's terms)."""
    costs = model_costs(profile)
    st, n = plan.stages[0], len(profile.nodes)
    weights = costs.weight_bytes(0, n - 1)
    held = costs.stash_table()[0][0]                     # what a micro-batch holds up to each node
    transients = costs.transient if costs.transient is not None else [0.0] * n
    worst = max(range(n), key=lambda k: held[k] + transients[k])     # the node at the stage's worst moment
    fixed = weights * (2 + OPTIMIZER_STATES[plan.optimizer])
    transient = transient_bytes(costs, 0, n - 1)
    return {"weights_grads_optimizer": fixed, "activations_in_flight": st.memory_bytes - fixed - transient,
            "transient": transient, "transient_node": profile.nodes[worst].name}


def _figure(result: dict):
    from benchmarks.common import pyplot
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    qs = list(result["precisions"])
    for i, side in enumerate(("plain", "ours")):
        a1.bar([k + (i - 0.5) * 0.4 for k in range(len(qs))],
               [result["precisions"][q]["median_step_ms"][side] for q in qs], width=0.4, label=side)
        a2.bar([k + (i - 0.5) * 0.4 for k in range(len(qs))],
               [result["precisions"][q]["peak_memory_bytes"][side] / 2**20 for q in qs], width=0.4, label=side)
    a2.plot(range(len(qs)), [result["precisions"][q]["predicted_memory_bytes"] / 2**20 for q in qs], "k_",
            markersize=30, label="predicted")
    for ax, label in ((a1, "ms per step"), (a2, "peak MiB")):
        ax.set_xticks(range(len(qs)), qs)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['model']} on {result['device']}", fontsize=9)
    return fig


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
