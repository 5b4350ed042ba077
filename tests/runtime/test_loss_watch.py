"""The loss watch (runtime/nonfinite.py): its flag after any losses is exactly "one of them was
NaN or infinite" (checked loss by loss with torch.isfinite), one operation per loss, no graph kept."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.runtime.nonfinite import NonFiniteWatch
from tests.pipeline.test_loss_seed import Ops

VALUES = st.sampled_from([0.0, -0.0, 1.5, -2.0, 3.0e38, -3.0e38, 6.0e4, 1e-45, math.nan, math.inf, -math.inf])
LOSS = st.tuples(st.lists(VALUES, min_size=1, max_size=3), st.sampled_from([torch.float32, torch.bfloat16,
                                                                              torch.float16]), st.booleans())


def watch() -> NonFiniteWatch:
    return NonFiniteWatch(torch.device("cpu"), skip=False, flushing=True)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.lists(LOSS, max_size=6), min_size=1, max_size=3))
def test_the_flag_is_raised_exactly_when_a_loss_of_the_step_was_not_finite(steps):
    w = watch()
    for losses in steps:
        expected = False
        for values, dtype, scalar in losses:
            value = torch.tensor(values[0] if scalar else values, dtype=dtype)
            expected |= not bool(torch.isfinite(value).all())       # the reference: each loss on its own
            w.note(value)
        assert float(w.flag) == float(expected)
        assert w.agree() is expected        # and the next step starts clear
        assert float(w.flag) == 0.0


def test_one_operation_per_loss_and_no_graph_kept():
    w, x = watch(), torch.randn(4, requires_grad=True)
    loss = (x * x).mean()
    ops = Ops()
    with ops:
        for _ in range(8):
            w.note(loss)
    assert ops.seen == {"add": 8}, ops.seen     # was 9 a loss: detach, isfinite's four, not, any, copy, maximum
    assert w.flag.requires_grad is False and w.agree() is False
