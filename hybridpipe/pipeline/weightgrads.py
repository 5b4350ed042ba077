"""The weight half's own formulas: a parameter-side gradient of an autograd node from its saved tensors.

Where a parameter's gradient path meets the input-gradient path (an "intermediate" of the split
backward, ``splitback.py``) the node is mostly a matrix product (``nn.Linear``, Hugging Face's
``Conv1D``: ``AddmmBackward0`` / ``MmBackward0``), a layer norm or an addition. For those the
gradients on the parameters' side are one call each, the call autograd's own formula makes
(``FunctionsManual.cpp``'s ``mm_mat1_backward`` / ``mm_mat2_backward`` with their layout choice,
``native_layer_norm_backward`` with only the weight and bias wanted), so the weight half needs no
autograd graph task per node and the input half need not keep the graph: :func:`take` reads what
the formula needs from the node before the input half frees its saved tensors. It never unpacks a
saved weight: ZeRO-3's saved-tensor hooks (``zero3.py``) would regather its unit outside a
backward. Layer norm's kernel reads the weight and bias only for their shapes when just their
gradients are wanted, so zeros of the edges' shape and dtype stand in for them (a convolution's
would need the weight's layout: it has no formula).

A gradient is handed back already summed to the shape and cast to the dtype autograd would give
the edge (the engine's ``validate_outputs``: a broadcast bias's gradient is summed to its shape).
One going straight to a parameter goes through a view of it, so that autograd's AccumulateGrad
takes the tensor as its gradient (a root's gradient, still referenced, it would copy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

ACCUMULATE = "torch::autograd::AccumulateGrad"
Formula = Callable[[torch.Tensor], list[tuple[int, torch.Tensor]]]


@dataclass
class NodeWeightGrad:
    """One intermediate's parameter-side gradients, computed from ``held`` (see the module docstring)."""

    node: Node
    formula: Formula                          # output gradient -> [(next-edge index, gradient)]
    held: tuple[torch.Tensor, ...]            # the saved tensors the formula reads (for the memory meter)
    grad: torch.Tensor | None = None          # the gradient the node received in the input half

    def edges(self, views: dict[Node, GradientEdge] | None = None) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        """The parameter-side edges and their gradients (none when the node got no gradient);
        ``views``: the edges through a view of each parameter, by its gradient accumulator, made
        once and kept (a view's node saves no tensor: it serves every micro-batch; None: made here)."""
        views = {} if views is None else views
        if self.grad is None:
            return [], []
        edges, grads = [], []
        for i, g in self.formula(self.grad):
            fn, nr = self.node.next_functions[i]
            assert fn is not None                 # a parameter-side edge leads somewhere
            meta = fn._input_metadata[nr]
            if tuple(g.shape) != tuple(meta.shape):
                g = g.sum_to_size(meta.shape)
            if g.is_complex() and not meta.dtype.is_complex:
                g = torch.real(g)
            if g.dtype != meta.dtype:
                g = g.to(meta.dtype)
            if fn.name() == ACCUMULATE and not _shares(g, self.grad):
                edges.append(param_edge(fn, views))
            else:
                edges.append(GradientEdge(fn, nr))
            grads.append(g)
        return edges, grads


def param_edge(accumulator: Node, views: dict[Node, GradientEdge]) -> GradientEdge:
    """The edge into a view of the parameter ``accumulator`` accumulates, made once and kept in
    ``views``: autograd hands a gradient it made alone to the parameter (as a plain backward's
    AccumulateGrad takes its own), not a copy of a root's (a view's node saves no tensor)."""
    edge = views.get(accumulator)
    if edge is None:
        param: torch.Tensor = accumulator.variable          # type: ignore[attr-defined]
        with torch.enable_grad():
            edge = views[accumulator] = get_gradient_edge(param.view_as(param))
    return edge


def cheap(node: Node, i: int) -> bool:
    """Whether ``node``'s next edge ``i`` gets a gradient that costs no matrix product, made afresh
    by autograd (so handing it to the parameter aliases nothing): layer norm's weight and bias (its
    kernel makes them in the call that makes the input's), a product's bias broadcast over its rows
    (the output gradient summed). The split backward's input half takes those (``splitback.py``)."""
    name = node.name()
    if name == "NativeLayerNormBackward0":
        return i in (1, 2)
    if name != "AddmmBackward0" or i != 0:
        return False
    fn, nr = node.next_functions[0]
    return fn is not None and len(fn._input_metadata[nr].shape) < 2      # summed over the rows: a new tensor


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def take(node: Node, side: Sequence[int]) -> NodeWeightGrad | None:
    """The formula for ``node``'s next edges ``side`` (the parameters' side), holding what it
    needs; None for a node this module has no formula for (autograd does it instead)."""
    make = _FORMULAS.get(node.name())
    return None if make is None else make(node, frozenset(side))


def _times(t: torch.Tensor, s: Any) -> torch.Tensor:
    """autograd's ``maybe_multiply``: no product by a scale of one."""
    return t if s == 1 else t * s


def _column_major(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    return strides[0] == 1 and strides[1] == sizes[0]


def _mat1_grad(g: torch.Tensor, mat2: torch.Tensor, sizes: Sequence[int], strides: Sequence[int],
               alpha: Any) -> torch.Tensor:
    """``mm_mat1_backward``: the gradient of ``mat1 @ mat2`` to mat1, in mat1's layout."""
    return _times(mat2.mm(g.t()).t() if _column_major(sizes, strides) else g.mm(mat2.t()), alpha)


def _mat2_grad(g: torch.Tensor, mat1: torch.Tensor, sizes: Sequence[int], strides: Sequence[int],
               alpha: Any) -> torch.Tensor:
    """``mm_mat2_backward``: the gradient of ``mat1 @ mat2`` to mat2, in mat2's layout."""
    return _times(g.t().mm(mat1).t() if _column_major(sizes, strides) else mat1.t().mm(g), alpha)


def _matmul(node: Any, side: frozenset[int], bias: bool) -> NodeWeightGrad | None:
    """``addmm(self, mat1, mat2)`` (edges self, mat1, mat2) or ``mm(self, mat2)`` (edges self = mat1, mat2)."""
    off = 1 if bias else 0                   # the edge of mat1
    if not side <= set(range(off + 2)):
        return None
    alpha, beta = (node._saved_alpha, node._saved_beta) if bias else (1, 1)
    mat1_name = "mat1" if bias else "self"
    # mat1's gradient reads mat2 and mat1's layout; mat2's reads mat1 and mat2's layout
    mat2 = node._saved_mat2 if off in side else None
    mat1 = getattr(node, f"_saved_{mat1_name}") if off + 1 in side else None
    layout1 = (getattr(node, f"_saved_{mat1_name}_sym_sizes"), getattr(node, f"_saved_{mat1_name}_sym_strides"))
    layout2 = (node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides)
    held = tuple(t for t in (mat1, mat2) if t is not None)
    if not all(t.layout == torch.strided and not t.is_complex() for t in held):
        return None

    def formula(g: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        out = []
        if bias and 0 in side:
            out.append((0, _times(g, beta)))
        if mat2 is not None:
            out.append((off, _mat1_grad(g, mat2, *layout1, alpha)))
        if mat1 is not None:
            out.append((off + 1, _mat2_grad(g, mat1, *layout2, alpha)))
        return out
    return NodeWeightGrad(node, formula, held)


def _layer_norm(node: Any, side: frozenset[int]) -> NodeWeightGrad | None:
    """``native_layer_norm(input, shape, weight, bias)`` (edges input, weight, bias): weight and bias only."""
    if not side <= {1, 2}:
        return None
    x, mean, rstd = node._saved_input, node._saved_result1, node._saved_result2
    weight, bias = (_stand_in(node, i) for i in (1, 2))
    shape = list(node._saved_normalized_shape)
    mask = [False, 1 in side, 2 in side]

    def formula(g: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        grads = torch.ops.aten.native_layer_norm_backward(g, x, shape, mean, rstd, weight, bias, mask)
        return [(i, grads[i]) for i in (1, 2) if mask[i]]
    return NodeWeightGrad(node, formula, (x, mean, rstd))


def _stand_in(node: Any, i: int) -> torch.Tensor | None:
    """Zeros shaped as the tensor on ``node``'s next edge ``i`` (None without that edge)."""
    fn, nr = node.next_functions[i]
    if fn is None:
        return None
    meta = fn._input_metadata[nr]
    return torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)


def _add(node: Any, side: frozenset[int]) -> NodeWeightGrad | None:
    """``self + alpha * other`` (edges self, other)."""
    alpha = node._saved_alpha

    def formula(g: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        return [(i, g if i == 0 else _times(g, alpha)) for i in sorted(side)]
    return NodeWeightGrad(node, formula, ()) if side <= {0, 1} else None


_FORMULAS: dict[str, Callable[[Any, frozenset[int]], NodeWeightGrad | None]] = {
    "AddmmBackward0": lambda node, side: _matmul(node, side, bias=True),
    "MmBackward0": lambda node, side: _matmul(node, side, bias=False),
    "NativeLayerNormBackward0": _layer_norm,
    "AddBackward0": _add,
}
