"""launch.py across hosts: `torchrun --nnodes 2 --rdzv-backend c10d` on two emulated hosts (network
namespaces linked at 1 Gbit/s; needs root, see tools/emucluster), checked against single-process
training."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from hybridpipe.partitioner.plan import save_plan
from tests.pipeline.harness import make_plan
from tests.runtime.jobs import ROOT, final_weights, max_diff, train_reference

pytestmark = [
    pytest.mark.slow, pytest.mark.root,
    pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="needs root to create network namespaces"),
    pytest.mark.skipif(not (shutil.which("ip") and shutil.which("tc")), reason="needs iproute2 (ip, tc)"),
]


def test_two_hosts_two_workers_each(tmp_path):
    from tools.emucluster import EmulatedCluster

    # ranks 0-1 (stage 0, replicated) on one host, 2-3 (stages 1, 2) on the other: activations cross the link
    plan = make_plan("mlp", [3, 6], [2, 1, 1], schedule="1f1b", micro_batches=4, batch_size=8)
    save_plan(plan, tmp_path / "plan.json")
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    args = [str(ROOT / "launch.py"), "--plan", str(tmp_path / "plan.json"), "--steps", "5", "--lr", "0.05",
            "--momentum", "0.5", "--checkpoint-dir", str(ckpt), "--run-dir", str(run), "--timeout", "120",
            "--no-progress"]
    with EmulatedCluster(2, rate="1gbit") as cluster:
        results = cluster.torchrun(args, nproc_per_node=2, timeout_s=300, cwd=ROOT,
                                   env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert all(r.returncode == 0 for r in results), results
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["replicas_identical"] == {"0": True}
    reference = train_reference(plan, 5, lr=0.05, momentum=0.5, seed=0)
    assert max_diff(final_weights(ckpt, 5), reference) <= 1e-5
