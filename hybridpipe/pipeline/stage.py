"""One rank's part of the model: forward named tensors in, named tensors (or the loss) out, and back.

    stage = build_stage(model, plan, rank, loss=spec.loss, leaf_modules=spec.leaf_modules)
    act = stage.forward({"x": x})                 # stage 0: the model's inputs by placeholder name
    send(act.outputs)                             # named tensors for the next stage
    ...
    act = stage.forward(received, target=y)       # last stage: act.loss
    grads = stage.backward(act)                   # last stage: from the loss
    grads = stage.backward(act, received_grads)   # other stages: grads of act.outputs
    send(grads)                                   # grads of the stage's inputs (none on stage 0)

``stage.module`` is the stage's ``nn.Module`` (hand it to the optimizer and to the gradient
sync); its ``state_dict()`` keys are the original model's keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from hybridpipe.partitioner.plan import Plan, check_plan_fits
from hybridpipe.pipeline.split import StageBoundary, stage_boundaries, stage_graph_module
from hybridpipe.pipeline.values import pack, unpack
from hybridpipe.profiles.format import graph_signature
from hybridpipe.profiles.trace import graph_edges, node_infos, trace_model

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


@dataclass
class Activation:
    """What one micro-batch's forward left on a stage for its backward."""

    inputs: dict[str, torch.Tensor]               # the stage's inputs (leaves; float ones require grad)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)   # named tensors for the next stage
    output: Any = None                            # the model's output (last stage)
    loss: torch.Tensor | None = None              # the micro-batch's mean loss (last stage, with a target)


class PipelineStage:
    """A stage of a pipeline: the model's nodes ``first_node..last_node`` as an fx GraphModule."""

    def __init__(self, module: fx.GraphModule, boundary: StageBoundary, n_stages: int, loss: LossFn | None = None):
        self.module = module
        self.boundary = boundary
        self.index = boundary.index
        self.n_stages = n_stages
        self.loss_fn = loss

    # ---- identity ----------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    @property
    def input_names(self) -> tuple[str, ...]:
        """Graph values this stage receives (stage 0: the model's input placeholders)."""
        return self.boundary.inputs

    @property
    def output_names(self) -> tuple[str, ...]:
        """Graph values this stage sends on (empty on the last stage)."""
        return self.boundary.outputs

    @property
    def device(self) -> torch.device:
        for t in (*self.module.parameters(), *self.module.buffers()):
            return t.device
        return torch.device("cpu")

    # ---- module delegation -------------------------------------------------------------
    def parameters(self) -> Iterable[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True):
        return self.module.load_state_dict(state, strict=strict)

    def to(self, device: torch.device | str) -> PipelineStage:
        self.module.to(device)
        return self

    def train(self, mode: bool = True) -> PipelineStage:
        self.module.train(mode)
        return self

    # ---- compute -----------------------------------------------------------------------
    def forward(self, inputs: Mapping[str, torch.Tensor], target: torch.Tensor | None = None,
                params: Mapping[str, torch.Tensor] | None = None) -> Activation:
        """Run the stage on named input tensors (as made by ``values.pack``).

        Float inputs of stages after the first become leaves that require grad, so ``backward``
        can return their gradients. ``params`` (name -> tensor) replaces parameters for this
        call only (weight stashing). On the last stage a ``target`` gives ``Activation.loss``.
        """
        leaves = {k: _leaf(t, grad=not self.is_first) for k, t in inputs.items()}
        values = unpack(leaves, self.input_names)
        args = tuple(values[name] for name in self.input_names)
        if params is None:
            result = self.module(*args)
        else:
            result = torch.func.functional_call(self.module, dict(params), args, strict=False)
        act = Activation(inputs=leaves)
        if self.is_last:
            act.output = result
            if target is not None:
                act.loss = self.loss(result, target)
        else:
            act.outputs = pack(dict(zip(self.output_names, result, strict=True)),
                               f" (between stages {self.index} and {self.index + 1})")
        return act

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The model's mean loss of one micro-batch (last stage)."""
        if self.loss_fn is None:
            raise RuntimeError(f"stage {self.index} has no loss function; pass loss= to build_stage")
        return self.loss_fn(output, target)

    def backward(self, act: Activation,
                 output_grads: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Backpropagate one micro-batch; accumulates parameter grads, returns the inputs' grads.

        On the last stage from ``act.loss``; elsewhere from ``output_grads`` (grads of
        ``act.outputs`` by name; outputs without a grad are treated as not influencing the loss).
        """
        grads: list[torch.Tensor | None]
        if self.is_last:
            if act.loss is None:
                raise RuntimeError("backward on the last stage needs a forward with a target (the loss)")
            tensors, grads = [act.loss], [None]
        else:
            unknown = set(output_grads or {}) - set(act.outputs)
            if unknown:
                raise KeyError(f"stage {self.index} got gradients for {sorted(unknown)}, which it did not send")
            pairs = [(act.outputs[k], g) for k, g in (output_grads or {}).items() if act.outputs[k].requires_grad]
            tensors, grads = [t for t, _ in pairs], [g for _, g in pairs]
        if tensors:
            torch.autograd.backward(tensors, grads)
        return {k: t.grad for k, t in act.inputs.items() if t.requires_grad and t.grad is not None}


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    if grad and (t.is_floating_point() or t.is_complex()):
        return t.detach().requires_grad_(True)
    return t.detach()


def build_stage(model: nn.Module, plan: Plan, rank: int, *, loss: LossFn | None = None,
                leaf_modules: Iterable[type | str] = (), gm: fx.GraphModule | None = None,
                model_name: str | None = None, batch_size: int | None = None,
                world_size: int | None = None) -> PipelineStage:
    """This rank's stage of ``model`` under ``plan`` (refuses a plan made for another model).

    ``gm`` is ``trace_model(model, leaf_modules)`` when the caller already has it. The traced
    graph must be the one the plan was made for (same node count and signature); ``model_name``,
    ``batch_size`` and ``world_size``, when given, must match the plan too (one-line UserError).
    """
    gm = gm if gm is not None else trace_model(model, leaf_modules)
    signature = graph_signature(node_infos(gm), graph_edges(gm))
    check_plan_fits(plan, model=model_name, signature=None, batch_size=batch_size, world_size=world_size,
                    n_nodes=len(gm.graph.nodes))
    check_plan_fits(plan, model=None, signature=signature, batch_size=None, world_size=None)
    stage, _ = plan.stage_of_rank(rank)
    return build_stage_index(gm, [(s.first_node, s.last_node) for s in plan.stages], stage.index, loss=loss)


def build_stage_index(gm: fx.GraphModule, ranges: list[tuple[int, int]], index: int, *,
                      loss: LossFn | None = None) -> PipelineStage:
    """Stage ``index`` of ``gm`` cut at inclusive node ``ranges`` (no plan needed)."""
    boundary = stage_boundaries(gm, ranges)[index]
    module = stage_graph_module(gm, boundary, last=index == len(ranges) - 1)
    return PipelineStage(module, boundary, len(ranges), loss)
