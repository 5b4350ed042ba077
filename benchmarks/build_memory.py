"""Peak resident memory per rank building a randomly initialised model on a pipeline: each rank
building only its own stage (hybridpipe's path: the model on the meta device, the stage's
parameters replayed from the seed, runtime/seeded.py) vs every rank building the whole model.

    python benchmarks/build_memory.py                        # zoo GPT, 16 layers x 1024: 304M params, 1.22 GB
    python benchmarks/build_memory.py --layers 2 --width 256 --quick
    python benchmarks/build_memory.py --precision bf16       # a bf16 plan: the capture under autocast

A plan of ``--stages`` stages of about equal parameter bytes (written directly, without profiling)
runs under ``torchrun --nproc-per-node STAGES`` twice: ``stage`` (``Trainer(spec, plan)``) and
``whole`` (``build_model(..., whole=True)``: every rank builds and captures the whole model on the
CPU, as before). Each rank reports its resident memory after its imports, its peak (``VmHWM``) once
the Trainer is built (model built, stage built, process groups, p2p channels), its stage's bytes,
and the peak after one SGD step (micro-batch 1, ``seq`` tokens, 4 micro-batches); the driver
checks that both runs give every rank's stage the same parameters (a SHA-256 of each). Results:
``benchmarks/results/build_memory[_quick].json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hf_load_memory import balanced_plan, status_kib  # noqa: E402

MODES = ("stage", "whole")


def rank_main(mode: str, plan_path: str, out: str) -> None:
    """One rank under torchrun: build the Trainer (its stage only, or the whole model), measure, one step."""
    baseline = status_kib("VmRSS")
    import torch

    from hybridpipe.partitioner.plan import load_plan
    from hybridpipe.pipeline import MicroBatches
    from hybridpipe.profiles.data import resolve_dataset
    from hybridpipe.profiles.zoo import resolve_model
    from hybridpipe.runtime.parts import PRECISIONS, build_model
    from hybridpipe.runtime.trainer import Trainer

    torch.set_num_threads(1)
    plan = load_plan(plan_path)
    spec = resolve_model(plan.model)
    imported = status_kib("VmRSS")
    model = build_model(spec, plan, seed=0, whole=mode == "whole", autocast=PRECISIONS[plan.precision])
    data = MicroBatches(resolve_dataset("synthetic", spec, size=plan.micro_batches * plan.batch_size, seed=0),
                        plan.batch_size, plan.micro_batches, targets=spec.loss is not None)
    trainer = Trainer(model, plan, optimizer="sgd", lr=1e-3, momentum=0.0, backend="gloo", timeout=900, data=data,
                      seed=0)
    built = status_kib("VmHWM")
    held = sum(t.numel() * t.element_size() for t in [*trainer.module.parameters(), *trainer.module.buffers()])
    meta = sum(p.numel() * p.element_size() for p in trainer.model.module.parameters() if p.device.type == "meta")
    digest = {n: hashlib.sha256(p.detach().contiguous().numpy()).hexdigest()
              for n, p in trainer.module.named_parameters()}
    trainer.train_step()
    stepped = status_kib("VmHWM")
    rank = trainer.proc.rank
    trainer.close()
    Path(out, f"{mode}-{rank}.json").write_text(json.dumps({
        "rank": rank, "mode": mode, "rss_at_start_kib": baseline, "rss_after_imports_kib": imported,
        "peak_after_build_kib": built, "peak_after_step_kib": stepped, "stage_bytes": held,
        "never_built_bytes": meta, "sums": digest}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="the plan's precision (bf16: captured and run under autocast)")
    ap.add_argument("--quick", action="store_true", help="write the _quick result files")
    ap.add_argument("--out-dir", default=None, help="where the results go (default benchmarks/results)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--rank-mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_mode:
        rank_main(args.rank_mode, args.plan, args.out)
        return

    from benchmarks.common import machine, result_paths, write_results
    from benchmarks.hf_load_memory import run_mode
    from hybridpipe.partitioner.plan import save_plan

    spec = (f"gpt[layers={args.layers},width={args.width},heads={max(1, args.width // 64)},seq={args.seq},"
            f"vocab={args.vocab}]")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        plan = balanced_plan(spec, args.stages, micro_batches=4, precision=args.precision)
        save_plan(plan, work / "plan.json")
        runs = {mode: run_mode(mode, work / "plan.json", len(plan.stages), work, args.timeout, script=__file__)
                for mode in MODES}
    mib = 1 / 1024
    rows = []
    for stage, whole in zip(runs["stage"], runs["whole"], strict=True):
        assert stage["sums"] == whole["sums"], f"rank {stage['rank']}: the stage's parameters differ"
        rows.append({"rank": stage["rank"], "stage_mib": stage["stage_bytes"] / 2**20,
                     "baseline_mib": stage["rss_after_imports_kib"] * mib,
                     **{f"{m}_{k}_mib": r[f"{key}_kib"] * mib for m, r in (("stage", stage), ("whole", whole))
                        for k, key in (("peak", "peak_after_build"), ("step_peak", "peak_after_step"))},
                     "stage_over_stage_bytes_mib": stage["peak_after_build_kib"] * mib - stage["stage_bytes"] / 2**20})
    total = runs["stage"][0]["stage_bytes"] + runs["stage"][0]["never_built_bytes"]
    data = {"model": {"spec": spec, "parameter_bytes": total}, "stages": len(plan.stages), "precision": args.precision,
            "plan": [(s.first_node, s.last_node) for s in plan.stages], "ranks": rows,
            "raw": {m: [{k: v for k, v in r.items() if k != "sums"} for r in rs] for m, rs in runs.items()},
            "machine": machine(),
            "command": "python benchmarks/build_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(f"{spec}: {total / 2**20:.0f} MiB of parameters, {len(plan.stages)} stages; MiB per rank:")
    print("rank  stage  after imports | peak once built: stage-only  whole | after 1 step: stage-only  whole")
    for r in rows:
        print(f"{r['rank']:4d}  {r['stage_mib']:5.0f}  {r['baseline_mib']:13.0f} | {r['stage_peak_mib']:27.0f} "
              f"{r['whole_peak_mib']:6.0f} | {r['stage_step_peak_mib']:24.0f} {r['whole_step_peak_mib']:6.0f}")
    fig = plot(rows, spec, total, len(plan.stages))
    name = "build_memory" if args.precision == "fp32" else f"build_memory_{args.precision}"
    json_path, png_path = result_paths(name, args.quick, args.out_dir)
    write_results(json_path, data, fig, png_path)
    print(f"wrote {json_path} and {png_path}")


def plot(rows: list[dict], spec: str, total: int, stages: int):
    """Per rank, each mode's peak once built and after one step, with its stage's bytes above the imports."""
    from benchmarks.common import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    xs = range(len(rows))
    for ax, key, title in zip(axes, ("peak", "step_peak"), ("once built", "after one training step"), strict=True):
        for k, mode in enumerate(MODES):
            ax.bar([x + (k - 0.5) * 0.35 for x in xs], [r[f"{mode}_{key}_mib"] for r in rows], 0.35,
                   label={"stage": "each rank builds its stage", "whole": "every rank builds the whole model"}[mode])
        ax.plot([x - 0.175 for x in xs], [r["baseline_mib"] + r["stage_mib"] for r in rows], "k_", markersize=14,
                label="after imports + the stage's bytes")
        ax.set_xticks(list(xs), [f"rank {r['rank']}" for r in rows])
        ax.set_title(title)
    axes[0].set_ylabel("peak resident memory (MiB)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=9)
    fig.suptitle(f"{spec}: {total / 1e9:.2f} GB of parameters (random init), {stages} stages")
    fig.subplots_adjust(bottom=0.2)
    return fig


if __name__ == "__main__":
    main()
