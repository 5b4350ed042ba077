"""A training step's own collectives on real gloo processes (torch's pipelining has none): the
non-finite loss check's verdicts and the step's mean loss reach every rank exactly, on the step's
last gradient frames where the plan's lists prove it (a chain: no collective), else by a broadcast
from the last stage's one rank instead of an all-reduce over the world where it is unreplicated."""

from __future__ import annotations

import contextlib
import math
import struct

import pytest
import torch
import torch.distributed as dist

from hybridpipe.partitioner.plan import load_plan, save_plan
from hybridpipe.runtime.nonfinite import NonFiniteWatch
from tests.comm.spawn import spawn
from tests.pipeline.harness import make_plan

STEPS = 4


@contextlib.contextmanager
def counted(*names: str):
    """Count calls of ``torch.distributed.<name>`` (wrapped, still called)."""
    real = {n: getattr(dist, n) for n in names}
    calls = dict.fromkeys(names, 0)

    def wrap(n):
        def call(*args, **kwargs):
            calls[n] += 1
            return real[n](*args, **kwargs)
        return call

    for n in names:
        setattr(dist, n, wrap(n))
    try:
        yield calls
    finally:
        for n, f in real.items():
            setattr(dist, n, f)


def agree_steps(rank: int, world: int, source: int | None, bad: dict[int, int]) -> dict:
    """Every rank agrees STEPS times; rank r notes a NaN loss at step bad[r] (a finite one otherwise,
    where it computes losses: the source only, or the ranks in ``bad``)."""
    watch = NonFiniteWatch(torch.device("cpu"), skip=True, flushing=True, source=source)
    assert watch.decides_alone == (source == rank)
    verdicts = []
    with counted("all_reduce", "broadcast") as calls:
        for step in range(STEPS):
            if rank == source or rank in bad:
                watch.note(torch.tensor(float("nan") if bad.get(rank) == step else 1.5))
            verdicts.append(watch.agree())
        for work in watch._pending:               # the source's last broadcast
            work.wait()
    return {"verdicts": verdicts, **calls}


def test_an_unreplicated_last_stage_broadcasts_its_verdict_instead_of_an_all_reduce():
    out = spawn(agree_steps, 4, 3, {3: 2}, timeout=60)
    assert all(r["verdicts"] == [False, False, True, False] for r in out), out
    assert all(r["all_reduce"] == 0 and r["broadcast"] == STEPS for r in out), out


def test_a_replicated_last_stage_keeps_the_all_reduce():
    out = spawn(agree_steps, 4, None, {2: 1, 3: 3}, timeout=60)
    assert all(r["verdicts"] == [False, True, False, True] for r in out), out
    assert all(r["all_reduce"] == STEPS and r["broadcast"] == 0 for r in out), out


def train_counted(rank: int, world: int, plan_path: str, settings: dict | None = None) -> dict:
    """STEPS training steps of a Trainer; the collectives they called and the losses returned."""
    from hybridpipe import Trainer
    from tests.runtime.jobs import data_for
    from tests.runtime.trainer_ranks import _batch

    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, lr=0.05, seed=3, timeout=60, **(settings or {}))
    data = data_for(plan, STEPS, 3)
    try:
        with counted("all_reduce", "broadcast") as calls:
            losses = [trainer.train_step(*_batch(trainer, data, k)) for k in range(STEPS)]
    finally:
        trainer.close()
    return {"losses": losses, **calls}


@pytest.mark.slow           # ~10 s: a Trainer per rank
def test_a_pipeline_step_hands_out_its_loss_and_verdict_by_broadcast(tmp_path):
    # per-tensor channels carry no step news (step_news.py): the collectives' path, as before
    plan = make_plan("mlp", [3], [1, 1], schedule="1f1b", micro_batches=2, batch_size=2)
    path = str(save_plan(plan, tmp_path / "plan.json"))
    out = spawn(train_counted, 2, path, {"comm_mode": "per-tensor"}, timeout=120)
    assert out[0]["losses"] == out[1]["losses"] and all(0 < v < 100 for v in out[0]["losses"]), out
    # one broadcast for the non-finite check and one for the mean loss per step; no all-reduce
    assert all(r["all_reduce"] == 0 and r["broadcast"] == 2 * STEPS for r in out), out


# ---- a chain's step news on its gradient frames (runtime/step_news.py): no collective at all ----
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "all_gather_into_tensor", "barrier",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
               "broadcast_object_list")
BAD = 2                     # the step whose micro-batch 0 has no valid target: its loss is NaN


def chain_batches(plan, steps: int):
    """Each step's global batch; at step BAD micro-batch 0's targets are all ignored (cross entropy's
    -100), so its mean loss is 0/0: a NaN made on the loss rank alone."""
    from tests.runtime.jobs import data_for
    data = data_for(plan, steps, 3)
    out = []
    for k in range(steps):
        x, y = data.global_batch(k)
        if k == BAD:
            y = y.clone()
            y[:plan.batch_size] = -100
        out.append((x, y))
    return out


def chain_run(rank: int, world: int, plan_path: str, settings: dict) -> dict:
    """STEPS steps of a Trainer (``settings``): per step its collectives, mean loss and this rank's
    weights after it; the skipped steps, or the step that stopped the run."""
    from hybridpipe import Trainer
    from hybridpipe.errors import AgreedError

    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, lr=0.05, seed=3, timeout=60, **settings)
    out: dict = {"losses": [], "calls": [], "weights": [], "stopped": None, "carried": trainer.news is not None,
                 "stats_group": trainer._stats is not None}
    try:
        for k, (x, y) in enumerate(chain_batches(plan, STEPS)):
            with counted(*COLLECTIVES) as calls:
                try:
                    out["losses"].append(trainer.train_step(x if trainer.stage_plan.index == 0 else None,
                                                            y if trainer.is_last else None))
                except AgreedError:
                    out["stopped"] = k
            out["calls"].append({n: c for n, c in calls.items() if c})
            out["weights"].append({n: p.detach().tolist() for n, p in trainer.module.state_dict().items()})
            if out["stopped"] is not None:
                break
        out["skipped"] = list(trainer.watch.skipped)
        out["meta_sent"] = sum(s["meta_sent"] for s in trainer.channels.stats().values())
    finally:
        trainer.close()
    return out


def chain_runs(rank: int, world: int, plan_path: str, runs: list[dict]) -> list[dict]:
    return [chain_run(rank, world, plan_path, settings) for settings in runs]


def plain_losses(plan, steps: int) -> list[float]:
    """The same training in one process, written out: SGD on each micro-batch's mean cross entropy
    summed over the step and scaled by 1/M; a step with a non-finite loss is skipped."""
    from hybridpipe.profiles.zoo import resolve_model
    torch.manual_seed(3)
    model = resolve_model(plan.model).build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)      # the Trainer's default momentum
    M, B, losses = plan.micro_batches, plan.batch_size, []
    for x, y in chain_batches(plan, steps):
        opt.zero_grad()
        step = [torch.nn.functional.cross_entropy(model(x[m * B:(m + 1) * B]), y[m * B:(m + 1) * B])
                for m in range(M)]
        for loss in step:
            loss.backward()
        losses.append(float(torch.stack([v.detach().double() for v in step]).sum() / M))
        if all(torch.isfinite(v) for v in step):
            for p in model.parameters():
                p.grad.mul_(1.0 / M)
            opt.step()
    return losses


def close_but_bad(ours: list[float], plain: list[float]) -> bool:
    """The plain loop's losses (its own float order: not bitwise), but at the NaN step."""
    return len(ours) == len(plain) and all(math.isclose(a, b, rel_tol=1e-6)
                                           for k, (a, b) in enumerate(zip(ours, plain, strict=True)) if k != BAD)


def same(a: list[float], b: list[float]) -> bool:
    """Bitwise equal floats (NaN equals NaN)."""
    return [struct.pack("<d", v) for v in a] == [struct.pack("<d", v) for v in b]


def test_a_chains_step_news_rides_on_its_gradient_frames(tmp_path):
    """1f1b on 2 gloo ranks, a NaN at step BAD on the loss rank, --skip-nonfinite: no collective in a
    good step (the broadcast path's 2 per step: the slow tests), the same verdicts and bitwise the
    same mean losses on both ranks, the plain loop's losses, the bad step's weights kept everywhere."""
    plan = make_plan("mlp", [3], [1, 1], schedule="1f1b", micro_batches=2, batch_size=2)
    path = str(save_plan(plan, tmp_path / "plan.json"))
    out = [r[0] for r in spawn(chain_runs, 2, path, [{"skip_nonfinite": True}], timeout=120)]
    assert [r["carried"] for r in out] == [True, True]
    assert not any(r["stats_group"] for r in out)              # the statistics group is not even made
    for r in out:
        assert [c for k, c in enumerate(r["calls"]) if k != BAD] == [{}] * (STEPS - 1), r["calls"]
        assert r["calls"][BAD] == {"all_gather_object": 1}      # the bad step's message names the micro-batch
        assert r["skipped"] == [BAD] and r["stopped"] is None
        assert r["weights"][BAD] == r["weights"][BAD - 1]
    # metadata once per kind: rank 0's activations; rank 1's gradients, plain and carrying (not every step)
    assert [r["meta_sent"] for r in out] == [1, 2]
    assert same(out[0]["losses"], out[1]["losses"]) and math.isnan(out[0]["losses"][BAD])
    plain = plain_losses(plan, STEPS)
    assert math.isnan(plain[BAD])
    assert close_but_bad(out[0]["losses"], plain)


@pytest.mark.slow           # ~10 s: four Trainers per rank on 4 ranks, twice
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_four_stage_chain_stops_or_skips_alike_on_every_rank(tmp_path, schedule):
    """4 stages: no collective per good step; skipping, or stopping at the bad step with no weight of
    it applied, on every rank; bitwise the losses and weights of the broadcast path (per-tensor
    channels carry no news: 2 broadcasts per step) and close to the plain loop's."""
    plan = make_plan("mlp", [1, 3, 5], [1, 1, 1, 1], schedule=schedule, micro_batches=4, batch_size=2)
    path = str(save_plan(plan, tmp_path / f"{schedule}.json"))
    runs = [{"skip_nonfinite": True}, {"skip_nonfinite": False}, {"skip_nonfinite": True, "comm_mode": "per-tensor"},
            {"skip_nonfinite": True, "comm_mode": "sra"}]
    out = spawn(chain_runs, 4, path, runs, timeout=180)
    skipped, stopped, fallback, sra = ([r[i] for r in out] for i in range(4))
    assert all(r["carried"] for r in skipped + stopped + sra) and not any(r["carried"] for r in fallback)
    for r in sra:                               # the fixed-order channels carry the same frames
        assert [c for k, c in enumerate(r["calls"]) if k != BAD] == [{}] * (STEPS - 1), r["calls"]
        assert same(r["losses"], skipped[0]["losses"])
    for r in skipped:
        assert [c for k, c in enumerate(r["calls"]) if k != BAD] == [{}] * (STEPS - 1), r["calls"]
        assert r["skipped"] == [BAD] and same(r["losses"], skipped[0]["losses"])
    for r in fallback:
        assert [c for k, c in enumerate(r["calls"]) if k != BAD] == [{"broadcast": 2}] * (STEPS - 1), r["calls"]
        assert r["skipped"] == [BAD] and same(r["losses"], skipped[0]["losses"])
    for ours, theirs in zip(skipped, fallback, strict=True):
        assert ours["weights"] == theirs["weights"]
    for r in stopped:
        assert r["stopped"] == BAD and same(r["losses"], skipped[0]["losses"][:BAD])
        assert r["weights"][BAD] == r["weights"][BAD - 1]
    plain = plain_losses(plan, STEPS)
    assert close_but_bad(skipped[0]["losses"], plain)


def carried_agree_ops(rank: int, world: int) -> dict:
    """The carried verdict (step_news.py) on 2 ranks: rank 1 the source noting a NaN loss at step 2,
    rank 0 hearing each step's flag as a gradient frame hands it over; the ops each agree dispatched."""
    from tests.pipeline.test_loss_seed import Ops

    watch = NonFiniteWatch(torch.device("cpu"), skip=True, flushing=True, source=1)
    watch.carried = True
    verdicts, ops = [], Ops()
    for step in range(STEPS):
        if rank == 1:
            watch.note(torch.tensor(float("nan") if step == 2 else 1.5))
        else:
            watch.heard(torch.tensor(1.0 if step == 2 else 0.0, dtype=torch.float64))
        with ops:
            verdicts.append(watch.agree())
    return {"verdicts": verdicts, "ops": dict(ops.seen)}


def test_the_carried_verdict_costs_one_read_a_step_and_no_copy():
    out = spawn(carried_agree_ops, 2, timeout=60)
    assert all(r["verdicts"] == [False, False, True, False] for r in out), out
    # one item() a step; before: a clone and a zeros_like beside it
    assert all(r["ops"] == {"_local_scalar_dense": STEPS} for r in out), out
