"""Elastic restarts end to end (issue 21): 4 torchrun agents on loopback (c10d rendezvous,
``--nnodes 3:4``), the job planned at start from a profile; one host (agent and worker) is
SIGKILLed mid-run; the survivors stop, torchrun re-forms a world of 3, the job re-plans for 3
workers, resumes from the newest complete checkpoint (resharded) and finishes every step. The
final weights equal plain single-process training of the unsplit model: the same global batch
(``--micro-batches`` fixed) and the same samples each step, whatever the plan."""

from __future__ import annotations

import json

import pytest
import torch

from hybridpipe.cli import main
from hybridpipe.pipeline.data import MicroBatches
from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.checkpoint_files import MANIFEST, step_dir
from tests.pipeline.harness import model_loss
from tests.runtime.elastic import ROOT, ElasticJob
from tests.runtime.jobs import final_weights, max_diff

MODEL, MICRO, BATCH, STEPS, EVERY, LR = "mlp[hidden=256]", 12, 2, 150, 10, 0.01


def reference(steps: int) -> dict[str, torch.Tensor]:
    spec = resolve_model(MODEL)
    torch.manual_seed(0)
    model = spec.build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    data = MicroBatches(resolve_dataset("synthetic", spec, size=steps * MICRO * BATCH, seed=0), MICRO * BATCH, 1)
    for k in range(steps):
        opt.zero_grad()
        model_loss(spec, model, *data.batch(k, 0)).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.slow
def test_a_killed_host_costs_a_restart_on_three_with_a_new_plan_and_the_run_ends_as_uninterrupted(tmp_path):
    profile = tmp_path / "profile.json"
    assert main(["profile", MODEL, "-b", str(BATCH), "--repeats", "2", "-q", "-o", str(profile)]) == 0
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    cluster = ROOT / "examples" / "clusters" / "local4.json"
    args = [str(ROOT / "launch.py"), "--profile", str(profile), "--cluster", str(cluster),
            "--micro-batches", str(MICRO), "--steps", str(STEPS), "--lr", str(LR), "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", str(EVERY), "--resume", "--run-dir", str(run), "--timeout", "60",
            "--peer-timeout", "5", "--no-progress", "--no-trace"]
    with ElasticJob(tmp_path / "logs", args, hosts=4, min_hosts=3, max_restarts=2) as job:
        job.wait_for(lambda: (step_dir(ckpt, 2 * EVERY) / MANIFEST).exists(), timeout=300)
        planned_for_four = json.loads((run / "plan.json").read_text())
        job.kill_host(3)
        results = job.wait(400)
    logs = "\n".join(f"--- agent {h} rc={rc}\n{out[-3000:]}" for h, (rc, out) in enumerate(results))
    assert [rc for rc, _ in results[:3]] == [0, 0, 0], logs
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["world_size"] == 3, logs
    (restart,) = summary["restarts"]
    assert restart["world_size_before"] == 4 and restart["world_size_after"] == 3, restart
    assert restart["resumed_from_step"] >= 2 * EVERY and restart["resumed_from_step"] % EVERY == 0, restart
    assert 0 <= restart["steps_redone"] < EVERY and restart["seconds_to_first_step"] > 0, restart
    planned_for_three = json.loads((run / "plan.json").read_text())
    assert sum(s["replicas"] for s in planned_for_four["stages"]) == 4
    assert sum(s["replicas"] for s in planned_for_three["stages"]) == 3
    assert max_diff(final_weights(ckpt, STEPS), reference(STEPS)) <= 1e-5
