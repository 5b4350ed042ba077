"""A merged state_dict written in other formats (``merge-checkpoint --format``).

* :func:`save_safetensors`: one ``.safetensors`` file of the state_dict (a tied parameter once,
  under its first name, as ``safetensors.torch.save_model`` writes it; ``--init-from`` and
  ``safetensors.torch.load_model`` restore its other names).
* :func:`save_hf`: a directory exactly as the model's own ``save_pretrained`` writes it (config.json,
  generation_config.json where the model has one, model.safetensors, or shards above
  ``max_shard_size`` with model.safetensors.index.json; tied weights as Hugging Face writes them):
  the state_dict is put into the model built with its parameters on the meta device (no copy),
  and transformers' ``save_pretrained`` writes it. Tokenizer files of an ``hf:DIR`` model are
  copied along, so the directory is what ``from_pretrained`` and ``pipeline(...)`` expect.

Both write into a temporary name beside the output and rename it at the end: a killed export
leaves no half-written output.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from hybridpipe.errors import UserError
from hybridpipe.jsonfile import replace_into

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "vocab.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")


def save_safetensors(state: dict[str, torch.Tensor], path: Path) -> int:
    """Write ``state`` to ``path`` as safetensors (tensors that share storage once, under their
    first name); the number of tensors written."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UserError("--format safetensors needs the safetensors package (pip install safetensors)") from None

    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    unique: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape))
        if key in seen and t.numel():
            continue
        seen[key] = name
        unique[name] = t.detach().contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(unique, tmp, metadata={"format": "pt"})
        replace_into(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(unique)


def save_hf(state: dict[str, torch.Tensor], spec: str, out: Path, *, max_shard_size: str | int = "5GB") -> list[str]:
    """Write ``state`` (the whole model's, every name of a tied weight present) as the model ``spec``
    names would ``save_pretrained`` it into directory ``out``; the names of the files written."""
    from hybridpipe.profiles.zoo.registry import build_skeleton

    try:
        import transformers
    except ImportError:
        raise UserError("--format hf needs the transformers package (pip install transformers)") from None
    model = build_skeleton(spec)
    if not isinstance(model, transformers.PreTrainedModel):
        raise UserError(f"--format hf writes Hugging Face models, and {spec} builds a {type(model).__name__}; "
                        "write a torch file or --format safetensors instead")
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise UserError(f"{spec}: {left[0]!r} got no value from the checkpoint; it cannot be written")
    model.eval()
    if out.exists() and not out.is_dir():
        raise UserError(f"cannot write to {out}: it is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise UserError(f"{out} is a directory holding other files; name a new or empty directory (or one written "
                        "by save_pretrained, which is replaced)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        _copy_tokenizer(spec, tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(p.name for p in out.iterdir())


def _copy_tokenizer(spec: str, out: Path) -> None:
    """The tokenizer files of an ``hf:DIR`` model's directory, copied into ``out``."""
    if not spec.startswith("hf:"):
        return
    source = Path(spec[len("hf:"):].partition("[")[0])
    if source.is_dir():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)


def _replace_dir(new: Path, out: Path) -> None:
    """Put directory ``new`` at ``out`` (an existing one is moved aside first, then removed)."""
    aside = None
    if out.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.rename(out, aside / out.name)
    os.rename(new, out)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
