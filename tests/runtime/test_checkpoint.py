"""Checkpoints (runtime/checkpoint.py, checkpoint_files.py) and ``hybridpipe merge-checkpoint``.

Single-process tests cover the file layer (atomic writes, completeness, pruning, corrupt files);
one three-rank job (stage 0 replicated on ranks 0 and 1, stage 1 on rank 2, each stage a real
slice of the zoo MLP keeping the model's parameter names) saves three checkpoints and dies in the
middle of a fourth; a second job resumes from it. The merged state_dict is checked against the
unsplit model trained the same way in this process.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from hybridpipe.cli import main
from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.cluster import Cluster, Level
from hybridpipe.partitioner.plan import Plan, Stage
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.checkpoint import Checkpointer, capture_rng, restore_rng
from hybridpipe.runtime.checkpoint_files import (
    MANIFEST,
    atomic_save,
    complete_steps,
    is_complete,
    latest_complete,
    load_file,
    stage_file,
    staging_dir,
    step_dir,
)
from hybridpipe.runtime.checkpoint_prune import prune
from hybridpipe.runtime.merged import merge_stages

HERE = Path(__file__).resolve()
MODEL = "mlp[layers=2]"       # Sequential: 0 Linear, 1 ReLU, 2 Linear, 3 ReLU, 4 Linear
CUT = 2                       # stage 0 = model[:2], stage 1 = model[2:]


def make_plan(stages: tuple[tuple[int, ...], ...] = ((0, 1), (2,)), model: str = MODEL) -> Plan:
    world = sum(len(r) for r in stages)
    cluster = Cluster(levels=(Level("node", world, 100.0),), memory_gb=1.0)
    bounds = [(0, 2), (3, 6)] if len(stages) == 2 else [(0, 6)]
    return Plan(model=model, batch_size=4, input_shape=(4, 64), profile_signature="t", cluster=cluster,
                strategy="optimal", schedule="1f1b", micro_batches=2, optimizer="sgd",
                stages=tuple(Stage(i, a, b, len(r), r)
                             for i, ((a, b), r) in enumerate(zip(bounds, stages, strict=True))))


def stage_module(stage: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = resolve_model(MODEL).build()
    children = list(model.named_children())
    return torch.nn.Sequential(OrderedDict(children[:CUT] if stage == 0 else children[CUT:]))  # keeps the keys


def train(module: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """A deterministic update touching every parameter (each parameter's own loss)."""
    for _ in range(steps):
        opt.zero_grad()
        sum((p ** 2).sum() for p in module.parameters()).backward()
        opt.step()


def make_opt(module):
    return torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)


# ---- files ------------------------------------------------------------------------------------
def test_atomic_save_records_size_and_hash_and_leaves_no_temp_files(tmp_path):
    rec = atomic_save({"w": torch.arange(10.0)}, tmp_path / "a.pt")
    assert rec.bytes == (tmp_path / "a.pt").stat().st_size and len(rec.sha256) == 64
    assert torch.equal(torch.load(tmp_path / "a.pt")["w"], torch.arange(10.0))
    atomic_save({"w": torch.zeros(3)}, tmp_path / "a.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]


KILLED_WRITER = """
import sys, torch
from pathlib import Path
from hybridpipe.runtime.checkpoint_files import atomic_save
path = Path(sys.argv[1])
atomic_save({"version": 0, "w": torch.zeros(4)}, path)
print("ready", flush=True)
for v in range(1, 10**6):
    atomic_save({"version": v, "w": torch.full((16 << 20,), float(v))}, path)   # 64 MiB each
"""


def test_a_writer_killed_mid_save_leaves_the_previous_file_whole(tmp_path):
    target = tmp_path / "stage-0.pt"
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target)], stdout=subprocess.PIPE, text=True,
                             cwd=HERE.parents[2])
    try:
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:             # kill once a new version is half on disk
            if any(p.stat().st_size > (1 << 20) for p in tmp_path.glob(".stage-0.pt.*.tmp")):
                break
            time.sleep(0.001)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(30)
    torn = list(tmp_path.glob(".stage-0.pt.*.tmp"))
    assert torn, "the kill did not land during a save"
    state = torch.load(target)                      # the last completed version, intact
    assert torch.equal(state["w"], torch.full_like(state["w"], float(state["version"])))
    assert latest_complete(tmp_path) is None and complete_steps(tmp_path) == []   # temp files are never steps


def _complete_checkpoint(root: Path, step: int, ck: Checkpointer | None = None) -> Path:
    module = stage_module(0)
    ck = ck or Checkpointer(root, plan=make_plan(((0,),)), rank=0, every=1, keep=0)
    return ck.save(step, module=module, optimizer=make_opt(module))


@pytest.mark.parametrize("damage", ["no manifest", "truncated stage file", "missing stage file", "torn manifest",
                                    "missing rank file", "other stage count"])
def test_damaged_checkpoints_are_never_complete(tmp_path, damage):
    _complete_checkpoint(tmp_path, 1)
    d = _complete_checkpoint(tmp_path, 2)
    assert latest_complete(tmp_path, 1) == 2
    if damage == "no manifest":
        (d / MANIFEST).unlink()
    elif damage == "truncated stage file":
        data = (d / stage_file(0)).read_bytes()
        (d / stage_file(0)).write_bytes(data[: len(data) // 2])
    elif damage == "missing stage file":
        (d / stage_file(0)).unlink()
    elif damage == "torn manifest":
        text = (d / MANIFEST).read_text()
        (d / MANIFEST).write_text(text[: len(text) // 2])
    elif damage == "missing rank file":
        (d / "rank-00000.pt").unlink()
    assert latest_complete(tmp_path, 2 if damage == "other stage count" else 1) == (None if damage ==
                                                                                   "other stage count" else 1)


def test_a_flipped_byte_is_caught_by_the_hash_and_resume_falls_back(tmp_path):
    _complete_checkpoint(tmp_path, 1)
    d = _complete_checkpoint(tmp_path, 2)
    data = bytearray((d / stage_file(0)).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (d / stage_file(0)).write_bytes(bytes(data))
    assert is_complete(d, 1) and not is_complete(d, 1, verify=True)
    with pytest.raises(UserError, match="corrupt"):
        load_file(tmp_path, 2, stage_file(0))
    restored = Checkpointer(tmp_path, plan=make_plan(((0,),)), rank=0).restore(stage_module(0))
    assert restored.step == 1 and len(restored.skipped) == 1
    assert restored.skipped[0].startswith("step-000002: rank 0: ") and "is corrupt" in restored.skipped[0]
    assert is_complete(d, 1)                            # skipped, never deleted


def test_prune_deletes_only_older_checkpoints_of_its_own_lineage(tmp_path):
    _complete_checkpoint(tmp_path, 1)                   # another training's checkpoint: never touched
    step_dir(tmp_path, 2).mkdir()                       # an old interrupted save of an older version: kept
    ours = Checkpointer(tmp_path, plan=make_plan(((0,),)), rank=0, every=1, keep=2)
    for s in (3, 4, 5, 6):
        _complete_checkpoint(tmp_path, s, ours)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001", "step-000002", "step-000005",
                                                          "step-000006"]
    assert complete_steps(tmp_path) == [1, 5, 6]
    assert prune(tmp_path, keep=1, lineage=ours.lineage).deleted == (step_dir(tmp_path, 5),)
    assert prune(tmp_path, keep=1, lineage="").deleted == () and complete_steps(tmp_path) == [1, 6]


def test_resume_refuses_a_checkpoint_of_another_model_with_one_line(tmp_path):
    _complete_checkpoint(tmp_path, 1)
    other = make_plan(((0,),), model="mlp[layers=3]")
    with pytest.raises(UserError, match="written for model 'mlp.layers=2.', not 'mlp.layers=3.'") as e:
        Checkpointer(tmp_path, plan=other, rank=0).restore(stage_module(0))
    assert "\n" not in str(e.value) and "nothing was loaded or changed" in str(e.value)


def test_what_the_runtime_saves_loads_as_plain_data(tmp_path):
    """RNG states (torch, Python, NumPy) and Adam's state go through torch.load(weights_only=True)."""
    import random

    import numpy as np

    from hybridpipe.runtime.checkpoint_files import load_data

    module = torch.nn.Linear(3, 2)
    adam = torch.optim.Adam(module.parameters(), lr=0.1)
    module(torch.randn(4, 3)).sum().backward()
    adam.step()
    atomic_save({"rng": capture_rng(), "optimizer": adam.state_dict()}, tmp_path / "r.pt")
    draws = (torch.rand(2).tolist(), random.random(), np.random.rand())
    loaded = load_data(tmp_path / "r.pt")
    restore_rng(loaded["rng"])
    assert (torch.rand(2).tolist(), random.random(), np.random.rand()) == draws
    fresh = torch.optim.Adam(module.parameters(), lr=0.1)
    fresh.load_state_dict(loaded["optimizer"])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], adam.state_dict()["state"][0]["exp_avg"])


def test_rng_states_round_trip():
    state = capture_rng()
    a = (torch.rand(3), torch.randint(0, 100, (3,)))
    restore_rng(state)
    b = (torch.rand(3), torch.randint(0, 100, (3,)))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---- three ranks -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> tuple[Path, list]:
    from tests.runtime.rank_procs import Job

    root = tmp_path_factory.mktemp("ckpt")
    with Job(HERE, "save_then_die", 3, (str(root),)) as job:
        results = job.wait(timeout=120)
    return root, results


@pytest.mark.slow
def test_ranks_save_complete_checkpoints_and_a_save_cut_short_is_ignored(saved_run):
    root, results = saved_run
    assert results[2].returncode == 17, results            # died in the middle of the step-8 save
    assert [r.value for r in results[:2]] == ["the step-8 save failed", "the step-8 save failed"], results
    assert complete_steps(root, 2) == [4, 6]                # keep=2 pruned step 2; step 8 has no manifest
    [d8] = root.glob(".step-000008.*.tmp")                 # the save in progress (named by the job), never a step-N
    assert d8.name == staging_dir(root, 8, d8.name.split(".")[2]).name
    assert (d8 / "rank-00002.pt").exists() and not (d8 / MANIFEST).exists() and not step_dir(root, 8).exists()
    files = sorted(p.name for p in step_dir(root, 6).iterdir())
    assert files == ["manifest.json", "rank-00000.pt", "rank-00001.pt", "rank-00002.pt", "stage-0.pt", "stage-1.pt"]
    manifest = json.loads((step_dir(root, 6) / MANIFEST).read_text())
    assert manifest["n_stages"] == 2 and manifest["world_size"] == 3 and manifest["model"] == MODEL


@pytest.mark.slow
def test_resume_restores_weights_optimizer_engine_state_and_rng(saved_run):
    from tests.runtime.rank_procs import Job

    root, before = saved_run
    with Job(HERE, "resume_and_report", 3, (str(root),)) as job:
        after = job.wait(timeout=120)
    assert all(r.returncode == 0 for r in after), after
    for b, a in zip(before, after, strict=True):
        step, stash, rand, digest = a.value
        assert step == 6 and stash == [float(a.rank)] * 2
        assert rand == b.stdout.split("RAND ")[1].split("\n")[0]       # RNG continues where it was saved
        assert digest == b.stdout.split("DIGEST ")[1].split("\n")[0]   # weights and optimizer state match
    assert complete_steps(root) == [4, 6] and not step_dir(root, 8).exists()   # leftovers of the dead save


@pytest.mark.slow
def test_merged_checkpoint_equals_the_unsplit_model_trained_alike(saved_run, tmp_path, capsys):
    root, _ = saved_run
    out = tmp_path / "model.pt"
    assert main(["merge-checkpoint", str(root), "-o", str(out)]) == 0
    assert "merged step 6 of mlp[layers=2] (2 stages" in capsys.readouterr().out
    torch.manual_seed(0)
    reference = resolve_model(MODEL).build()
    train(reference, make_opt(reference), 6)
    fresh = resolve_model(MODEL).build()
    fresh.load_state_dict(torch.load(out), strict=True)
    for key, value in reference.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    assert main(["merge-checkpoint", str(step_dir(root, 4)), "-o", str(tmp_path / "m4.pt")]) == 0
    state4, _ = merge_stages(root, 4)
    assert set(state4) == set(reference.state_dict())


@pytest.mark.slow
def test_merge_checkpoint_names_what_does_not_fit(saved_run, tmp_path, capsys):
    root, _ = saved_run
    assert main(["merge-checkpoint", str(root), "--step", "2", "-o", str(tmp_path / "m.pt")]) == 2
    assert "no complete checkpoint for step 2" in capsys.readouterr().err
    m = json.loads((step_dir(root, 6) / MANIFEST).read_text())
    broken = tmp_path / "copy"
    import shutil
    shutil.copytree(step_dir(root, 6), broken / "step-000006")
    (broken / "step-000006" / MANIFEST).write_text(json.dumps(dict(m, model="mlp[layers=3]")))
    assert main(["merge-checkpoint", str(broken), "-o", str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err
    assert "does not fit mlp[layers=3]" in err and "missing" in err
    assert main(["merge-checkpoint", str(broken), "--no-check", "-o", str(tmp_path / "m.pt")]) == 0


# ---- rank programs -----------------------------------------------------------------------------
def _digest(module, opt) -> str:
    parts = [module.state_dict(), opt.state_dict()["state"]]
    return str([round(float(t.double().sum()), 12) for d in parts for t in _tensors(d)])


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _tensors(obj[k])


def _setup(rank: int):
    plan = make_plan()
    stage, _ = plan.stage_of_rank(rank)
    module = stage_module(stage.index)
    return plan, module, make_opt(module)


def save_then_die(rank: int, world: int, root: str) -> str:
    plan, module, opt = _setup(rank)
    ck = Checkpointer(root, plan=plan, rank=rank, every=2, keep=2)
    torch.manual_seed(100 + rank)
    for step in range(6):
        train(module, opt, 1)
        torch.rand(5)                                        # draws that the RNG state must carry
        if ck.due(step + 1):
            ck.save(step + 1, module=module, optimizer=opt, engine={"stash": torch.full((2,), float(rank))})
    print("RAND", torch.rand(3).tolist(), flush=True)
    print("DIGEST", _digest(module, opt), flush=True)
    train(module, opt, 2)
    if rank == 2:       # dies after writing its own files, before the manifest exists
        ck._gather = lambda obj: __import__("os")._exit(17)
    try:
        ck.save(8, module=module, optimizer=opt, engine={})
    except RuntimeError:
        return "the step-8 save failed"
    return "saved step 8"


def resume_and_report(rank: int, world: int, root: str):
    plan, module, opt = _setup(rank)
    torch.manual_seed(999)
    ck = Checkpointer(root, plan=plan, rank=rank, every=2)
    restored = ck.restore(module)
    ck.load_into(restored, module, opt)
    restore_rng(restored.rng)
    return [restored.step, restored.engine["stash"].tolist(), str(torch.rand(3).tolist()), _digest(module, opt)]
