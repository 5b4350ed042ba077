"""The partitioner's predicted step time against the simulator, where its model's assumption holds.

The partitioner's objective is a steady-state formula: for gpipe/1f1b one micro-batch's trip
through the pipeline plus the slowest stage's other micro-batches; for pipedream the slowest
stage's work per step. On compute-bound pipelines (fast links) the simulator must agree:

* gpipe: within 2 %;
* pipedream, on pipelines without replicated stages (and on pure data parallelism): within
  2 %. A replicated pipedream stage updates after every round of its replicas' backwards, an
  all-reduce that holds the earliest replica until the last one's backward is done; the
  partitioner's formula leaves that wait out, so it is optimistic there (not tested);
* 1f1b: never below the simulation by more than 2 %, and at most 25 % above it: the formula is
  exact for balanced stages, while on unbalanced ones 1F1B's interleaving hides part of the
  slowest stage's bubble that the formula charges.
* zb-h1: within 25 % either way. The formula charges the paper's (p - 1)(F + B - W) fill and
  drain, exact for balanced stages with at least as many micro-batches per replica as stages;
  with fewer (e.g. two stages of 4 replicas, one micro-batch each) the drain has no weight
  halves to fill it with and the formula is optimistic (up to -20 % seen), on unbalanced
  stages the fixed order leaves gaps the formula also misses (up to +12 %).
"""

from __future__ import annotations

import random

import pytest

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.cluster import Cluster, Level
from hybridpipe.partitioner.planner import Request, partition
from hybridpipe.pipeline.simulator import simulate
from hybridpipe.profiles.format import Profile
from tests.partitioner.synth import make_profile

SEEDS = {"gpipe": 1, "1f1b": 2, "pipedream": 3, "zb-h1": 4}
TOLERANCE = {"gpipe": (-0.02, 0.02), "pipedream": (-0.02, 0.02), "1f1b": (-0.02, 0.25), "zb-h1": (-0.25, 0.25)}


def chain_profile(rng: random.Random, n: int) -> Profile:
    """input -> n layers (backward = 2 x forward, small activations) -> output."""
    layers = []
    for _ in range(n):
        f = rng.uniform(0.5, 5.0)
        par = rng.choice([0, 1 << 12, 1 << 16])
        layers.append((f, 2 * f, rng.choice([1 << 10, 1 << 14]), par))
    return make_profile(layers, input_bytes=1024)


def fast_cluster(rng: random.Random) -> Cluster:
    return rng.choice([Cluster((Level("net", 4, 100.0),), 16.0), Cluster((Level("net", 8, 100.0),), 16.0),
                       Cluster((Level("host", 2, 100.0, 1.0), Level("net", 2, 100.0, 5.0)), 16.0)])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream", "zb-h1"])
def test_prediction_agrees_with_simulation_on_compute_bound_pipelines(schedule):
    rng = random.Random(SEEDS[schedule])
    low, high = TOLERANCE[schedule]
    checked, errors = 0, []
    for _ in range(40):
        strategy = rng.choice(["optimal", "uniform", "time", "params", "dp"])
        M = rng.choice([4, 8, 16])
        try:
            plan = partition(chain_profile(rng, rng.randint(4, 12)), fast_cluster(rng),
                             Request(schedule=schedule, strategy=strategy, micro_batches=M)).plan
        except UserError:
            continue        # e.g. more uniform stages than nodes
        except ValueError as e:     # dp.solve's tie-break pass can come back empty (reported to the partitioner)
            if "empty sequence" not in str(e):
                raise
            continue
        reps = [s.replicas for s in plan.stages]
        if max(reps) > M or schedule == "pipedream" and any(M % r for r in reps):
            continue        # plans the runtime refuses (replicas left without micro-batches)
        if schedule == "pipedream" and len(reps) > 1 and max(reps) > 1:
            continue        # the round lock-step the formula leaves out (see the module docstring)
        sim = simulate(plan).step_ms
        err = (plan.predicted_step_ms - sim) / sim
        errors.append(err)
        assert low <= err <= high, (strategy, reps, M, plan.predicted_step_ms, sim)
        checked += 1
    assert checked >= 15
    print(schedule, f"prediction - simulation: {min(errors):+.1%} .. {max(errors):+.1%}")
