"""Profiling a model: capture it, time every block's forward and backward, count its bytes.

``profile_model(spec, batch_size=...)`` returns a ``Profile`` (see format.py). Node times come
from replaying each block in isolation on its real inputs (measure.py); the last block carries
the loss, which the last pipeline stage computes. The node sums are checked against a timed
full forward + loss + backward of the whole model: ``totals.ratio`` near 1 means the per-node
numbers add up to what training costs (the whole captured graph, which is what the stages run).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.utils._pytree as pytree
from tqdm import tqdm

from hybridpipe.errors import UserError
from hybridpipe.profiles.capture import (
    CapturedModel,
    autocast_context,
    capture_model,
    own_loss,
    tied_parameters,
)
from hybridpipe.profiles.format import Profile, ProfileNode, ProfileTotals, ProfileValue, inconsistent_times
from hybridpipe.profiles.graphinfo import graph_edges, node_infos, unused_parameters
from hybridpipe.profiles.losses import as_mean
from hybridpipe.profiles.measure import (
    BlockModule,
    Timing,
    block_modules,
    measure_block,
    measure_optimizer,
    measure_step,
    nbytes,
    reference_pass,
    storage_keys,
    tensors,
)
from hybridpipe.profiles.weighthalf import SplitBackward, weight_half_split
from hybridpipe.profiles.zoo.spec import ModelSpec

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}    # precision -> autocast dtype


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
                  warmup: int = 1, seed: int = 0, progress: bool | None = True,
                  granularity: str | int = "blocks", precision: str = "fp32",
                  split_backward: SplitBackward | None = None, threads: int | None = None) -> Profile:
    """Capture and measure ``model`` at ``batch_size`` samples per (micro-)batch on ``device``.

    ``granularity``: how operations group into nodes (profiles/blocks.py). ``progress``: a tqdm
    bar on stderr (None: only when stderr is a terminal). ``precision`` bf16 / fp16: captured and
    measured under ``torch.autocast`` as a job with ``--precision`` runs (activation bytes in 16 bits
    where autocast computes in them; the weights stay float32). ``split_backward``: the pipeline's
    split backward's input half (``pipeline/splitback.backward_input``; this package imports nothing
    of the pipeline): with it, each node's ``weight_half_bytes`` / ``weight_half_saves`` /
    ``weight_half_grad_bytes`` are measured (weighthalf.py), what a zero-bubble schedule's stage holds
    between a micro-batch's input and weight halves. ``threads``: intra-op CPU threads to measure with
    (None: torch's current count, which honours ``OMP_NUM_THREADS``), restored afterwards.
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _profile(model, batch_size=batch_size, device=device, repeats=repeats, warmup=warmup, seed=seed,
                        progress=progress, granularity=granularity, precision=precision,
                        split_backward=split_backward)
    finally:
        torch.set_num_threads(before)


def _profile(model: ModelSpec, *, batch_size: int, device: str | torch.device, repeats: int, warmup: int,
             seed: int, progress: bool | None, granularity: str | int, precision: str,
             split_backward: SplitBackward | None) -> Profile:
    if precision not in AUTOCAST:
        raise UserError(f"unknown precision {precision!r}; choose one of {', '.join(AUTOCAST)}")
    autocast = AUTOCAST[precision]
    if batch_size < 1 or repeats < 1 or warmup < 0:
        raise UserError(f"need batch size >= 1, repeats >= 1 and warmup >= 0; got {batch_size}, {repeats}, {warmup}")
    device = resolve_device(str(device))
    torch.manual_seed(seed)
    module = model.build().to(device).train()
    generator = torch.Generator().manual_seed(seed)
    batch = to_device(model.example_input(batch_size, generator), device)
    target = to_device(model.example_target(batch_size, generator), device)
    loss = as_mean(model.loss) if model.loss is not None else None      # a (loss_sum, count) pair as its mean
    captured = capture_model(module, batch, granularity=granularity, leaf_modules=model.leaf_modules,
                             autocast=autocast)
    blocks = block_modules(captured)
    env = reference_pass(captured, blocks, batch, autocast=autocast)
    infos = node_infos(captured)
    timing = Timing(device=device, repeats=repeats, warmup=warmup)
    disable = None if progress is None else not progress
    nodes = []
    for i, (block, info) in enumerate(tqdm(list(zip(blocks, infos, strict=True)), desc=f"profile {model.name}",
                                           unit="node", disable=disable, leave=False)):
        cost = measure_block(captured, block, env, loss=loss, target=target, autocast=autocast, **timing)
        half = None if split_backward is None else weight_half_split(
            captured, block, env, loss=loss, target=target, split=split_backward, autocast=autocast,
            device=timing["device"])
        kept = None if half is None else half.kept
        own = [module.get_parameter(p) for p in info.params]
        crossing = [env[name] for name in block.outputs] if not block.last else []
        nodes.append(ProfileNode(
            id=i, name=info.name, op=info.op, target=info.target, type=info.type,
            forward_ms=round(cost.forward_ms, 6), backward_ms=round(cost.backward_ms, 6),
            activation_bytes=cost.output_bytes, saved_bytes=cost.saved.inner_bytes, saves=cost.saved.saves,
            param_count=sum(p.numel() for p in own), param_bytes=sum(p.numel() * p.element_size() for p in own),
            trained_bytes=sum(p.numel() * p.element_size() for p in own if p.requires_grad),
            params=info.params, shared=info.shared,
            shared_bytes=tuple(_nbytes(module.get_parameter(p)) for p in info.shared),
            cut_bytes=sum(nbytes(v) for v in crossing),
            cut_grad_bytes=sum(t.numel() * t.element_size() for v in crossing for t in tensors(v) if t.requires_grad),
            cut_blocker=next((name for name in block.outputs if name in captured.blocked), None),
            forward_transient_bytes=cost.forward_transient, backward_transient_bytes=cost.backward_transient,
            weight_half_bytes=None if kept is None else kept.inner_bytes,
            weight_half_saves=None if kept is None else kept.saves,
            weight_half_grad_bytes=None if half is None else half.grad_bytes))
    values = boundary_values(captured, blocks, env)
    del env
    flat = captured.flatten_input(batch)
    graph_args = [flat[name] for name in captured.inputs]

    def run_loss() -> torch.Tensor:     # the captured graph, as the pipeline's stages run it
        with autocast_context(module, autocast):
            out = captured.rebuild_output(captured.graph(*graph_args))
            return loss(out, target) if loss is not None else own_loss_of(out)

    measured = measure_step(run_loss, module, **timing)
    steps = {kind: measure_optimizer(module, kind, **timing) for kind in ("sgd", "adam")}
    first = next(t for t in tensors(batch))
    params = list(module.parameters())
    totals = _totals(nodes, module, measured, steps)
    busy = inconsistent_times(totals.ratio, torch.get_num_threads())
    return Profile(
        model=model.name, batch_size=batch_size, input_shape=tuple(first.shape),
        input_dtype=_dtype_name(first.dtype), dtype=_dtype_name(params[0].dtype) if params else "float32",
        device=device_description(device), torch_version=torch.__version__,
        nodes=tuple(nodes), edges=tuple(graph_edges(captured)),
        totals=totals, repeats=repeats,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        notes=_notes(captured) + ((busy,) if busy else ()), granularity=str(granularity), front_end=captured.front_end,
        tied=tuple(tied_parameters(module)), values=values, loss_saved_bytes=cost.saved.loss_bytes,
        precision=precision, threads=torch.get_num_threads())


def boundary_values(captured: CapturedModel, blocks: list[BlockModule],
                    env: dict[str, Any]) -> tuple[ProfileValue, ...]:
    """Every value that enters a block from outside it: the model's inputs and the outputs blocks hand
    on, with the block that makes it (-1: a model input), the last block that reads it, its bytes,
    the first value sharing its storage (a view of another) and whether it requires grad."""
    producer = {name: -1 for name in captured.inputs}
    last_use: dict[str, int] = {}
    for b, block in enumerate(blocks):
        producer.update({name: b for name in block.produced})
        last_use.update({name: b for name in block.inputs})
    out: list[ProfileValue] = []
    first_of: dict[int, int] = {}
    for name, b in producer.items():
        if name not in last_use or name not in env:
            continue                # a model input no block reads
        keys = sorted(storage_keys(env[name]))
        alias = first_of.setdefault(keys[0], len(out)) if keys else len(out)
        grad = any(t.requires_grad for t in tensors(env[name]))
        out.append(ProfileValue(name, b, last_use[name], nbytes(env[name]), alias, grad))
    return tuple(out)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (tensor, tuple or dict, nested) with every tensor moved to ``device``."""
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)


def own_loss_of(output: Any) -> torch.Tensor:
    loss = own_loss(output)
    if loss is None:
        raise UserError(f"the model returned a {type(output).__name__} without a loss and has no loss function")
    return loss


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


def _notes(captured: CapturedModel) -> tuple[str, ...]:
    notes = ["the last node's forward_ms/backward_ms include the loss's"]
    if captured.front_end == "fx":
        notes.append("captured with torch.fx's tracer (torch.export could not capture the model)")
    unused = unused_parameters(captured)
    if unused:
        notes.append(f"{len(unused)} parameter tensors are not used by forward (held unchanged by the node of "
                     f"their nearest module): {', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}")
    return tuple(notes)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
