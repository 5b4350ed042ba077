"""partition(): plans for every strategy, their round trip, and every request it must refuse."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.calibration import Calibration, LinkFit
from hybridpipe.partitioner.cost.cluster import Cluster, load_cluster
from hybridpipe.partitioner.plan import STRATEGIES, check_plan_fits, load_plan, save_plan
from hybridpipe.partitioner.planner import Request, partition
from tests.partitioner.synth import make_profile, two_level

LAYERS = [(4.0, 8.0, 2_000_000, 100_000), (3.0, 6.0, 1_000_000, 2_000_000), (2.0, 4.0, 400_000, 3_000_000),
          (0.5, 1.0, 16_000, 60_000_000), (0.2, 0.4, 4_000, 4_000_000)]
PROFILE = make_profile(LAYERS, skips=[(1, 4)], model="synthetic-convfc")
# Megatron's split needs the layers + 2 to divide over the 4 stages: one more layer (6 + 2 = 8)
MEGATRON_PROFILE = make_profile([*LAYERS, (1.0, 2.0, 100_000, 500_000)], skips=[(1, 4)], model="synthetic-convfc")


def profile_for(strategy: str):
    return MEGATRON_PROFILE if strategy == "megatron" else PROFILE
CLUSTER = two_level(1, 4, outer_gbps=1.0, memory_gb=4.0)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream", "zb-h1"])
def test_every_strategy_makes_a_valid_plan(strategy, schedule, tmp_path):
    PROFILE = profile_for(strategy)
    out = partition(PROFILE, CLUSTER, Request(strategy=strategy, schedule=schedule))
    plan = out.plan
    assert plan.world_size == 4 and plan.strategy == strategy
    if strategy == "pipedream":         # the default rounded up to a count its replicas divide
        assert plan.micro_batches >= 8 and all(plan.micro_batches % s.replicas == 0 for s in plan.stages)
    else:
        assert plan.micro_batches == 8
    assert plan.stages[0].first_node == 0 and plan.stages[-1].last_node == len(PROFILE.nodes) - 1
    assert plan.predicted_step_ms >= out.evaluation.objective_ms > 0
    assert plan.predicted_samples_per_s == pytest.approx(plan.micro_batches * PROFILE.batch_size
                                                         / plan.predicted_step_ms * 1e3)
    for stage in plan.stages:
        assert stage.compute_ms == pytest.approx(stage.forward_ms + stage.backward_ms)
        assert stage.memory_bytes <= 4e9
        owned = [n for n in PROFILE.nodes[stage.first_node:stage.last_node + 1] if n.param_bytes]
        if stage.replicas > 1:
            assert [lv.layer for lv in stage.layers] == [n.name for n in owned]
            assert all(lv.params == n.params and lv.bytes == n.param_bytes
                       for lv, n in zip(stage.layers, owned, strict=True))
        else:
            assert stage.layers == () and stage.sync_ms == 0
    back = load_plan(save_plan(plan, tmp_path / "plan.json"))
    assert back == plan
    check_plan_fits(back, model="synthetic-convfc", batch_size=8, world_size=4)
    assert back.profile_signature == PROFILE.signature() and back.stages[-1].last_node == len(PROFILE.nodes) - 1


def test_optimal_is_never_worse_than_a_baseline():
    for strategy in STRATEGIES:
        best = partition(profile_for(strategy), CLUSTER).evaluation.objective_ms
        theirs = partition(profile_for(strategy), CLUSTER, Request(strategy=strategy)).evaluation.objective_ms
        assert best <= theirs * (1 + 1e-9)


def test_skip_connections_are_charged_at_every_cut_they_cross():
    out = partition(PROFILE, CLUSTER, Request(strategy="time"))
    # node 1's output feeds node 4 too: it crosses every cut between them
    for stage in out.plan.stages[:-1]:
        if 1 <= stage.last_node < 4:
            assert stage.send_bytes >= LAYERS[0][2]


def test_workers_and_micro_batches_and_calibration():
    out = partition(PROFILE, two_level(2, 4), Request(workers=4, micro_batches=3, optimizer="adam"))
    assert out.plan.world_size == 4 and out.plan.micro_batches == 3 and out.plan.cluster.total_workers == 4
    cal = Calibration(4, 4, "gloo", "cpu", "net", 1e-10, LinkFit(1e-3, 1e-7), {"ring": LinkFit(1e-3, 1e-7)})
    slow = partition(PROFILE, CLUSTER, Request(strategy="dp"), [cal]).plan.predicted_step_ms
    assert slow > partition(PROFILE, CLUSTER, Request(strategy="dp")).plan.predicted_step_ms


BAD_CLUSTERS = [
    ([], "expected a JSON object"),
    ({"kind": "plan", "levels": [], "memory_gb": 1}, "not a cluster file"),
    ({"format": 2, "levels": [], "memory_gb": 1}, "format 2 is not supported"),
    ({"memory_gb": 1}, 'missing required field "levels"'),
    ({"levels": [], "memory_gb": 1}, '"levels" is empty'),
    ({"levels": [3], "memory_gb": 1}, "level 0: expected an object"),
    ({"levels": [{"workers": 2}], "memory_gb": 1}, 'missing required field "bandwidth_gbps"'),
    ({"levels": [{"workers": 2, "bandwidth_gbps": 0}], "memory_gb": 1}, "\"bandwidth_gbps\" must be >= 1e-06"),
    ({"levels": [{"workers": 2, "bandwidth_gbps": "fast"}], "memory_gb": 1}, '"bandwidth_gbps" must be a number'),
    ({"levels": [{"workers": 0, "bandwidth_gbps": 1}], "memory_gb": 1}, '"workers" must be >= 1'),
    ({"levels": [{"workers": 2.5, "bandwidth_gbps": 1}], "memory_gb": 1}, '"workers" must be an integer'),
    ({"levels": [{"workers": True, "bandwidth_gbps": 1}], "memory_gb": 1}, '"workers" must be an integer'),
    ({"levels": [{"workers": 2, "bandwidth_gbps": 1, "latency_us": -1}], "memory_gb": 1}, '"latency_us" must be >= 0'),
    ({"levels": [{"name": "a", "workers": 2, "bandwidth_gbps": 1}, {"name": "a", "workers": 2, "bandwidth_gbps": 1}],
      "memory_gb": 1}, "level names must be unique"),
    ({"levels": [{"workers": 2, "bandwidth_gbps": 1}]}, 'missing required field "memory_gb"'),
    ({"levels": [{"workers": 2, "bandwidth_gbps": 1}], "memory_gb": 0}, "memory_gb must be > 0"),
    ({"levels": [{"workers": 2, "bandwidth_gbps": float("nan")}], "memory_gb": 1}, "must be a finite number"),
]


@pytest.mark.parametrize("data,message", BAD_CLUSTERS)
def test_malformed_clusters_are_rejected_in_one_line(data, message, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=message) as err:
        load_cluster(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_a_wrong_kind_or_format_shows_the_value_as_written_and_the_fix(tmp_path):
    path = tmp_path / "c.json"
    for data, shown, fix in (({"kind": "plan", "levels": [], "memory_gb": 1}, '(its "kind" is "plan")',
                              "examples/clusters/"),
                             ({"format": "2", "levels": [], "memory_gb": 1}, 'cluster format "2" is not supported',
                              'write "format": 1 or leave it out')):
        path.write_text(json.dumps(data))
        with pytest.raises(UserError) as err:
            load_cluster(path)
        assert shown in str(err.value) and fix in str(err.value), err.value


def test_unreadable_cluster_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_cluster(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{levels: 1")
    with pytest.raises(UserError, match="not valid JSON"):
        load_cluster(tmp_path / "bad.json")


BAD_REQUESTS = [
    (Request(workers=0), "--workers must be at least 1"),
    (Request(workers=-3), "--workers must be at least 1"),
    (Request(workers=5), "more than the cluster's 4 workers"),
    (Request(memory_gb=0.0), "--memory-gb must be > 0"),
    (Request(memory_gb=0.01), "no plan fits in 0.01 GB per worker: node 'l4' alone needs"),
    (Request(memory_gb=0.3, schedule="gpipe", micro_batches=64, strategy="time"), "--strategy time does not fit"),
    (Request(micro_batches=0), "--micro-batches must be at least 1"),
    (Request(stages=0, strategy="uniform"), "--stages must be at least 1"),
    (Request(stages=3, strategy="uniform"), "must divide the 4 workers"),
    (Request(stages=2), "drop --stages"),
    (Request(stages=2, strategy="time"), "replicates nothing"),
    (Request(strategy="magic"), "unknown strategy"),
    (Request(schedule="zigzag"), "unknown schedule"),
    (Request(optimizer="lamb"), "unknown optimizer"),
    (Request(algorithms=("ring", "carrier-pigeon")), "--algorithms must name some of"),
    (Request(algorithms=()), "--algorithms must name some of"),
    (Request(strategy="dp", micro_batches=2), "gives stage 0 4 replicas but a step has 2 micro-batches; use "
                                              "--micro-batches at least 4"),
    (Request(strategy="uniform", stages=1, schedule="pipedream", micro_batches=6), "a multiple of 4"),
]


@pytest.mark.parametrize("req,message", BAD_REQUESTS)
def test_impossible_requests_are_refused_in_one_line(req, message):
    with pytest.raises(UserError, match=message) as err:
        partition(PROFILE, CLUSTER, req)
    assert "\n" not in str(err.value)


def test_more_stages_than_nodes_and_bad_worker_counts():
    tiny = make_profile([(1.0, 2.0, 100, 100)])                           # 3 nodes
    with pytest.raises(UserError, match="needs 4 stages but the profile has only 3 nodes"):
        partition(tiny, CLUSTER, Request(strategy="time"))
    assert partition(tiny, CLUSTER).plan.world_size == 4                  # optimal replicates instead
    with pytest.raises(UserError, match="positive multiple of 4"):
        partition(PROFILE, two_level(4, 2), Request(workers=6))
    cal = Calibration(4, 4, "gloo", "cpu", "rack", 1e-10, LinkFit(1e-3, 1e-7), {})
    with pytest.raises(UserError, match="level 'rack'"):
        partition(PROFILE, CLUSTER, Request(), [cal])


@pytest.mark.parametrize("strategy", ["optimal", "time", "dp"])
def test_prediction_covers_fill_drain_and_the_busiest_stage(strategy):
    plan = partition(PROFILE, CLUSTER, Request(schedule="1f1b", strategy=strategy)).plan
    trip = sum(s.forward_ms + s.backward_ms + s.send_ms for s in plan.stages)
    rest = max((-(-plan.micro_batches // s.replicas) - 1) * s.compute_ms for s in plan.stages)
    assert plan.predicted_step_ms >= trip + rest - 1e-9
    assert isinstance(plan.cluster, Cluster)


@pytest.mark.parametrize("schedule,micro", [("1f1b", 3), ("gpipe", 2), ("pipedream", 6), ("pipedream", 3)])
def test_every_replica_gets_micro_batches(schedule, micro):
    plan = partition(PROFILE, CLUSTER, Request(schedule=schedule, micro_batches=micro)).plan
    for stage in plan.stages:
        assert stage.replicas <= micro
        assert schedule != "pipedream" or micro % stage.replicas == 0


def test_auto_picks_the_fastest_flushed_schedule():
    out = partition(PROFILE, CLUSTER, Request(schedule="auto"))
    times = {name: partition(PROFILE, CLUSTER, Request(schedule=name)).plan.predicted_step_ms
             for name in ("gpipe", "1f1b", "zb-h1")}
    assert out.plan.schedule in times and out.plan.predicted_step_ms == min(times.values())
    assert times["zb-h1"] < times["1f1b"]          # the split backward shortens the fill and drain


def test_recompute_auto_fits_where_keeping_activations_does_not_and_pays_a_forward():
    big = make_profile([(2.0, 4.0, 40_000_000, 1_000)] * 4, model="activation-heavy")
    cluster = two_level(1, 2, outer_gbps=100.0, memory_gb=4.0)
    req = Request(strategy="uniform", stages=2, micro_batches=8, schedule="gpipe", memory_gb=0.45)
    with pytest.raises(UserError, match="--recompute auto"):
        partition(big, cluster, req)
    free = partition(big, cluster, Request(**{**req.__dict__, "memory_gb": None})).plan
    plan = partition(big, cluster, Request(**{**req.__dict__, "recompute": "auto"})).plan
    assert all(s.recompute for s in plan.stages)
    for s, f in zip(plan.stages, free.stages, strict=True):
        assert s.memory_bytes <= 0.45e9 < f.memory_bytes
        assert s.backward_ms == pytest.approx(f.backward_ms + f.forward_ms)      # the forward, run again
    assert plan.predicted_step_ms > free.predicted_step_ms
    roomy = partition(big, cluster, Request(**{**req.__dict__, "recompute": "auto", "memory_gb": None})).plan
    assert not any(s.recompute for s in roomy.stages)                          # auto: only where memory binds


@settings(max_examples=40, deadline=None)
@given(layers=st.lists(st.tuples(st.floats(0.01, 2.0), st.floats(0.01, 4.0), st.integers(1, 1 << 20),
                                 st.integers(0, 1 << 20)), min_size=2, max_size=8),
       embedding=st.integers(1 << 16, 1 << 24), outer_gbps=st.sampled_from([0.05, 1.0, 10.0]),
       per_host=st.sampled_from([1, 2]))
def test_optimal_is_never_predicted_slower_than_data_parallelism(layers, embedding, outer_gbps, per_host):
    """The DP's objective leaves out the fill's transfer latencies and the sum of a weight tied across
    stages (here the first layer's, read again by the last node); the planner then keeps data
    parallelism wherever the pipeline's full predicted step is slower."""
    chain = make_profile([(1.0, 2.0, 4096, embedding)] + layers)
    last = chain.nodes[-1]
    tied = dataclasses.replace(last, shared=("l1.weight",), shared_bytes=(embedding,))
    profile = dataclasses.replace(chain, nodes=chain.nodes[:-1] + (tied,))
    cluster = two_level(per_host, 4 // per_host, outer_gbps=outer_gbps)
    best = partition(profile, cluster, Request(strategy="optimal")).plan.predicted_step_ms
    dp = partition(profile, cluster, Request(strategy="dp")).plan.predicted_step_ms
    assert best <= dp * (1 + 1e-9)


def test_bf16_plans_price_transfers_and_all_reduces_at_half_the_bytes(tmp_path):
    """partition --precision bf16 of an fp32 profile: transfers at half the bytes (latencies stay);
    --reduce-dtype bf16: the all-reduces too (fp32 by default, as launch sums them). The plan records
    both and the simulator prices the same way."""
    from hybridpipe.pipeline.simulator import simulate

    profile = make_profile([(1.0, 2.0, 1 << 22, 1 << 22)] * 4)
    cluster = two_level(2, 2, outer_gbps=1.0)
    stages = Request(strategy="uniform", stages=2, micro_batches=4)
    fp32 = partition(profile, cluster, stages).plan
    bf16 = partition(profile, cluster, dataclasses.replace(stages, precision="bf16")).plan
    low = partition(profile, cluster, dataclasses.replace(stages, precision="bf16", reduce_dtype="bf16")).plan
    assert (fp32.precision, bf16.precision, bf16.reduce_dtype, low.reduce_dtype) == ("fp32", "bf16", "fp32", "bf16")
    assert bf16.stages[0].send_bytes == fp32.stages[0].send_bytes          # profiled bytes, priced at half
    assert 0.45 < bf16.stages[0].send_ms / fp32.stages[0].send_ms < 0.55
    assert bf16.stages[0].sync_ms == pytest.approx(fp32.stages[0].sync_ms)
    assert 0.45 < low.stages[0].sync_ms / fp32.stages[0].sync_ms < 0.55
    assert low.predicted_step_ms <= bf16.predicted_step_ms < fp32.predicted_step_ms      # the sync overlaps
    back = load_plan(save_plan(low, tmp_path / "p.json"))
    assert (back.precision, back.reduce_dtype) == ("bf16", "bf16")
    assert simulate(back).step_ms <= simulate(bf16).step_ms < simulate(fp32).step_ms
    with pytest.raises(UserError, match="unknown precision"):
        partition(profile, cluster, dataclasses.replace(stages, precision="fp8"))
    with pytest.raises(UserError, match="unknown reduce dtype"):
        partition(profile, cluster, dataclasses.replace(stages, reduce_dtype="fp8"))


def test_a_profile_taken_in_bf16_prices_its_activations_as_measured(tmp_path):
    """Activations cross in the dtype the forward made them (a float32 residual stream stays float32
    under autocast): a bf16 profile already holds their wire bytes, so a bf16 plan of it prices them
    whole (an fp32 profile's are halved, an estimate); the gradients' all-reduce halves in both. The
    saved plan records the profile's precision and the simulator prices it the same way."""
    from hybridpipe.pipeline.simulator import simulate

    fp32 = make_profile([(1.0, 2.0, 1 << 22, 1 << 22)] * 4)
    measured = dataclasses.replace(fp32, precision="bf16")
    cluster = two_level(2, 2, outer_gbps=1.0)
    req = Request(strategy="uniform", stages=2, micro_batches=4, precision="bf16")
    estimated, priced = partition(fp32, cluster, req).plan, partition(measured, cluster, req).plan
    assert (estimated.profile_precision, priced.profile_precision) == ("fp32", "bf16")
    assert 1.9 < priced.stages[0].send_ms / estimated.stages[0].send_ms < 2.1
    assert priced.stages[0].sync_ms == pytest.approx(estimated.stages[0].sync_ms)
    back = load_plan(save_plan(priced, tmp_path / "p.json"))
    assert back.profile_precision == "bf16"
    assert simulate(back).step_ms > simulate(estimated).step_ms


def test_a_plan_for_another_precision_than_the_profiles_says_so():
    profile = make_profile([(1.0, 2.0, 1 << 20, 1 << 20)] * 2)
    cluster = two_level(1, 2)
    assert not any("precision" in n for n in partition(profile, cluster, Request()).notes)
    notes = partition(profile, cluster, Request(precision="bf16")).notes
    assert any("measured in fp32 and the plan is for bf16" in n for n in notes)
    same = dataclasses.replace(profile, precision="bf16")
    assert not any("precision" in n for n in partition(same, cluster, Request(precision="bf16")).notes)


def test_shard_level_round_trips_defaults_to_none_and_needs_replicas(tmp_path):
    path = save_plan(partition(PROFILE, CLUSTER, Request(strategy="dp")).plan, tmp_path / "plan.json")
    assert all(s.shard == "none" and s.reshard_after_forward for s in load_plan(path).stages)
    data = json.loads(path.read_text())
    for s in data["stages"]:
        del s["shard"], s["reshard_after_forward"]          # a plan written before the field
    path.write_text(json.dumps(data))
    assert all(s.shard == "none" for s in load_plan(path).stages)
    data["stages"][0].update(shard="parameters", reshard_after_forward=False)
    path.write_text(json.dumps(data))
    back = load_plan(path).stages[0]
    assert (back.shard, back.reshard_after_forward) == ("parameters", False)
    data["stages"][0]["shard"] = "everything"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match="must be one of none, optimizer, gradients, parameters"):
        load_plan(path)
    one = save_plan(partition(PROFILE, CLUSTER, Request(strategy="uniform", stages=4)).plan, tmp_path / "pipe.json")
    data = json.loads(one.read_text())
    data["stages"][0]["shard"] = "optimizer"
    one.write_text(json.dumps(data))
    with pytest.raises(UserError, match="needs replicas to shard over"):
        load_plan(one)


def test_the_plan_records_the_cpu_threads_its_profile_measured_with(tmp_path):
    """A CPU profile's times are those of its intra-op thread count: the plan carries it (launch compares
    it with the ranks'); a GPU profile's or an older profile's is 0 (not a CPU setting, or unknown)."""
    cpu = dataclasses.replace(make_profile([(1.0, 2.0, 1 << 20, 1 << 20)] * 2), device="cpu", threads=3)
    cluster = two_level(1, 2)
    plan = partition(cpu, cluster, Request()).plan
    assert plan.profile_threads == 3 and load_plan(save_plan(plan, tmp_path / "p.json")).profile_threads == 3
    assert partition(dataclasses.replace(cpu, device="cuda (H200)"), cluster, Request()).plan.profile_threads == 0
    assert partition(dataclasses.replace(cpu, threads=0), cluster, Request()).plan.profile_threads == 0
