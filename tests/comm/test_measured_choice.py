"""The per-layer choice follows measurements: a calibration in which butterfly was timed slower
than ring on large messages (as on gloo over 1 Gbit/s) makes ``auto`` and the hybrid policy pick
ring there, and butterfly where it was timed faster; a calibration measured inside a job reaches
every rank identically."""

from __future__ import annotations

from torch import nn

from hybridpipe.comm.allreduce import Topology, group_costs
from hybridpipe.comm.allreduce.bench import calibrate_group, fits_summary
from hybridpipe.comm.hybrid_dp import model_layers, plan_units
from hybridpipe.partitioner.cost.calibration import Sample
from hybridpipe.partitioner.cost.fitting import fit_calibration
from tests.comm.spawn import spawn

SIZES = (4096, 65536, 1 << 20, 16 << 20, 64 << 20)
WORLD = 4
GBIT = 8e-9            # seconds per byte at 1 Gbit/s


def _measured() -> list[Sample]:
    """Timings of 4 hosts: ring 6 steps of 700 us, 1.5 S at 0.93 Gbit/s; butterfly (recursive
    doubling below 256 KB, Rabenseifner above) 2-4 steps of 500 us, 1.5 S at 0.6 Gbit/s."""
    out = []
    for s in SIZES:
        out.append(Sample("ring", s, 6 * 700e-6 + 1.5 * s * GBIT / 0.93))
        doubling = 2 * 500e-6 + 2.0 * s * GBIT / 0.6
        halving = 4 * 500e-6 + 1.5 * s * GBIT / 0.6
        out.append(Sample("butterfly", s, min(doubling, halving)))
    return out


def test_auto_and_the_hybrid_policy_follow_the_measurements() -> None:
    cal = fit_calibration(_measured(), world_size=WORLD, hosts=WORLD, backend="gloo", device="cpu",
                          gamma_s_per_byte=1 / 4e9)
    assert cal.algorithms["butterfly"].beta_s_per_byte > 1.4 * cal.algorithms["ring"].beta_s_per_byte
    costs = group_costs(Topology(tuple((i,) for i in range(WORLD))), cal)
    picks = {s: costs.fastest(s, ("ring", "butterfly")) for s in SIZES}
    assert picks == {4096: "butterfly", 65536: "butterfly", 1 << 20: "ring", 16 << 20: "ring", 64 << 20: "ring"}
    nominal = group_costs(Topology(tuple((i,) for i in range(WORLD))))
    assert nominal.fastest(64 << 20, ("ring", "butterfly")) == "butterfly"     # what the nominal model says

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(2048, 2048))             # 288 B and 16 MB of gradients
    units = plan_units(model_layers(model), "hybrid", costs, fuse_small=False, two_lanes=False)
    assert [u.algorithm for u in units] == ["butterfly", "ring"]


def _calibrate(rank: int, world: int) -> dict:
    cal = calibrate_group(("ring", "native"), (4096, 65536), reps=1, budget_s=0.0)
    return {"fits": fits_summary(cal), "world": cal.world_size, "algorithms": sorted(cal.algorithms),
            "samples": len(cal.samples)}


def test_calibrate_group_gives_every_rank_the_same_calibration() -> None:
    results = spawn(_calibrate, 2, timeout=120)
    assert results[0] == results[1]
    assert results[0]["world"] == 2 and results[0]["algorithms"] == ["native", "ring"]
    assert results[0]["samples"] == 6                      # ring, native, p2p at two sizes
    assert set(results[0]["fits"]) == {"native", "ring", "p2p"}
