"""A NaN or infinite loss stops the run (or, with ``--skip-nonfinite``, skips the step) on every
rank at once, before any weight of that step is applied or saved.

The loss lives on the last stage only; every rank must learn of it before it updates its
weights or writes a checkpoint. So each rank's optimizer is wrapped: its ``step()`` first joins
one tiny all-reduce (MAX over the world) of a flag that the last stage's loss function raised
when a micro-batch's loss was not finite, and applies the update only when the flag is clear.
On the schedules that flush every step (gpipe, 1f1b) every rank takes exactly one optimizer step
per step, after all its micro-batches, so this is one scalar all-reduce per step and a bad step
changes no weight anywhere. ``pipedream`` updates per micro-batch: there the flag is exchanged
after each step instead (the run stops before the step's weights are saved; skipping is refused
at start).

    watch = NonFiniteWatch(device, skip=config.skip_nonfinite, flushing=flushes(plan))
    stage = build_stage_index(..., loss=watch.wrap_mean(spec.loss))
    optimizer = watch.wrap_optimizer(make_optimizer(...))
    for step in ...:
        result = engine.run_step(step)
        watch.after_step(step, result.losses)    # AgreedError (stop), or counts a skipped step

The flag stays on the device between micro-batches (no host sync per loss): each loss is only
added to the step's float64 sum (one operation), which is non-finite exactly when a loss was, and
the flag is read from it once per step. Only the last stage raises it, so when that stage has one replica its
rank (``source``) already knows the verdict (``decides_alone``) and the others need only its
flag: a broadcast from it instead of the all-reduce (one message to each rank, where gloo's
all-reduce exchanged several per rank). The source posts it without waiting (the other ranks
reach their optimizer step later) and goes on, so the check costs it nothing and costs the
others one scalar receive. A replicated last stage, or a recovery in place (every rank must pass
the check before any update), keeps the all-reduce.

Where the plan's instruction lists prove that every rank receives its last gradients of the step
after the source's last loss, through a chain of gradient messages and before its update
(pipeline/stepnews.py: plain chains under gpipe, 1f1b, zb-h1, ...), the watch is ``carried``: the
source's flag rides upstream on those gradient frames (runtime/step_news.py's ``FrameNews`` calls
:meth:`NonFiniteWatch.heard`) and agreeing costs no collective at all, on any rank.

What a rank shares is its :attr:`~NonFiniteWatch.signal`, one scalar whose maximum over the ranks
is the verdict: 1 a non-finite loss, 0 a loss that counted, -0.5 only ``(loss_sum, count)`` pairs
that counted nothing, -1 no loss. So a step whose whole global batch counted nothing (every
micro-batch all padding, on every last-stage replica) is withheld and stops, or is skipped, like a
non-finite one, naming its cause (:attr:`~NonFiniteWatch.empty`); one replica with nothing to
count beside another that counted is a normal step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hybridpipe.errors import AgreedError
from hybridpipe.profiles.losses import LossValue, loss_mean, pair_counted

log = logging.getLogger(__name__)


class NonFiniteWatch:
    """See the module docstring. ``group``: the ranks that agree (default: the world);
    ``stage``: this rank's stage (named in the message); ``hint``: appended to the stop line."""

    def __init__(self, device: torch.device, *, skip: bool, flushing: bool, stage: int = 0,
                 group: dist.ProcessGroup | None = None, hint: str = "", source: int | None = None) -> None:
        self.device, self.skip, self.flushing, self.stage = device, skip, flushing, stage
        self.group, self.hint = group, hint
        self._source = source       # the one (global) rank that can raise the flag, if there is one
        self._alone: bool | None = None     # decides_alone, once known for this source
        self.skipped: list[int] = []
        self._pending: list[Any] = []           # async all-reduces of a rank that decides alone
        # never written in place (note() makes a new tensor), so a fresh sum is this one, not a copy
        self._zero = torch.zeros((), dtype=torch.float64, device=device)
        self._sum = self._zero      # the step's losses added up: non-finite exactly when one of them is
        self._plain = 0             # the step's losses noted without a count (they count)
        self._counted = self._zero  # ... the step's (loss_sum, count) pairs whose count was not 0
        self._pairs = 0             # ... and how many pairs were noted
        self.empty = False          # the last agreement's cause: no micro-batch of the step counted anything
        self._verdict: bool | None = None
        self.carried = False        # the verdict reaches the other ranks on gradient frames (step_news.py)
        self._heard: torch.Tensor | None = None     # carried: the source's flag of this step, as received

    @property
    def source(self) -> int | None:
        """The one (global) rank that can raise the flag, if there is one (set again when the world re-forms)."""
        return self._source

    @source.setter
    def source(self, rank: int | None) -> None:
        self._source, self._alone = rank, None

    @property
    def decides_alone(self) -> bool:
        """This rank is the ``source``: it knows the verdict before sharing it (asked of torch.distributed
        once each time ``source`` is set, not at every step's check)."""
        if self._alone is None:
            if self._source is None or not dist.is_initialized():
                return False
            self._alone = dist.get_rank() == self._source
        return self._alone

    # ---- wrapping ----------------------------------------------------------------------
    def wrap_mean(self, fn: Callable[..., LossValue]) -> Callable[..., torch.Tensor]:
        """``fn`` returning the micro-batch's mean (profiles/losses.py's ``loss_mean``: a pair counting
        nothing is 0), noted with whether it counted anything: a step whose every micro-batch, on
        every rank, counted nothing stops (or is skipped) as a non-finite one does, naming the cause."""
        def loss(*args: Any, **kwargs: Any) -> torch.Tensor:
            value = fn(*args, **kwargs)
            mean = loss_mean(value)
            self.note(mean, counted=pair_counted(value))
            return mean
        return loss

    def note(self, value: torch.Tensor, counted: torch.Tensor | None = None) -> None:
        """Raise the flag when ``value`` (a loss) is NaN or infinite (token-weighted losses are
        checked as sums, pipeline/tokens.py). One operation per loss: the value is added to the
        step's float64 sum, which a NaN or an infinity makes non-finite for good and finite float32
        or bf16 losses cannot overflow; the flag is read from the sum once a step. ``counted``: the
        loss was a pair, and this says whether its count was not 0 (one more operation)."""
        with torch.no_grad():       # no graph from the loss to the sum (and no detach to dispatch)
            self._sum = self._sum + (value if value.dim() == 0 else value.sum(dtype=torch.float64))
            if counted is None:
                self._plain += 1
            else:
                self._counted = self._counted + counted
                self._pairs += 1

    @property
    def flag(self) -> torch.Tensor:
        """This rank's flag since the last agreement (raised: 1.0, a float32 scalar)."""
        return (~torch.isfinite(self._sum)).to(torch.float32)

    @property
    def signal(self) -> torch.Tensor:
        """What this rank shares at the agreement, a float32 scalar whose maximum over the ranks is the
        verdict: 1 a non-finite loss; else 0 a loss that counted; else -0.5 only pairs counting nothing
        (a step with no item to average); -1 no loss noted (a rank off the last stage)."""
        if self._plain == 0 and self._pairs == 0:
            return torch.where(torch.isfinite(self._sum), -1.0, 1.0).to(torch.float32)
        some = torch.ones((), dtype=torch.float64, device=self.device) if self._plain else self._counted
        return torch.where(torch.isfinite(self._sum), torch.where(some > 0, 0.0, -0.5), 1.0).to(torch.float32)

    def heard(self, flag: torch.Tensor) -> None:
        """Carried (step_news.py): the source's flag of this step, received on a gradient frame."""
        self._heard = flag

    def wrap_optimizer(self, optimizer: Any) -> GuardedOptimizer:
        return GuardedOptimizer(optimizer, self)

    def reset(self) -> None:
        """Forget an interrupted step (in-place recovery): its flag, verdict and all-reduces."""
        self._pending.clear()
        self._clear()
        self._verdict = None
        self._heard = None

    # ---- agreeing ----------------------------------------------------------------------
    def _clear(self) -> None:
        self._sum, self._counted, self._plain, self._pairs = self._zero, self._zero, 0, 0

    def _host_signal(self) -> float:
        """:attr:`signal` read on the host: one read (two where only pairs were noted)."""
        if not math.isfinite(self._sum.item()):
            return 1.0
        if self._plain == 0 and self._pairs == 0:
            return -1.0
        return 0.0 if self._plain or self._counted.item() > 0 else -0.5

    def _verdict_of(self, signal: float) -> bool:
        """Whether the agreed ``signal`` withholds the update (:attr:`empty` says if for no count)."""
        self.empty = signal == -0.5
        return signal > 0 or self.empty

    def agree(self) -> bool:
        """Collective: whether any rank saw a non-finite loss since the last call, or no rank's
        loss counted anything while some noted a pair (:attr:`empty`); then clears."""
        if not dist.is_initialized() or (self.carried and self.decides_alone):
            known = self._host_signal()           # no collective: this rank knows (carried: the others heard it)
            self._clear()
            return self._verdict_of(known)
        if self.carried:
            self._clear()                         # note() replaces the sums, never writes them: no copy
            heard, self._heard = self._heard, None
            if heard is None:
                raise RuntimeError("this step's loss verdict did not arrive on its gradient frames")
            return self._verdict_of(heard.item())
        flag = self.signal                        # a new tensor: the collectives work on it
        self._clear()
        if self.decides_alone:
            mine = self._verdict_of(flag.item())      # read before the collective works on it in place
            for work in self._pending:            # the previous step's: long complete
                work.wait()
            self._pending = [self._share(flag, async_op=True)]
            return mine
        self._share(flag, async_op=False)
        return self._verdict_of(flag.item())

    def _share(self, flag: torch.Tensor, *, async_op: bool) -> Any:
        """Every rank's flag becomes the verdict: the source's, broadcast, or the max over the ranks."""
        if self.source is not None:
            return dist.broadcast(flag, src=self.source, group=self.group, async_op=async_op)
        return dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=async_op)

    def before_update(self) -> bool:
        """The optimizer's check (flushing schedules): True when the update may be applied."""
        if not self.flushing:
            return True
        self._verdict = self.agree()
        return not self._verdict

    def after_step(self, step: int, losses: dict[int, torch.Tensor]) -> bool:
        """Collective, once per step on every rank: False when the step was skipped; stops the run
        (AgreedError, the same line on every rank) when a loss was not finite and ``skip`` is off."""
        bad = self._verdict if self._verdict is not None else self.agree()
        self._verdict = None
        if not bad:
            return True
        where = f"no micro-batch of step {step} counted anything to average (the loss function's count was 0 on " \
            "the whole global batch: all padding?)" if self.empty else self._describe(step, losses)
        if self.skip:
            self.skipped.append(step)
            log.warning("skipped step %d: %s", step, where)
            return False
        applied = "no weight of that step was applied, and none saved" if self.flushing else \
            "the weights of that step were not saved"
        raise AgreedError(f"training stopped: {where}; {applied}"
                          + (f"; {self.hint}" if self.hint else "")
                          + "; lower --lr, check the data, or pass --skip-nonfinite to skip such steps")

    def _describe(self, step: int, losses: dict[int, torch.Tensor]) -> str:
        """"the loss is nan at step 5 (stage 2, micro-batch 3)", agreed from the last stage's ranks."""
        mine = None
        for m in sorted(losses):
            value = float(losses[m])
            if not math.isfinite(value):
                mine = (m, value, self.stage)
                break
        found = [mine]
        if dist.is_initialized():
            found = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(found, mine, group=self.group)
        hits = sorted(x for x in found if x is not None)
        if not hits:
            return f"a loss was not finite at step {step}"
        m, value, stage = hits[0]
        return f"the loss is {value} at step {step} (stage {stage}, micro-batch {m})"


class GuardedOptimizer:
    """An optimizer whose ``step()`` asks the watch first (see the module docstring); everything
    else (``zero_grad``, ``state_dict``, ``param_groups``...) is the wrapped optimizer's."""

    def __init__(self, optimizer: Any, watch: NonFiniteWatch) -> None:
        self.optimizer, self.watch = optimizer, watch

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if not self.watch.before_update():
            return None
        return self.optimizer.step() if closure is None else self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``; for a torch optimizer that keeps torch's own with
        ``set_to_none``, what that does (every parameter's ``.grad`` set to None), without its
        profiler range and per-call checks."""
        opt = self.optimizer
        if set_to_none and getattr(type(opt), "zero_grad", None) is torch.optim.Optimizer.zero_grad:
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = None
            return
        opt.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
