"""The all-reduce layer's pure parts: flat spaces, topologies, the group's cost model, tags,
and the benchmark's sizes and table (no processes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.comm.allreduce.bench import busbw_gbps, table
from hybridpipe.comm.allreduce.costs import group_costs
from hybridpipe.comm.allreduce.flat import FlatSpace
from hybridpipe.comm.allreduce.schedule import PHASES
from hybridpipe.comm.allreduce.topology import Topology
from hybridpipe.comm.allreduce.transport import ALGORITHM_IDS, MAX_LANES, message_tag
from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.calibration import Calibration, LinkFit, Sample
from hybridpipe.units import parse_sizes, size_label


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=5), chunk=st.integers(1, 16),
       data=st.data())
def test_flat_space_cuts_ranges_at_tensors_and_grid(sizes, chunk, data) -> None:
    tensors = [torch.arange(n, dtype=torch.float32) + 100 * i for i, n in enumerate(sizes)]
    space = FlatSpace(tensors, chunk)
    total = sum(sizes)
    lo = data.draw(st.integers(0, total))
    hi = data.draw(st.integers(lo, total))
    pieces = list(space.pieces(lo, hi))
    flat = torch.cat(tensors)
    assert [p.lo for p in pieces[1:]] == [p.hi for p in pieces[:-1]]
    assert (pieces[0].lo, pieces[-1].hi) == (lo, hi) if pieces else lo == hi
    for p in pieces:
        assert p.cell == p.lo // chunk == (p.hi - 1) // chunk
        assert torch.equal(space.view(p.lo, p.hi), flat[p.lo:p.hi])   # one tensor, the right elements


def test_flat_space_views_write_through_and_rejects_mixed_tensors() -> None:
    a, b = torch.zeros(3), torch.zeros(2, 2)
    space = FlatSpace([a, b], 2)
    space.view(3, 7).fill_(1)
    assert b.sum() == 4 and a.sum() == 0
    with pytest.raises(ValueError, match="crosses a tensor boundary"):
        space.view(2, 4)
    with pytest.raises(ValueError, match="share dtype and device"):
        FlatSpace([a, torch.zeros(2, dtype=torch.int64)], 2)
    with pytest.raises(ValueError, match="contiguous"):
        FlatSpace([torch.zeros(3, 3).t()], 2)


def test_topologies() -> None:
    assert Topology.from_labels(["a", "b", "a", "c", "b"]).units == ((0, 2), (1, 4), (3,))
    assert Topology.blocks(5, 2).units == ((0, 1), (2, 3), (4,))
    assert Topology.blocks(6, 3).uniform == 3 and Topology.blocks(5, 2).uniform is None
    with pytest.raises(ValueError, match="partition"):
        Topology(((0, 1), (1, 2)))


def test_topology_from_torchrun_environment(monkeypatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert Topology.from_env([3, 5, 6]).units == ((0, 1, 2),)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert Topology.from_env([1, 3, 4, 6, 9]).units == ((0, 1), (2, 3), (4,))   # nodes 0, 0, 1, 1, 2


def test_tags_are_distinct_per_lane_algorithm_and_phase() -> None:
    tags = {message_tag(lane, a, p) for lane in range(0, MAX_LANES, 37) for a in ALGORITHM_IDS for p in PHASES}
    assert len(tags) == len(range(0, MAX_LANES, 37)) * len(ALGORITHM_IDS) * len(PHASES)
    with pytest.raises(ValueError, match="lane"):
        message_tag(MAX_LANES, "ring", "fold")


def _calibration(level: str, hosts: int, world: int = 4) -> Calibration:
    fit = LinkFit(1e-3, 1e-9)
    return Calibration(world, hosts, "gloo", "cpu", level, 1e-10, fit, {"ring": fit, "native": LinkFit(5e-4, 1e-9)})


def test_group_costs_shape_the_cluster_like_the_topology() -> None:
    flat = group_costs(Topology.flat(4))
    assert [lv.name for lv in flat.model.cluster.levels] == ["host"]
    two = group_costs(Topology.from_labels(["a", "b", "a", "b"]))
    assert [(lv.name, lv.workers) for lv in two.model.cluster.levels] == [("host", 2), ("network", 2)]
    assert sorted(map(sorted, two.model.groups(two.ranks))) == [[0, 1], [2, 3]]   # positions 0,2 share a host
    assert two.torus_shape() == (2, 2)
    # unequal hosts: the model's groups are still the hosts (hierarchical runs over them)
    uneven = group_costs(Topology.blocks(5, 2))
    assert [(lv.name, lv.workers) for lv in uneven.model.cluster.levels] == [("host", 2), ("network", 3)]
    assert uneven.topology().units == Topology.blocks(5, 2).units


def test_a_plans_cost_model_gives_the_groups_hierarchical_uses() -> None:
    from hybridpipe.comm.allreduce import GroupCosts
    from hybridpipe.partitioner.cost.cluster import Cluster, Level
    from hybridpipe.partitioner.cost.costmodel import CostModel
    cluster = Cluster((Level("node", 2, 100.0), Level("network", 4, 1.0)), 16.0)
    costs = GroupCosts(CostModel(cluster), (7, 2, 6, 3))          # a stage's ranks, in any order
    assert costs.topology().units == ((0, 1), (2, 3))             # positions of 2,3 and of 6,7
    assert costs.torus_shape() == (2, 2)


def test_group_costs_price_what_the_calibration_measured() -> None:
    local = group_costs(Topology.flat(4), _calibration("", hosts=1))
    assert local.seconds("native", 4096) < local.seconds("ring", 4096)      # native's own, smaller alpha
    named = group_costs(Topology.blocks(4, 2), _calibration("fabric", hosts=2))
    assert [lv.name for lv in named.model.cluster.levels] == ["host", "fabric"]


def test_auto_prefers_few_steps_for_small_and_bandwidth_for_large_messages() -> None:
    costs = group_costs(Topology.from_labels(range(8)))       # 8 hosts of one rank
    assert costs.fastest(1024, ("native", "ring", "butterfly")) == "butterfly"      # log2 8 = 3 steps, not 14
    assert costs.fastest(1024) in ("butterfly", "aggregator")                     # the model's 2-step one-root
    assert costs.halving(64 << 20) and not costs.halving(64)     # Rabenseifner for large messages
    six = group_costs(Topology.from_labels(range(6)))             # its fold costs 2 S more: rings win
    assert six.fastest(64 << 20) in ("native", "ring", "hierarchical", "torus2d")


def test_sizes_and_bandwidths() -> None:
    assert parse_sizes("4K..64K") == [4096, 16384, 65536]
    assert parse_sizes("4K..32K", 2) == [4096, 8192, 16384, 32768]
    assert parse_sizes("1M,17") == [1 << 20, 17]
    assert [size_label(s) for s in (4096, 1 << 20, 1000)] == ["4K", "1M", "1000"]
    assert busbw_gbps(1e9 / 8, 1.0, 4) == pytest.approx(1.5)
    for bad in ("4X", "64M..4K", "0"):
        with pytest.raises(UserError):
            parse_sizes(bad)


def test_table_marks_the_fastest_per_size() -> None:
    samples = [Sample("ring", 4096, 2e-3), Sample("butterfly", 4096, 1e-3), Sample("ring", 1 << 20, 1e-2),
               Sample("butterfly", 1 << 20, 2e-2), Sample("p2p", 4096, 1e-4), Sample("p2p", 1 << 20, 1e-3)]
    lines = table(samples, 4).splitlines()
    assert "ring" in lines[0] and "butterfly" in lines[0] and "p2p" in lines[0]
    row_4k, row_1m = lines[2], lines[3]
    assert row_4k.strip().startswith("4K") and row_4k.index("*") > row_4k.index("1.000")
    assert row_1m.strip().startswith("1M") and row_1m.index("*") < row_1m.index("20.000")
