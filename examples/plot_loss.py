"""Plot a run's training and held-out loss (launch's metrics) as a PNG.

    python examples/plot_loss.py RUN_DIR -o loss.png

Reads ``RUN_DIR/metrics/rank-*.jsonl``: the training loss of the last stage's ranks (mean over
them per step) and the held-out ``eval_loss`` (every rank has it; rank 0's is used).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hybridpipe.runtime.metrics import read_metrics  # noqa: E402


def curves(run_dir: Path) -> tuple[dict[int, float], dict[int, float]]:
    """(step -> training loss, step -> held-out loss) of a run."""
    train: dict[int, list[float]] = defaultdict(list)
    held: dict[int, float] = {}
    for path in sorted((run_dir / "metrics").glob("rank-*.jsonl")):
        for r in read_metrics(path):
            if "loss" in r:
                train[r["step"]].append(r["loss"])
            if "eval_loss" in r and path.name == "rank-00000.jsonl":
                held[r["step"]] = r["eval_loss"]
    return {k: sum(v) / len(v) for k, v in sorted(train.items())}, held


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    train, held = curves(args.run_dir)
    if not train:
        print(f"no training loss in {args.run_dir}/metrics", file=sys.stderr)
        return 2
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([k + 1 for k in train], list(train.values()), lw=1, alpha=0.6, label="training loss (per step)")
    if held:
        ax.plot([k + 1 for k in held], list(held.values()), "o-", label="held-out loss")
    ax.set_xlabel("steps done")
    ax.set_ylabel("loss (nats per byte)" if "vocab=256" in args.title else "loss")
    ax.set_title(args.title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
