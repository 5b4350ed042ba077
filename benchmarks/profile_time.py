"""How long ``hybridpipe profile`` takes, and whether its per-node numbers add up (issue 13's figure).

For each model: the wall time of ``profile_model`` (capture with torch.export, one reference pass,
every block timed alone, one timed full forward+backward of the model itself, the optimizer
steps), the node count, and ``totals.ratio`` = (sum of the nodes' forward and backward ms) /
(the model's own forward + loss + backward ms): near 1 means the nodes' times add up to what
training costs. One thread, as a pipeline worker runs. Defaults: a 24-block tiny Llama (Hugging
Face, random weights) and the papers' AlexNet at batch 8.

    .venv/bin/python benchmarks/profile_time.py                 # JSON + PNG in benchmarks/results/
    .venv/bin/python benchmarks/profile_time.py --quick         # fewer repeats
    .venv/bin/python benchmarks/profile_time.py --models 'alexnet' --batch-size 32
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.common import machine, pyplot, result_paths, setup_logging, write_results  # noqa: E402
from hybridpipe.profiles.profiler import profile_model  # noqa: E402
from hybridpipe.profiles.zoo import resolve_model  # noqa: E402

LLAMA24 = ("hf:llama[num_hidden_layers=24,hidden_size=128,intermediate_size=256,num_attention_heads=4,"
           "num_key_value_heads=2,vocab_size=2048,seq=64]")
DEFAULT_MODELS = (LLAMA24, "alexnet")


def measure(model: str, batch_size: int, repeats: int) -> dict:
    """Profile ``model`` once; wall seconds, node count, the sums and the ratio."""
    t0 = time.perf_counter()
    profile = profile_model(resolve_model(model), batch_size=batch_size, repeats=repeats, progress=False)
    wall = time.perf_counter() - t0
    t = profile.totals
    return {"model": model, "batch_size": batch_size, "repeats": repeats, "wall_s": round(wall, 2),
            "nodes": len(profile.nodes), "node_names": [n.name for n in profile.nodes][:8],
            "sum_ms": round(t.forward_ms + t.backward_ms, 3), "measured_ms": round(t.measured_ms, 3),
            "ratio": t.ratio, "parameters": t.param_count, "front_end": profile.front_end}


def figure(rows: list[dict]):
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    labels = [r["model"].split("[")[0] + f"\n({r['nodes']} nodes)" for r in rows]
    a.bar(labels, [r["wall_s"] for r in rows], color="#4477aa")
    a.axhline(60, color="grey", ls="--", lw=1)
    a.set_ylabel("profile wall time (s)")
    a.set_title("hybridpipe profile (aim < 60 s)")
    b.bar(labels, [r["ratio"] for r in rows], color="#ee6677")
    for y in (0.9, 1.1):
        b.axhline(y, color="grey", ls="--", lw=1)
    b.set_ylabel("sum of nodes / measured")
    b.set_title("per-node sum vs one fwd+bwd (aim 0.9-1.1)")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated model specs "
                   "(a spec's own commas are kept inside its brackets)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="3 repeats")
    p.add_argument("--out-dir", help="where the JSON and PNG go (default benchmarks/results)")
    args = p.parse_args(argv)
    setup_logging()
    torch.set_num_threads(1)
    models, depth, current = [], 0, ""
    for ch in args.models:            # split on commas outside brackets
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            models.append(current)
            current = ""
        else:
            current += ch
    models.append(current)
    repeats = 3 if args.quick else args.repeats
    rows = []
    for m in filter(None, (x.strip() for x in models)):
        row = measure(m, args.batch_size, repeats)
        rows.append(row)
        print(f"{m}: {row['nodes']} nodes in {row['wall_s']:.1f} s; per-node sum {row['sum_ms']:.1f} ms, "
              f"measured {row['measured_ms']:.1f} ms, ratio {row['ratio']:.3f}", flush=True)
    json_path, png_path = result_paths("profile_time", args.quick, args.out_dir)
    write_results(json_path, {"benchmark": "profile_time", "machine": machine(), "rows": rows,
                              "command": "python benchmarks/profile_time.py" + (" --quick" if args.quick else "")},
                  figure(rows), png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
