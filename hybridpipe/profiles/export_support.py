"""What the capture needs around torch.export: its failures as one line, kept off stderr; the
custom autograd Functions on an autograd graph; a forward that leaves no trace.

torch.export prints the partial graph of a failed capture to stderr and logs shape warnings; the
user gets instead one line naming the construct, the source line, the module and what to do.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

_TORCH_DIR = os.path.dirname(torch.__file__)
_PROFILES_DIR = os.path.dirname(__file__) + os.sep      # hybridpipe's capture code: not the user's


@contextlib.contextmanager
def quiet_failures() -> Iterator[None]:
    """Keep a failed export's partial graph (torch prints it to stderr: dozens of lines ahead of the
    one-line error the user gets) and its "Unable to find user code" warnings off stderr; pass on
    everything else written there. In the main thread only: sys.stderr is the whole process's."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level, real, buffer = shapes.level, sys.stderr, io.StringIO()
    shapes.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    except BaseException as e:
        partial = str(getattr(e, "partial_fx_graph", "") or "")
        real.write(buffer.getvalue().replace(partial + "\n", "") if partial else buffer.getvalue())
        raise
    else:
        real.write(buffer.getvalue())
    finally:
        shapes.setLevel(level)


def custom_functions(output: Any) -> list[str]:
    """Names of the custom ``torch.autograd.Function``s on the autograd graph behind ``output``.

    Not counted: the autograd formula of an operator registered with ``torch.library`` (such as
    transformers' ``grouped_mm_fallback``), which torch.export records as one call of that
    operator, its registered backward kept."""
    found: list[str] = []
    for fn in _function_nodes(output):
        name = _function_name(fn)
        if name not in found:
            found.append(name)
    return found


def _function_nodes(output: Any, stop: set[Any] | None = None) -> list[Any]:
    """The backward nodes of custom autograd Functions behind ``output`` (not past ``stop``)."""
    stack: list[Any] = [t.grad_fn for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    seen: set[Any] = set(stop or ())
    found = []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if (isinstance(fn, torch.autograd.function.BackwardCFunction)
                and getattr(getattr(fn, "_forward_cls", None), "__module__", "") != "torch._library.autograd"):
            found.append(fn)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found


def _function_name(fn: Any) -> str:
    return type(fn).__name__.removesuffix("Backward")


def _reachable(value: Any) -> set[Any]:
    """Every autograd node behind the tensors of ``value``."""
    stack: list[Any] = [t.grad_fn for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    seen: set[Any] = set()
    while stack:
        fn = stack.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return seen


def function_callers(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, str]:
    """Custom autograd Function name -> class of the innermost module whose forward calls it (the
    model's own class for a call in its forward), from one eager forward that leaves no trace."""
    depth: dict[Any, tuple[int, str]] = {}          # Function node -> (module depth, module class)
    paths = {id(m): p for p, m in model.named_modules()}

    def after(module: nn.Module, a: tuple, kw: dict, output: Any) -> None:
        path = paths.get(id(module), "")
        level = len(path.split(".")) if path else 0
        for fn in _function_nodes(output, stop=_reachable((a, kw))):
            if fn not in depth or depth[fn][0] < level:
                depth[fn] = (level, type(module).__name__)

    handles = [m.register_forward_hook(after, with_kwargs=True) for m in model.modules()]
    try:
        with side_effect_free(model), torch.enable_grad():
            out = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    callers: dict[str, str] = {}
    for fn, (_, cls) in depth.items():
        callers.setdefault(_function_name(fn), cls)
    del out
    return callers


@contextlib.contextmanager
def side_effect_free(model: nn.Module) -> Iterator[None]:
    """Run a forward of ``model`` that leaves no trace: its buffers (batch norm statistics) and the
    random number generators are as they were afterwards."""
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    devices = sorted({t.device.index or 0 for t in (*model.parameters(), *model.buffers()) if t.is_cuda})
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(saved[name])


def function_refusal(model: nn.Module, args: tuple, kwargs: dict, functions: list[str],
                     leaves: list[str]) -> str:
    """One line: which custom autograd Functions (outside the ``leaves``), called in which module's
    forward, and which --leaf keeps them."""
    root = type(model).__name__
    callers = function_callers(model, args, kwargs)
    owners = list(dict.fromkeys(callers.get(f, "") for f in functions))
    outside = f" outside the leaf modules ({', '.join(leaves)})" if leaves else ""
    where = ", ".join(f"{o}.forward" for o in owners if o)
    classes = [o for o in owners if o and o != root]
    fixes = [f"keep {' and '.join(classes)} whole with {' '.join(f'--leaf {c}' for c in classes)} (then it runs as "
             "written, as one call inside the graph, its own backward kept)"] if classes else []
    if root in owners:
        fixes.append(f"move the call out of {root}.forward into a submodule and keep that whole with --leaf CLASS")
    if "" in owners:
        fixes.append("keep the module that calls it whole with --leaf CLASS")
    return (f"{root} calls the custom torch.autograd.Function {', '.join(functions)}{outside}"
            f"{f' (in {where})' if where else ''}, whose own backward torch.export would replace by the derivative "
            f"of its forward; {'; '.join(fixes)}")


def export_failure_message(model: nn.Module, error: BaseException) -> str:
    """One line: what torch.export could not capture, where in the user's code, and what to do."""
    frame = user_frame(error)
    at = f" at {os.path.basename(frame.filename)}:{frame.lineno} `{(frame.line or '').strip()}`" if frame else ""
    owner = module_of_error(error)
    inside = f" (in {owner}.forward)" if owner and owner != type(model).__name__ else ""
    leaf = (f", or keep {owner} whole with --leaf {owner} (it then runs as written, as one call inside the graph)"
            if inside else "")
    return (f"torch.export cannot capture {type(model).__name__}{at}{inside}: {type(error).__name__}: "
            f"{first_line(error)}; make that code traceable (no Python branching on tensor values: use "
            f"torch.where/torch.cond, or compute it outside forward){leaf}, or pass an example input the model accepts")


def module_of_error(error: BaseException) -> str | None:
    """The class of the innermost module (outside torch) whose ``forward`` was running when ``error`` rose."""
    owner = None
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        this = frame.f_locals.get("self")
        if isinstance(this, nn.Module) and not frame.f_code.co_filename.startswith(_TORCH_DIR):
            owner = type(this).__name__
        tb = tb.tb_next
    return owner


def user_frame(error: BaseException) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(error.__traceback__)
    user = [f for f in frames if not f.filename.startswith((_TORCH_DIR, _PROFILES_DIR))]
    return user[-1] if user else None


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else "(no message)"
    return line[:300]
