"""HybridDataParallel(wire_dtype=torch.bfloat16): gradients travel and are summed in bfloat16, and
come back as float32 (3 gloo processes)."""

from __future__ import annotations

import torch
from torch import nn

from hybridpipe.comm.hybrid_dp import HybridDataParallel
from tests.comm.spawn import spawn


def _sum(rank: int, world: int, wire: str) -> list[float]:
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    hdp = HybridDataParallel(net, reduce="sum", policy="ring", wire_dtype=getattr(torch, wire) if wire else None)
    # every gradient entry becomes 1 + 2**-10: float32 holds it, bfloat16 (8 bits of mantissa) rounds it to 1
    out = hdp(torch.ones(2, 4))
    out.backward(torch.full_like(out, (1 + 2**-10) / 2))
    hdp.finish()
    assert net.weight.grad is not None and net.weight.grad.dtype == torch.float32
    return [float(net.weight.grad[0, 0]), float(net.bias.grad[0])]


def test_bf16_wire_sums_in_bf16_and_returns_float32():
    fp32 = spawn(_sum, 3, "", timeout=120)
    bf16 = spawn(_sum, 3, "bfloat16", timeout=120)
    assert all(v == [3 * (1 + 2**-10)] * 2 for v in fp32)      # 3.0029296875, exact in float32
    assert all(v == [3.0, 3.0] for v in bf16)                   # each 1 + 2**-10 travelled as 1.0
