"""Peak resident memory per rank loading a Hugging Face model saved with save_pretrained (``hf:DIR``),
read lazily (each rank its own stage's tensors) vs whole (every rank loads the whole model).

    python benchmarks/hf_load_memory.py                      # GPT-2, 16 layers x 1024: 254M params, 1.02 GB
    python benchmarks/hf_load_memory.py --layers 4 --width 512 --quick

The driver saves a GPT-2 with random weights (``save_pretrained``, fp32) into ``--dir`` (kept for
reuse), cuts it into ``--stages`` stages of about equal parameter bytes (a plan written directly,
without profiling), and runs ``torchrun --nproc-per-node STAGES`` of this script three times:
``lazy`` (``Trainer("hf:DIR", plan)``, hybridpipe's path), ``whole`` (the same spec with its
weights loaded by ``from_pretrained`` on every rank, as before issue 28: transformers 5 memory-maps
the file, so a rank holds the pages it touches) and ``whole-read`` (``from_pretrained(...,
disable_mmap=True)``: the file read into memory, as transformers does on FUSE mounts such as
hf-mount and as transformers 4 did). Each rank reports its resident
memory after its imports (``baseline``: torch, transformers, hybridpipe), its peak (``VmHWM`` of
/proc/self/status) once the Trainer is built (model loaded, stage built, process groups, p2p
channels), the bytes of its stage's tensors, and the peak after one SGD step (micro-batch 1, 32
tokens, 4 micro-batches). Results: ``benchmarks/results/hf_load_memory[_quick].json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


MODES = ("lazy", "whole", "whole-read")


def status_kib(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rank_main(mode: str, plan_path: str, out: str) -> None:
    """One rank under torchrun: build the Trainer (lazy or whole), measure, one step, measure."""
    baseline = status_kib("VmRSS")
    import torch

    from hybridpipe.partitioner.plan import load_plan
    from hybridpipe.pipeline import MicroBatches
    from hybridpipe.profiles.data import resolve_dataset
    from hybridpipe.profiles.zoo import resolve_model
    from hybridpipe.runtime.trainer import Trainer

    torch.set_num_threads(1)
    plan = load_plan(plan_path)
    spec = resolve_model(plan.model)
    imported = status_kib("VmRSS")
    if mode != "lazy":                                          # from_pretrained on every rank
        build = spec.build
        if mode == "whole-read":
            import transformers

            directory = plan.model[len("hf:"):].partition("[")[0]

            def build() -> torch.nn.Module:
                return transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True,
                                                                          disable_mmap=True)
        spec = dataclasses.replace(spec, weights=None, build=build)
    data = MicroBatches(resolve_dataset("synthetic", spec, size=plan.micro_batches * plan.batch_size, seed=0),
                        plan.batch_size, plan.micro_batches, targets=spec.loss is not None)
    trainer = Trainer(spec, plan, optimizer="sgd", lr=1e-3, momentum=0.0, backend="gloo", timeout=600, data=data)
    built, mapped = status_kib("VmHWM"), status_kib("VmSize")
    held = sum(t.numel() * t.element_size() for t in [*trainer.module.parameters(), *trainer.module.buffers()])
    meta = sum(p.numel() * p.element_size() for p in trainer.model.module.parameters() if p.device.type == "meta")
    trainer.train_step()
    stepped = status_kib("VmHWM")
    rank = trainer.proc.rank
    trainer.close()
    Path(out, f"{mode}-{rank}.json").write_text(json.dumps({
        "rank": rank, "mode": mode, "rss_at_start_kib": baseline, "rss_after_imports_kib": imported,
        "peak_after_load_kib": built, "virtual_after_load_kib": mapped, "peak_after_step_kib": stepped,
        "stage_bytes": held, "never_read_bytes": meta}))


def save_model(directory: Path, layers: int, width: int, vocab: int) -> dict:
    """A GPT-2 with random weights, saved as a pretrained model is (reused when already there)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=vocab,
                                     n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if not (directory / "config.json").is_file():
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    files = [p for p in directory.iterdir() if p.suffix == ".safetensors"]
    return {"layers": layers, "width": width, "vocab": vocab, "file_bytes": sum(p.stat().st_size for p in files)}


def balanced_plan(spec_name: str, stages: int, micro_batches: int, precision: str = "fp32"):
    """A plan of ``stages`` stages of about equal parameter bytes (contiguous blocks, no replicas),
    for the graph every rank captures in ``precision`` (its signature, its tied weights)."""
    import torch

    from hybridpipe.partitioner.cost.cluster import Cluster, Level
    from hybridpipe.partitioner.plan import Plan, Stage, TiedGroup
    from hybridpipe.partitioner.tied import shared_across
    from hybridpipe.pipeline.stage import captured_signature
    from hybridpipe.profiles.capture import tied_parameters
    from hybridpipe.profiles.graphinfo import node_infos
    from hybridpipe.profiles.meta import capture_on_meta, parameters_on_meta
    from hybridpipe.profiles.zoo import resolve_model
    from hybridpipe.runtime.parts import PRECISIONS

    spec = resolve_model(spec_name)
    with parameters_on_meta():
        model = (spec.skeleton or spec.build)()
    captured = capture_on_meta(model, spec.example_input(1, torch.Generator().manual_seed(0)),
                               leaf_modules=spec.leaf_modules, autocast=PRECISIONS[precision])
    infos = node_infos(captured)
    sizes = [sum(model.get_parameter(p).numel() for p in i.params) for i in infos]
    total, cuts, acc = sum(sizes), [], 0
    for node, size in enumerate(sizes[:-1]):
        acc += size
        if len(cuts) < stages - 1 and acc >= total * (len(cuts) + 1) / stages:
            cuts.append(node)
    bounds = [-1, *cuts, len(sizes) - 1]
    plan_stages = tuple(Stage(index=s, first_node=bounds[s] + 1, last_node=bounds[s + 1], replicas=1, ranks=(s,))
                        for s in range(len(bounds) - 1))
    ranges = [(s.first_node, s.last_node) for s in plan_stages]
    tied = shared_across([i.params for i in infos], [i.shared for i in infos], tied_parameters(model), ranges)
    return Plan(model=spec_name, batch_size=1, input_shape=(1,), profile_signature=captured_signature(captured),
                cluster=Cluster((Level("node", len(plan_stages), 100.0),), 64.0), strategy="params",
                schedule="1f1b", micro_batches=micro_batches, optimizer="sgd", stages=plan_stages, precision=precision,
                tied=tuple(TiedGroup(p, s, 0) for p, s in tied))


def run_mode(mode: str, plan_path: Path, stages: int, work: Path, timeout: float, script: str = __file__) -> list[dict]:
    """``torchrun --nproc-per-node STAGES script --rank-mode MODE``: each rank's JSON report."""
    out = work / mode
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(stages),
           script, "--rank-mode", mode, "--plan", str(plan_path), "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "[rank0]" in line or "error" in line.lower()]
        raise SystemExit(f"{mode} run failed ({done.returncode}):\n{done.stdout[-3000:]}\n" + "\n".join(errors[-40:]))
    return sorted((json.loads(p.read_text()) for p in out.glob("*.json")), key=lambda r: r["rank"])


def plot(rows: list[dict], model: dict, stages: int):
    """Per rank, each mode's peak once loaded and after one step, with its stage's bytes above the imports."""
    from benchmarks.common import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    xs = range(len(rows))
    for ax, key, title in zip(axes, ("peak", "step_peak"), ("once loaded", "after one training step"), strict=True):
        for k, mode in enumerate(MODES):
            ax.bar([x + (k - 1) * 0.27 for x in xs], [r[f"{mode}_{key}_mib"] for r in rows], 0.27, label=mode)
        ax.plot([x - 0.27 for x in xs], [r["baseline_mib"] + r["stage_mib"] for r in rows], "k_", markersize=14,
                label="after imports + the stage's bytes")
        ax.set_xticks(list(xs), [f"rank {r['rank']}" for r in rows])
        ax.set_title(title)
    axes[0].set_ylabel("peak resident memory (MiB)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=9)
    fig.suptitle(f"hf:DIR, {model['file_bytes'] / 1e9:.2f} GB of safetensors, {stages} stages")
    fig.subplots_adjust(bottom=0.2)
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where the saved model lives (default /tmp/hybridpipe-hf-LxW)")
    ap.add_argument("--quick", action="store_true", help="write the _quick result files")
    ap.add_argument("--out-dir", default=None, help="where the results go (default benchmarks/results)")
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--rank-mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_mode:
        rank_main(args.rank_mode, args.plan, args.out)
        return

    from benchmarks.common import machine, result_paths, write_results
    from hybridpipe.partitioner.plan import save_plan

    directory = Path(args.dir or f"/tmp/hybridpipe-hf-{args.layers}x{args.width}")
    model = save_model(directory, args.layers, args.width, args.vocab)
    spec = f"hf:{directory}[seq=32]"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        plan = balanced_plan(spec, args.stages, micro_batches=4)
        save_plan(plan, work / "plan.json")
        runs = {mode: run_mode(mode, work / "plan.json", args.stages, work, args.timeout) for mode in MODES}
    mib = 1 / 1024
    rows = []
    for per_mode in zip(*(runs[m] for m in MODES), strict=True):
        first = per_mode[0]
        row = {"rank": first["rank"], "stage_mib": first["stage_bytes"] / 2**20,
               "baseline_mib": first["rss_after_imports_kib"] * mib}
        for mode, r in zip(MODES, per_mode, strict=True):
            row[f"{mode}_peak_mib"] = r["peak_after_load_kib"] * mib
            row[f"{mode}_over_baseline_mib"] = (r["peak_after_load_kib"] - r["rss_after_imports_kib"]) * mib
            row[f"{mode}_step_peak_mib"] = r["peak_after_step_kib"] * mib
            row[f"{mode}_virtual_mib"] = r["virtual_after_load_kib"] * mib
        rows.append(row)
    data = {"model": {**model, "spec": spec, "file_mib": model["file_bytes"] / 2**20}, "stages": args.stages,
            "plan": [(s.first_node, s.last_node) for s in plan.stages], "ranks": rows, "raw": runs,
            "machine": machine(),
            "command": "python benchmarks/hf_load_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(f"{spec}: {model['file_bytes'] / 2**20:.0f} MiB of safetensors, {args.stages} stages; MiB per rank:")
    print("rank  stage  after imports  | peak after load: lazy  whole  whole-read | after 1 step: lazy  whole  "
          "whole-read | mapped: lazy  whole")
    for r in rows:
        print(f"{r['rank']:4d}  {r['stage_mib']:5.0f}  {r['baseline_mib']:13.0f}  | "
              + "".join(f"{r[f'{m}_peak_mib']:{w}.0f}" for m, w in zip(MODES, (22, 7, 12), strict=True))
              + " | " + "".join(f"{r[f'{m}_step_peak_mib']:{w}.0f}" for m, w in zip(MODES, (18, 7, 12), strict=True))
              + f" | {r['lazy_virtual_mib']:12.0f} {r['whole_virtual_mib']:6.0f}")
    fig = plot(rows, model, args.stages)
    json_path, png_path = result_paths("hf_load_memory", args.quick, args.out_dir)
    write_results(json_path, data, fig, png_path)
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
