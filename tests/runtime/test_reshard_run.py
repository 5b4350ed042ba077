"""Checkpoints move between plans (issue 21), through launch.py with real processes: 4 stages
for 3 steps, resumed as 2 stages x 2 replicas (other micro-batch split, same global batch) to
step 6, equals plain single-process training of the unsplit model for 6 steps; a merged
checkpoint with its optimizer state started with --init-from equals resuming."""

from __future__ import annotations

import pytest
import torch

from hybridpipe.cli import main
from hybridpipe.partitioner.plan import save_plan
from hybridpipe.pipeline.data import MicroBatches
from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.checkpoint_files import step_dirs
from hybridpipe.runtime.dirlock import LOCK_NAME
from tests.pipeline.harness import make_plan, model_loss
from tests.runtime.jobs import final_weights, launch, max_diff

MODEL, SEED, LR, WD = "mlp", 0, 0.01, 0.1      # WD: adamw's decoupled weight decay
GLOBAL = 16                         # 4 x 4 in the first plan, 2 x 8 in the second
SIZE = 3 * GLOBAL                   # 3 global batches: step k reads samples of step k mod 3


def reference(optimizer: str, steps: int) -> dict[str, torch.Tensor]:
    """The unsplit model, one process, each step's whole global batch (mean loss)."""
    spec = resolve_model(MODEL)
    torch.manual_seed(SEED)
    model = spec.build()
    opt = (torch.optim.Adam(model.parameters(), lr=LR) if optimizer == "adam"
           else torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    data = MicroBatches(resolve_dataset("synthetic", spec, size=SIZE, seed=SEED), GLOBAL, 1)
    for k in range(steps):
        opt.zero_grad()
        model_loss(spec, model, *data.batch(k, 0)).backward()
        opt.step()
    return model.state_dict()


def common(plan, ckpt, run, optimizer: str) -> list[str]:
    return ["--plan", str(plan), "--checkpoint-dir", str(ckpt), "--run-dir", str(run), "--optimizer", optimizer,
            "--lr", str(LR), "--dataset-size", str(SIZE), "--seed", str(SEED), "--timeout", "60", "--no-progress",
            "--no-trace", *(["--weight-decay", str(WD)] if optimizer == "adamw" else [])]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_four_stages_resumed_as_two_by_two_equal_one_process_and_init_from_equals_resuming(tmp_path, optimizer):
    four = tmp_path / "four.json"
    save_plan(make_plan(MODEL, [2, 4, 6], [1, 1, 1, 1], micro_batches=4, batch_size=4), four)
    two = tmp_path / "two.json"
    save_plan(make_plan(MODEL, [4], [2, 2], micro_batches=2, batch_size=8), two)
    ckpt = tmp_path / "ckpt"
    done = launch([*common(four, ckpt, tmp_path / "a", optimizer), "--steps", "3"], 4)
    assert all(d.returncode == 0 for d in done), done
    done = launch([*common(two, ckpt, tmp_path / "b", optimizer), "--steps", "6", "--resume"], 4)
    assert all(d.returncode == 0 for d in done), done
    said = "".join(d.stdout + d.stderr for d in done)
    assert "continuing from" in said and "step 3" in said and "resharded" in said, done
    assert sorted(step_dirs(ckpt)) == [3, 6]
    resumed = final_weights(ckpt, 6)
    # Adam's g / sqrt(v) amplifies the micro-batch sums' rounding where gradients are near zero
    assert max_diff(resumed, reference(optimizer, 6)) <= (1e-4 if optimizer == "adamw" else 1e-5)

    merged = tmp_path / "model.pt"
    assert main(["merge-checkpoint", str(ckpt), "--step", "3", "--with-optimizer", "-o", str(merged)]) == 0
    fresh = tmp_path / "fresh"
    done = launch([*common(two, fresh, tmp_path / "c", optimizer), "--steps", "3", "--init-from", str(merged)], 4)
    assert all(d.returncode == 0 for d in done), done
    assert max_diff(final_weights(fresh, 3), resumed) <= 1e-6       # same plan, same samples: as resuming


@pytest.mark.slow
def test_a_checkpoint_of_another_model_stops_with_one_line_and_changes_nothing(tmp_path):
    plan = tmp_path / "plan.json"
    save_plan(make_plan(MODEL, [4], [1, 1], micro_batches=2, batch_size=4), plan)
    ckpt = tmp_path / "ckpt"
    args = ["--checkpoint-dir", str(ckpt), "--timeout", "60", "--no-progress", "--no-trace", "--steps", "2"]
    assert all(d.returncode == 0 for d in launch(["--plan", str(plan), *args, "--run-dir", str(tmp_path / "a")], 2))
    before = {p: p.stat().st_mtime_ns for p in ckpt.rglob("*") if p.name != LOCK_NAME}   # the lock: who runs there
    other = tmp_path / "other.json"
    save_plan(make_plan("mlp[hidden=48]", [4], [1, 1], micro_batches=2, batch_size=4), other)
    done = launch(["--plan", str(other), *args, "--resume", "--run-dir", str(tmp_path / "b")], 2)
    assert all(d.returncode == 2 for d in done), done
    last = done[0].stderr.strip().splitlines()[-1]
    assert "was written for model 'mlp', not 'mlp[hidden=48]'" in last and "nothing was loaded" in last, done
    assert {p: p.stat().st_mtime_ns for p in ckpt.rglob("*") if p.name != LOCK_NAME} == before


@pytest.mark.slow
def test_gpt2_tied_embedding_moves_from_two_by_two_to_four_stages(tmp_path):
    """The tied embedding/head weight (written once, by stage 0) reaches both stages that read it
    in the new plan, and training goes on as one process would."""
    pytest.importorskip("transformers")
    from tests.pipeline.hf_models import BY_NAME
    from tests.runtime.jobs import train_reference

    case = BY_NAME["gpt2"]
    plans = {}
    for name, cuts, replicas in (("two", case.two, [2, 2]), ("four", case.four, [1, 1, 1, 1])):
        plans[name] = make_plan(case.spec, cuts, replicas, micro_batches=4, batch_size=2, shared_capture=True)
        save_plan(plans[name], tmp_path / f"{name}.json")
    assert {t.stages for t in plans["four"].tied} == {(0, 3)}
    ckpt = tmp_path / "ckpt"
    base = ["--checkpoint-dir", str(ckpt), "--lr", "0.05", "--momentum", "0.5", "--seed", "3", "--dataset-size",
            str(6 * 8), "--timeout", "120", "--no-progress", "--no-trace"]
    done = launch(["--plan", str(tmp_path / "two.json"), *base, "--steps", "3", "--run-dir", str(tmp_path / "a")], 4,
                  timeout=300)
    assert all(d.returncode == 0 for d in done), done
    done = launch(["--plan", str(tmp_path / "four.json"), *base, "--steps", "6", "--resume", "--run-dir",
                   str(tmp_path / "b")], 4, timeout=300)
    assert all(d.returncode == 0 for d in done), done
    reference = train_reference(plans["four"], 6, lr=0.05, momentum=0.5, seed=3)
    assert max_diff(final_weights(ckpt, 6), reference) <= 1e-5
