"""Tiny Hugging Face models (and torch's nn.TransformerEncoder) for the tests of issue 13: specs,
block names, and cuts that put the tied embedding and the head in different stages.

Every spec builds from a config with random weights (nothing is downloaded; tests/conftest.py sets
HF_HUB_OFFLINE) and no dropout, so a pipeline can be compared with one process bit by bit.
"""

from __future__ import annotations

from dataclasses import dataclass

GPT2 = "hf:gpt2[n_layer=2,n_embd=32,n_head=2,vocab_size=128,seq=8,dropout=0]"
LLAMA = ("hf:llama[num_hidden_layers=2,hidden_size=32,intermediate_size=64,num_attention_heads=2,"
         "num_key_value_heads=1,vocab_size=128,tie_word_embeddings=true,seq=8]")
BERT = ("hf:BertForSequenceClassification[num_hidden_layers=2,hidden_size=32,intermediate_size=64,"
        "num_attention_heads=2,vocab_size=128,num_labels=3,seq=8,dropout=0]")
T5 = ("hf:t5[num_layers=2,num_decoder_layers=2,d_model=32,d_ff=64,num_heads=2,d_kv=16,vocab_size=128,"
      "decoder_start_token_id=0,seq=8,dropout=0]")
VIT = ("hf:vit[num_hidden_layers=2,hidden_size=32,intermediate_size=64,num_attention_heads=2,image_size=16,"
       "patch_size=8,num_labels=10,dropout=0]")
ENCODER = "tests.profiles.user_models:transformer_encoder"
QWEN2 = ("hf:qwen2[num_hidden_layers=2,hidden_size=32,intermediate_size=64,num_attention_heads=2,"
         "num_key_value_heads=1,vocab_size=128,seq=8]")        # use_cache defaults to True: a DynamicCache
# mixtures of experts (2 layers, hidden 32, 4 experts, top-2): transformers' default experts code
# (grouped matrix products through a torch.library operator), or its eager loop over the experts hit
# (data-dependent: a leaf module, run as written)
MIXTRAL = ("hf:mixtral[num_hidden_layers=2,hidden_size=32,intermediate_size=64,num_attention_heads=4,"
           "num_key_value_heads=2,num_local_experts=4,num_experts_per_tok=2,vocab_size=128,seq=8,dropout=0]")
QWEN2_MOE = ("hf:qwen2_moe[num_hidden_layers=2,hidden_size=32,intermediate_size=64,moe_intermediate_size=32,"
             "shared_expert_intermediate_size=64,num_attention_heads=4,num_key_value_heads=2,num_experts=4,"
             "num_experts_per_tok=2,vocab_size=128,seq=8,dropout=0]")
MIXTRAL_EAGER = MIXTRAL.replace("]", ",experts_implementation=eager]")
MIXTRAL_LEAF = MIXTRAL.replace("]", ",experts_implementation=eager,leaf=MixtralExperts]")
QWEN2_MOE_LEAF = QWEN2_MOE.replace("]", ",experts_implementation=eager,leaf=Qwen2MoeExperts]")
GPT2_PADDED = "tests.profiles.user_models:gpt2_padded"
RAGGED = "tests.profiles.user_models:ragged_tokens"


@dataclass(frozen=True)
class Case:
    name: str
    spec: str
    layer: str                             # the class of its repeated blocks
    blocks: tuple[str, ...] | None         # the profile's node names (block granularity; None: ask the model)
    two: list[int]                         # cut of 2 stages (block ids)
    four: list[int]                        # cuts of 4 stages
    tied: str | None = None                # the tied parameter (canonical name), cut apart by both


CASES = [
    Case("gpt2", GPT2, "GPT2Block",
         ("transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0", "transformer.h.1",
          "transformer.ln_f", "lm_head"), [3], [0, 3, 4], "transformer.wte.weight"),
    Case("llama", LLAMA, "LlamaDecoderLayer",
         ("model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1", "model.norm", "lm_head"),
         [2], [1, 2, 3], "model.embed_tokens.weight"),
    Case("bert", BERT, "BertLayer",
         ("bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "bert.pooler", "dropout", "classifier"),
         [1], [0, 1, 3]),
    Case("t5", T5, "T5Block",
         ("encoder.embed_tokens", "encoder.dropout", "encoder.block.0", "encoder.block.1", "encoder.final_layer_norm",
          "encoder.dropout#2", "decoder.embed_tokens", "decoder.dropout", "decoder.block.0", "decoder.block.1",
          "decoder.final_layer_norm", "decoder.dropout#2", "lm_head"), [5], [3, 6, 9], "shared.weight"),
    Case("vit", VIT, "ViTLayer", None, [1], [0, 1, 2]),      # vit.layers.N (or vit.encoder.layer.N: by version)
    Case("encoder", ENCODER, "TransformerEncoderLayer", ("layers.0", "layers.1", "layers.2", "layers.3"),
         [1], [0, 1, 2]),
]
BY_NAME = {c.name: c for c in CASES}
