"""Hugging Face format in and out (issue 28 items 5 and 6).

* merge-checkpoint checks keys and shapes of any model the launcher trains without running it:
  a Hugging Face model from the user's own factory, and ``hf:DIR``;
* ``--format hf`` writes what ``save_pretrained`` writes: ``from_pretrained`` loads it strictly
  (no missing, unexpected or mismatched keys) and computes the same logits, sharded or not;
  ``--format safetensors`` and ``--init-from`` of a ``.safetensors`` file or an HF directory;
* ``hf:DIR`` is built without its weights and each rank reads only its own stages' tensors, the
  values ``from_pretrained`` gives; under launch it trains what one process trains.

Checkpoints are written by hand in the runtime's format (tests/runtime/hf_checkpoints.py) except
in the launch test.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from hybridpipe.cli import main
from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import save_plan
from hybridpipe.profiles.calling import autocast_context
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.profiles.zoo.registry import build_skeleton
from hybridpipe.runtime.hf_export import save_safetensors
from hybridpipe.runtime.lazy import capture_lazily, load_initial, load_whole, uncovered
from hybridpipe.runtime.merged import merge_stages
from hybridpipe.runtime.parts import build_model
from hybridpipe.runtime.tensor_files import open_weights
from tests.pipeline.harness import make_plan
from tests.profiles.user_models import gpt2_padded
from tests.runtime.hf_checkpoints import perturbed, write_checkpoint
from tests.runtime.jobs import launch, max_diff, train_reference

transformers = pytest.importorskip("transformers")

FACTORY = "tests.profiles.user_models:gpt2_padded"
LLAMA = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=128, max_position_embeddings=64, tie_word_embeddings=True)


def saved_gpt2(directory, seed: int = 0):
    """A tiny GPT-2 (no dropout) with random weights, saved with save_pretrained as a pretrained one would be."""
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    model = perturbed(transformers.GPT2LMHeadModel(config), seed)
    model.save_pretrained(directory)
    return model


def saved_llama(directory, seed: int = 0):
    """A tiny Llama (tied embeddings, rotary frequencies as a buffer no file holds), saved."""
    torch.manual_seed(seed)
    model = perturbed(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)), seed)
    model.save_pretrained(directory)
    return model


def loaded_strictly(directory):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.eval()


def ids(batch: int = 2, seq: int = 12):
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(7))


# ---- item 5: merge-checkpoint checks any model without running it ----------------------------------
def test_merge_checks_a_user_factory_hf_model_and_an_hf_directory(tmp_path, capsys):
    model = perturbed(gpt2_padded()[0])
    write_checkpoint(tmp_path / "factory", FACTORY, model)
    assert main(["merge-checkpoint", str(tmp_path / "factory"), "-o", str(tmp_path / "a.pt")]) == 0
    assert "its keys and shapes match" in capsys.readouterr().out
    merged = torch.load(tmp_path / "a.pt", weights_only=True)
    assert max_diff(merged, model.state_dict()) == 0

    saved_gpt2(tmp_path / "pretrained")
    spec = f"hf:{tmp_path / 'pretrained'}[seq=8]"
    trained = perturbed(resolve_model(spec).build(), seed=2)
    write_checkpoint(tmp_path / "dir", spec, trained)
    assert main(["merge-checkpoint", str(tmp_path / "dir"), "-o", str(tmp_path / "b.pt")]) == 0
    capsys.readouterr()

    # a checkpoint that lost a tensor is refused for what it is, not blamed on the model
    write_checkpoint(tmp_path / "lost", FACTORY, torch.nn.ModuleDict({"transformer": model.transformer}))
    assert main(["merge-checkpoint", str(tmp_path / "lost"), "-o", str(tmp_path / "c.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit" in err[0] and "lm_head.weight" in err[0], err
    assert "raised" not in err[0] and "meta" not in err[0], err


# ---- item 6: out ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shard", [None, "40KB"])
def test_hf_export_is_what_save_pretrained_writes_and_loads_strictly_to_equal_logits(tmp_path, capsys, shard):
    saved_gpt2(tmp_path / "pretrained")
    (tmp_path / "pretrained" / "tokenizer_config.json").write_text("{}")      # carried along
    spec = f"hf:{tmp_path / 'pretrained'}[seq=8]"
    trained = perturbed(resolve_model(spec).build(), seed=3).eval()
    write_checkpoint(tmp_path / "ckpt", spec, trained)
    out = tmp_path / "export"
    assert main(["merge-checkpoint", str(tmp_path / "ckpt"), "--format", "hf", "-o", str(out),
                 *(["--max-shard-size", shard] if shard else [])]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer_config.json"} <= files
    if shard:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = set(index["weight_map"].values())
        assert len(shards) > 1 and shards <= files and "model.safetensors" not in files
    else:
        assert "model.safetensors" in files
    loaded = loaded_strictly(out)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight           # tied as Hugging Face ties it
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids()).logits, trained(input_ids=ids()).logits)

    # exactly what save_pretrained writes for the same weights
    trained.save_pretrained(tmp_path / "theirs", **({"max_shard_size": shard} if shard else {}))
    theirs = {p.name for p in (tmp_path / "theirs").iterdir()}
    assert theirs == files - {"tokenizer_config.json"}
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((tmp_path / "theirs" / "config.json").read_text())


def test_hf_export_of_a_user_factory_model_and_refusals(tmp_path, capsys):
    model = perturbed(gpt2_padded()[0]).eval()
    write_checkpoint(tmp_path / "ckpt", FACTORY, model)
    assert main(["merge-checkpoint", str(tmp_path / "ckpt"), "--format", "hf", "-o", str(tmp_path / "out")]) == 0
    with torch.no_grad():
        assert torch.equal(loaded_strictly(tmp_path / "out")(input_ids=ids()).logits, model(input_ids=ids()).logits)
    capsys.readouterr()
    write_checkpoint(tmp_path / "mlp", "mlp[layers=1]", resolve_model("mlp[layers=1]").build())
    assert main(["merge-checkpoint", str(tmp_path / "mlp"), "--format", "hf", "-o", str(tmp_path / "x")]) == 2
    assert "--format hf writes Hugging Face models" in capsys.readouterr().err
    assert main(["merge-checkpoint", str(tmp_path / "ckpt"), "--format", "hf", "--with-optimizer",
                 "-o", str(tmp_path / "y")]) == 2
    assert "--with-optimizer writes a torch file" in capsys.readouterr().err


# ---- item 6: in ----------------------------------------------------------------------------------
def test_safetensors_export_and_init_from_safetensors_or_an_hf_directory(tmp_path, capsys):
    model = perturbed(gpt2_padded()[0])
    write_checkpoint(tmp_path / "ckpt", FACTORY, model)
    assert main(["merge-checkpoint", str(tmp_path / "ckpt"), "-o", str(tmp_path / "m.safetensors")]) == 0
    assert "as safetensors" in capsys.readouterr().out
    from safetensors.torch import load_file
    held = load_file(tmp_path / "m.safetensors")
    assert "lm_head.weight" not in held and "transformer.wte.weight" in held      # a tied weight once
    model.save_pretrained(tmp_path / "hf")
    for source in (tmp_path / "m.safetensors", tmp_path / "hf"):
        fresh = gpt2_padded()[0]
        weights, optimizer = load_initial(source, fresh)
        assert optimizer is None
        state = {k: weights.get(k if k in weights.keys() else "transformer.wte.weight") for k in fresh.state_dict()}
        fresh.load_state_dict(state, strict=True)
        assert max_diff(fresh.state_dict(), model.state_dict()) == 0
    small = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128))
    with pytest.raises(UserError, match="does not fit the model .*unexpected 'transformer.h.1"):
        load_initial(tmp_path / "m.safetensors", small)
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(UserError, match="is not a safetensors file"):
        load_initial(tmp_path / "bad.safetensors", small)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_hf_directory_is_read_a_stage_at_a_time_with_from_pretrained_values(tmp_path, autocast):
    """Llama: a tied embedding cut apart from its head, rotary frequencies in a buffer no file holds
    (GPT-2 runs the same path under launch below); a bf16 job's capture under autocast alike."""
    saved_llama(tmp_path / "pretrained")
    spec = resolve_model(f"hf:{tmp_path / 'pretrained'}[seq=8]")
    whole = spec.build().eval()                                 # from_pretrained: the reference values
    plan = make_plan(spec.name, [1, 2, 3], [1, 1, 1, 1], batch_size=2)
    expected = whole.state_dict()
    built = build_model(spec, plan, seed=0, autocast=autocast)  # as every rank builds it: nothing read
    assert built.weights is not None and all(p.device.type == "meta" for p in built.module.parameters())
    assert plan.tied and all(b.device.type == "cpu" for b in built.module.buffers())
    stages, read = [], set()
    for rank in range(4):                                       # each rank reads its stage
        model = copy.deepcopy(built)
        model.materialize(plan, [rank])
        stage = build_stage_index_of(model, plan, rank)
        real = {n for n, p in model.module.named_parameters() if p.device.type != "meta"}
        assert real == {n for n, _ in stage.module.named_parameters()}         # its stage's, nothing else
        read |= real
        for name, t in stage.module.state_dict().items():
            assert torch.equal(t, expected[name]), name
        stages.append(stage)
    assert read == {n for n, _ in whole.named_parameters()}
    batch = {"input_ids": ids(2, 8), "labels": ids(2, 8)}
    with torch.no_grad(), autocast_context(whole, autocast):
        act = stages[0].forward(stages[0].data_inputs(batch))
        for stage in stages[1:]:
            act = stage.forward(act.outputs)
        assert torch.equal(act.loss, whole(**batch).loss)

    # --init-from a .safetensors file: the ranks read their stages from it instead
    other = perturbed(spec.build(), seed=9)
    save_safetensors(other.state_dict(), tmp_path / "start.safetensors")
    model = copy.deepcopy(built)
    assert model.start_from(str(tmp_path / "start.safetensors")) is None
    model.materialize(plan, [3])
    for name, t in build_stage_index_of(model, plan, 3).module.state_dict().items():
        assert torch.equal(t, other.state_dict()[name]), name


def test_init_from_safetensors_into_a_model_built_whole(tmp_path):
    plan = make_plan("mlp", [3], [1, 1], batch_size=4)
    model = build_model(resolve_model("mlp"), plan, seed=0, whole=True)
    assert model.weights is None and model.recipe is None
    other = perturbed(resolve_model("mlp").build(), seed=4)
    save_safetensors(other.state_dict(), tmp_path / "start.safetensors")
    model.start_from(str(tmp_path / "start.safetensors"))
    assert max_diff(model.module.state_dict(), other.state_dict()) == 0


def build_stage_index_of(model, plan, index):
    from hybridpipe.pipeline import build_stage_index

    return build_stage_index(model.captured, [(s.first_node, s.last_node) for s in plan.stages], index)


def test_an_hf_directory_the_files_do_not_cover_is_loaded_whole(tmp_path, caplog):
    saved_gpt2(tmp_path / "pretrained")
    from safetensors.torch import load_file, save_file
    held = load_file(tmp_path / "pretrained" / "model.safetensors")
    held.pop("transformer.ln_f.bias")                           # from_pretrained initialises what is missing
    save_file(held, tmp_path / "pretrained" / "model.safetensors", metadata={"format": "pt"})
    spec = resolve_model(f"hf:{tmp_path / 'pretrained'}[seq=8]")
    weights = open_weights(tmp_path / "pretrained")
    assert weights.shape("transformer.wte.weight") == (128, 32)
    assert "transformer.ln_f.bias" in uncovered(build_skeleton(spec.name), weights)
    # build_model then loads it whole (from_pretrained), saying why; the plan is not needed to decide
    assert capture_lazily(spec, spec.example_input(2), None, weights) is None      # type: ignore[arg-type]
    assert "loads the whole of" in caplog.text and "transformer.ln_f.bias" in caplog.text


# ---- under launch ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_hf_directory_under_launch_exports_to_from_pretrained(tmp_path):
    """hf:DIR read lazily on 2 ranks (the tied embedding and the head in different stages), 3 SGD
    steps: equal to one process training from_pretrained's model; exported with --format hf,
    from_pretrained loads it strictly and computes its logits."""
    saved_gpt2(tmp_path / "pretrained")
    plan = make_plan(f"hf:{tmp_path / 'pretrained'}[seq=8]", [3], [1, 1], micro_batches=2, batch_size=2)
    save_plan(plan, tmp_path / "plan.json")
    ckpt = tmp_path / "ckpt"
    done = launch(["--plan", str(tmp_path / "plan.json"), "--steps", "3", "--lr", "0.05", "--momentum", "0.5",
                   "--checkpoint-dir", str(ckpt), "--run-dir", str(tmp_path / "run"), "--timeout", "120",
                   "--no-progress", "--no-trace"], plan.world_size, timeout=300)
    assert all(d.returncode == 0 for d in done), done
    assert not any("loads the whole of" in d.stderr for d in done), done
    reference = train_reference(plan, 3, lr=0.05, momentum=0.5, seed=0)
    merged, _ = merge_stages(ckpt, 3)
    assert max_diff(merged, reference) <= 1e-5
    assert main(["merge-checkpoint", str(ckpt), "--format", "hf", "-o", str(tmp_path / "out")]) == 0
    model = resolve_model(plan.model).build().eval()
    model.load_state_dict(reference, strict=True)
    with torch.no_grad():
        logits = loaded_strictly(tmp_path / "out")(input_ids=ids()).logits
        assert float((logits - model(input_ids=ids()).logits).abs().max()) <= 1e-4



def saved_swin(directory):
    """A tiny Swin, saved: transformers 5 writes ``attention.q_proj.weight`` as
    ``attention.self.query.weight`` (its conversion mapping), from_pretrained renames it back."""
    config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                     window_size=4, num_labels=3, drop_path_rate=0.0)
    torch.manual_seed(0)
    perturbed(transformers.SwinForImageClassification(config)).save_pretrained(directory)
    return config


def test_init_from_an_hf_directory_whose_files_rename_tensors(tmp_path):
    """--init-from such a directory fits and loads from_pretrained's values, and it covers the model
    (before: "does not fit the model (missing 'swin.encoder...q_proj.weight'; 26 missing, 26 unexpected"),
    and every rank of an hf:DIR job loaded the whole model)."""

    config = saved_swin(tmp_path / "pretrained")
    expected = transformers.SwinForImageClassification.from_pretrained(tmp_path / "pretrained").state_dict()
    assert "swin.encoder.layers.0.blocks.0.attention.q_proj.weight" in expected
    fresh = transformers.SwinForImageClassification(config)
    weights, _ = load_initial(tmp_path / "pretrained", fresh)
    assert "swin.encoder.layers.0.blocks.0.attention.q_proj.weight" in weights.keys()       # the module's names
    assert "swin.encoder.layers.0.blocks.0.attention.self.query.weight" not in weights.keys()
    assert uncovered(fresh, weights) == ""
    load_whole(fresh, weights)
    assert max_diff(fresh.state_dict(), expected) == 0


@pytest.mark.slow
def test_an_hf_directory_whose_files_rename_tensors_is_read_a_stage_at_a_time(tmp_path):
    """Each rank reads only its stage of the saved Swin, by the files' names, with from_pretrained's
    values (before: capture_lazily found the files short and every rank loaded the whole model). ~90 s:
    Swin's capture."""
    saved_swin(tmp_path / "pretrained")
    read_stage_by_stage(f"hf:{tmp_path / 'pretrained'}[dropout=0]")


def read_stage_by_stage(name: str) -> list[dict[str, torch.Tensor]]:
    """hf:DIR on 2 stages, as each rank builds it: the spec's files cover the model (nothing read at
    build), and each stage's tensors read alone equal from_pretrained's; the stages' state dicts."""
    spec = resolve_model(name)
    expected = spec.build().state_dict()                        # from_pretrained
    plan = make_plan(spec.name, [2], [1, 1], batch_size=2)
    built = build_model(spec, plan, seed=0)
    assert built.weights is not None, "loaded whole"
    states = []
    for index in range(2):
        model = copy.deepcopy(built)
        model.materialize(plan, [index])
        states.append(build_stage_index_of(model, plan, index).module.state_dict())
        for name, t in states[-1].items():
            assert torch.equal(t, expected[name]), name
    return states


MIXTRAL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)


def saved_mixtral(directory):
    """A tiny Mixtral, saved: transformers 5 holds each layer's experts stacked (``mlp.experts.gate_up_proj``,
    4 x 128 x 32) and writes them as the Hub's checkpoints hold them, one ``w1``, ``w2``, ``w3`` per expert
    under ``block_sparse_moe``; from_pretrained stacks and concatenates them back."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**MIXTRAL)
    perturbed(transformers.MixtralForCausalLM(config)).save_pretrained(directory)
    return config


class Reads:
    """Real weights that note each name read."""

    def __init__(self, weights):
        self.weights, self.where, self.read = weights, weights.where, []

    def keys(self):
        return self.weights.keys()

    def shape(self, name):
        return self.weights.shape(name)

    def dtype(self, name):
        return self.weights.dtype(name)

    def get(self, name):
        self.read.append(name)
        return self.weights.get(name)


def test_init_from_an_hf_directory_whose_files_hold_the_experts_apart(tmp_path):
    """--init-from a Mixtral directory (a pretrained MoE's layout) fits and loads from_pretrained's values
    (before: "does not fit the model (missing 'model.layers.0.mlp.experts.down_proj'; 4 missing, 26
    unexpected"); a stacked tensor is made from its own layer's file tensors only, read when asked for."""
    from hybridpipe.runtime.hf_names import module_view

    config = saved_mixtral(tmp_path / "pretrained")
    expected = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "pretrained").state_dict()
    fresh = transformers.MixtralForCausalLM(config)
    weights, _ = load_initial(tmp_path / "pretrained", fresh)
    assert uncovered(fresh, weights) == ""
    load_whole(fresh, weights)
    assert max_diff(fresh.state_dict(), expected) == 0
    files = Reads(open_weights(tmp_path / "pretrained"))
    view = module_view(files, fresh)
    assert files.read == [] and view.shape("model.layers.1.mlp.experts.gate_up_proj") == (4, 128, 32)
    assert torch.equal(view.get("model.layers.1.mlp.experts.gate_up_proj"),
                       expected["model.layers.1.mlp.experts.gate_up_proj"])
    assert sorted(files.read) == sorted(f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"
                                        for e in range(4) for w in ("w1", "w3"))


@pytest.mark.slow
def test_an_hf_directory_whose_files_hold_the_experts_apart_is_read_a_stage_at_a_time(tmp_path):
    """hf:DIR of that Mixtral: each rank reads only its stage, with from_pretrained's values (before: the
    files did not cover the model and every rank loaded the whole of it). ~5 s."""
    saved_mixtral(tmp_path / "pretrained")
    states = read_stage_by_stage(f"hf:{tmp_path / 'pretrained'}[seq=8]")
    assert all(f"model.layers.{i}.mlp.experts.gate_up_proj" in state for i, state in enumerate(states))


MOE_FAMILIES = {       # transformers' other conversion patterns for experts (shared experts, dense first layers)
    "Qwen2Moe": dict(moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                     num_experts_per_tok=2),
    "Olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "DeepseekV3": dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                       first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1),
}


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_init_from_other_moe_families_equals_from_pretrained(tmp_path, family):
    config = getattr(transformers, f"{family}Config")(**{**MIXTRAL, **MOE_FAMILIES[family]})
    cls = getattr(transformers, f"{family}ForCausalLM")
    torch.manual_seed(0)
    perturbed(cls(config)).save_pretrained(tmp_path)
    fresh = cls(config)
    weights, _ = load_initial(tmp_path, fresh)
    load_whole(fresh, weights)
    assert max_diff(fresh.state_dict(), cls.from_pretrained(tmp_path).state_dict()) == 0


def saved_bf16_llama(directory) -> None:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).to(torch.bfloat16).save_pretrained(directory)


def test_a_bf16_checkpoint_covers_a_float32_model(tmp_path):
    """Pretrained checkpoints ship in bf16; float32 weights built from one are cast tensor by tensor
    (before: "is torch.bfloat16, the model torch.float32": every rank loaded the whole model)."""
    saved_bf16_llama(tmp_path)
    assert uncovered(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)), open_weights(tmp_path)) == ""


@pytest.mark.slow
def test_a_bf16_checkpoint_is_read_a_stage_at_a_time_into_float32_weights(tmp_path):
    """hf:DIR[dtype=float32] of a bf16 directory: each rank reads only its stage, cast as
    from_pretrained(dtype=float32) casts it."""
    saved_bf16_llama(tmp_path / "bf16")
    states = read_stage_by_stage(f"hf:{tmp_path / 'bf16'}[seq=8,dtype=float32]")
    assert all(t.dtype == torch.float32 for state in states for t in state.values() if t.is_floating_point())
