"""Running launch.py as a real multi-process job in tests, and the single-process references.

:func:`launch` runs launch.py as one process per rank, forked from the session's warm fork
server (tests/forked.py), with the environment torchrun gives its workers (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT; the parent hosts the c10d store on a free port, as torchrun's
agent does), waits at most ``timeout`` seconds and always reaps the processes. :func:`torchrun`
goes through the real torchrun (new interpreters) instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridpipe.partitioner.plan import Plan
from hybridpipe.pipeline.data import MicroBatches
from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.merged import merge_stages
from tests.forked import Forked
from tests.pipeline.harness import model_loss
from tests.runtime.rank_procs import Job

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch.py"


@dataclass
class Finished:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str

    def __repr__(self) -> str:
        return f"<rank {self.rank} rc={self.returncode}\nstdout: {self.stdout[-2000:]}\nstderr: {self.stderr[-3000:]}>"


def _env(extra: dict | None = None) -> dict:
    """The environment of a job: the repository on PYTHONPATH (``extra`` may set or, with None
    values, remove variables)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def launch(args: list[str], world: int, *, timeout: float = 120.0, env: dict | None = None,
           on_start: Callable[[list[Forked]], None] | None = None,
           rank_args: Callable[[int], list[str]] | None = None) -> list[Finished]:
    """Run launch.py on ``world`` local ranks like torchrun would (see the module docstring);
    ``on_start(processes)`` runs once they are started (e.g. to kill one: they have Popen's
    poll/wait/kill/send_signal); ``rank_args(rank)`` adds arguments for one rank only."""
    with Job(None, None, world, pg_timeout=timeout, env=env, launch=args, rank_launch=rank_args) as job:
        if on_start is not None:
            try:
                on_start(job.procs)
            except BaseException:
                job.wait(0)
                raise
        done = job.wait(timeout)                # the store lives until every rank is done
    return [Finished(d.rank, d.returncode, d.stdout, d.stderr) for d in done]


def torchrun(args: list[str], nproc: int, *, timeout: float = 180.0, env: dict | None = None,
             entry: list[str] | None = None, cwd: Path = ROOT) -> Finished:
    """``torchrun --standalone --nproc-per-node nproc launch.py args`` (its combined output);
    ``entry`` replaces ``launch.py`` (e.g. ``["-m", "hybridpipe.launch"]``), ``cwd`` the directory."""
    o, e = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *(entry or [str(LAUNCH)]), *args]
    p = subprocess.Popen(cmd, cwd=cwd, stdout=o, stderr=e, env=_env(env), start_new_session=True)
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
        p.wait(10)
    o.seek(0)
    e.seek(0)
    done = Finished(0, p.returncode, o.read(), e.read())
    o.close()
    e.close()
    return done


def data_for(plan: Plan, steps: int, seed: int, dataset: str = "synthetic") -> MicroBatches:
    """The data the runtime feeds (``--dataset``; synthetic: one pass of ``steps`` global batches)."""
    spec = resolve_model(plan.model)
    size = steps * plan.micro_batches * plan.batch_size
    return MicroBatches(resolve_dataset(dataset, spec, size=size, seed=seed), plan.batch_size, plan.micro_batches,
                        targets=spec.loss is not None)


def sgd(params, lr: float, momentum: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def train_reference(plan: Plan, steps: int, *, lr: float, momentum: float, seed: int, dataset: str = "synthetic",
                    accumulate: bool = False) -> dict[str, torch.Tensor]:
    """Plain single-process SGD on each step's concatenated global batch (mean loss), or with
    ``accumulate`` micro-batch by micro-batch (each one's mean loss / M: batches padded to
    different lengths). A model without a loss function trains on its own (a Hugging Face model's
    ``output.loss``)."""
    spec = resolve_model(plan.model)
    torch.manual_seed(seed)
    model = spec.build()
    opt = sgd(model.parameters(), lr, momentum)
    data = data_for(plan, steps, seed, dataset)
    for k in range(steps):
        opt.zero_grad()
        if accumulate:
            for m in range(plan.micro_batches):
                (model_loss(spec, model, *data.batch(k, m)) / plan.micro_batches).backward()
        else:
            model_loss(spec, model, *data.global_batch(k)).backward()
        opt.step()
    return model.state_dict()


def final_weights(checkpoint_dir: Path, steps: int) -> dict[str, torch.Tensor]:
    """The model as the run's final checkpoint holds it (every stage merged)."""
    merged, _ = merge_stages(checkpoint_dir, steps)
    return merged


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k].detach().cpu().double() - b[k].detach().cpu().double()).abs().max()) for k in a)
