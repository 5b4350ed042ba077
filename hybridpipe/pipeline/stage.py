"""One rank's part of the model: forward named values in, named tensors (or the loss) out, and back.

    captured = capture_model(model, example)           # profiles/capture.py (every rank, same graph)
    stage = build_stage(captured, plan, rank, loss=spec.loss)   # plancheck.py: the plan checked, then the stage
    act = stage.forward(stage.data_inputs(batch))      # stage 0: the batch as the model takes it
    send(act.outputs)                                  # named tensors for the next stage
    ...
    act = stage.forward(received, target=y)            # last stage: act.loss
    grads = stage.backward(act)                        # last stage: from the loss
    grads = stage.backward(act, received_grads)        # other stages: grads of act.outputs
    send(grads)                                        # grads of the stage's inputs (none on stage 0)

``stage.module`` is the stage's ``nn.Module`` (hand it to the optimizer and to the gradient
sync); its ``state_dict()`` keys are the original model's keys. The loss is ``loss(output,
target)`` when the model spec has a loss function, else the one the model computes itself (a
Hugging Face model given ``labels``: ``output.loss``).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import fx, nn

from hybridpipe.errors import UserError
from hybridpipe.pipeline.batch_stats import COMBINE, DIRECT, RunningStats, install
from hybridpipe.pipeline.buffer_writes import buffer_writes, check_stage_writes
from hybridpipe.pipeline.splitback import WeightWork, backward_input, backward_weight
from hybridpipe.pipeline.splitplan import SplitPlans
from hybridpipe.pipeline.values import pack, unpack
from hybridpipe.profiles.capture import CapturedModel, own_loss
from hybridpipe.profiles.cut import StageBoundary, stage_boundaries, stage_graph_module
from hybridpipe.profiles.evalmode import eval_graph
from hybridpipe.profiles.format import graph_signature
from hybridpipe.profiles.gradflow import grad_values
from hybridpipe.profiles.graphinfo import graph_edges, node_infos

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class Activation:
    """What one micro-batch's forward left on a stage for its backward."""

    inputs: dict[str, torch.Tensor]               # the stage's inputs (leaves; those that may carry a grad require it)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)   # named tensors for the next stage
    output: Any = None                            # the model's output (last stage)
    loss: torch.Tensor | None = None              # the micro-batch's mean loss (last stage)


def loss_of(spec_loss: LossFn | None) -> LossFn:
    """``(output, target) -> loss`` for a model spec's loss: its function, or (None) the loss the
    model computed itself (the target is then unused)."""
    if spec_loss is not None:
        return spec_loss
    return lambda output, _target: model_loss(output)


def model_loss(output: Any) -> torch.Tensor:
    """The loss a model computed itself: ``output.loss`` / ``output["loss"]``, or a scalar output."""
    loss = own_loss(output)
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if loss is None:
        raise UserError(f"the model returned a {type(output).__name__} without a loss: give the model's factory a "
                        "loss function, (module, example_input, loss_fn), or include the labels in its inputs")
    return loss


class PipelineStage:
    """A stage of a pipeline: the model's blocks ``first_node..last_node`` as an fx GraphModule."""

    def __init__(self, module: fx.GraphModule, boundary: StageBoundary, n_stages: int, captured: CapturedModel,
                 loss: LossFn | None = None, recompute: bool = False, replicas: int = 1):
        self.recompute = recompute      # keep only the inputs; rerun the forward inside backward
        self.replicas = replicas        # > 1: running statistics are combined across them (batch_stats.py)
        self.boundary = boundary
        self.index = boundary.index
        self.n_stages = n_stages
        self.captured = captured
        self.loss_fn = loss
        self._eval_module: fx.GraphModule | None = None
        carrying = grad_values(captured.graph)     # received values that may need a gradient (None: any float)
        self._grad_inputs = None if carrying is None else frozenset(carrying)
        self._plain_graph: fx.Graph | None = None       # the model's own calls, for evaluation
        self.stats: RunningStats | None = None
        writes = buffer_writes(module) if replicas > 1 or recompute else []
        if writes:
            check_stage_writes(writes, self.index, replicas, recompute)
            self._plain_graph = copy.deepcopy(module.graph)
            self.stats = install(module, writes, COMBINE if replicas > 1 else DIRECT)
        self.module = module
        self._first_param: nn.Parameter | None = None     # where `device` looks (found once)
        self.split_plans = SplitPlans()          # the split backward's cut, kept across micro-batches

    # ---- identity ----------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    @property
    def input_names(self) -> tuple[str, ...]:
        """Graph values this stage receives (stage 0: the model's inputs)."""
        return self.boundary.inputs

    @property
    def output_names(self) -> tuple[str, ...]:
        """Graph values this stage sends on (empty on the last stage)."""
        return self.boundary.outputs

    @property
    def device(self) -> torch.device:
        """Where the stage's weights are: its first parameter's (or buffer's) device; CPU with none.
        The parameter is found once (``module.to`` moves it in place; it is read every forward)."""
        if self._first_param is not None:
            return self._first_param.device
        first = next(itertools.chain(self.module.parameters(), self.module.buffers()), None)
        if isinstance(first, nn.Parameter):
            self._first_param = first
        return torch.device("cpu") if first is None else first.device

    def _needs_grad(self, key: str) -> bool:
        """Whether the received tensor ``key`` (a value, or a leaf ``value.i`` of one: values.py) may
        carry a gradient: values made from inputs and buffers alone (rotary cos/sin, masks) do not
        (profiles/gradflow.py), so the stage neither keeps nor computes nor sends one for them."""
        return self._grad_inputs is None or key.split(".")[0] in self._grad_inputs

    def data_inputs(self, batch: Any) -> dict[str, torch.Tensor]:
        """Stage 0: one batch as the data gives it (tensor, tuple or dict) -> its named input tensors."""
        values = self.captured.flatten_input(batch)
        return pack({name: values[name] for name in self.input_names})

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
        self._first_param = None
        self._eval_module = None            # it would hold the buffers' old tensors
        return self

    def train(self, mode: bool = True) -> PipelineStage:
        self.module.train(mode)
        return self

    # ---- compute -----------------------------------------------------------------------
    def forward(self, inputs: Mapping[str, torch.Tensor], target: torch.Tensor | None = None,
                params: Mapping[str, torch.Tensor] | None = None, micro_batch: int | None = None,
                owned: bool = False) -> Activation:
        """Run the stage on named input tensors (as made by ``values.pack``).

        Float inputs of stages after the first become leaves that require grad, so ``backward``
        can return their gradients. ``params`` (name -> tensor) replaces parameters for this
        call only (weight stashing). On the last stage the loss is computed when a ``target`` is
        given or the model computes its own loss. With ``recompute`` the stage's graph runs under
        ``torch.utils.checkpoint`` (non-reentrant, random state preserved): autograd keeps only
        the stage's inputs and reruns the forward when the backward first needs its activations
        (running statistics are updated once, by this call: batch_stats.py). ``micro_batch``: its
        number over the run, which orders a replicated stage's statistics (default: calls so far).
        ``owned``: the input tensors are this call's alone (a receive's), so a leaf is marked in place
        (no ``detach`` dispatched per input); else the caller's tensors are left as they are.
        """
        first = self.is_first
        leaves = {k: _leaf(t, not first and self._needs_grad(k), owned) for k, t in inputs.items()}
        values = unpack(_unleafed(leaves, self.device), self.input_names)
        args = tuple(values[name] for name in self.input_names)

        def run(*xs: Any) -> Any:
            if params is None:
                return self.module(*xs)
            return torch.func.functional_call(self.module, dict(params), xs, strict=False)
        versions = _versions(self.module) if self.replicas > 1 else None
        if self.stats is not None:
            self.stats.begin(micro_batch)
        try:
            if self.recompute and torch.is_grad_enabled():
                result = torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)
            else:
                result = run(*args)
        finally:
            if self.stats is not None:
                self.stats.end()
        if versions is not None:
            _check_versions(self.module, versions, self.index, self.replicas)
        act = Activation(inputs=leaves)
        if self.is_last:
            act.output = self.captured.rebuild_output(result)
            if target is not None or self.loss_fn is None:
                act.loss = self.loss(act.output, target)
        else:
            act.outputs = pack(dict(zip(self.output_names, result, strict=True)),
                               f" (between stages {self.index} and {self.index + 1})")
        return act

    def forward_eval(self, inputs: Mapping[str, torch.Tensor], target: torch.Tensor | None = None) -> Activation:
        """The forward of an evaluation step: evaluation mode (no dropout, batch norm on running
        statistics), no autograd; the loss on the last stage as in :meth:`forward`."""
        if self._eval_module is None:
            plain = self._plain_graph
            self._eval_module = eval_graph(self.module if plain is None
                                           else fx.GraphModule(self.module, copy.deepcopy(plain)))
        with torch.no_grad():
            values = unpack(inputs, self.input_names)
            result = self._eval_module(*(values[name] for name in self.input_names))
            act = Activation(inputs=dict(inputs))
            if self.is_last:
                act.output = self.captured.rebuild_output(result)
                if target is not None or self.loss_fn is None:
                    act.loss = self.loss(act.output, target)
            else:
                act.outputs = pack(dict(zip(self.output_names, result, strict=True)))
        return act

    def loss(self, output: Any, target: torch.Tensor | None) -> torch.Tensor:
        """The model's mean loss of one micro-batch (last stage)."""
        if self.loss_fn is None:
            return model_loss(output)
        return self.loss_fn(output, target)

    def backward(self, act: Activation, output_grads: Mapping[str, torch.Tensor] | None = None, *,
                 loss_seed: float | None = None) -> dict[str, torch.Tensor]:
        """Backpropagate one micro-batch; accumulates parameter grads, returns the inputs' grads.

        On the last stage from ``act.loss`` (seeded with ``loss_seed`` instead of 1 when given:
        loss_seed.py); elsewhere from ``output_grads`` (grads of ``act.outputs`` by name; outputs
        without a grad are treated as not influencing the loss).
        """
        tensors, grads = self._roots(act, output_grads, loss_seed)
        if tensors:
            torch.autograd.backward(tensors, grads)
        return {k: t.grad for k, t in act.inputs.items() if t.requires_grad and t.grad is not None}

    def backward_input(self, act: Activation, output_grads: Mapping[str, torch.Tensor] | None = None, *,
                       loss_seed: float | None = None) -> tuple[dict[str, torch.Tensor], WeightWork]:
        """The first half of a split backward: the inputs' grads (as :meth:`backward` returns
        them), and what :meth:`backward_weight` needs to accumulate the parameters' grads later."""
        tensors, grads = self._roots(act, output_grads, loss_seed)
        work = backward_input(tensors, grads, list(act.inputs.values()), list(self.module.parameters()),
                              one_pass=self.recompute, plans=self.split_plans)
        out = {k: t.grad for k, t in act.inputs.items() if t.requires_grad and t.grad is not None}
        for t in act.inputs.values():       # ``act`` waits for the weight half: not its inputs' gradients too
            t.grad = None
        return out, work

    @staticmethod
    def backward_weight(work: WeightWork) -> None:
        """The second half of a split backward: accumulate the parameters' grads."""
        backward_weight(work)

    def _roots(self, act: Activation, output_grads: Mapping[str, torch.Tensor] | None, loss_seed: float | None
               ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Where a backward starts: the loss (last stage; its seed ``loss_seed``, None: ones), else
        the outputs that got gradients."""
        if self.is_last:
            if act.loss is None:
                raise RuntimeError("backward on the last stage needs a forward with a target (the loss)")
            # the seed made here in place of autograd's ones_like: no extra op for the 1/M factor
            return [act.loss], [None if loss_seed is None else torch.full_like(act.loss, loss_seed)]
        unknown = set(output_grads or {}) - set(act.outputs)
        if unknown:
            raise KeyError(f"stage {self.index} got gradients for {sorted(unknown)}, which it did not send")
        pairs = [(act.outputs[k], g) for k, g in (output_grads or {}).items() if act.outputs[k].requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]


def _versions(module: nn.Module) -> list[int]:
    return [b._version for b in module.buffers()]


def _check_versions(module: nn.Module, before: list[int], index: int, replicas: int) -> None:
    """UserError when a forward of a replicated stage changed a buffer (one the graph hides: a leaf module's)."""
    for (name, b), v in zip(module.named_buffers(), before, strict=True):
        if b._version != v:
            raise UserError(f"stage {index} has {replicas} replicas and its training forward changed buffer {name!r} "
                            "(inside a leaf module), which hybridpipe cannot combine across replicas: give that "
                            "layer a stage without replicas (re-partition) or stop changing the buffer in forward")


def _leaf(t: torch.Tensor, grad: bool, owned: bool) -> torch.Tensor:
    """A stage input as a leaf of the stage's graph, requiring grad where ``grad`` and it can.
    A tensor without a graph that needs no grad is taken as it is (``detach`` would only dispatch
    one more op); one that ``owned`` (a receive's: no one else holds it) is marked in place; a
    caller's own that requires grad or must start to is detached first (left unchanged)."""
    if t.requires_grad or (grad and not owned):
        t = t.detach()
    if grad and (t.is_floating_point() or t.is_complex()):
        return t.requires_grad_(True)
    return t


def _unleafed(leaves: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """What the graph is fed under autocast: each input that requires grad as a view of its leaf.
    Autocast caches its 16-bit copy of a leaf that requires grad (meant for weights) and reuses it
    for every op in the forward, so the gradients of those uses would be summed in 16 bits before
    the cast back; in the unsplit model this value is no leaf, is cast once per use, and its
    gradients are summed in its own dtype. A view is no leaf: the same casts as the unsplit model,
    and the gradient reaches the leaf unchanged."""
    if not torch.is_autocast_enabled(device.type):
        return leaves
    return {k: t.view_as(t) if t.requires_grad else t for k, t in leaves.items()}


def captured_signature(captured: CapturedModel) -> str:
    """The profile signature of a capture (what a plan's ``profile_signature`` must equal)."""
    return graph_signature(node_infos(captured), graph_edges(captured))


def build_stage_index(captured: CapturedModel, ranges: list[tuple[int, int]], index: int, *,
                      loss: LossFn | None = None, recompute: bool = False, replicas: int = 1) -> PipelineStage:
    """Stage ``index`` of ``captured`` cut at inclusive block ``ranges`` (no plan needed);
    ``replicas`` > 1 combines running statistics across them (pipeline/batch_stats.py)."""
    boundary = stage_boundaries(captured, ranges)[index]
    module = stage_graph_module(captured, boundary, last=index == len(ranges) - 1)
    return PipelineStage(module, boundary, len(ranges), captured, loss, recompute, replicas)
