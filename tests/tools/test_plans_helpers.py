"""benchmarks/plans.py's pure helpers: profile scaling, plan identity, rows and ratios (no processes)."""

import pytest

from benchmarks.plans_analysis import (
    add_relative,
    allreduce_choices,
    compute_concurrency,
    compute_scale,
    contention_at,
    error_summary,
    memory_refusal,
    plan_key,
    prediction_error,
    row_from,
    scale_plan_compute,
    scale_profile,
    stage_layout,
    strategy_args,
)
from hybridpipe.profiles.format import Profile


def _profile_dict() -> dict:
    """A real (tiny) profile JSON, as `hybridpipe profile` writes it."""
    from hybridpipe.profiles.profiler import profile_model
    from hybridpipe.profiles.zoo import resolve_model
    model = resolve_model("mlp[features=8,hidden=16,layers=2]")
    return profile_model(model, batch_size=4, repeats=1, progress=False).to_dict()


def _stage(first, last, replicas, ranks, algos=(), mem=1 << 30):
    return {"first_node": first, "last_node": last, "replicas": replicas, "ranks": list(ranks), "memory_bytes": mem,
            "layers": [{"layer": f"l{i}", "algorithm": a} for i, a in enumerate(algos)]}


def _plan(stages, predicted_ms=1000.0, mb=8, bs=32):
    return {"schedule": "1f1b", "micro_batches": mb, "batch_size": bs, "stages": stages,
            "predicted_step_ms": predicted_ms, "predicted_samples_per_s": mb * bs / predicted_ms * 1e3}


def test_scale_profile_multiplies_every_node_and_keeps_the_graph():
    raw = _profile_dict()
    scaled = scale_profile(raw, 2.5, "x2.5 by test")
    for a, b in zip(raw["nodes"], scaled["nodes"], strict=True):
        assert b["forward_ms"] == pytest.approx(2.5 * a["forward_ms"])
        assert b["backward_ms"] == pytest.approx(2.5 * a["backward_ms"])
        assert b["activation_bytes"] == a["activation_bytes"]
    assert scaled["totals"]["forward_ms"] == pytest.approx(2.5 * raw["totals"]["forward_ms"])
    assert scaled["notes"][-1] == "x2.5 by test"
    assert raw["notes"] != scaled["notes"]                      # the input is not modified
    prof = Profile.from_dict(scaled)                            # still a valid profile, same graph
    assert prof.signature() == Profile.from_dict(raw).signature()
    with pytest.raises(ValueError):
        scale_profile(raw, 0.0, "")


def test_compute_scale_is_isolation_times_contention():
    s = compute_scale(node_sum_ms=100.0, alone_ms=120.0, contended_ms=240.0)
    assert s == {"isolation": 1.2, "contention": 2.0, "scale": 2.4}
    assert s["isolation"] * s["contention"] == pytest.approx(s["scale"])
    with pytest.raises(ValueError):
        compute_scale(0.0, 1.0, 1.0)


def test_plan_key_tells_runtime_differences_apart():
    dp = _plan([_stage(0, 9, 4, range(4), ["ring"] * 3)])
    assert plan_key(dp) == plan_key(_plan([_stage(0, 9, 4, range(4), ["ring"] * 3)], predicted_ms=5.0))
    assert plan_key(dp) != plan_key(_plan([_stage(0, 9, 4, range(4), ["ring", "ring", "butterfly"])]))
    assert plan_key(dp) != plan_key(_plan([_stage(0, 9, 4, range(4), ["ring"] * 3)], mb=16))
    pipe = _plan([_stage(0, 4, 1, [0]), _stage(5, 9, 3, [1, 2, 3], ["ring"])])
    assert plan_key(pipe) != plan_key(dp)
    assert stage_layout(pipe) == "0-4x1 | 5-9x3"
    assert stage_layout(_plan([_stage(0, 0, 1, [0]), _stage(1, 9, 1, [1])])) == "0x1 | 1-9x1"
    assert allreduce_choices(_plan([_stage(0, 4, 2, [0, 1], ["ring", "butterfly", "ring"]), _stage(5, 9, 1, [2])])) \
        == [{"butterfly": 1, "ring": 2}, {}]


def test_rows_errors_and_ratios_to_optimal():
    assert prediction_error(1100.0, 1000.0) == pytest.approx(0.1)
    assert prediction_error(None, 1000.0) is None
    opt = _plan([_stage(0, 9, 4, range(4), ["ring"])], predicted_ms=1000.0)
    slow = _plan([_stage(0, 4, 2, [0, 1]), _stage(5, 9, 2, [2, 3])], predicted_ms=2000.0)
    rows = [row_from("m", 4, "optimal", opt, {"measured_step_ms": 1200.0, "samples_per_s": 256 / 1.2,
                                              "job_step_ms": {"0": 2000.0, "1": 1200.0}, "warmup_steps": 1,
                                              "replicas_identical": {"0": True}, "wall_s": 10.0}),
            row_from("m", 4, "uniform", slow, {"measured_step_ms": 1800.0, "samples_per_s": 256 / 1.8,
                                               "job_step_ms": {"0": 2000.0, "1": 1800.0}, "warmup_steps": 1,
                                               "replicas_identical": {}, "wall_s": 10.0}),
            row_from("m", 4, "params", slow, {"failed": "RuntimeError: boom"}),
            row_from("m", 8, "dp", opt, None)]
    add_relative(rows)
    assert rows[0]["error"] == pytest.approx(0.2) and rows[0]["measured_vs_optimal"] == 1.0
    assert rows[1]["measured_vs_optimal"] == pytest.approx(1.2 / 1.8)
    assert rows[1]["predicted_vs_optimal"] == pytest.approx(0.5)
    assert rows[1]["error"] == pytest.approx(-0.1)
    assert rows[2]["status"] == "failed" and rows[2]["reason"] == "RuntimeError: boom"
    assert rows[2]["measured_vs_optimal"] is None
    assert rows[3]["measured_vs_optimal"] is None               # no optimal row for 8 hosts
    summary = error_summary(rows + [{**rows[0], "strategy": "dp", "same_plan_as": "optimal"}])
    assert summary["runs"] == 2 and summary["within_goal"] == 1      # a same-plan row is not counted twice
    assert summary["median_abs_error"] == pytest.approx(0.15)


def test_memory_refusal_names_the_need():
    assert memory_refusal(_plan([_stage(0, 9, 1, [0], mem=1 << 20)])) is None
    why = memory_refusal(_plan([_stage(0, 9, 8, range(8), mem=1 << 40)]))
    assert why is not None and "GiB" in why and "8 workers" in why


def test_contention_curve_interpolates_between_measured_counts():
    curve = {2: 1.2, 4: 2.6, 8: 5.0}
    assert contention_at(curve, 0.5) == 1.0 and contention_at(curve, 1) == 1.0
    assert contention_at(curve, 1.5) == pytest.approx(1.1)
    assert contention_at(curve, 3) == pytest.approx(1.9)
    assert contention_at(curve, 8) == 5.0 and contention_at(curve, 12) == 5.0      # clamped
    assert contention_at({"4": 2.0}, 2.5) == pytest.approx(1.5)                     # keys from JSON


def test_compute_concurrency_weights_by_work():
    assert compute_concurrency([(0, 1), (0, 1), (0, 1), (0, 1)]) == pytest.approx(4)      # data parallel: all at once
    assert compute_concurrency([(0, 1), (1, 2), (2, 3), (3, 4)]) == pytest.approx(1)      # one at a time
    # two workers overlap for half of their work: n = 1, 2, 1 for 1 ms each -> (1 + 4 + 1) / (1 + 2 + 1)
    assert compute_concurrency([(0, 2), (1, 3)]) == pytest.approx(1.5)
    assert compute_concurrency([]) == 1.0


def test_scale_plan_compute_leaves_communication_alone():
    plan = _plan([dict(_stage(0, 9, 2, [0, 1], ["ring"]), forward_ms=10.0, backward_ms=20.0, compute_ms=30.0,
                       send_ms=5.0, sync_ms=7.0)])
    out = scale_plan_compute(plan, 0.5)
    s = out["stages"][0]
    got = (s["forward_ms"], s["backward_ms"], s["compute_ms"], s["send_ms"], s["sync_ms"])
    assert got == (5.0, 10.0, 15.0, 5.0, 7.0)
    assert plan["stages"][0]["forward_ms"] == 10.0


@pytest.mark.slow
def test_the_compute_measurement_calls_a_hugging_face_model_with_its_dict_batch_and_own_loss(tmp_path, capsys):
    """plans.py's calibration (contention.compute_worker) on a model whose batch is a dict and whose loss is its
    own (hf:llama): it called ``model(x)`` with the dict and ``spec.loss`` (None) before."""
    import os

    from benchmarks.common import read_result
    from benchmarks.contention import compute_worker
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    compute_worker("hf:llama[num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,"
                   "num_key_value_heads=1,vocab_size=64,seq=8]", 2, 0.05, str(tmp_path), 1)
    result = read_result(capsys.readouterr().out)
    assert result["median_ms"] > 0 and result["iterations"] >= 2 and result["sgd_step_ms"] > 0


def test_strategy_names_give_partition_flags_and_s_at_n_a_hybrid_stage_count():
    assert strategy_args("time") == ["--strategy", "time"]
    assert strategy_args("uniform@2") == ["--strategy", "uniform", "--stages", "2"]
    assert strategy_args("torchtitan@3") == ["--strategy", "torchtitan", "--stages", "3"]
    for bad in ("time@2", "uniform@", "uniform@x", "uniform@0", "nope", "nope@2"):
        with pytest.raises(ValueError):
            strategy_args(bad)
