"""A mixture of experts whose experts are leaf modules (data-dependent routing, a Python loop over the
experts hit, a custom autograd Function: run as written inside their stage) through the whole path
under real processes: profile -> partition (2 stages, each holding one experts leaf) -> launch's
rank processes (forked as torchrun's workers; torchrun itself: test_preempt.py) -> merge-checkpoint,
equal to a plain single-process loop written here. The default suite runs it on 2 ranks (2 stages);
on 4 ranks (2 stages x 2 replicas), and the Hugging Face MoE models (Mixtral, Qwen2-MoE with leaf
experts) the same way: make test-slow."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hybridpipe.cli import main
from hybridpipe.partitioner.plan import load_plan
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.hf_models import MIXTRAL_LEAF, QWEN2_MOE_LEAF
from tests.runtime.jobs import data_for, launch, max_diff

STEPS, LR, MOMENTUM, SEED = 3, 0.05, 0.5, 3
USER_MOE = "tests.profiles.moe_models:moe[leaf=Experts]"


def plain_training(spec_name: str, plan, steps: int) -> dict[str, torch.Tensor]:
    """One process: the model built from SEED, SGD with momentum on each step's global batch."""
    spec = resolve_model(spec_name)
    torch.manual_seed(SEED)
    model = spec.build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    data = data_for(plan, steps, SEED)
    for k in range(steps):
        x, y = data.global_batch(k)
        opt.zero_grad()
        loss = model(**x, use_cache=False).loss if isinstance(x, dict) else nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return model.state_dict()


def profile_partition_launch_merge(tmp_path, spec: str, batch: int, workers: int, shard: str = "none") -> None:
    """Profile, partition into 2 stages over ``workers`` local processes (replicas sharding
    ``shard``), train, merge, compare."""
    profile, plan_path, cluster = tmp_path / "profile.json", tmp_path / "plan.json", tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"kind": "cluster", "format": 1, "memory_gb": 4, "levels": [
        {"name": "local", "workers": workers, "bandwidth_gbps": 8, "latency_us": 500}]}))
    assert main(["profile", spec, "--batch-size", str(batch), "--repeats", "1", "--warmup", "0", "-q",
                 "-o", str(profile)]) == 0
    assert main(["partition", str(profile), "--cluster", str(cluster),
                 "--strategy", "uniform", "--stages", "2", "--micro-batches", "4", "--shard", shard, "-q",
                 "-o", str(plan_path)]) == 0
    plan = load_plan(plan_path)
    assert [s.replicas for s in plan.stages] == [workers // 2] * 2
    assert all(s.shard == (shard if s.replicas > 1 else "none") for s in plan.stages), plan.stages
    names = [n["name"] for n in json.loads(profile.read_text())["nodes"]]
    for stage in plan.stages:                                    # a leaf (experts) inside every stage
        assert any("blocks." in n or "layers." in n for n in names[stage.first_node:stage.last_node + 1])
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    done = launch(["--plan", str(plan_path), "--steps", str(STEPS), "--lr", str(LR), "--momentum", str(MOMENTUM),
                   "--seed", str(SEED), "--checkpoint-dir", str(ckpt), "--run-dir", str(run), "--timeout", "120",
                   "--no-progress", "--no-trace"], workers, timeout=300)
    assert all(r.returncode == 0 for r in done), done
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_run"] == STEPS and all(summary["replicas_identical"].values()), summary
    out = tmp_path / "model.pt"
    assert main(["merge-checkpoint", str(ckpt), "-o", str(out)]) == 0     # keys and shapes checked
    merged = torch.load(out, weights_only=True)
    assert max_diff(merged, plain_training(spec, plan, STEPS)) <= 1e-6
    resolve_model(spec).build().load_state_dict(merged, strict=True)


@pytest.mark.parametrize("workers", [2, pytest.param(4, marks=pytest.mark.slow)], ids=["2", "2x2"])
def test_user_moe_profile_partition_torchrun_merge(tmp_path, workers):
    profile_partition_launch_merge(tmp_path, USER_MOE, 4, workers)


@pytest.mark.parametrize("shard", ["none", *(pytest.param(s, marks=pytest.mark.slow)
                                              for s in ("optimizer", "gradients", "parameters"))])
def test_experts_one_replica_runs_and_another_does_not(tmp_path, shard):
    """16 experts, top-1, one sample a micro-batch on 2 x 2: each replica's micro-batches choose other
    experts, some none at all: the replicas sum what they have (missing ones as zeros) and an expert
    no replica ran keeps no gradient (momentum SGD skips it, as the plain loop does). Before: the
    replicas all-reduced different lists of gradients (gloo aborted on a size mismatch, or summed
    one expert's gradient into another's)."""
    profile_partition_launch_merge(tmp_path, USER_MOE.replace("]", ",experts=16,top_k=1]"), 1, 4, shard)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [MIXTRAL_LEAF, QWEN2_MOE_LEAF], ids=["mixtral", "qwen2_moe"])
def test_hf_moe_profile_partition_torchrun_merge(tmp_path, spec):
    pytest.importorskip("transformers")
    profile_partition_launch_merge(tmp_path, spec, 2, 4)


@pytest.mark.slow
@pytest.mark.parametrize("normalization", ["micro-batch", "tokens"])
def test_a_router_loss_is_one_process_accumulating_micro_batches(tmp_path, normalization):
    """Mixtral's router load-balancing loss is not a sum over tokens: over 4 micro-batches on 2 stages it is
    what one process computes accumulating them (within 1e-6), not the global batch at once (1.7e-3 apart),
    in both loss normalizations (equal tokens per micro-batch here); `tokens` says so in one line, once a job."""
    from hybridpipe.partitioner.plan import save_plan
    from hybridpipe.runtime.merged import merge_stages
    from tests.pipeline.harness import make_plan
    from tests.pipeline.hf_models import MIXTRAL
    from tests.runtime.jobs import train_reference

    spec = MIXTRAL.replace("]", ",output_router_logits=true,router_aux_loss_coef=0.5]")
    plan = make_plan(spec, [3], [1, 1], micro_batches=4, batch_size=2)
    save_plan(plan, tmp_path / "plan.json")
    done = launch(["--plan", str(tmp_path / "plan.json"), "--steps", "3", "--lr", str(LR), "--momentum",
                   str(MOMENTUM), "--loss-normalization", normalization, "--checkpoint-dir", str(tmp_path / "ckpt"),
                   "--run-dir", str(tmp_path / "run"), "--timeout", "120", "--no-progress", "--no-trace"],
                  plan.world_size, timeout=300)
    assert all(d.returncode == 0 for d in done), done
    merged, _ = merge_stages(tmp_path / "ckpt", 3)
    assert max_diff(merged, train_reference(plan, 3, lr=LR, momentum=MOMENTUM, seed=0, accumulate=True)) <= 1e-6
    assert max_diff(merged, train_reference(plan, 3, lr=LR, momentum=MOMENTUM, seed=0)) > 1e-4
    said = sum("router loss (router_aux_loss_coef=0.5) is computed per micro-batch" in d.stderr for d in done)
    assert said == (normalization == "tokens"), done                       # once (rank 0), not per rank

