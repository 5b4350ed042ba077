"""The largest GPT each shard level lets the partitioner plan under a memory limit (planned only).

    python benchmarks/shard_fit.py                      # 4 workers, 2 GB each, AdamW
    python benchmarks/shard_fit.py --vocab 8192 --name shard_fit_vocab8k
    python benchmarks/shard_fit.py --memory-gb 1 --quick

For each ``--shard`` level and each width, the partitioner is asked for a plan of a GPT (the zoo's
``gpt``: token + position embeddings, pre-LN blocks of 12 d^2 + 13 d parameters, a final LayerNorm,
an untied LM head) with a growing number of layers (doubling, then bisection) until none fits in
``--memory-gb`` per worker; the largest model is the (layers, width) with the most parameters. Two
searches:

* ``dp``: one stage on all 4 workers (``--strategy dp``): the stage structure fixed, so the levels
  compare like for like (the issue's aims: ``optimizer`` >= 1.5x the parameters of replicated-only,
  ``parameters`` >= 3x).
* ``optimal``: the partitioner chooses stages and replicas. Without sharding it can still cut the
  model into 4 stages, which divides each worker's weights and optimizer state by 4 as ZeRO-3 does,
  so there the levels gain much less: what is left is the largest node (an embedding or head no
  stage can split) and the gathered working set.

Profiles are built here, not measured (so that hundreds of sizes take seconds): parameter bytes are
exact (checked against the zoo's module on the meta device), activation bytes per block are
Korthikanti et al.'s ``s b (34 d + 5 a s)`` at 2 bytes doubled for float32, and times come from a
nominal FLOP rate; feasibility, which is what is measured, depends on the bytes only. Results:
``benchmarks/results/shard_fit[_quick].json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, pyplot, result_paths, write_results  # noqa: E402
from hybridpipe.errors import UserError  # noqa: E402
from hybridpipe.partitioner.cost.cluster import Cluster, Level  # noqa: E402
from hybridpipe.partitioner.planner import Request, partition  # noqa: E402
from hybridpipe.profiles.format import Profile, ProfileNode  # noqa: E402

LEVELS = ("none", "optimizer", "gradients", "parameters", "auto")
FLOPS = 40e12          # nominal: times only order the plans that fit, never whether one fits


def gpt_nodes(layers: int, width: int, vocab: int, seq: int, batch: int) -> list[tuple]:
    """(name, type, forward ms, activation bytes, saved bytes, parameter count) per node, in order."""
    heads = max(1, width // 64)
    tokens = batch * seq
    act = 4 * tokens * width
    block_flops = 2 * tokens * (12 * width * width) + 4 * tokens * seq * width
    nodes = [("x", "ops", 0.0, 8 * tokens, 0, 0),
             ("embed", "Embeddings", 0.0, act, 8 * tokens, (vocab + seq) * width)]
    saved = 2 * tokens * (34 * width + 5 * heads * seq)          # Korthikanti et al. x 2 (float32)
    nodes += [(f"blocks.{k}", "Block", 1e3 * block_flops / FLOPS, act, saved, 12 * width * width + 13 * width)
              for k in range(layers)]
    nodes.append(("ln", "LayerNorm", 0.0, act, act, 2 * width))
    nodes.append(("head", "Linear", 1e3 * 2 * tokens * width * vocab / FLOPS, 4 * tokens * vocab, act, vocab * width))
    nodes.append(("loss", "ops", 0.0, 4, 4 * tokens * vocab, 0))
    return nodes


def gpt_profile(layers: int, width: int, vocab: int, seq: int, batch: int) -> Profile:
    """A chain profile of the GPT (module docstring): backward twice the forward; cuts carry each node's output."""
    specs = gpt_nodes(layers, width, vocab, seq, batch)
    nodes = []
    for i, (name, kind, fwd, act, saved, count) in enumerate(specs):
        nodes.append(ProfileNode(i, name, "module" if kind != "ops" else "ops", name, kind, fwd, 2 * fwd, act,
                                 count, 4 * count, (f"{name}.weight",) if count else (), saved_bytes=saved,
                                 cut_bytes=act, cut_grad_bytes=act if i > 0 else 0))
    edges = tuple((k, k + 1) for k in range(len(nodes) - 1))
    return Profile(f"gpt[layers={layers},width={width}]", batch, (batch, seq), "float32", "float32", "synthetic",
                   "built", tuple(nodes), edges)


def check_parameter_count(layers: int = 2, width: int = 128, vocab: int = 1000, seq: int = 32) -> None:
    """The profile's parameters = the zoo GPT's, built on the meta device."""
    import torch

    from hybridpipe.profiles.zoo.gpt import GPT
    with torch.device("meta"):
        model = GPT(layers=layers, width=width, heads=2, seq=seq, vocab=vocab)
    real = sum(p.numel() for p in model.parameters())
    ours = sum(n[5] for n in gpt_nodes(layers, width, vocab, seq, 1))
    if real != ours:
        raise SystemExit(f"parameter count drifted from the zoo GPT: {ours} here, {real} there")


class Fit:
    """Does a GPT of (layers, width) have a plan at this shard level?"""

    def __init__(self, args: argparse.Namespace, strategy: str):
        self.args, self.strategy = args, strategy
        self.cluster = Cluster((Level("net", args.workers, args.gbps, 20.0),), args.memory_gb)
        self.calls = 0

    def plan(self, layers: int, width: int, shard: str):
        a = self.args
        req = Request(strategy=self.strategy, micro_batches=a.micro_batches, optimizer="adamw",
                      memory_gb=a.memory_gb, shard=shard, time_budget_s=60.0)
        self.calls += 1
        try:
            return partition(gpt_profile(layers, width, a.vocab, a.seq, a.batch), self.cluster, req).plan
        except UserError as e:
            if "fit" not in str(e):              # not a memory refusal: a mistake in this script
                raise
            return None

    def most_layers(self, width: int, shard: str, cap: int) -> int:
        """The most layers with a plan (0: not even one), doubling then bisection."""
        good, layers = 0, 1
        while layers <= cap and self.plan(layers, width, shard) is not None:
            good, layers = layers, layers * 2
        bad = min(layers, cap + 1)
        while bad - good > 1:
            mid = (good + bad) // 2
            if self.plan(mid, width, shard) is not None:
                good = mid
            else:
                bad = mid
        return good


def params(layers: int, width: int, vocab: int, seq: int) -> int:
    return sum(n[5] for n in gpt_nodes(layers, width, vocab, seq, 1)) if layers else 0


def search(args: argparse.Namespace, strategy: str) -> dict:
    fit = Fit(args, strategy)
    out: dict = {}
    for shard in LEVELS:
        rows = []
        for width in args.widths:
            layers = fit.most_layers(width, shard, args.max_layers)
            rows.append({"width": width, "layers": layers, "params": params(layers, width, args.vocab, args.seq)})
        best = max(rows, key=lambda r: r["params"])
        plan = fit.plan(best["layers"], best["width"], shard) if best["layers"] else None
        out[shard] = {"per_width": rows, "best": best,
                      "plan": None if plan is None else {
                          "stages": len(plan.stages), "replicas": [s.replicas for s in plan.stages],
                          "shard": [s.shard for s in plan.stages],
                          "reshard_after_forward": [s.reshard_after_forward for s in plan.stages],
                          "memory_gb": [round(s.memory_bytes / 1e9, 3) for s in plan.stages],
                          "step_ms": round(plan.predicted_step_ms, 2)}}
    base = out["none"]["best"]["params"]
    for shard in LEVELS:
        out[shard]["vs_none"] = round(out[shard]["best"]["params"] / base, 3) if base else None
    out["partitions"] = fit.calls
    return out


def figure(results: dict, args: argparse.Namespace):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, strategy in zip(axes, ("dp", "optimal"), strict=True):
        res = results[strategy]
        for shard in LEVELS:
            rows = res[shard]["per_width"]
            ax.plot([r["width"] for r in rows], [r["params"] / 1e6 for r in rows], marker="o",
                    label=f"{shard} ({res[shard]['vs_none']}x)")
        ax.set_xlabel("width")
        ax.set_ylabel("largest GPT planned (M parameters)")
        ax.set_title(f"--strategy {strategy}: {args.workers} workers, {args.memory_gb:g} GB each, AdamW")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--memory-gb", type=float, default=2.0)
    p.add_argument("--gbps", type=float, default=25.0)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--batch", type=int, default=1, help="samples per micro-batch")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--max-layers", type=int, default=512)
    p.add_argument("--widths", type=lambda s: [int(x) for x in s.split(",")],
                   default=[512, 768, 1024, 1536, 2048, 2560, 3072, 4096])
    p.add_argument("--quick", action="store_true", help="three widths")
    p.add_argument("--name", default="shard_fit", help="results file name (benchmarks/results/NAME.json)")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.widths = [768, 1536, 3072]
    check_parameter_count()
    start = time.monotonic()
    results = {strategy: search(args, strategy) for strategy in ("dp", "optimal")}
    data = {"benchmark": "shard_fit", "argv": sys.argv[1:], "machine": machine(), "settings": {
        k: v for k, v in vars(args).items() if k not in ("out_dir", "name")}, "results": results,
        "seconds": round(time.monotonic() - start, 1)}
    json_path, png_path = result_paths(args.name, args.quick, args.out_dir)
    write_results(json_path, data, figure(results, args), png_path)
    for strategy, res in results.items():
        print(f"--strategy {strategy}:")
        for shard in LEVELS:
            b, plan = res[shard]["best"], res[shard]["plan"]
            shape = "-" if plan is None else f"{plan['stages']} stages x {plan['replicas']} {plan['shard']}"
            print(f"  {shard:10s} {b['params'] / 1e6:8.1f} M params ({b['layers']} layers x {b['width']}), "
                  f"{res[shard]['vs_none']}x none; plan: {shape}")
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
