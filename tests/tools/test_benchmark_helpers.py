"""The benchmark scripts' pure helpers: sizes, bus bandwidth, crossovers."""

import pytest

from benchmarks.allreduce_sweep import analyse, crossovers, settles
from benchmarks.common import read_result, summary
from hybridpipe.comm.allreduce.bench import busbw_gbps
from hybridpipe.errors import UserError
from hybridpipe.units import parse_sizes, size_label


def test_size_ranges_and_labels():
    assert parse_sizes("4K..64M", 4) == [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20,
                                               16 << 20, 64 << 20]
    assert len(parse_sizes("4K..64M", 2)) == 15
    assert parse_sizes("4K,1M") == [4096, 1 << 20]
    assert [size_label(s) for s in (4096, 1 << 20, 64 << 20, 1000)] == ["4K", "1M", "64M", "1000"]
    with pytest.raises(UserError):
        parse_sizes("64M..4K")


def test_busbw_is_the_link_rate_a_ring_needs():
    # A ring all-reduce of S bytes on n ranks puts 2(n-1)/n S on each link: at exactly 1 Gbit/s
    # that takes 2(n-1)/n * S * 8 / 1e9 seconds, which must read as busbw = 1 Gbit/s.
    for n in (2, 4, 8):
        s = 64 << 20
        t = 2 * (n - 1) / n * s * 8 / 1e9
        assert busbw_gbps(s, t, n) == pytest.approx(1.0)


def test_crossovers_find_every_swap():
    ring = {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0}
    fly = {1: 1.0, 2: 5.0, 4: 20.0, 8: 40.0}
    assert crossovers(fly, ring) == [{"between": [2, 4], "below": "algo", "from": "ring"}]
    assert crossovers(ring, ring) == []
    wavy = {1: 1.0, 2: 20.0, 4: 1.0, 8: 20.0}
    assert [c["between"] for c in crossovers(wavy, ring)] == [[1, 2], [2, 4], [4, 8]]


def test_settles_ignores_flips_below_the_last_crossover():
    ring = {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0}
    assert settles({1: 1.0, 2: 20.0, 4: 1.0, 8: 20.0, 16: 20.0}, ring) == {"winner": "ring", "from": 8}
    assert settles({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0}, ring) == {"winner": "algo", "from": 1}
    assert settles({}, ring) is None


def test_analyse_names_the_winners_and_skips_wrong_sums():
    rows = [{"algorithm": "ring", "bytes": b, "median_s": 1.0, "correct": True} for b in (1, 2)]
    rows += [{"algorithm": "butterfly", "bytes": 1, "median_s": 0.5, "correct": True},
             {"algorithm": "butterfly", "bytes": 2, "median_s": 2.0, "correct": True},
             {"algorithm": "torus2d", "bytes": 1, "median_s": 0.1, "correct": False}]
    out = analyse({"hosts": 4, "rate_gbps": 1.0}, rows)
    assert out["fastest"] == {"1": "butterfly", "2": "ring"}
    assert out["crossovers"]["butterfly_vs_ring"] == [{"between": [1, 2], "below": "butterfly", "from": "ring"}]
    assert "torus2d_vs_ring" not in out["crossovers"]
    assert out["settles"]["butterfly_vs_ring"] == {"winner": "ring", "from": 2}
    assert out["rows"][0]["busbw_of_link"] == pytest.approx(busbw_gbps(1, 1.0, 4))


def test_summary_and_result_lines():
    s = summary([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)
    assert read_result("noise\nRESULT {\"a\": 1}\nRESULT {\"a\": 2}\n") == {"a": 2}
    with pytest.raises(RuntimeError):
        read_result("no result here")
