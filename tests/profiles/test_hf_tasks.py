"""``hf:`` models a new user fine-tunes, each as hybridpipe builds it and its synthetic task: every
case here failed before its fix (a crash, a misleading refusal, or a silent difference from the
plain loop), and each test compares with what transformers itself computes.

* the task's labels: a class per token (token classification), float targets (regression), a
  multi-hot vector (multi-label); a classifier's ``problem_type`` fixed as its first forward infers
  it (DeBERTa-v2's None branch cannot be exported);
* ``dropout=0`` also zeroes stochastic depth (BEiT's ``drop_path_rate``) and LayerDrop;
* an encoder-decoder type's default head is its seq2seq one (Whisper: log-mel features in);
* T5's config in transformers 5 lacks ``decoder_start_token_id``;
* dict-valued config fields in the spec (``rope_scaling={...}``);
* one-line refusals for a model without a loss (CLIPModel) or an input hybridpipe cannot make (audio
  samples), and for transformers' gradient checkpointing (a captured graph cannot keep it).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import default_collate

from hybridpipe.errors import UserError
from hybridpipe.profiles.capture import training_switches
from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.profiles.zoo.spec import parse_args

pytest.importorskip("transformers")

BERT = "num_hidden_layers=1,hidden_size=16,intermediate_size=32,num_attention_heads=2,vocab_size=64,seq=6,dropout=0"
VISION = "num_hidden_layers=1,hidden_size=16,intermediate_size=32,num_attention_heads=2,image_size=8,patch_size=4"
LLAMA = "num_hidden_layers=1,hidden_size=16,intermediate_size=32,num_attention_heads=2,vocab_size=64,seq=6"
SEQ2SEQ = ("d_model=16,encoder_layers=1,decoder_layers=1,encoder_ffn_dim=32,decoder_ffn_dim=32,"
           "encoder_attention_heads=2,decoder_attention_heads=2,vocab_size=64,pad_token_id=0,bos_token_id=1,eos_token_id=2,"
           "decoder_start_token_id=1,seq=6,dropout=0")
WHISPER = f"hf:whisper[{SEQ2SEQ},num_mel_bins=4,max_source_positions=8,max_target_positions=16]"


def built(spec: str, n: int = 4) -> tuple[torch.nn.Module, dict]:
    """The spec's model (seed 0, training mode) and a batch of ``n`` synthetic samples."""
    resolved = resolve_model(spec)
    torch.manual_seed(0)
    model = resolved.build().train()
    data = resolve_dataset("synthetic", resolved, size=n, seed=1)
    return model, default_collate([data[i] for i in range(n)])


def test_token_classification_labels_are_a_class_per_token():
    model, batch = built("hf:DistilBertForTokenClassification[n_layers=1,dim=16,hidden_dim=32,n_heads=2,"
                         "vocab_size=64,num_labels=5,seq=6,dropout=0]")
    assert batch["labels"].shape == batch["input_ids"].shape and int(batch["labels"].max()) < 5
    out = model(**batch)       # the token ids as labels before: "Target 21 is out of bounds"
    logits = out.logits.flatten(0, 1)
    assert torch.allclose(out.loss, torch.nn.functional.cross_entropy(logits, batch["labels"].flatten()))


@pytest.mark.parametrize("extra,loss", [
    ("num_labels=1", lambda z, y: torch.nn.functional.mse_loss(z.squeeze(), y)),
    ("num_labels=3,problem_type=regression", torch.nn.functional.mse_loss),
    ("num_labels=4,problem_type=multi_label_classification", torch.nn.functional.binary_cross_entropy_with_logits)])
def test_regression_and_multi_label_targets_are_floats_the_model_trains_on(extra, loss):
    model, batch = built(f"hf:BertForSequenceClassification[{BERT},{extra}]")
    labels = batch["labels"]
    assert labels.is_floating_point() and len(labels.unique()) > 1        # integer zeros (regression) before
    out = model(**batch)
    assert torch.allclose(out.loss, loss(out.logits, labels))


def test_a_classifiers_problem_type_is_fixed_so_deberta_exports():
    """DeBERTa-v2's problem_type None branch filters labels with ``nonzero`` (export refused it);
    fixed to single-label classification, the loss is the same cross-entropy."""
    resolved = resolve_model(f"hf:DebertaV2ForSequenceClassification[{BERT},num_labels=3]")
    model, batch = built(resolved.name)
    assert model.config.problem_type == "single_label_classification"
    out = model(**batch)
    assert torch.allclose(out.loss, torch.nn.functional.cross_entropy(out.logits, batch["labels"]))
    exported = torch.export.export(model, (), dict(batch), strict=False)     # GuardOnDataDependentSymNode before
    assert exported.graph_signature.user_outputs


def test_dropout_zero_zeroes_stochastic_depth():
    """BEiT's drop_path_rate (0.1 by default) escaped ``dropout=0``: two training forwards differed,
    and a pipeline ended 6e-4 from the plain loop (its ranks draw other masks)."""
    model, batch = built(f"hf:beit[{VISION},num_labels=3,dropout=0]")
    assert model.config.drop_path_rate == 0.0
    assert torch.equal(model(**batch).logits, model(**batch).logits)


def test_an_encoder_decoder_types_head_is_its_seq2seq_one():
    model, batch = built(WHISPER)
    assert type(model).__name__ == "WhisperForConditionalGeneration"      # WhisperForCausalLM before
    assert batch["input_features"].shape == (4, 4, 16)
    assert model(**batch).loss.isfinite()
    assert type(resolve_model(f"hf:bart[{SEQ2SEQ}]").build()).__name__ == "BartForConditionalGeneration"


def test_t5_shifts_its_labels_from_the_pad_token():
    model, batch = built("hf:t5[num_layers=1,num_decoder_layers=1,d_model=16,d_ff=32,num_heads=2,d_kv=8,"
                         "vocab_size=64,seq=6,dropout=0]")
    assert model.config.decoder_start_token_id == model.config.pad_token_id == 0
    out = model(**batch)     # AttributeError: no decoder_start_token_id before
    assert torch.allclose(out.loss, torch.nn.functional.cross_entropy(out.logits.flatten(0, 1),
                                                                      batch["labels"].flatten()))


def test_dict_values_reach_the_config():
    assert parse_args('[a={"rope_type": "linear","factor":2.0},b={x=[1,2],y={z=s}}]', "s") == \
        {"a": {"rope_type": "linear", "factor": 2.0}, "b": {"x": [1, 2], "y": {"z": "s"}}}
    plain, _ = built(f"hf:llama[{LLAMA}]")
    scaled, batch = built(f'hf:llama[{LLAMA},rope_scaling={{"rope_type":"linear","factor":2.0}}]')
    assert torch.equal(scaled.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq / 2)
    assert not torch.allclose(scaled(**batch, **training_switches(scaled)).logits,
                              plain(**batch, **training_switches(plain)).logits)


@pytest.mark.parametrize("spec,says", [
    ("hf:CLIPModel[]", "takes no labels"),
    ("hf:Wav2Vec2ForCTC[num_hidden_layers=1]", "reads 'input_values'")])
def test_what_cannot_be_made_up_is_refused_in_one_line(spec, says):
    with pytest.raises(UserError) as e:
        resolve_model(spec)
    assert says in str(e.value) and "factory" in str(e.value) and "\n" not in str(e.value)


def test_gradient_checkpointing_is_refused_not_silently_dropped():
    """``gradient_checkpointing=true`` was accepted: transformers consumes the field at the first
    build only (the profile's build had it off), and a captured graph never recomputes anyway."""
    from hybridpipe.profiles.capture import capture_model

    with pytest.raises(UserError, match="--recompute"):
        resolve_model(f"hf:bert[{BERT},gradient_checkpointing=true]")
    model, batch = built(f"hf:bert[{BERT}]")
    model.gradient_checkpointing_enable()          # a factory's own model, checkpointing on
    with pytest.raises(UserError, match="gradient checkpointing on"):
        capture_model(model, batch)
