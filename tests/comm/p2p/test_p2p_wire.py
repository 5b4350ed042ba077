"""The frame format: headers and metadata survive a round trip; corruption is detected."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpipe.comm.p2p import layouts, wire
from hybridpipe.comm.p2p.wire import Flag, Header, TensorMeta

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool, torch.complex64]

keys = st.text(min_size=1, max_size=20).filter(lambda k: len(k.encode()) <= wire.MAX_KEY_BYTES)
headers = st.builds(Header, st.sampled_from(Flag.ALL), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
                    st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
                    st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), keys)
metas = st.lists(st.builds(TensorMeta, st.text(max_size=12), st.sampled_from(DTYPES),
                           st.lists(st.integers(0, 1000), max_size=4).map(tuple)), max_size=6).map(tuple)


@given(headers)
def test_header_round_trip(h):
    raw = wire.encode_header(h)
    assert len(raw) == wire.HEADER_BYTES
    assert wire.decode_header(raw) == h
    assert wire.decode_header(wire.from_bytes_tensor(wire.to_bytes_tensor(raw))) == h


@given(metas)
def test_meta_round_trip_and_sizes(ms):
    assert wire.decode_meta(wire.encode_meta(ms)) == ms
    assert wire.payload_bytes(ms) == sum(torch.empty(m.shape, dtype=m.dtype, device="meta").nbytes for m in ms)


@settings(max_examples=50)
@given(headers, st.integers(0, 5), st.integers(1, 255))
def test_corrupted_magic_or_version_is_rejected(h, pos, flip):
    raw = bytearray(wire.encode_header(h))
    raw[pos] ^= flip                               # bytes 0-3 magic, 4-5 version
    with pytest.raises(wire.WireError):
        wire.decode_header(bytes(raw))


def test_bad_inputs_are_explained():
    with pytest.raises(wire.WireError, match="hybridpipe p2p protocol"):
        wire.decode_header(b"x" * wire.HEADER_BYTES)
    with pytest.raises(wire.WireError, match="bytes"):
        wire.decode_header(b"short")
    with pytest.raises(wire.WireError, match="metadata"):
        wire.decode_meta(b'[["x", "not_a_dtype", [1]]]')
    with pytest.raises(wire.WireError, match="metadata"):
        wire.decode_meta(b"{broken")
    with pytest.raises(ValueError, match="at most"):
        wire.check_key("k" * (wire.MAX_KEY_BYTES + 1))
    with pytest.raises(ValueError, match="non-empty"):
        wire.check_key("")
    with pytest.raises(TypeError, match="dict"):
        wire.named_items([torch.zeros(1)])
    with pytest.raises(TypeError, match="not a tensor"):
        wire.named_items({"x": [1, 2]})
    with pytest.raises(TypeError, match="dense"):
        wire.named_items({"x": torch.zeros(2, 2).to_sparse()})


def test_meta_cache_announces_once_per_kind_and_again_on_change():
    cache = layouts.MetaCache()
    ia, ib = [("x", torch.zeros(2, 3))], [("x", torch.zeros(4, 3))]
    a, b = wire.describe(ia), wire.describe(ib)

    def changed(key, items):
        return cache.sent(key, items)[1]
    assert changed("act/0", ia)
    assert not changed("act/1", ia)          # same kind, same metadata: cached
    assert changed("grad/0", ia)             # another kind has its own entry
    assert changed("act/2", ib)              # a changed shape is re-announced
    assert not changed("act/3", ib)
    assert changed("act/4", [("x", torch.zeros(4, 3, dtype=torch.float64))])
    assert cache.layout("act/9", 1).metas != b and cache.layout("grad/1", 1).metas == a
    assert cache.layout("act/9", 2) is None


def test_a_kind_alternating_two_tensor_counts_announces_each_once():
    """The step's last gradient frame carries one more tensor (the step's news): no re-announcement
    of either layout, step after step."""
    cache = layouts.MetaCache()
    plain, carrying = [("x", torch.zeros(2, 3))], [("x", torch.zeros(2, 3)), ("news", torch.zeros(3))]
    assert [cache.sent(f"grad/0/{m}", carrying if m == 3 else plain)[1] for _ in range(3) for m in range(4)] \
        == [True, False, False, True] + [False] * 8
    assert cache.layout("grad/0/1", 2).signature == (("x", torch.float32, (2, 3)), ("news", torch.float32, (3,)))
    assert wire.kind_of("act/3") == "act" and wire.kind_of("labels") == "labels"
    assert wire.kind_of("act/2/3") == "act/2" != wire.kind_of("act/5/3")


small_metas = st.lists(st.builds(TensorMeta, st.text(max_size=12), st.sampled_from(DTYPES),
                                 st.lists(st.integers(0, 12), max_size=3).map(tuple)), max_size=6).map(tuple)


@settings(max_examples=50, deadline=None)
@given(small_metas, st.integers(0, 256))
def test_flat_message_round_trip_into_a_larger_buffer(ms, spare):
    """A frame's tensors survive flatten -> (receive into a buffer with spare room) -> unflatten,
    at aligned offsets; a lone tensor is sent from its own memory."""
    items = [(m.name, torch.arange(m.numel).to(m.dtype).reshape(m.shape)) for m in ms]
    items = list(dict(items).items())                       # unique names, as messages have
    ms = wire.describe(items)
    offsets, total = wire.flat_layout(ms)
    assert all(o % wire.FLAT_ALIGN == 0 for o, m in zip(offsets, ms, strict=True) if m.nbytes)
    assert total >= wire.payload_bytes(ms)
    flat = wire.flatten(items, ms)
    assert (flat is None) == (total == 0)
    received = torch.full((total + spare,), 255, dtype=torch.uint8)
    if flat is not None:
        assert flat.numel() == total
        received[:total] = flat
    got = wire.unflatten(received if total else None, ms)
    for name, t in items:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t)
    full = [t for _, t in items if t.numel()]
    if len(full) == 1:
        assert flat.data_ptr() == full[0].data_ptr()


@settings(max_examples=50, deadline=None)
@given(small_metas, st.booleans(), st.integers(0, 256))
def test_whole_frame_round_trip_into_the_posted_buffer(ms, announce, spare):
    """One buffer holds header, metadata and body; received into a larger (capacity) buffer, the
    header, the metadata and every tensor come back, at aligned offsets."""
    items = list(dict((m.name, torch.arange(m.numel).to(m.dtype).reshape(m.shape)) for m in ms).items())
    ms = wire.describe(items)
    offsets, body = wire.flat_layout(ms)
    meta = wire.encode_meta(ms) if announce else b""
    h = Header(Flag.META if announce else Flag.NONE, 3, 2, len(items), len(items), len(meta),
               wire.payload_bytes(ms), body, "act/0/7")
    frame = wire.encode_frame(h, meta, items, offsets)
    assert frame.numel() == wire.inline_bytes(len(meta), body)
    received = torch.full((frame.numel() + spare,), 255, dtype=torch.uint8)
    received[:frame.numel()] = frame
    raw = received.numpy()
    assert wire.decode_header(raw) == h
    if announce:
        assert wire.decode_meta(raw[wire.HEADER_BYTES:wire.HEADER_BYTES + len(meta)]) == ms
    start = wire.body_offset(len(meta), body)
    assert start % wire.FLAT_ALIGN == 0 or body == 0
    got = wire.unflatten(received if body else None, ms, start)
    for name, t in items:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t)


def test_capacity_grows_to_fit_the_frames_seen_but_not_for_bodies_sent_apart():
    def header(meta_len: int, body: int) -> Header:
        return Header(Flag.NONE, 0, 0, 1, 1, meta_len, body, body, "act/0")

    cap = wire.MIN_CAPACITY
    assert wire.is_inline(100, 1000, cap) and not wire.is_inline(100, cap, cap)
    cap = wire.next_capacity(cap, header(100, 10_000))
    assert cap == wire.inline_bytes(100, 10_000) == 256 + 10_000      # header + metadata, aligned
    assert wire.is_inline(0, 10_000, cap) and wire.is_inline(100, 10_000, cap)
    assert wire.next_capacity(cap, header(0, 64)) == cap                # never shrinks
    big = wire.INLINE_LIMIT + 1
    assert wire.next_capacity(cap, header(0, big)) == cap               # goes apart: no room kept for it
    assert not wire.is_inline(0, big, 10 * big)


@settings(max_examples=30, deadline=None)
@given(small_metas, st.booleans())
def test_a_reused_frame_buffer_holds_the_bytes_encode_frame_writes(ms, announce):
    """A FrameBuffer packed again (other values, same layout) reads back as the new frame, and
    its header, metadata and body are the bytes encode_frame writes."""
    ms = tuple({m.name: m for m in ms}.values())          # a message's names are distinct
    layout = layouts.layout_of(ms)
    meta = wire.encode_meta(ms) if announce else b""
    start = wire.body_offset(len(meta), layout.body_bytes)
    fb = wire.FrameBuffer(start + layout.body_bytes)
    for tag in (1, 2):
        items = [(m.name, (torch.arange(m.numel) + tag).to(m.dtype).reshape(m.shape)) for m in ms]
        h = Header(Flag.META if announce else Flag.NONE, tag, tag, len(items), len(items), len(meta),
                   layout.payload_bytes, layout.body_bytes, f"act/{tag}")
        got = fb.pack(h, meta, items, layout, start)
        want = wire.encode_frame(h, meta, items, layout.offsets)
        assert got.numel() == want.numel()
        assert torch.equal(got[:wire.HEADER_BYTES + len(meta)], want[:wire.HEADER_BYTES + len(meta)])
        for m, off in zip(ms, layout.offsets, strict=True):
            assert torch.equal(got[start + off:start + off + m.nbytes], want[start + off:start + off + m.nbytes])
        assert wire.decode_header(got.numpy()) == h
        back = wire.unflatten(got, ms, start, layout.offsets)
        assert all(torch.equal(back[n], t) for n, t in items)


def test_a_frame_buffer_packs_what_each_tensor_means():
    """Small real tensors are packed by a plain memory copy, the rest by copy_: every kind reads back
    as torch resolves it (a lazily negated view, a lazy conjugate, an efficient zero tensor with no
    memory, one that requires grad, one above RAW_COPY_LIMIT), and the frame records no graph."""
    z = torch.randn(3, dtype=torch.complex64)
    items = [("grad", torch.randn(2, 8, requires_grad=True)),
             ("neg", torch.randn(1, dtype=torch.complex64).conj().imag),     # is_neg, contiguous
             ("conj", z.conj()),
             ("zero", torch._efficientzerotensor(4)),
             ("int", torch.arange(5, dtype=torch.int64)),
             ("big", torch.randn(wire.RAW_COPY_LIMIT // 4 + 16))]
    assert items[1][1].is_neg() and items[2][1].is_conj() and items[3][1]._is_zerotensor()
    layout = layouts.layout_of(wire.describe(items))
    start = wire.body_offset(0, layout.body_bytes)
    fb = wire.FrameBuffer(start + layout.body_bytes)
    for tag in (1, 2):          # the second pack reuses the destinations made by the first
        items[0][1].data.add_(tag)
        h = Header(Flag.NONE, tag, tag, len(items), len(items), 0, layout.payload_bytes, layout.body_bytes, "act/0")
        got = fb.pack(h, b"", items, layout, start)
        assert not got.requires_grad and got.grad_fn is None
        back = wire.unflatten(got, layout.metas, start, layout.offsets)
        for name, t in items:
            want = t.detach().resolve_conj().resolve_neg()
            assert back[name].dtype == t.dtype and torch.equal(back[name], want), name


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@settings(max_examples=50, deadline=None)
@given(small_metas, st.integers(0, 100))
def test_a_received_body_is_viewed_once_per_tensor(ms, spare):
    """Unflattening a received buffer (``receive_buffer``: whole elements of any dtype) makes one
    view per tensor, plus one per change of dtype along the frame (the slice and two views each it
    made before), and the views read the bytes flatten wrote, with a contiguous tensor's strides."""
    items = list(dict((m.name, (torch.arange(m.numel) % 7 + 1).to(m.dtype).reshape(m.shape)) for m in ms).items())
    ms = wire.describe(items)
    offsets, body = wire.flat_layout(ms)
    start = wire.body_offset(0, body)
    received = wire.receive_buffer(start + body + spare)
    assert received.numel() % wire.FLAT_ALIGN == 0 and received.numel() >= start + body
    flat = wire.flatten(items, ms)
    if flat is not None:
        received[start:start + body] = flat
    with _CountOps() as mode:
        got = wire.unflatten(received if body else None, ms, start, offsets)
    full = [m for m in ms if m.nbytes]
    dtypes = [torch.uint8] + [m.dtype for m in full]        # the buffer's own dtype needs no view
    switches = sum(1 for a, b in itertools.pairwise(dtypes) if a != b and b != torch.uint8)
    # (an empty tensor is made per empty tensor; the dispatch mode also sees a detach per dtype view)
    views = [op for op in mode.ops if not op.startswith(("aten.empty", "aten.detach"))]
    assert len(views) == len(full) + switches, mode.ops
    for name, t in items:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t)
        assert got[name].is_contiguous() and got[name].stride() == t.stride()
        if t.numel():
            assert got[name].untyped_storage().data_ptr() == received.untyped_storage().data_ptr()


def test_unflatten_of_a_buffer_that_is_not_whole_elements_long_still_reads_the_right_bytes():
    """A body in a buffer whose length is not a whole number of elements (not what a receive
    makes) takes the slicing path: same values."""
    items = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.arange(5, dtype=torch.int64))]
    ms = wire.describe(items)
    offsets, body = wire.flat_layout(ms)
    store = torch.zeros(body + 64 + 3, dtype=torch.uint8)
    for shift, length in ((0, body + 3), (64, body + 3), (0, body)):
        flat = store[shift:shift + length]
        flat[:body] = wire.flatten(items, ms)
        got = wire.unflatten(flat, ms, 0, offsets)
        assert all(torch.equal(got[n], t) for n, t in items)


def test_meta_cache_re_announces_a_rename_a_reshape_and_a_dtype_of_the_same_size():
    cache = layouts.MetaCache()
    steps = [[("x", torch.zeros(2, 3))], [("x", torch.zeros(2, 3))], [("y", torch.zeros(2, 3))],
             [("y", torch.zeros(3, 2))], [("y", torch.zeros(3, 2, dtype=torch.int32))],
             [("y", torch.zeros(3, 2, dtype=torch.int32))]]
    assert [cache.sent(f"act/{i}", items)[1] for i, items in enumerate(steps)] == [True, False, True, True, True, False]
    assert cache.layout("act/9", 1).signature == (("y", torch.int32, (3, 2)),)
