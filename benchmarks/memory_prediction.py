"""Memory predicted vs measured per stage on Hugging Face models (issue 28 item 9).

    python benchmarks/memory_prediction.py                      # every family x 1f1b/zb-h1/zbv x sgd/adam
    python benchmarks/memory_prediction.py --families gpt2-tied,mistral --quick   # 1f1b + sgd only

For each family of tests/pipeline/memory_matrix.py (tiny configs: GPT-2 with tied embeddings,
Mistral, DistilBERT MLM, BART, an HF ResNet and ConvNeXt) on 4 stages, the partitioner's
per-stage prediction (``stagememory.memory_bytes`` from a fresh profile) next to the engine's
``MemoryMeter`` peak in an in-process pipeline (threads; on the CPU the bytes of the tensors a
stage holds). Results: ``benchmarks/results/memory_prediction[_quick].json`` and ``.png`` (the
measured / predicted ratio per stage).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, pyplot, result_paths, setup_logging, write_results  # noqa: E402
from tests.pipeline.memory_matrix import FAMILIES, measure  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    ap.add_argument("--quick", action="store_true", help="1f1b and sgd only")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    setup_logging()
    schedules, optimizers = (("1f1b",), ("sgd",)) if args.quick else (("1f1b", "zb-h1", "zbv"), ("sgd", "adam"))
    rows = []
    for family in args.families.split(","):
        for schedule in schedules:
            for optimizer in optimizers:
                for r in measure(family, schedule, optimizer):
                    rows.append({"family": family, "schedule": schedule, "optimizer": optimizer, "stage": r.stage,
                                 "nodes": r.nodes, "measured_bytes": r.measured, "predicted_bytes": r.predicted,
                                 "ratio": r.ratio})
                    print(f"{family:15s} {schedule:6s} {optimizer:5s} stage {r.stage}: measured {r.measured:>9d} "
                          f"predicted {r.predicted:>11.0f} ratio {r.ratio:.3f}", flush=True)
    json_path, png_path = result_paths("memory_prediction", args.quick, args.out_dir)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(range(len(rows)), [r["ratio"] for r in rows])
    ax.axhline(1.05, color="red", linestyle="--", linewidth=0.8)
    ax.axhline(0.95, color="red", linestyle="--", linewidth=0.8)
    ax.set_ylabel("measured / predicted")
    ax.set_xticks(range(len(rows)), [f"{r['family']} {r['schedule']} {r['optimizer']} s{r['stage']}" for r in rows],
                  rotation=90, fontsize=6)
    write_results(json_path, {"machine": machine(), "rows": rows}, fig, png_path)


if __name__ == "__main__":
    main()
