"""``hybridpipe merge-checkpoint DIR [--step N] -o model.pt``: one state_dict from a run's stages.

DIR is the run's ``--checkpoint-dir`` (the newest complete checkpoint is used, or ``--step N``)
or one ``step-N`` directory. The output is an ordinary ``torch.save``d state_dict with the
model's own keys: ``model.load_state_dict(torch.load("model.pt"), strict=True)`` works on the
unsplit model. Before writing, the keys and shapes are checked against the model the run
trained (built with its parameters on the meta device and never run, so no memory is spent);
``--no-check`` skips that for a model that cannot be rebuilt here.

``--format safetensors`` (or an output named ``*.safetensors``) writes the state_dict as one
safetensors file; ``--format hf -o DIR`` writes the directory the model's own ``save_pretrained``
writes (a Hugging Face model: ``AutoModelFor....from_pretrained(DIR)`` loads it; runtime/hf_export.py).

``--with-optimizer`` writes ``{"model": state_dict, "optimizer": {"state": {name: ...},
"param_groups": [...]}, "step": N}`` instead: the optimizer state keyed by parameter names
(SGD momentum, Adam moments and step counts), which ``launch --init-from`` puts into any plan.
"""

from __future__ import annotations

import argparse
import re

import torch

from hybridpipe.argtypes import check_output_dir, check_output_file, nonneg_int, output_path
from hybridpipe.commands.show import human_bytes
from hybridpipe.errors import UserError
from hybridpipe.runtime.checkpoint_files import atomic_save, resolve_step
from hybridpipe.runtime.hf_export import save_hf, save_safetensors
from hybridpipe.runtime.merged import merge_optimizer, merge_stages

FORMATS = ("torch", "safetensors", "hf")
_SIZE = re.compile(r"^[0-9]+(?:[KMG]i?B)?$", re.IGNORECASE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", help="the run's --checkpoint-dir, or one of its step-N directories")
    parser.add_argument("--step", type=nonneg_int, default=None, help="which step (default: the newest complete one)")
    parser.add_argument("-o", "--output", required=True, type=output_path,
                        help="the merged state_dict to write (e.g. model.pt, model.safetensors), or with --format hf "
                             "the directory")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="torch: a torch.save'd state_dict (the default, unless the output ends in .safetensors); "
                             "safetensors: one .safetensors file (a tied weight once); hf: a directory as the model's "
                             "save_pretrained writes it (config.json, model.safetensors or shards with their index, "
                             "generation_config.json), which AutoModelFor...from_pretrained(DIR) loads")
    parser.add_argument("--max-shard-size", type=shard_size, default="5GB", metavar="SIZE",
                        help="--format hf: shard the weights above SIZE (e.g. 500MB; default 5GB), as "
                             "save_pretrained's max_shard_size")
    parser.add_argument("--with-optimizer", action="store_true",
                        help="also write the optimizer state, keyed by parameter names: the file is then "
                             "{\"model\": state_dict, \"optimizer\": ..., \"step\": N} (for launch --init-from)")
    parser.add_argument("--no-check", action="store_true",
                        help="do not check the keys and shapes against the model named in the checkpoint")


def run(args: argparse.Namespace) -> int:
    fmt = args.format or ("safetensors" if str(args.output).endswith(".safetensors") else "torch")
    if args.with_optimizer and fmt != "torch":
        raise UserError(f"--with-optimizer writes a torch file (weights and optimizer state), not --format {fmt}")
    out = check_output_dir(args.output) if fmt == "hf" else check_output_file(args.output)
    root, step = resolve_step(args.checkpoint_dir, args.step)
    state, manifest = merge_stages(root, step)
    if not args.no_check:
        check_against_model(state, manifest["model"])
    if fmt == "hf":
        written = save_hf(state, manifest["model"], out, max_shard_size=args.max_shard_size)
    elif fmt == "safetensors":
        save_safetensors(state, out)
    else:
        atomic_save({"model": state, "optimizer": merge_optimizer(root, step), "step": step}
                    if args.with_optimizer else state, out)
    size = sum(t.numel() * t.element_size() for t in state.values())
    print(f"merged step {step} of {manifest['model']} ({manifest['n_stages']} stages, {len(state)} tensors, "
          f"{human_bytes(size)}) into {out}")
    if fmt == "hf":
        shards = [f for f in written if f.startswith("model-") and f.endswith(".safetensors")]
        files = [f for f in written if f not in shards] + ([f"{len(shards)} shards"] if shards else [])
        print(f"  as save_pretrained writes it ({', '.join(files)}): load it with "
              f"AutoModelFor....from_pretrained({str(out)!r})")
    elif fmt == "safetensors":
        print("  as safetensors (a tied weight once, under its first name): load it with "
              "safetensors.torch.load_model(model, path), or start a run from it with launch --init-from")
    elif args.with_optimizer:
        print("  with the optimizer state (by parameter name) under \"optimizer\", the weights under \"model\"; "
              "start a run from it with launch --init-from")
    elif not args.no_check:
        print(f"  its keys and shapes match {manifest['model']}: load it with "
              "model.load_state_dict(torch.load(path), strict=True)")
    return 0


def shard_size(text: str) -> str:
    """An argparse type: a size as save_pretrained's max_shard_size takes it (500MB, 5GB, 2GiB, bytes)."""
    if not _SIZE.match(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 500MB, 5GB or 2GiB")
    return text.strip()


def check_against_model(state: dict[str, torch.Tensor], spec: str) -> None:
    """UserError unless ``state`` has exactly the keys and shapes of the model ``spec`` builds (built
    with its parameters on the meta device, never run: profiles/zoo/registry.py build_skeleton)."""
    from hybridpipe.profiles.zoo.registry import build_skeleton

    try:
        expected = {k: tuple(v.shape) for k, v in build_skeleton(spec).state_dict().items()}
    except UserError as e:
        raise UserError(f"{e} -- while rebuilding {spec} to check the merged keys and shapes; pass --no-check "
                        "to write the merged state_dict without the check") from None
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k} {tuple(state[k].shape)} vs {expected[k]}" for k in expected
              if k in state and tuple(state[k].shape) != expected[k]]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} key(s): {', '.join(missing[:5])}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} key(s): {', '.join(unexpected[:5])}")
    if shapes:
        problems.append(f"shape mismatch: {'; '.join(shapes[:3])}")
    if problems:
        raise UserError(f"the merged checkpoint does not fit {spec}: {'; '.join(problems)} "
                        "(a stage lost or renamed parameters; pass --no-check to write it anyway)")
