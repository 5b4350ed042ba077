"""The evaluation-mode twin of a captured graph equals the model in eval mode (no dropout, running stats)."""

from __future__ import annotations

import os

import pytest
import torch

from hybridpipe.pipeline.stage import build_stage_index
from hybridpipe.profiles.capture import call_args
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import capture

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODELS = ["alexnet-small", "resnet-small", "hf:gpt2[n_layer=2,n_embd=32,n_head=2,vocab_size=128,seq=8]"]


def two_stages(name: str):
    spec = resolve_model(name)
    captured = capture(spec, 4)
    n = len(captured.blocks)
    ranges = [(0, n // 2), (n // 2 + 1, n - 1)]
    return spec, captured, [build_stage_index(captured, ranges, i, loss=spec.loss) for i in range(2)]


@pytest.mark.parametrize("name", MODELS)
def test_eval_stages_equal_the_model_in_eval_mode(name):
    spec, captured, stages = two_stages(name)
    x, y = spec.example_input(4), spec.example_target(4)
    front = stages[0].forward_eval(stages[0].data_inputs(x))
    back = stages[1].forward_eval(front.outputs, target=y)
    model = captured.module.eval()
    with torch.no_grad():
        args, kwargs = call_args(x)
        out = model(*args, **kwargs)
        reference = spec.loss(out, y) if spec.loss is not None else out.loss
    assert torch.equal(back.loss, reference)
    assert not back.loss.requires_grad


def test_the_training_graph_differs_where_eval_mode_matters():
    """Dropout is active in the training graph, so the check above can fail."""
    spec, captured, stages = two_stages(MODELS[2])
    x = spec.example_input(4)
    with torch.no_grad():
        train = stages[1].forward(stages[0].forward(stages[0].data_inputs(x)).outputs).loss
        evaluated = stages[1].forward_eval(stages[0].forward_eval(stages[0].data_inputs(x)).outputs).loss
    assert not torch.equal(train, evaluated)


def test_batch_norm_statistics_are_not_updated_by_evaluation():
    """Running statistics and ``num_batches_tracked`` (before: +1 per evaluated micro-batch, unlike
    ``model.eval()``, and so in every checkpoint after an evaluation)."""
    spec, captured, stages = two_stages("resnet-small")
    before = {k: v.clone() for k, v in captured.module.state_dict().items() if "running" in k or "batches" in k}
    stages[0].forward_eval(stages[0].data_inputs(spec.example_input(4)))
    after = captured.module.state_dict()
    assert any("num_batches_tracked" in k for k in before)
    assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before
                                                                    if not torch.equal(before[k], after[k])]


@pytest.mark.parametrize("replicas", [1, 2])
def test_evaluating_an_fx_graph_leaves_its_modules_training(replicas):
    """torch.fx graphs call the model's BatchNorm modules (momentum=None cannot be exported): the
    evaluation twin calls eval-mode copies of them; before, it switched the training graph's own
    modules to eval mode for good (training on running statistics, no updates). With replicas
    the training graph calls batch_stats' replacements and evaluation the model's modules."""
    spec = resolve_model("tests.pipeline.bn_models:bn_mlp_cumulative")
    captured = capture(spec, 4)
    assert captured.front_end == "fx"
    n = len(captured.blocks)
    stage = build_stage_index(captured, [(0, n - 1)], 0, loss=spec.loss, replicas=replicas)
    x, y = spec.example_input(4), spec.example_target(4)
    evaluated = stage.forward_eval(stage.data_inputs(x), target=y).loss
    assert all(m.training for m in stage.module.modules())
    assert int(stage.module.get_buffer("1.num_batches_tracked")) == 0          # evaluation updates nothing
    with torch.no_grad():
        reference = spec.loss(captured.module.eval()(x), y)
    captured.module.train()
    assert torch.equal(evaluated, reference)
    before = stage.module.get_buffer("1.num_batches_tracked").clone()
    stage.forward(stage.data_inputs(x), target=y)
    if stage.stats is not None:                      # replicas: the step's statistics replayed (one replica here)
        stage.stats.combine([0], lambda table: None)
    assert int(stage.module.get_buffer("1.num_batches_tracked")) == int(before) + 1     # still training


class _ModeOps(torch.nn.Module):
    """The calls whose evaluation form the capture must reach besides dropout and batch norm."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
        self.drop = torch.nn.Dropout(0.5, inplace=True)
        self.rrelu = torch.nn.RReLU()
        self.inorm = torch.nn.InstanceNorm1d(8, track_running_stats=True)
        self.bn = torch.nn.BatchNorm1d(8, track_running_stats=False)
        self.bn_stats = torch.nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.kind == "inplace-dropout":
            h = self.drop(h)
        elif self.kind == "functional-inplace-dropout":
            h = torch.nn.functional.dropout(h, 0.5, self.training, inplace=True)
        elif self.kind == "rrelu":
            h = self.rrelu(h)
        elif self.kind == "instance-norm-with-running-stats":
            h = self.inorm(h.unsqueeze(-1).expand(-1, -1, 4).contiguous()).mean(-1)
        elif self.kind == "batch-norm-without-running-stats":
            h = self.bn(h)
        elif self.kind == "batch-norm":
            h = self.bn_stats(h)
        elif self.kind == "dropout-in-an-fp32-region":
            with torch.autocast("cpu", enabled=False):       # a wrap_with_autocast call and its body
                h = torch.nn.functional.dropout(h.float(), 0.5, self.training)
        elif self.kind == "batch-norm-in-an-fp32-region":
            with torch.autocast("cpu", enabled=False):
                h = self.bn_stats(h.float())
        return self.head(h)


@pytest.mark.parametrize("kind", ["inplace-dropout", "functional-inplace-dropout", "rrelu",
                                  "instance-norm-with-running-stats", "batch-norm-without-running-stats",
                                  "batch-norm", "dropout-in-an-fp32-region", "batch-norm-in-an-fp32-region"])
def test_eval_reaches_in_place_dropout_rrelu_and_instance_norm(kind):
    """Before: an in-place dropout (nn.Dropout(inplace=True)) kept dropping and RReLU kept sampling its
    slope in evaluation, an InstanceNorm with running statistics normalised by the batch (the loss here
    2.14x / 0.988x / 0.645x the model's in eval mode), a BatchNorm without running statistics raised
    "running_mean must be defined in evaluation mode", every BatchNorm counted the evaluated batch in
    ``num_batches_tracked``, and inside a ``torch.autocast(enabled=False)`` region (a higher-order
    call's body) dropout kept dropping (2.14x) and BatchNorm normalised by the batch and updated its
    running statistics (5.99x)."""
    from hybridpipe.profiles.capture import capture_model
    torch.manual_seed(0)
    module, x = _ModeOps(kind), torch.randn(6, 8)
    captured = capture_model(module, x, granularity="blocks")
    stage = build_stage_index(captured, [(0, len(captured.blocks) - 1)], 0, loss=lambda out, y: (out - y).pow(2).mean())
    y = torch.zeros(6, 3)
    held = {k: v.clone() for k, v in captured.module.state_dict().items()}
    evaluated = stage.forward_eval(stage.data_inputs(x), target=y).loss
    assert all(torch.equal(v, held[k]) for k, v in captured.module.state_dict().items())     # nothing updated
    with torch.no_grad():
        reference = (captured.module.eval()(x) - y).pow(2).mean()
    captured.module.train()
    assert torch.equal(evaluated, reference)
