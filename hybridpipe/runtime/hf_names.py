"""The names a Hugging Face model's tensors have in its ``save_pretrained`` files.

transformers 5 renames some models' weights between the files and the module: Swin's
``attention.q_proj.weight`` is ``attention.self.query.weight`` on disk, and ``from_pretrained``
and ``save_pretrained`` translate (transformers' conversion mapping). Reading a directory by the
module's names therefore misses those tensors. :func:`file_names` asks transformers for the
translation ``save_pretrained`` applies and keeps the one-to-one renames: a tensor that a
converter merges or splits (Mixtral's per-expert files into one stacked tensor) has no single
file name and stays absent, so a reader that needs it still reports it missing.
"""

from __future__ import annotations

from torch import nn


def file_names(module: nn.Module) -> dict[str, str]:
    """Each saved tensor of ``module`` whose name in its ``save_pretrained`` files differs from its
    ``state_dict`` name -> that file name (empty for any other module, or without transformers)."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return {}
    if not isinstance(module, PreTrainedModel):
        return {}
    state = {name: t.detach() for name, t in module.state_dict(keep_vars=True).items()}  # one object a name
    name_of = {id(t): name for name, t in state.items()}
    renamed = {}
    for key, tensor in revert_weight_conversion(module, dict(state)).items():   # what save_pretrained writes
        name = name_of.get(id(tensor))          # a renamed tensor is passed on as it is; a converted one is new
        if name is not None and name != key:
            renamed[name] = key
    return renamed
