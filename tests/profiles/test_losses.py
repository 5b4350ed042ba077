"""The loss contract (profiles/losses.py), the user's factories with their own loss on any input
and target (zoo/registry.py), and token counting (pipeline/tokens.py): plain data, no processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hybridpipe.commands.merge_checkpoint import check_against_model
from hybridpipe.errors import UserError
from hybridpipe.pipeline.tokens import COUNT_KEY, TokenCounts
from hybridpipe.profiles.data import check_sample, resolve_dataset
from hybridpipe.profiles.losses import count_labels, is_pair, label_counter, loss_mean, loss_pair
from hybridpipe.profiles.zoo import resolve_model

MODULE = "tests.profiles.test_losses"


# ---- the contract ---------------------------------------------------------------------------------
def test_a_pair_is_summed_losses_and_their_count():
    total, count = torch.tensor(6.0), torch.tensor(4)
    assert is_pair((total, count)) and not is_pair(total) and not is_pair((1.0, 2))
    assert float(loss_mean((total, count))) == 1.5 and float(loss_mean(total)) == 6.0
    got = loss_pair((total, 3))
    assert got[0] is total and got[1].dtype == torch.float64 and float(got[1]) == 3.0
    with pytest.raises(UserError, match=r"must return \(loss_sum, count\).*a tensor of shape \[\]"):
        loss_pair(total)
    with pytest.raises(UserError, match="two scalars"):
        loss_pair((torch.ones(2), 2))


def test_labels_are_counted_as_hugging_face_averages_them():
    labels = torch.tensor([[5, 6, -100, 7], [-100, 1, 2, -100]])
    assert int(count_labels({"labels": labels}, shift=False)) == 5
    assert int(count_labels({"labels": labels}, shift=True)) == 4          # the first token predicts nothing
    assert int(count_labels({"labels": labels, "shift_labels": labels[:, :2]}, shift=True)) == 3
    with pytest.raises(UserError, match="no \"labels\""):
        count_labels({"input_ids": labels}, shift=False)


def test_label_counter_knows_causal_lms_and_nothing_else():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16,
                                                                bos_token_id=0, eos_token_id=0))
    bert = transformers.BertForMaskedLM(transformers.BertConfig(num_hidden_layers=1, hidden_size=8,
                                                                num_attention_heads=2, intermediate_size=8,
                                                                vocab_size=16))
    labels = {"labels": torch.tensor([[1, 2, 3]])}
    gpt2_count, bert_count = label_counter(gpt2), label_counter(bert)
    assert gpt2_count is not None and bert_count is not None
    assert int(gpt2_count(labels)) == 2 and int(bert_count(labels)) == 3
    assert label_counter(nn.Linear(2, 2)) is None
    # the count is what the model's own loss averages over
    ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(0))
    lab = ids.masked_fill(ids % 3 == 0, -100)
    out = gpt2(input_ids=ids, labels=lab)
    per_token = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), lab[:, 1:].flatten(), reduction="sum",
                                ignore_index=-100)
    assert torch.allclose(out.loss * gpt2_count({"labels": lab}), per_token)


# ---- token bookkeeping ----------------------------------------------------------------------------
def test_token_counts_travel_with_the_activations_and_scale_the_step_once():
    summed = []

    def total(part):
        summed.append(part.clone())
        return part * 2                          # as if a second rank held the same numbers

    first = TokenCounts(total, count_input=lambda b: (b["labels"] != -100).sum(), divisor=5)
    assert first.divisor == 5.0
    first.loaded((0, 0), {"labels": torch.tensor([[1, -100, 2]])}, torch.device("cpu"))
    message = first.outgoing((0, 0), {"h": torch.ones(1)})
    assert float(message[COUNT_KEY]) == 2.0
    last = TokenCounts(total, count_input=lambda b: torch.tensor(0), divisor=4)
    assert set(last.incoming((1, 0), message)) == {"h"}
    root, loss_sum, count = last.split((1, 0), torch.tensor(3.0))        # the model's own mean loss
    assert (float(root), float(loss_sum), float(count)) == (1.5, 6.0, 2.0)
    assert last.step_total() == (12.0, 4.0, 1.0)                         # D / N = 4 / 4
    assert last.divisor == 4.0                                           # fixed for the run
    with pytest.raises(UserError, match=r"must return \(loss_sum, count\)"):
        TokenCounts(total).split((1, 0), torch.tensor(3.0))             # a user loss without its count



# ---- the user's factories ---------------------------------------------------------------------------
class DictModel(nn.Module):
    """dict in, dict out: {"x", "mask"} -> {"scores", "aux"}."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x, mask):
        h = torch.tanh(self.a(x)) * mask.unsqueeze(-1)
        return {"scores": self.b(h), "aux": h.pow(2).mean()}


def masked_loss(output, target):
    per = F.cross_entropy(output["scores"].flatten(0, 1), target["y"].flatten(), reduction="none")
    return (per * target["w"].flatten()).sum() + 0.01 * output["aux"], target["w"].sum()


def dict_model():
    x = {"x": torch.randn(3, 5, 6), "mask": torch.ones(3, 5)}
    return DictModel(), x, masked_loss, {"y": torch.randint(0, 4, (3, 5)), "w": torch.rand(3, 5)}


def dict_default_targets():
    return DictModel(), {"x": torch.randn(3, 5, 6), "mask": torch.ones(3, 5)}, \
        lambda out, y: F.cross_entropy(out["scores"].flatten(0, 1), y.flatten())


def bad_rows():
    return DictModel(), {"x": torch.randn(3, 5, 6), "mask": torch.ones(3, 5)}, masked_loss, \
        {"y": torch.zeros(2, 5, dtype=torch.long), "w": torch.ones(2, 5)}


def bad_loss():
    return DictModel(), {"x": torch.randn(3, 5, 6), "mask": torch.ones(3, 5)}, lambda o, t: o["scores"]


def target_without_loss():
    return DictModel(), {"x": torch.randn(3, 5, 6), "mask": torch.ones(3, 5)}, None, torch.zeros(3)


class PairDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"x": torch.randn(5, 6), "mask": torch.ones(5)}, {"y": torch.zeros(5, dtype=torch.long),
                                                                 "w": torch.ones(5)}


def pairs():
    return PairDataset()


def inputs_only():
    return [{"x": torch.randn(5, 6), "mask": torch.ones(5)}] * 4


def test_a_dict_model_with_a_loss_on_a_dict_target_resolves_profiles_and_merges():
    spec = resolve_model(f"{MODULE}:dict_model")
    x, y = spec.example_input(2), spec.example_target(2)
    assert x["x"].shape == (2, 5, 6) and y["y"].shape == (2, 5) and y["w"].dtype == torch.float32
    value = spec.loss(spec.build()(**x), y)
    assert is_pair(value)
    sample = resolve_dataset("synthetic", spec, size=3)[0]
    assert isinstance(sample, tuple) and set(sample[0]) == {"x", "mask"} and set(sample[1]) == {"y", "w"}
    check_sample(PairDataset()[0], spec, "pairs")
    resolve_dataset(f"{MODULE}:pairs", spec, size=4)
    with pytest.raises(UserError, match=r"must be a pair \(input, target\)"):
        resolve_dataset(f"{MODULE}:inputs_only", spec, size=4)
    state = spec.build().state_dict()
    check_against_model(state, spec.name)                    # merge-checkpoint's key check (meta device)
    from hybridpipe.profiles.profiler import profile_model
    profile = profile_model(spec, batch_size=2, repeats=1, warmup=0, progress=False)
    assert profile.nodes


def test_default_targets_are_class_ids_of_the_first_output_tensor():
    spec = resolve_model(f"{MODULE}:dict_default_targets")
    y = spec.example_target(2)
    assert y.shape == (2, 5) and y.dtype == torch.int64 and int(y.max()) < 4


@pytest.mark.parametrize("factory,message", [
    ("bad_rows", "the example target has 2 rows but the example input 3"),
    ("bad_loss", r"must return a scalar tensor \(the mean loss\) or \(loss_sum, count\); it returned a tensor"),
    ("target_without_loss", "an example target .* needs a loss function"),
])
def test_factory_mistakes_are_one_line(factory, message):
    with pytest.raises(UserError, match=message):
        resolve_model(f"{MODULE}:{factory}")


def test_a_pair_counting_nothing_is_zero_with_zero_gradients_and_others_torchs_division():
    """An all-padding micro-batch's (loss_sum, count) = (0, 0) under micro-batch normalization adds
    nothing (it was 0 / 0: NaN); any other pair is loss_sum / count bit for bit, as torch divides."""
    torch.manual_seed(0)
    w = torch.randn(8, 5, requires_grad=True)
    x = torch.randn(6, 8)
    for labels in (torch.full((6,), -100), torch.tensor([1, -100, 3, 4, -100, 0])):
        total = torch.nn.functional.cross_entropy(x @ w, labels, ignore_index=-100, reduction="sum")
        count = (labels != -100).sum()
        mean = loss_mean((total, count))
        (grad,) = torch.autograd.grad(mean, w, retain_graph=True)
        if count == 0:
            assert float(mean) == 0.0 and torch.equal(grad, torch.zeros_like(w))
        else:
            want = torch.nn.functional.cross_entropy(x @ w, labels, ignore_index=-100)
            (want_grad,) = torch.autograd.grad(total / count, w)
            assert torch.equal(mean, total / count) and torch.allclose(mean, want)
            assert torch.equal(grad, want_grad)
