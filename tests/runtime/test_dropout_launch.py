"""Dropout (p = 0.1) on 2 x 2 rank processes under launch. Each rank draws its masks from its own
random stream (seeded from --seed and its rank), so a pipelined run with dropout is not what one
process computes bit for bit (README, "Dropout"); what it must be is consistent: a recomputing stage
replays the masks of its forward (torch.utils.checkpoint restores the stream), and a run resumed from
a checkpoint draws what the uninterrupted run drew (each rank's stream is saved with it). Both are
compared bitwise here, weights merged by merge-checkpoint; and dropout does act (the run differs from
the same run with dropout 0)."""

from __future__ import annotations

import shutil

import pytest
import torch

from hybridpipe.cli import main
from hybridpipe.partitioner.plan import save_plan
from tests.pipeline.harness import make_plan
from tests.runtime.jobs import launch

pytest.importorskip("transformers")

SPEC = "hf:gpt2[n_layer=2,n_embd=32,n_head=2,vocab_size=128,seq=8,dropout={p}]"


def run(tmp, name: str, *, p: float = 0.1, recompute: bool = False, resume_from=None) -> dict[str, torch.Tensor]:
    """4 steps of 2 x 2 1f1b, a checkpoint every 2; the merged weights of step 4."""
    plan = make_plan(SPEC.format(p=p), [3], [2, 2], schedule="1f1b", micro_batches=4, batch_size=2,
                     recompute=recompute)
    path, ckpt = tmp / f"{name}.json", tmp / f"ckpt-{name}"
    save_plan(plan, path)
    args = ["--plan", str(path), "--steps", "4", "--lr", "0.05", "--momentum", "0.5", "--seed", "3",
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--keep-checkpoints", "3", "--timeout", "60",
            "--no-progress", "--run-dir", str(tmp / f"run-{name}")]
    if resume_from is not None:
        ckpt.mkdir()
        shutil.copytree(resume_from, ckpt / resume_from.name)
        args.append("--resume")
    done = launch(args, 4, timeout=300)
    assert all(r.returncode == 0 for r in done), done
    assert main(["merge-checkpoint", str(ckpt), "-o", str(tmp / f"{name}.pt")]) in (0, None)
    return torch.load(tmp / f"{name}.pt", weights_only=True)


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert set(a) == set(b), set(a) ^ set(b)
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_dropout_is_replayed_by_recomputation_and_resumed_bit_for_bit(tmp_path):
    uninterrupted = run(tmp_path, "a")
    assert equal(run(tmp_path, "resumed", resume_from=tmp_path / "ckpt-a" / "step-000002"), uninterrupted)
    assert equal(run(tmp_path, "recomputed", recompute=True), uninterrupted)
    assert not equal(run(tmp_path, "p0", p=0.0), uninterrupted)
