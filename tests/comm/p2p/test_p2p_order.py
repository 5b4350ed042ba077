"""sra orders: derived from the ranks' programs, mirrored, and deadlock-free in lockstep.

The reference is a model of the runtime: callers execute their programs (a send hands the
message to the link thread and goes on; a receive blocks until the link thread delivered
it) and each link's two threads execute the link's order in lockstep (transfer i happens
once the sending caller has handed message i over). All transitions stay enabled once
enabled, so running them to a fixpoint decides whether the system can deadlock.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.comm.p2p.order import Cursor, check_order, keys_of, link_orders, mirror, order_digest
from tests.comm.p2p.scenarios import random_programs


def lockstep_completes(programs: dict, orders: dict) -> bool:
    pc = {r: 0 for r in programs}
    handed = {r: set() for r in programs}         # keys handed to link threads
    delivered = {r: set() for r in programs}      # keys delivered to this rank
    pos = {}                                       # link (a, b) -> index into orders[a][b]
    progress = True
    while progress:
        progress = False
        for r, prog in programs.items():
            while pc[r] < len(prog):
                op, peer, key = prog[pc[r]]
                if op == "send":
                    handed[r].add((peer, key))
                elif (peer, key) in delivered[r]:
                    pass
                else:
                    break
                pc[r] += 1
                progress = True
        for a in orders:
            for b, order in orders[a].items():
                if a > b:
                    continue
                i = pos.get((a, b), 0)
                while i < len(order):
                    op, key = order[i]
                    src, dst = (a, b) if op == "send" else (b, a)
                    if (dst, key) not in handed[src]:
                        break
                    delivered[dst].add((src, key))
                    i += 1
                    progress = True
                pos[(a, b)] = i
    return all(pc[r] == len(p) for r, p in programs.items())


def one_f_one_b(stages: int, micro: int) -> dict:
    """Per-rank programs of a 1F1B schedule on a chain (rank = stage)."""
    return {s: _stage_ops(stages, micro, s) for s in range(stages)}


def _stage_ops(stages: int, micro: int, s: int) -> list:
    warmup = min(stages - s - 1, micro)
    fwd = bwd = 0
    ops = []
    def forward():
        nonlocal fwd
        if s > 0:
            ops.append(("recv", s - 1, f"act/{fwd}"))
        if s < stages - 1:
            ops.append(("send", s + 1, f"act/{fwd}"))
        fwd += 1
    def backward():
        nonlocal bwd
        if s < stages - 1:
            ops.append(("recv", s + 1, f"grad/{bwd}"))
        if s > 0:
            ops.append(("send", s - 1, f"grad/{bwd}"))
        bwd += 1
    for _ in range(warmup):
        forward()
    while fwd < micro:
        forward()
        backward()
    while bwd < micro:
        backward()
    return ops


@st.composite
def valid_programs(draw):
    """Programs from a random global execution: always runnable with unbounded buffers."""
    return random_programs(draw(st.integers(0, 2**32)), draw(st.integers(2, 5)), draw(st.integers(0, 40)))


@settings(max_examples=150, deadline=None)
@given(valid_programs())
def test_derived_orders_are_mirrored_complete_and_never_deadlock(programs):
    orders = link_orders(programs)
    for a, per_peer in orders.items():
        for b, order in per_peer.items():
            assert orders[b][a] == mirror(order)
            assert order_digest(orders[b][a]) == order_digest(mirror(order))
    for r, prog in programs.items():            # every op of every program is in its link's order
        for peer in {p for _, p, _ in prog}:
            mine = [(op, k) for op, p, k in prog if p == peer]
            assert sorted(mine) == sorted(orders[r][peer])
            assert keys_of(orders[r][peer], "send") == [k for op, k in mine if op == "send"]
    assert lockstep_completes(programs, orders)


@pytest.mark.parametrize("stages, micro", [(2, 1), (2, 4), (4, 8), (5, 3)])
def test_one_f_one_b_orders_run_in_lockstep(stages, micro):
    programs = one_f_one_b(stages, micro)
    assert lockstep_completes(programs, link_orders(programs))


def test_the_model_catches_an_inconsistent_order():
    """An order that each side could execute alone, but which puts a transfer before one it
    depends on, deadlocks (and link_orders does not produce it)."""
    programs = {0: [("send", 1, "a"), ("send", 1, "b"), ("recv", 1, "c")],
                1: [("recv", 0, "a"), ("recv", 0, "b"), ("send", 0, "c")]}
    bad = [("send", "a"), ("recv", "c"), ("send", "b")]
    assert not lockstep_completes(programs, {0: {1: bad}, 1: {0: mirror(bad)}})
    assert link_orders(programs)[0][1] == [("send", "a"), ("send", "b"), ("recv", "c")]


def test_programs_that_cannot_run_are_rejected():
    with pytest.raises(ValueError, match="deadlock"):
        link_orders({0: [("recv", 1, "a")], 1: [("recv", 0, "b")]})
    with pytest.raises(ValueError, match="sends 'a' next"):
        link_orders({0: [("send", 1, "a")], 1: [("recv", 0, "b")]})
    with pytest.raises(ValueError, match="never received"):
        link_orders({0: [("send", 1, "a")], 1: []})
    with pytest.raises(ValueError, match="no program"):
        link_orders({0: [("send", 7, "a")]})
    with pytest.raises(ValueError, match="expected"):
        link_orders({0: [("send", 1)], 1: []})


def test_order_checks_and_cursor():
    assert check_order([("send", "a"), ["recv", "b"]], 1) == [("send", "a"), ("recv", "b")]
    with pytest.raises(ValueError, match="'send' or 'recv'"):
        check_order([("push", "a")], 1)
    c = Cursor(["a", "b"])
    seen = []
    for _ in range(5):
        seen.append(c.peek())
        c.advance()
    assert seen == ["a", "b", "a", "b", "a"]        # one cycle per training step
    assert Cursor([]).peek() is None
    assert order_digest(None) == "none" and order_digest([("send", "a")]) != order_digest([("recv", "a")])
