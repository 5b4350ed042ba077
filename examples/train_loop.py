"""Your own training loop with hybridpipe.Trainer: a byte-level GPT on the standard library's sources.

    torchrun --standalone --nproc-per-node 4 examples/train_loop.py            # (about a minute)
    torchrun --standalone --nproc-per-node 4 examples/train_loop.py --steps 300 --plan plan.json

Without ``--plan``, rank 0 first profiles the model and lets the partitioner plan it for
examples/clusters/demo-2x2-slow.json (what ``hybridpipe profile`` and ``hybridpipe partition`` do
on the command line). Every rank then builds its part of the plan with ``hybridpipe.Trainer`` and
runs the loop below: each rank loads only the micro-batches its stage reads, every call is made
on every rank, and every rank gets the loss back.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import torch.distributed as dist

import hybridpipe
from hybridpipe.profiles.corpus import python_stdlib

MODEL = "gpt[layers=4,width=128,heads=4,seq=64,vocab=256]"        # a zoo spec, or "package.module:factory"
CLUSTER = Path(__file__).resolve().parent / "clusters" / "demo-2x2-slow.json"


def make_plan(out: Path, workers: int) -> Path:
    """Profile and partition MODEL (rank 0 only)."""
    from hybridpipe.cli import main

    profile, plan = out / "profile.json", out / "plan.json"
    assert main(["profile", MODEL, "--batch-size", "8", "--repeats", "2", "--quiet", "-o", str(profile)]) == 0
    assert main(["partition", str(profile), "--cluster", str(CLUSTER), "--workers", str(workers),
                 "--optimizer", "adam", "--micro-batches", "4", "-o", str(plan)]) == 0
    return plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", type=Path, help="a plan for MODEL (default: make one)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--out", type=Path, default=Path("out/train_loop"))
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    args = p.parse_args()

    checkpoints = args.out / "checkpoints"
    if any(checkpoints.glob("step-*")):       # trainer.save would refuse them at the end, after training
        raise SystemExit(f"{checkpoints} holds another run's checkpoints: pass another --out "
                         "(trainer.load(dir) resumes a run, as launch --resume does)")
    dist.init_process_group("gloo")          # torchrun's environment; Trainer joins this group
    rank = dist.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)
    plan = [str(args.plan) if args.plan else None]
    if plan[0] is None and rank == 0:
        plan[0] = str(make_plan(args.out, dist.get_world_size()))
    dist.broadcast_object_list(plan, src=0)

    trainer = hybridpipe.Trainer(
        MODEL, plan[0], seed=0,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps),
        clip_grad_norm=1.0)
    train, held_out = python_stdlib("train", seq=64), python_stdlib("held-out", seq=64)

    def evaluate(batches: int = 4) -> float:
        parts = trainer.loader(held_out, shuffle=False)
        return sum(trainer.eval_step(part) for part in itertools.islice(parts, batches)) / batches

    if rank == 0:
        print(f"held-out loss before training: {evaluate():.3f} nats/byte", flush=True)
    else:
        evaluate()
    for epoch in itertools.count():
        for part in trainer.loader(train, epoch=epoch, num_workers=args.workers):
            loss = trainer.train_step(part)                  # the step's mean loss, on every rank
            if trainer.step % args.eval_every == 0 or trainer.step == args.steps:
                held = evaluate()                             # forward only: nothing changes
                if rank == 0:
                    print(f"step {trainer.step:4d}  loss {loss:.3f}  held-out {held:.3f}  lr {trainer.lr:.2e}  "
                          f"grad norm {trainer.last_grad_norm:.2f}", flush=True)
            if trainer.step == args.steps:
                break
        if trainer.step == args.steps:
            break
    path = trainer.save(checkpoints)                         # trainer.load(...) resumes from it
    if rank == 0:
        print(f"saved {path} (merge the stages: hybridpipe merge-checkpoint {args.out / 'checkpoints'} -o model.pt)")
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
