"""examples/train_loop.py runs as shipped under torchrun (4 ranks): it plans, trains, evaluates, saves."""

from __future__ import annotations

import re

import pytest

from tests.runtime.jobs import ROOT, torchrun


@pytest.mark.slow
def test_the_train_loop_example_runs_under_torchrun_and_the_held_out_loss_falls(tmp_path):
    done = torchrun(["--steps", "20", "--eval-every", "10", "--out", str(tmp_path)], 4,
                    entry=[str(ROOT / "examples" / "train_loop.py")], timeout=300)
    assert done.returncode == 0, done
    before = float(re.search(r"held-out loss before training: ([\d.]+)", done.stdout).group(1))
    after = [float(x) for x in re.findall(r"held-out ([\d.]+)  lr", done.stdout)]
    assert len(after) == 2 and before > 5.0 and after[-1] < before - 1.5, done.stdout
    assert (tmp_path / "checkpoints" / "step-000020" / "manifest.json").exists()
    # run again on the same --out: refused at once (Trainer.save would refuse it only after training)
    again = torchrun(["--steps", "20", "--out", str(tmp_path)], 4, entry=[str(ROOT / "examples" / "train_loop.py")],
                     timeout=300)
    assert again.returncode != 0 and "holds another run's checkpoints: pass another --out" in again.stderr, again
