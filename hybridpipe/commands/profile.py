"""``hybridpipe profile MODEL``: capture a model and measure every node; write a Profile (JSON)."""

from __future__ import annotations

import argparse
import re

from hybridpipe.profiles.blocks import parse_granularity
from hybridpipe.profiles.format import save_profile
from hybridpipe.profiles.profiler import profile_model
from hybridpipe.profiles.zoo.registry import resolve_model, with_leaves, zoo_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help=f"a zoo model ({', '.join(zoo_names())}), a Hugging Face model "
                        "(hf:gpt2[n_layer=4,...], hf:/path/to/checkpoint) or your own package.module:factory, "
                        "optionally with [key=value,...]")
    parser.add_argument("-b", "--batch-size", type=int, default=32, help="samples per (micro-)batch (default 32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per node; the median is kept (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed ones (default 1)")
    parser.add_argument("--granularity", default="blocks", metavar="G",
                        help="what a node is: blocks (default: the model's repeated layers and what sits between "
                        "them), modules (every leaf module), ops (every operation) or a module depth 1, 2, ...")
    parser.add_argument("--leaf", action="append", default=[], metavar="CLASS",
                        help="never split modules of this class into several nodes; repeat or separate with "
                        "commas; recorded in the profile's model spec")
    parser.add_argument("--seed", type=int, default=0, help="seed for the weights and the example batch")
    parser.add_argument("-o", "--output", help="profile file to write (default: MODEL.json in the current folder)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    granularity = parse_granularity(args.granularity)      # a UserError (one line, exit 2) if unknown
    leaves = [x.strip() for item in args.leaf for x in item.split(",") if x.strip()]
    spec = with_leaves(args.model, leaves)
    model = resolve_model(spec)
    profile = profile_model(model, batch_size=args.batch_size, device=args.device, repeats=args.repeats,
                            warmup=args.warmup, seed=args.seed, progress=False if args.quiet else None,
                            granularity=granularity)
    path = save_profile(profile, args.output or default_output(args.model))
    t = profile.totals
    print(f"profiled {profile.model}: {len(profile.nodes)} nodes ({profile.granularity}), {len(profile.edges)} edges, "
          f"{t.param_count:,} parameters ({t.param_bytes / 2**20:.1f} MiB), batch {profile.batch_size} "
          f"on {profile.device}")
    print(f"per-node sums: forward {t.forward_ms:.2f} ms + backward {t.backward_ms:.2f} ms = "
          f"{t.forward_ms + t.backward_ms:.2f} ms; one full forward+backward {t.measured_ms:.2f} ms "
          f"(ratio {t.ratio:.2f})")
    print(f"one optimizer step over all parameters: sgd {t.sgd_step_ms:.2f} ms, adam {t.adam_step_ms:.2f} ms")
    print(f"wrote {path}; `hybridpipe show {path}` prints every node")
    return 0


def default_output(model: str) -> str:
    """``MODEL.json`` with the spec's punctuation made file-name safe."""
    return re.sub(r"[^\w.\-]+", "_", model).strip("_") + ".json"
