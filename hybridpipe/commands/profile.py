"""``hybridpipe profile MODEL``: capture a model and measure every node; write a Profile (JSON).

Before any timing, the model is built on the meta device (its parameter bytes, free) and run
on one real sample (its activation bytes per sample, and whether the input fits it at all), so a
batch or a model this machine cannot hold is refused in a second with what it would need.
"""

from __future__ import annotations

import argparse
import re

import torch

from hybridpipe.argtypes import check_output_file, int_range, output_file, positive_int, seed
from hybridpipe.errors import UserError
from hybridpipe.limits import available_memory_bytes, require_memory
from hybridpipe.pipeline.splitback import backward_input
from hybridpipe.profiles.blocks import parse_granularity
from hybridpipe.profiles.capture import call_args, training_switches
from hybridpipe.profiles.format import inconsistent_times, save_profile
from hybridpipe.profiles.profiler import profile_model, resolve_device
from hybridpipe.profiles.zoo.registry import resolve_model, with_leaves, zoo_names
from hybridpipe.profiles.zoo.spec import ModelSpec, call_user, describe_model

MAX_RUNS = 10_000           # runs of every node: more measures nothing new and takes hours


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help=f"a zoo model ({', '.join(zoo_names())}), a Hugging Face model "
                        "(hf:gpt2[n_layer=4,...], hf:/path/to/checkpoint) or your own package.module:factory, "
                        "optionally with [key=value,...]")
    parser.add_argument("-b", "--batch-size", type=positive_int, default=32,
                        help="samples per (micro-)batch (default 32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    parser.add_argument("--repeats", type=int_range(1, MAX_RUNS), default=5,
                        help=f"timed runs per node; the median is kept (default 5, at most {MAX_RUNS})")
    parser.add_argument("--warmup", type=int_range(0, MAX_RUNS), default=1,
                        help=f"untimed runs before the timed ones (default 1, at most {MAX_RUNS})")
    parser.add_argument("--granularity", default="blocks", metavar="G",
                        help="what a node is: blocks (default: the model's repeated layers and what sits between "
                        "them), modules (every leaf module), ops (every operation) or a module depth 1, 2, ...")
    parser.add_argument("--leaf", action="append", default=[], metavar="CLASS",
                        help="keep modules of this class whole: each call is one opaque node that runs the "
                        "module as written (data-dependent routing, .item(), loops, custom autograd Functions); "
                        "repeat or separate with commas; recorded in the profile's model spec")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="what the job will compute in (launch --precision): bf16/fp16 capture and measure "
                        "under torch.autocast, so activation and transient bytes are the mixed-precision job's "
                        "(default fp32)")
    parser.add_argument("--threads", type=int_range(1, 4096), default=None, metavar="N",
                        help="intra-op CPU threads to measure with (default: torch's, which honours OMP_NUM_THREADS); "
                        "measure with what each worker will compute with: torchrun gives each of several workers "
                        "on a host 1")
    parser.add_argument("--seed", type=seed, default=0, help="seed for the weights and the example batch")
    parser.add_argument("-o", "--output", type=output_file,
                        help="profile file to write (default: MODEL.json in the current folder)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    granularity = parse_granularity(args.granularity)      # a UserError (one line, exit 2) if unknown
    leaves = [x.strip() for item in args.leaf for x in item.split(",") if x.strip()]
    spec = with_leaves(args.model, leaves)
    output = check_output_file(args.output or default_output(args.model), "profile")
    device = resolve_device(args.device)
    model = resolve_model(spec)
    check_fits(model, args.batch_size, device)
    profile = profile_model(model, batch_size=args.batch_size, device=device, repeats=args.repeats,
                            warmup=args.warmup, seed=args.seed, progress=False if args.quiet else None,
                            granularity=granularity, precision=args.precision, split_backward=backward_input,
                            threads=args.threads)
    path = save_profile(profile, output)
    t = profile.totals
    print(f"profiled {profile.model}: {len(profile.nodes)} nodes ({profile.granularity}), {len(profile.edges)} edges, "
          f"{t.param_count:,} parameters ({t.param_bytes / 2**20:.1f} MiB), batch {profile.batch_size} "
          f"on {profile.device}")
    print(f"per-node sums: forward {t.forward_ms:.2f} ms + backward {t.backward_ms:.2f} ms = "
          f"{t.forward_ms + t.backward_ms:.2f} ms; one full forward+backward {t.measured_ms:.2f} ms "
          f"(ratio {t.ratio:.2f}; {profile.threads} intra-op thread{'s' if profile.threads > 1 else ''})")
    busy = inconsistent_times(t.ratio, profile.threads)
    if busy:
        print(f"note: {busy}")
    print(f"one optimizer step over all parameters: sgd {t.sgd_step_ms:.2f} ms, adam {t.adam_step_ms:.2f} ms")
    print(f"wrote {path}; `hybridpipe show {path}` prints every node")
    return 0


def default_output(model: str) -> str:
    """``MODEL.json`` with the spec's punctuation made file-name safe."""
    return re.sub(r"[^\w.\-]+", "_", model).strip("_") + ".json"


def footprint(model: ModelSpec) -> tuple[int, int, int]:
    """(parameter bytes, activation bytes per sample, input bytes per sample) of ``model``.

    Parameters are counted on the meta device (nothing allocated); activations are the outputs
    of every leaf module in one forward of one real sample (eval mode, no gradients), which
    also proves that the model takes its input."""
    who = describe_model(model.name)
    try:
        with torch.device("meta"):
            meta = call_user(who, model.build)
    except UserError:
        if who.startswith("zoo"):
            raise
        meta = None             # a user's factory that cannot build on the meta device: built for real below
    sample = model.example_input(1)
    per_sample = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(sample)
                     if isinstance(t, torch.Tensor))
    if meta is not None:
        params = sum(p.numel() * p.element_size() for p in meta.parameters())
        n_params = sum(p.numel() for p in meta.parameters())
        require_memory(params, f"building {model.name} ({n_params:,} parameters)", "choose smaller model options")
    torch.manual_seed(0)
    module = call_user(who, model.build).eval()
    total = [0]

    def count(_module, _inputs, output) -> None:
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor):
                total[0] += t.numel() * t.element_size()

    leaves = [m for m in module.modules() if not any(True for _ in m.children())] or [module]
    hooks = [m.register_forward_hook(count) for m in leaves]
    try:
        args, kwargs = call_args(sample)
        with torch.no_grad():
            call_user(f"{who} (one sample of its input)", module, *args, **kwargs, **training_switches(module))
    finally:
        for h in hooks:
            h.remove()
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return params, total[0], per_sample


def check_fits(model: ModelSpec, batch_size: int, device: torch.device) -> None:
    """UserError before any timing unless the profile of ``model`` at ``batch_size`` fits here:
    weights, gradients and two optimizer states, plus each sample's input and activations kept
    for the backward and their gradients."""
    params, activations, inputs = footprint(model)
    need = 4 * params + batch_size * (inputs + 3 * activations)
    if device.type == "cuda":
        room = torch.cuda.mem_get_info(device)[0]
    else:
        room = available_memory_bytes()
    require_memory(need, f"profiling {model.name} at batch {batch_size} on {device.type} "
                   f"({params / 2**20:.1f} MiB of parameters, {activations / 2**20:.1f} MiB of activations per sample)",
                   "lower --batch-size or choose smaller model options", available=room)

