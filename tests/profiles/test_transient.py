"""Transient memory: the CPU live-bytes tracker against cases computed by hand and against the CPU
allocator itself (torch's profiler reports every allocation with the running total), and the
profile's per-node transient bytes."""

from __future__ import annotations

import gc
from functools import cache

import pytest
import torch

from hybridpipe.profiles.format import Profile
from hybridpipe.profiles.profiler import profile_model
from hybridpipe.profiles.transient import LiveBytes, PeakMeter
from hybridpipe.profiles.zoo import resolve_model
from tests.allocator import allocator_peak, in_fresh_process

N = 64
MAT = N * N * 4          # bytes of one float32 N x N matrix
GPT = "gpt[layers=2,width=64,heads=2,seq=32,vocab=256]"
BATCH = 8


def test_a_matmul_chain_peaks_where_counted_by_hand():
    a = torch.randn(N, N)                              # allocated before: not counted
    with torch.no_grad(), LiveBytes() as live:
        b = a @ a
        c = b @ b                                      # b, c
        del b                                          # c
        d = c @ c                                      # c, d
        e = d.t()                                      # a view: no allocation
        d.add_(1.0)                                    # in place: no allocation
        assert (live.live, live.peak) == (2 * MAT, 2 * MAT)
        f = torch.cat([c, d, e])                       # c, d, f (3 matrices)
        del c, d, e
        assert (live.live, live.peak) == (3 * MAT, 5 * MAT)
        del f
        assert live.live == 0


def test_saved_tensors_live_until_the_backward_frees_them():
    a = torch.randn(N, N, requires_grad=True)
    with LiveBytes() as live:
        b = a @ a
        c = b @ b                                      # saves b (both operands)
        del b
        assert live.live == 2 * MAT                    # b lives on in c's graph
        live.reset_peak()
        c.sum().backward()
        # b freed with the graph; a.grad = two matmuls' sum; c's gradient (ones) and b's came and went
        assert live.live == 2 * MAT                    # c and a.grad
        assert live.peak >= 4 * MAT


def live_and_allocator_peaks() -> tuple[int, int]:
    """One GPT training step's peak by LiveBytes and by the CPU allocator (after a warm-up step)."""
    torch.manual_seed(0)
    spec = resolve_model(GPT)
    model = spec.build()
    g = torch.Generator().manual_seed(0)
    x, y = spec.example_input(BATCH, g), spec.example_target(BATCH, g)

    def step() -> None:
        spec.loss(model(x), y).backward()
        model.zero_grad(set_to_none=True)

    step()                                             # one-time allocations
    with LiveBytes() as live:
        step()
    return live.peak, allocator_peak(step)


def test_live_bytes_peak_is_the_cpu_allocators_on_a_training_step():
    # a fresh process: after the pipeline memory tests something left in this process allocates
    # (294 KB) inside the allocator's window
    live, allocator = in_fresh_process("tests.profiles.test_transient", "live_and_allocator_peaks", timeout=300)
    assert live == pytest.approx(allocator, rel=0.02)


@cache
def _profile(precision: str = "fp32") -> Profile:
    torch.manual_seed(0)
    return profile_model(resolve_model(GPT), batch_size=BATCH, repeats=1, warmup=0, progress=False,
                         precision=precision)


def test_the_last_nodes_backward_holds_the_logits_gradients():
    p = _profile()
    head = p.nodes[-1]
    logits = BATCH * 32 * 256 * 4
    # nll_loss's gradient and log_softmax's, each the logits' size, at once (plus the scalar's)
    assert head.backward_transient_bytes == 2 * logits + 4
    block = next(n for n in p.nodes if n.name == "blocks.0")
    assert block.forward_transient_bytes > 0 and block.backward_transient_bytes > 0


def test_profiles_without_transients_load_with_zero():
    d = _profile().to_dict()
    for n in d["nodes"]:
        del n["forward_transient_bytes"], n["backward_transient_bytes"]
    del d["precision"]
    old = Profile.from_dict(d)
    assert all(n.forward_transient_bytes == n.backward_transient_bytes == 0 for n in old.nodes)
    assert old.precision == "fp32"


def test_a_bf16_profile_measures_under_autocast():
    fp32, bf16 = _profile(), _profile("bf16")
    assert bf16.precision == "bf16" and Profile.from_dict(bf16.to_dict()).precision == "bf16"
    # a block's linear layers save 16-bit activations (and 16-bit copies of their weights)
    block32, block16 = (next(n for n in p.nodes if n.name == "blocks.0") for p in (fp32, bf16))
    assert block16.saved_bytes < block32.saved_bytes
    assert bf16.nodes[-1].activation_bytes == fp32.nodes[-1].activation_bytes // 2     # bf16 logits


def test_peak_meter_reports_peak_and_what_is_left():
    a = torch.randn(N, N)
    with PeakMeter("cpu") as meter:
        kept = a @ a
        tmp = kept @ kept
        del tmp
    assert (meter.peak, meter.end, meter.transient) == (2 * MAT, MAT, MAT)
    del kept


def _live_tensor_storages() -> set[int]:
    gc.collect()
    return {o.untyped_storage().data_ptr() for o in gc.get_objects()
            if isinstance(o, torch.Tensor) and type(o) in (torch.Tensor, torch.nn.Parameter)}


def test_profiling_leaves_no_tensor_alive():
    """The saved-tensor hook that counts what a block saves kept each saved output as itself: a cycle
    through its grad_fn that Python's collector cannot see, so every block's graph (the model's
    parameters, a forward's activations: 1.7 MB of this GPT, gigabytes on a GPU) outlived profiling."""
    before = _live_tensor_storages()
    _profile_leak_check()
    assert _live_tensor_storages() - before == set()


def _profile_leak_check() -> None:
    profile_model(resolve_model(GPT), batch_size=2, repeats=1, warmup=0, progress=False)
