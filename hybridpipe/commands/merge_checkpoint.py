"""``hybridpipe merge-checkpoint DIR [--step N] -o model.pt``: one state_dict from a run's stages.

DIR is the run's ``--checkpoint-dir`` (the newest complete checkpoint is used, or ``--step N``)
or one ``step-N`` directory. The output is an ordinary ``torch.save``d state_dict with the
model's own keys: ``model.load_state_dict(torch.load("model.pt"), strict=True)`` works on the
unsplit model. Before writing, the keys and shapes are checked against the model the run
trained (built on the meta device, so no memory is spent); ``--no-check`` skips that for a
model that cannot be rebuilt here.

``--with-optimizer`` writes ``{"model": state_dict, "optimizer": {"state": {name: ...},
"param_groups": [...]}, "step": N}`` instead: the optimizer state keyed by parameter names
(SGD momentum, Adam moments and step counts), which ``launch --init-from`` puts into any plan.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hybridpipe.argtypes import nonneg_int, output_file
from hybridpipe.commands.show import human_bytes
from hybridpipe.errors import UserError
from hybridpipe.runtime.checkpoint_files import atomic_save, resolve_step
from hybridpipe.runtime.merged import merge_optimizer, merge_stages


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", help="the run's --checkpoint-dir, or one of its step-N directories")
    parser.add_argument("--step", type=nonneg_int, default=None, help="which step (default: the newest complete one)")
    parser.add_argument("-o", "--output", type=output_file, required=True,
                        help="the merged state_dict to write (e.g. model.pt)")
    parser.add_argument("--with-optimizer", action="store_true",
                        help="also write the optimizer state, keyed by parameter names: the file is then "
                             "{\"model\": state_dict, \"optimizer\": ..., \"step\": N} (for launch --init-from)")
    parser.add_argument("--no-check", action="store_true",
                        help="do not check the keys and shapes against the model named in the checkpoint")


def run(args: argparse.Namespace) -> int:
    root, step = resolve_step(args.checkpoint_dir, args.step)
    state, manifest = merge_stages(root, step)
    if not args.no_check:
        check_against_model(state, manifest["model"])
    out = Path(args.output)
    atomic_save({"model": state, "optimizer": merge_optimizer(root, step), "step": step}
                if args.with_optimizer else state, out)
    size = sum(t.numel() * t.element_size() for t in state.values())
    print(f"merged step {step} of {manifest['model']} ({manifest['n_stages']} stages, {len(state)} tensors, "
          f"{human_bytes(size)}) into {out}")
    if args.with_optimizer:
        print("  with the optimizer state (by parameter name) under \"optimizer\", the weights under \"model\"; "
              "start a run from it with launch --init-from")
    elif not args.no_check:
        print(f"  its keys and shapes match {manifest['model']}: load it with "
              "model.load_state_dict(torch.load(path), strict=True)")
    return 0


def check_against_model(state: dict[str, torch.Tensor], spec: str) -> None:
    """UserError unless ``state`` has exactly the keys and shapes of the model ``spec`` builds."""
    from hybridpipe.profiles.zoo import resolve_model

    try:
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in resolve_model(spec).build().state_dict().items()}
    except UserError:
        raise
    except Exception as e:      # noqa: BLE001 - a user's factory that cannot build on the meta device
        raise UserError(f"cannot rebuild {spec} here to check the merged keys ({type(e).__name__}: {e}); "
                        "pass --no-check to write the merged state_dict without the check") from None
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
