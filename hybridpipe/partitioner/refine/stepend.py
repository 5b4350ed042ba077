"""A flushed step's end as the runtime runs it, for the prediction of a run (issue 30 item 4).

The objective's per-layer lane (``cost/layersync.py``) lets a replicated stage's last all-reduces hide
behind the pipeline's drain and the next step's fill (``StageEval.gap_ms`` = the forwards and backwards
of the stages before it) and behind its own forwards of the layers before each one. The runtime
(``pipeline/engine.py``) waits for every all-reduce of the stage (``finish()``) before the stage's
optimizer step, and the next step's forwards start after it:

* **finish**: no layer's sync hides behind the stage's own next forwards: the stage's exposed sync is
  the lane's tail after the backward less the gap, ``max(0, lane end - backward - gap)``.
* **barrier**: where the last stage is replicated the loss check (``runtime/nonfinite.py``) is an
  all-reduce over the world before every rank's optimizer step, so no rank starts the next step before
  the latest rank entered it: the next step's fill (the forwards of the stages before) hides nothing,
  only the drain (their backwards) does. Where the last stage has one replica the check rides on the
  gradient frames and costs no collective: the gap stays.

:func:`step_end_evaluation` re-times each replicated stage's exposed sync this way; pure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybridpipe.partitioner.cost.layersync import simulate_lane
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.objective import Evaluation, Options, StageSpec


@dataclass(frozen=True)
class StepEnd:
    """Which of the module docstring's two rules apply (both off: the objective's lane as it is)."""

    finish: bool = False
    barrier: bool = False

    @property
    def on(self) -> bool:
        return self.finish or self.barrier


AS_PLANNED = StepEnd()          # neither rule: the objective's lane as it is


def stage_tail_ms(layer_ms: dict[str, float], names, backward_ms, forward_ms, gap_ms: float, finish: bool) -> float:
    """A stage's exposed sync: the lane of its layers' all-reduces (``layer_ms`` by node name) from the
    start of its last backward; ``finish``: measured against the backward's end + gap alone."""
    sync = [layer_ms.get(n, 0.0) for n in names]
    forwards = [0.0] * len(names) if finish else list(forward_ms)
    return simulate_lane(sync, list(backward_ms), forwards, gap_ms).total_exposed_ms


def step_end_evaluation(ev: Evaluation, costs: ModelCosts, specs: list[StageSpec], opts: Options,
                        rule: StepEnd) -> Evaluation:
    """``ev`` with every replicated stage's exposed sync re-timed by ``rule`` (module docstring)."""
    if not rule.on or opts.schedule.asynchronous or not ev.fits:
        return ev
    barrier = rule.barrier and len(specs[-1].ranks) > 1
    out = []
    for spec, s in zip(specs, ev.stages, strict=True):
        if len(spec.ranks) <= 1 or not s.sync.layers:
            out.append(s)
            continue
        i, j = spec.first, spec.last
        gap = float(costs.backward_ms[:i].sum()) if barrier else s.gap_ms
        layer_ms: dict[str, float] = {}
        for lv in s.sync.layers:
            layer_ms[lv.layer] = layer_ms.get(lv.layer, 0.0) + lv.predicted_ms
        tail = stage_tail_ms(layer_ms, costs.names[i:j + 1], costs.backward_ms[i:j + 1], costs.forward_ms[i:j + 1],
                             gap, rule.finish)
        out.append(replace(s, sync=replace(s.sync, exposed_ms=tail)))
    return replace(ev, stages=tuple(out))
