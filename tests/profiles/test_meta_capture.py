"""A model captured without its weights (profiles/meta.py) gives the graph a capture of the whole
model on the CPU gives, in float32 and under bf16 autocast (where the capture runs on fake CPU
tensors: autocast has no meta device), and the model gets its own tensors back."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from hybridpipe.profiles.capture import capture_model
from hybridpipe.profiles.meta import capture_on_meta, parameters_on_meta, replace_tensors
from hybridpipe.profiles.zoo import resolve_model

LLAMA = ("hf:llama[num_hidden_layers=2,hidden_size=32,intermediate_size=64,num_attention_heads=4,"
         "num_key_value_heads=2,vocab_size=128,seq=8]")
GPT2 = "hf:gpt2[n_layer=2,n_embd=32,n_head=2,vocab_size=128,seq=8]"


def captures(name: str, autocast: torch.dtype | None):
    """(the whole model's capture on the CPU, the meta-built model, its capture without weights)."""
    spec = resolve_model(name)
    example = spec.example_input(2, torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    whole = capture_model(spec.build(), example, leaf_modules=spec.leaf_modules, autocast=autocast)
    torch.manual_seed(0)
    with parameters_on_meta():
        model = spec.build()
    buffers = {n: b for n, b in model.named_buffers()}
    meta = capture_on_meta(model, example, leaf_modules=spec.leaf_modules, autocast=autocast)
    assert all(p.is_meta for p in model.parameters())
    assert all(b is buffers[n] for n, b in model.named_buffers())          # its own buffers back
    return whole, model, meta


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["gpt[layers=2,width=16,heads=2,seq=8,vocab=64]", LLAMA,
                                  pytest.param(GPT2, marks=pytest.mark.slow)])
def test_a_capture_without_weights_is_the_whole_models_graph(name, autocast):
    whole, model, meta = captures(name, autocast)
    assert meta.graph.code == whole.graph.code
    assert [b.name for b in meta.blocks] == [b.name for b in whole.blocks]
    assert meta.autocast == autocast
    own = {id(t) for t in [*model.parameters(), *model.buffers()]}
    assert all(id(t) in own for t in [*meta.graph.parameters(), *meta.graph.buffers()])


def test_meta_tensors_alone_would_miss_autocast():
    """Why the bf16 capture runs on fake CPU tensors: on the meta device autocast does not apply,
    so Llama's RMSNorm would cast back to the float32 it read instead of bfloat16."""
    whole, model, _ = captures(LLAMA, torch.bfloat16)
    on_meta = {id(t): torch.empty_like(t, device="meta") for t in model.buffers()}
    replace_tensors([model], on_meta)
    spec = resolve_model(LLAMA)
    example = pytree.tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v,
                              spec.example_input(2, torch.Generator().manual_seed(0)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = capture_model(model, example, autocast=None)
    assert plain.graph.code != whole.graph.code
