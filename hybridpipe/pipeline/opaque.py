"""The parameters of a stage whose gradients may come on some replicas and steps only.

A stage's graph reaches the same parameters on every replica and step, but a module it calls as
it is (a ``--leaf``: eager code, a mixture of experts' loop over the experts its tokens chose)
decides for itself which of its parameters it uses: one replica's micro-batches may give an expert
a gradient and another's not. Replicas sync such parameters once a step, in the same order on
every replica, and agree on which got a gradient at all (comm/hybrid_dp, comm/sharded).
"""

from __future__ import annotations

from torch import fx, nn


def run_as_written(module: nn.Module) -> list[nn.Parameter]:
    """The parameters (requiring grad) of the user's modules that ``module``'s graph calls whole
    (``call_module`` on a class of neither torch's nor hybridpipe's: a ``--leaf``); empty for a
    module that is not a graph."""
    if not isinstance(module, fx.GraphModule):
        return []
    out: dict[int, nn.Parameter] = {}
    for node in module.graph.nodes:
        if node.op != "call_module":
            continue
        called = module.get_submodule(str(node.target))
        if type(called).__module__.split(".")[0] in ("torch", "hybridpipe"):
            continue
        out.update({id(p): p for p in called.parameters() if p.requires_grad})
    return list(out.values())
