"""BatchNorm on replicated stages (plain and sharded: ZeRO-1, 2, 3) through launch on 4 rank
processes and ``hybridpipe merge-checkpoint``: the merged state_dict, weights and every buffer, is
what a plain single-process loop written here trains (micro-batches in order, gradients
accumulated); merge-checkpoint refuses a checkpoint whose replicas saved different buffers.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from hybridpipe.cli import main
from hybridpipe.launch import main as launch_main
from hybridpipe.partitioner.plan import save_plan
from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.checkpoint_files import MANIFEST, step_dir
from hybridpipe.runtime.timeline import find_rank_traces, load_rank_trace
from tests.pipeline.harness import make_plan
from tests.runtime.jobs import launch

STEPS, LR, MOMENTUM, SEED, M, B = 3, 0.05, 0.5, 2, 4, 2


def plain_loop(model: str) -> dict[str, torch.Tensor]:
    """launch's run in one process: the model built after manual_seed(SEED), SGD with momentum, the
    synthetic samples of seed SEED in order, each micro-batch's mean loss / M accumulated."""
    spec = resolve_model(model)
    torch.manual_seed(SEED)
    net = spec.build().train()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    samples = resolve_dataset("synthetic", spec, size=STEPS * M * B, seed=SEED)
    for k in range(STEPS):
        opt.zero_grad()
        for m in range(M):
            first = (k * M + m) * B
            x, y = default_collate([samples[i] for i in range(first, first + B)])
            (F.cross_entropy(net(x), y) / M).backward()
        opt.step()
    return {name: t.detach() for name, t in net.state_dict().items()}


def test_resnet_small_two_by_two_under_launch_merges_into_one_process_state(tmp_path, capsys):
    plan = make_plan("resnet-small", [4], [2, 2], schedule="1f1b", micro_batches=M, batch_size=B)
    path, run, ckpt = tmp_path / "plan.json", tmp_path / "run", tmp_path / "ckpt"
    save_plan(plan, path)
    done = launch(["--plan", str(path), "--steps", str(STEPS), "--lr", str(LR), "--momentum", str(MOMENTUM),
                   "--seed", str(SEED), "--run-dir", str(run), "--checkpoint-dir", str(ckpt), "--timeout", "60",
                   "--no-progress"], 4)
    assert all(r.returncode == 0 for r in done), done
    stdout = "".join(r.stdout for r in done)
    assert "replicas: identical weights and buffers in every replicated stage (running statistics combined " \
           "across replicas: stage 0: stem.1, blocks.0.conv1.1, blocks.0.conv2.1 and 3 more; stage 1: " \
           "blocks.2.shortcut.1, blocks.2.conv1.1, blocks.2.conv2.1)" in stdout, done
    summary = json.loads((run / "summary.json").read_text())
    assert summary["replicas_identical"] == {"0": True, "1": True}
    assert "stem.1.running_var" in summary["buffers_combined"]["0"]
    # each replicated layer's all-reduce in every rank's trace: its own time, apart from the wait (``sync``)
    for trace in map(load_rank_trace, find_rank_traces(run / "trace")):
        syncs = [e for e in trace.events if e.get("cat") == "all-reduce"]
        assert {e["args"]["step"] for e in syncs} == set(range(STEPS)), trace.rank
        covered = {layer for e in syncs for layer in e["name"].split("+")}      # a fused unit: its layers
        assert covered == {x["layer"] for x in summary["sync"][str(trace.meta["stage"])]}, (trace.rank, covered)
        assert all(e["dur"] >= 0 and e["args"]["bytes"] > 0 and e["args"]["algorithm"] for e in syncs)

    out = tmp_path / "model.pt"
    assert main(["merge-checkpoint", str(ckpt), "-o", str(out)]) == 0
    merged, reference = torch.load(out), plain_loop(plan.model)
    assert set(merged) == set(reference)
    for name, value in merged.items():
        if value.is_floating_point():
            assert float((value - reference[name]).abs().max()) <= 1e-6, name
        else:
            assert torch.equal(value, reference[name]), (name, value, reference[name])   # num_batches_tracked: 12
    assert int(merged["stem.1.num_batches_tracked"]) == STEPS * M
    capsys.readouterr()

    # a checkpoint whose replicas reported different buffers (the manifest edited by hand) is refused
    directory = step_dir(ckpt, STEPS)
    manifest = json.loads((directory / MANIFEST).read_text())
    assert manifest["replicas"]["0"]["0"] == manifest["replicas"]["0"]["1"]
    manifest["replicas"]["0"]["1"]["stem.1.running_var"] = "0" * 64
    (directory / MANIFEST).write_text(json.dumps(manifest))
    assert main(["merge-checkpoint", str(ckpt), "-o", str(tmp_path / "bad.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the replicas of stage 0 saved different values of 'stem.1.running_var'" in err[0], err
    assert not (tmp_path / "bad.pt").exists()


def test_launch_refuses_an_uncombinable_buffer_on_a_replicated_stage_before_starting(tmp_path, capsys, monkeypatch):
    """An exponential moving average kept in a buffer by stage 1's forward, stage 1 replicated:
    one line naming the buffer and what to do, exit 2, before any process group exists."""
    plan = make_plan("tests.pipeline.bn_models:smoothed", [0], [1, 2], micro_batches=4, batch_size=4)
    save_plan(plan, tmp_path / "plan.json")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert launch_main(["--plan", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybridpipe.launch: error: stage 1 has 2 replicas and its training "
                                               "forward changes buffer 'ema'"), err
    assert "give that layer a stage without replicas" in err[0]


@pytest.mark.slow
@pytest.mark.parametrize("level", ["optimizer", "gradients", "parameters"])
def test_batchnorm_on_sharded_replicas_trains_as_one_process(tmp_path, level):
    """The same run with both stages' replicas sharded (ZeRO-1, 2, 3): weights and every buffer as
    the plain loop's (the running statistics still combined across the shards' replicas)."""
    plan = make_plan("resnet-small", [4], [2, 2], schedule="1f1b", micro_batches=M, batch_size=B)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard=level) for s in plan.stages))
    path, ckpt = tmp_path / "plan.json", tmp_path / "ckpt"
    save_plan(plan, path)
    done = launch(["--plan", str(path), "--steps", str(STEPS), "--lr", str(LR), "--momentum", str(MOMENTUM),
                   "--seed", str(SEED), "--run-dir", str(tmp_path / "run"), "--checkpoint-dir", str(ckpt),
                   "--timeout", "60", "--no-progress", "--no-trace"], 4)
    assert all(r.returncode == 0 for r in done), done
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["sync"] == {}, summary["sync"]       # no layer all-reduced: the shards' collectives instead
    assert summary["replicas_identical"] == {"0": True, "1": True}
    assert main(["merge-checkpoint", str(ckpt), "-o", str(tmp_path / "model.pt")]) == 0
    merged, reference = torch.load(tmp_path / "model.pt"), plain_loop(plan.model)
    assert set(merged) == set(reference)
    for name, value in merged.items():
        if value.is_floating_point():
            assert float((value - reference[name]).abs().max()) <= 1e-6, (level, name)
        else:
            assert torch.equal(value, reference[name]), (level, name, value, reference[name])
