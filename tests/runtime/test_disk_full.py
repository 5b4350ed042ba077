"""A full disk while a checkpoint is written, on a real tiny tmpfs (needs root to mount it; skipped
otherwise): one line naming the file and the cause, the step never committed, the older steps intact."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from hybridpipe.errors import AgreedError, UserError
from hybridpipe.partitioner.plan import save_plan
from hybridpipe.runtime.checkpoint import Checkpointer
from hybridpipe.runtime.checkpoint_files import atomic_save, complete_steps, staging_dirs, step_dir
from tests.pipeline.harness import make_plan
from tests.runtime.jobs import launch
from tests.runtime.test_checkpoint import make_opt, stage_module
from tests.runtime.test_checkpoint import make_plan as one_stage_plan
from tests.runtime.test_hardening import _lines


@pytest.fixture
def tiny_disk(tmp_path) -> Iterator[Callable[[str], Path]]:
    """``mount(size)``: a fresh tmpfs of ``size`` (e.g. "64k"), unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    try:
        yield mount
    finally:
        for where in mounted:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_full_disk_is_one_line_naming_the_file_and_no_temp_file_stays(tiny_disk):
    disk = tiny_disk("64k")
    with pytest.raises(UserError) as e:
        atomic_save({"w": torch.zeros(100_000)}, disk / "stage-0.pt")      # 400 kB
    assert str(e.value) == f"cannot write {disk / 'stage-0.pt'}: No space left on device"
    assert list(disk.iterdir()) == []


def test_a_save_that_fills_the_disk_is_not_committed_and_the_older_one_stays_whole(tiny_disk):
    disk = tiny_disk("96k")
    ck = Checkpointer(disk, plan=one_stage_plan(((0,),)), rank=0, every=1, keep=5)
    module = stage_module(0)
    ck.save(1, module=module, optimizer=make_opt(module))                 # 60 kB: fits once, not twice
    with pytest.raises(AgreedError) as e:
        ck.save(2, module=module, optimizer=make_opt(module))
    assert str(e.value).startswith(f"checkpoint of step 2 not saved: rank 0: cannot write {disk}/.step-000002.")
    assert ": No space left on device; nothing of it was committed and the older checkpoints (newest: " \
           "step-000001) are as they were; free space there or pass another --checkpoint-dir, then restart with " \
           "--resume" in str(e.value)
    assert complete_steps(disk, verify=True) == [1] and not step_dir(disk, 2).exists() and staging_dirs(disk) == {}


def test_a_job_whose_disk_fills_stops_every_rank_with_one_line_and_keeps_its_steps(tiny_disk, tmp_path):
    """Two ranks, a checkpoint (516 kB) every step on a 1300 kB disk: the third does not fit."""
    disk = tiny_disk("1300k")
    save_plan(make_plan("mlp", [3], [1, 1], micro_batches=2, batch_size=4), tmp_path / "plan.json")
    ranks = launch(["--plan", str(tmp_path / "plan.json"), "--steps", "8", "--checkpoint-dir", str(disk),
                    "--checkpoint-every", "1", "--keep-checkpoints", "100", "--run-dir", str(tmp_path / "run"),
                    "--no-progress", "--timeout", "60"], 2)
    assert [r.returncode for r in ranks] == [2, 2], ranks
    [line] = _lines(ranks[0].stderr)                  # once per host (the first local rank prints it)
    assert ranks[1].stderr == "", ranks
    assert line.startswith("hybridpipe.launch: error: checkpoint of step 3 not saved: rank ") and \
        f"cannot write {disk}/.step-000003." in line and ": No space left on device; nothing of it was committed " \
        "and the older checkpoints (newest: step-000002) are as they were" in line, line
    assert "Traceback" not in ranks[0].stderr + ranks[1].stderr and "unexpected pos" not in line
    assert complete_steps(disk, verify=True) == [1, 2] and staging_dirs(disk) == {}
