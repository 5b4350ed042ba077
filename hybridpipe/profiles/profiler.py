"""Profiling a model: trace it, time every node's forward and backward, count its bytes.

``profile_model(spec, batch_size=...)`` returns a ``Profile`` (see format.py). Node times come
from replaying each node in isolation on its real inputs (measure.py); the ``output`` node
carries the loss (its forward and backward), which the last pipeline stage computes. The
node sums are checked against a timed full forward + loss + backward of the whole graph:
``totals.ratio`` near 1 means the per-node numbers add up to what training costs.
"""

from __future__ import annotations

import datetime

import torch
from tqdm import tqdm

from hybridpipe.errors import UserError
from hybridpipe.profiles.format import Profile, ProfileNode, ProfileTotals
from hybridpipe.profiles.measure import (
    Timing,
    measure_loss,
    measure_node,
    measure_optimizer,
    measure_step,
    reference_pass,
)
from hybridpipe.profiles.trace import graph_edges, node_infos, trace_model
from hybridpipe.profiles.zoo.registry import ModelSpec


def resolve_device(name: str) -> torch.device:
    """``cpu`` or ``cuda[:i]``; asking for CUDA on a machine without it is a UserError."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"device {name!r} is not a torch device; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but torch sees no CUDA device here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device {name!r} is not supported; use cpu or cuda")
    return device


def device_description(device: torch.device) -> str:
    """``cpu`` or ``cuda (GPU name)``, as recorded in a profile."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu"


def profile_model(model: ModelSpec, *, batch_size: int, device: str | torch.device = "cpu", repeats: int = 5,
                  warmup: int = 1, seed: int = 0, progress: bool | None = True) -> Profile:
    """Trace and measure ``model`` at ``batch_size`` samples per (micro-)batch on ``device``.

    ``progress``: a tqdm bar on stderr (None: only when stderr is a terminal).
    """
    if batch_size < 1 or repeats < 1 or warmup < 0:
        raise UserError(f"need batch size >= 1, repeats >= 1 and warmup >= 0; got {batch_size}, {repeats}, {warmup}")
    device = resolve_device(str(device))
    torch.manual_seed(seed)
    module = model.build().to(device).train()
    gm = trace_model(module, model.leaf_modules)
    infos = node_infos(gm)
    generator = torch.Generator().manual_seed(seed)
    x = model.example_input(batch_size, generator).to(device)
    target = model.example_target(batch_size, generator).to(device)

    env = reference_pass(gm, x)
    params = dict(gm.named_parameters(remove_duplicate=False))
    counted: set[int] = set()
    nodes = []
    timing = Timing(device=device, repeats=repeats, warmup=warmup)
    disable = None if progress is None else not progress
    for i, (node, info) in enumerate(tqdm(list(zip(gm.graph.nodes, infos, strict=True)), desc=f"profile {model.name}",
                                          unit="node", disable=disable, leave=False)):
        if node.op == "output":
            fwd, bwd = measure_loss(model.loss, env[node], target, **timing)
            cost_bytes = 0
        else:
            cost = measure_node(gm, node, env, **timing)
            fwd, bwd, cost_bytes = cost.forward_ms, cost.backward_ms, cost.activation_bytes
        own = [params[p] for p in info.params if id(params[p]) not in counted]
        counted.update(id(p) for p in own)
        nodes.append(ProfileNode(
            id=i, name=info.name, op=info.op, target=info.target, type=info.type,
            forward_ms=round(fwd, 6), backward_ms=round(bwd, 6), activation_bytes=cost_bytes,
            param_count=sum(p.numel() for p in own), param_bytes=sum(p.numel() * p.element_size() for p in own),
            params=info.params))
    del env
    measured = measure_step(gm, model.loss, (x,), target, **timing)
    steps = {kind: measure_optimizer(gm, kind, **timing) for kind in ("sgd", "adam")}
    return Profile(
        model=model.name, batch_size=batch_size, input_shape=tuple(x.shape),
        input_dtype=_dtype_name(x.dtype), dtype=_dtype_name(next(iter(params.values())).dtype) if params else "float32",
        device=device_description(device), torch_version=torch.__version__,
        nodes=tuple(nodes), edges=tuple(graph_edges(gm)),
        totals=_totals(nodes, module, measured, steps), repeats=repeats,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        notes=_notes(nodes, module))


def _totals(nodes: list[ProfileNode], module: torch.nn.Module, measured_ms: float,
            step_ms: dict[str, float]) -> ProfileTotals:
    fwd = sum(n.forward_ms for n in nodes)
    bwd = sum(n.backward_ms for n in nodes)
    unique = {id(p): p for p in module.parameters()}.values()
    return ProfileTotals(
        forward_ms=round(fwd, 6), backward_ms=round(bwd, 6), measured_ms=round(measured_ms, 6),
        ratio=round((fwd + bwd) / measured_ms, 4) if measured_ms > 0 else 0.0,
        param_count=sum(p.numel() for p in unique), param_bytes=sum(p.numel() * p.element_size() for p in unique),
        activation_bytes=sum(n.activation_bytes for n in nodes),
        sgd_step_ms=round(step_ms.get("sgd", 0.0), 6), adam_step_ms=round(step_ms.get("adam", 0.0), 6))


def _notes(nodes: list[ProfileNode], module: torch.nn.Module) -> tuple[str, ...]:
    notes = ["the output node's forward_ms/backward_ms are the loss's"]
    distinct = {id(p): p for p in module.parameters()}.values()
    unused = sum(p.numel() for p in distinct) - sum(n.param_count for n in nodes)
    if unused:
        notes.append(f"{unused} parameters are not used by forward (no node owns them)")
    return tuple(notes)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
