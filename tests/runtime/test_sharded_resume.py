"""Checkpoints of sharded replicas (ZeRO-1/2/3) through launch on real rank processes (gloo), each
against a plain single-process PyTorch loop written here (weights, BatchNorm buffers and AdamW's
state by parameter name: which parameters have one, step counts, moments):

* a ZeRO-2 run on 2 stages x 2 replicas resumed under ZeRO-3, under no sharding, under another split
  with another replica count (1 + 3 ranks, the 3 replicas at ZeRO-3) and interleaved over virtual
  stages at mixed levels ends where the uninterrupted plain loop does, the learning-rate schedule included;
* ``merge-checkpoint --with-optimizer`` of a sharded run started with ``--init-from`` under a sharded
  plan continues as the plain loop continues from the same weights and optimizer state;
* ``merge-checkpoint --format hf`` of a ZeRO-1/2/3 run of a tiny GPT-2 or Llama loads with
  ``from_pretrained`` as the plain loop's model, and ``--init-from`` that directory continues as the plain loop;
* a mixture of experts whose unchosen experts get no gradient trains, saves and resumes sharded as
  torch's AdamW does (skipped, their own step counts);
* ``--init-from`` a checkpoint directory is refused in one line naming the merge-checkpoint to run.

All but the last are multi-process (make test-slow).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hybridpipe.cli import main
from hybridpipe.partitioner.plan import Plan, save_plan
from hybridpipe.pipeline.data import MicroBatches
from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.checkpoint_files import step_dir
from hybridpipe.runtime.merged import merge_optimizer
from tests.pipeline.harness import make_plan, model_loss
from tests.runtime.jobs import final_weights, launch, max_diff

MODEL = "tests.runtime.resume_models:bn_mlp"     # Linear -> BatchNorm1d -> ReLU blocks: weights and buffers
SEED, LR, WD, CLIP, WARMUP = 3, 0.01, 0.1, 0.5, 2
M, B = 6, 4                                      # one global batch: 24 samples, every plan
FIRST, MORE = 3, 2                               # steps before the checkpoint, steps after
SIZE = (FIRST + MORE) * M * B
TOL = 1e-5


def cosine(step: int, total: int) -> float:
    """``--lr-schedule cosine --warmup-steps WARMUP`` as the README says it: the factor on the learning
    rate of the step after ``step`` steps, rising linearly over WARMUP steps, then half a cosine to 0 at ``total``."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP) / max(1, total - WARMUP))))


def sharded(plan: Plan, *levels: str) -> Plan:
    """``plan`` with stage s's replicas at ``levels[s]`` (a stage of one replica stays unsharded)."""
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard=lvl if s.replicas > 1 else "none")
                                                  for s, lvl in zip(plan.stages, levels, strict=True)))


def plain_loop(steps: int, start: dict | None = None, *, model_spec: str = MODEL, micro_batches: int = M,
               batch_size: int = B, size: int = SIZE) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """The unsplit model in one process for ``steps`` steps: built after manual_seed(SEED) (or given
    ``start``'s weights and name-keyed AdamW state, if any), the synthetic samples of SEED (``size``
    of them) from the first onwards, each micro-batch's mean loss / M accumulated, clipped by the
    global norm, torch's AdamW under the :func:`cosine` schedule to ``steps``. Its state_dict (weights
    and buffers) and its optimizer state by parameter name."""
    spec = resolve_model(model_spec)
    torch.manual_seed(SEED)
    model = spec.build().train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    names = dict(model.named_parameters())
    if start is not None:
        model.load_state_dict(start["model"], strict=True)
        for name, st in start.get("optimizer", {"state": {}})["state"].items():
            opt.state[names[name]] = {k: v.clone() for k, v in st.items()}
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: cosine(k, steps))
    data = MicroBatches(resolve_dataset("synthetic", spec, size=size, seed=SEED), batch_size, micro_batches,
                        targets=spec.loss is not None)
    for k in range(steps):
        opt.zero_grad()
        for m in range(micro_batches):
            (model_loss(spec, model, *data.batch(k, m)) / micro_batches).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
    by_id = {id(p): n for n, p in names.items()}
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {by_id[id(p)]: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()})


def run(tmp: Path, plan: Plan, name: str, ckpt: Path, *more: str, size: int = SIZE, timeout: float = 120) -> str:
    """launch on ``plan``'s ranks (AdamW, clipping, the cosine schedule, the fixed dataset); every rank
    must succeed: their output."""
    path = save_plan(plan, tmp / f"{name}.json")
    done = launch(["--plan", str(path), "--optimizer", "adamw", "--lr", str(LR), "--weight-decay", str(WD),
                   "--clip-grad-norm", str(CLIP), "--lr-schedule", "cosine", "--warmup-steps", str(WARMUP),
                   "--seed", str(SEED), "--dataset-size", str(size), "--checkpoint-dir", str(ckpt),
                   "--run-dir", str(tmp / f"run-{name}"), "--timeout", "60",
                   "--no-progress", "--no-trace", *more], plan.world_size, timeout=timeout)
    assert all(d.returncode == 0 for d in done), done
    return "".join(d.stdout + d.stderr for d in done)


def check_state(ckpt: Path, step: int, weights: dict[str, torch.Tensor], state: dict[str, dict], *,
                noise: Callable[[dict], dict] = lambda w: w) -> None:
    """The checkpoint of ``step`` holds ``weights`` (and buffers) and AdamW ``state``, by name (the
    weights as ``noise`` leaves them on both sides)."""
    merged = noise(final_weights(ckpt, step))
    weights = noise(weights)
    floats = {k for k, v in weights.items() if v.is_floating_point()}
    assert max_diff({k: merged[k] for k in floats}, {k: weights[k] for k in floats}) <= TOL
    for k in set(weights) - floats:                       # num_batches_tracked: exactly
        assert torch.equal(merged[k], weights[k]), (k, merged[k], weights[k])
    assert set(merged) == set(weights)
    saved = merge_optimizer(ckpt, step)["state"]
    assert set(saved) == set(state)
    for name, st in state.items():
        assert float(saved[name]["step"]) == float(st["step"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert saved[name][key].shape == st[key].shape, (name, key)
            assert float((saved[name][key] - st[key]).abs().max()) <= TOL, (name, key)



def test_init_from_a_checkpoint_directory_is_refused_in_one_line_naming_the_merge(tmp_path, capsys):
    """``--init-from`` reads a state_dict or merged file, a .safetensors file or a save_pretrained
    directory, not a run's checkpoint directory (nor one of its step-N): one line saying so and what
    to run; running it gives the file --init-from takes (before: "holds no model.safetensors")."""
    from hybridpipe.errors import UserError
    from hybridpipe.runtime.lazy import load_initial
    from tests.runtime.hf_checkpoints import perturbed, write_checkpoint

    model = perturbed(resolve_model(MODEL).build())
    step = write_checkpoint(tmp_path / "ckpt", MODEL, model, step=3)
    for given in (tmp_path / "ckpt", step):
        with pytest.raises(UserError) as e:
            load_initial(given, resolve_model(MODEL).build())
        assert "\n" not in str(e.value) and "is a hybridpipe checkpoint directory" in str(e.value), e.value
        assert f"`hybridpipe merge-checkpoint {given} --with-optimizer -o start.pt`" in str(e.value)
    assert main(["merge-checkpoint", str(tmp_path / "ckpt"), "--with-optimizer", "-o", str(tmp_path / "start.pt")]) == 0
    weights, optimizer = load_initial(tmp_path / "start.pt", resolve_model(MODEL).build())
    assert optimizer is not None
    assert all(torch.equal(weights.get(k), v) for k, v in model.state_dict().items())
    capsys.readouterr()


def zero2() -> Plan:
    """2 stages x 2 replicas, both at ZeRO-2."""
    return sharded(make_plan(MODEL, [4], [2, 2], micro_batches=M, batch_size=B), "gradients", "gradients")


TARGETS = {     # the plans a ZeRO-2 2 x 2 checkpoint resumes under
    "zero3": lambda: sharded(make_plan(MODEL, [4], [2, 2], micro_batches=M, batch_size=B), "parameters", "parameters"),
    "replicated": lambda: make_plan(MODEL, [4], [2, 2], micro_batches=M, batch_size=B),
    "1+3-zero3": lambda: sharded(make_plan(MODEL, [6], [1, 3], micro_batches=M, batch_size=B), "none", "parameters"),
    "interleaved-zero3": lambda: sharded(make_plan(MODEL, [1, 4, 7], [2, 2], schedule="interleaved-1f1b",
                                                   micro_batches=M, batch_size=B, virtual_stages=2),
                                         "parameters", "optimizer", "gradients", "parameters"),
}


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGETS))
def test_zero2_resumed_under_another_level_or_split_equals_the_uninterrupted_plain_loop(tmp_path, target):
    """FIRST + MORE steps at ZeRO-2 on 2 x 2 ranks (a checkpoint after FIRST), as the plain loop; the last
    checkpoint removed, the run resumed under ``target`` for MORE steps: every weight, buffer and AdamW
    moment and step count as the plain loop's after FIRST + MORE steps (the schedule's learning rate
    replayed to the step where the plan changed)."""
    ckpt = tmp_path / "ckpt"
    run(tmp_path, zero2(), "first", ckpt, "--steps", str(FIRST + MORE), "--checkpoint-every", str(FIRST))
    reference = plain_loop(FIRST + MORE)
    check_state(ckpt, FIRST + MORE, *reference)
    shutil.rmtree(step_dir(ckpt, FIRST + MORE))              # as if the job had died after step FIRST
    said = run(tmp_path, TARGETS[target](), "second", ckpt, "--steps", str(FIRST + MORE), "--resume")
    assert f"continuing from {step_dir(ckpt, FIRST)} (step {FIRST})" in said, said
    check_state(ckpt, FIRST + MORE, *reference)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["optimizer", "gradients", "parameters"])
def test_init_from_a_merged_sharded_checkpoint_with_its_optimizer_continues_the_plain_loop(tmp_path, level):
    """FIRST steps at ZeRO-2, ``merge-checkpoint --with-optimizer``, then a new run at ``level`` started
    with ``--init-from`` for MORE steps (its data from the first sample again, its own schedule): as the
    plain loop given the same weights and AdamW state (its step counts too) for MORE steps."""
    ckpt = tmp_path / "ckpt"
    run(tmp_path, zero2(), "first", ckpt, "--steps", str(FIRST))
    start = tmp_path / "start.pt"
    assert main(["merge-checkpoint", str(ckpt), "--with-optimizer", "-o", str(start)]) == 0
    given = torch.load(start, weights_only=True)
    check_state(ckpt, FIRST, *plain_loop(FIRST))
    second = sharded(make_plan(MODEL, [4], [2, 2], micro_batches=M, batch_size=B), level, level)
    run(tmp_path, second, "second", tmp_path / "fresh", "--steps", str(MORE), "--init-from", str(start))
    check_state(tmp_path / "fresh", MORE, *plain_loop(MORE, start=given))


HF_M, HF_B, HF_STEPS = 4, 2, 3
HF_SIZE = HF_STEPS * HF_M * HF_B


def without_key_bias(state: dict) -> dict:
    """GPT-2's weights without the attention's key bias (the middle third of ``c_attn.bias``): softmax
    ignores what it adds, so its gradient is zero up to rounding, which AdamW's g / sqrt(v) makes a
    step of chance size and sign (measured 4e-6 to 2e-5 from the plain loop, replicated or sharded
    alike); its AdamW moments are still compared."""
    out = dict(state)
    for name, t in state.items():
        if name.endswith("attn.c_attn.bias"):
            third = t.shape[0] // 3
            out[name] = torch.cat([t[:third], t[2 * third:]])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name,level", [("gpt2", "optimizer"), ("gpt2", "gradients"), ("gpt2", "parameters"),
                                        ("llama", "parameters")])
def test_hf_export_of_a_sharded_run_loads_as_the_plain_loop_and_starts_a_sharded_run(tmp_path, name, level):
    """A tiny Hugging Face model (its embedding tied to the head and cut apart from it) on 2 stages x 2
    replicas at ``level``: the checkpoint (weights and AdamW state) is the plain loop's after HF_STEPS
    steps; ``merge-checkpoint --format hf`` writes a directory ``from_pretrained`` loads strictly into
    the plain loop's weights (still tied); ``--init-from`` that directory under ZeRO-3 trains MORE
    steps as the plain loop from those weights (a fresh AdamW)."""
    transformers = pytest.importorskip("transformers")
    from tests.pipeline.hf_models import BY_NAME

    case = BY_NAME[name]
    plan = sharded(make_plan(case.spec, case.two, [2, 2], micro_batches=HF_M, batch_size=HF_B), level, level)
    assert [(t.param, t.stages) for t in plan.tied] == [(case.tied, (0, 1))]
    shape = {"model_spec": case.spec, "micro_batches": HF_M, "batch_size": HF_B, "size": HF_SIZE}
    ckpt = tmp_path / "ckpt"
    run(tmp_path, plan, "first", ckpt, "--steps", str(HF_STEPS), size=HF_SIZE, timeout=240)
    noise = without_key_bias if name == "gpt2" else (lambda w: w)
    weights, state = plain_loop(HF_STEPS, **shape)
    check_state(ckpt, HF_STEPS, weights, state, noise=noise)
    out = tmp_path / "hf"
    assert main(["merge-checkpoint", str(ckpt), "--format", "hf", "-o", str(out)]) == 0
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    exported = loaded.state_dict()
    assert max_diff(noise(exported), noise({k: weights[k] for k in exported})) <= TOL

    second = sharded(make_plan(case.spec, case.two, [2, 2], micro_batches=HF_M, batch_size=HF_B), "parameters",
                     "parameters")
    run(tmp_path, second, "second", tmp_path / "fresh", "--steps", str(MORE), "--init-from", str(out), size=HF_SIZE,
        timeout=240)
    check_state(tmp_path / "fresh", MORE, *plain_loop(MORE, {"model": exported}, **shape), noise=noise)



@pytest.mark.slow
def test_an_hf_export_of_a_sharded_run_read_a_stage_at_a_time_by_a_zero3_run(tmp_path):
    """The ``--format hf`` directory of a ZeRO-2 GPT-2 run named as the model (``hf:DIR``: each rank
    reads only its stage's tensors, after which ZeRO-3 keeps its pieces) trains MORE steps as the
    plain loop does from ``from_pretrained``'s model of that directory."""
    pytest.importorskip("transformers")
    from tests.pipeline.hf_models import BY_NAME

    case = BY_NAME["gpt2"]
    first = sharded(make_plan(case.spec, case.two, [2, 2], micro_batches=HF_M, batch_size=HF_B), "gradients",
                    "gradients")
    run(tmp_path, first, "first", tmp_path / "ckpt", "--steps", str(HF_STEPS), size=HF_SIZE, timeout=240)
    assert main(["merge-checkpoint", str(tmp_path / "ckpt"), "--format", "hf", "-o", str(tmp_path / "hf")]) == 0
    spec = f"hf:{tmp_path / 'hf'}[seq=8]"
    second = sharded(make_plan(spec, case.two, [2, 2], micro_batches=HF_M, batch_size=HF_B), "parameters",
                     "parameters")
    said = run(tmp_path, second, "second", tmp_path / "fresh", "--steps", str(MORE), size=HF_SIZE, timeout=240)
    assert "loads the whole of" not in said, said                   # read a stage at a time
    shape = {"model_spec": spec, "micro_batches": HF_M, "batch_size": HF_B, "size": HF_SIZE}
    check_state(tmp_path / "fresh", MORE, *plain_loop(MORE, **shape), noise=without_key_bias)



@pytest.mark.slow
def test_gpt2_with_its_tie_cut_apart_resumed_from_zero1_at_zero3_equals_the_plain_loop(tmp_path):
    """GPT-2 (the embedding tied to the head, each in another stage: kept whole, summed across stages)
    on 2 x 2 ranks at ZeRO-1 for FIRST + MORE steps, the last checkpoint removed and the run resumed from
    FIRST at ZeRO-3: weights and AdamW state (the tied weight's once) as the plain loop's."""
    pytest.importorskip("transformers")
    from tests.pipeline.hf_models import BY_NAME

    case = BY_NAME["gpt2"]
    plan = make_plan(case.spec, case.two, [2, 2], micro_batches=HF_M, batch_size=HF_B)
    size = (FIRST + MORE) * HF_M * HF_B
    ckpt = tmp_path / "ckpt"
    run(tmp_path, sharded(plan, "optimizer", "optimizer"), "first", ckpt, "--steps", str(FIRST + MORE),
        "--checkpoint-every", str(FIRST), size=size, timeout=240)
    reference = plain_loop(FIRST + MORE, model_spec=case.spec, micro_batches=HF_M, batch_size=HF_B, size=size)
    check_state(ckpt, FIRST + MORE, *reference, noise=without_key_bias)
    shutil.rmtree(step_dir(ckpt, FIRST + MORE))
    run(tmp_path, sharded(plan, "parameters", "parameters"), "second", ckpt, "--steps", str(FIRST + MORE),
        "--resume", size=size, timeout=240)
    check_state(ckpt, FIRST + MORE, *reference, noise=without_key_bias)


MOE = "tests.runtime.resume_models:moe[leaf=Experts,width=64,experts=32]"      # eager: only chosen experts run
MOE_M, MOE_B = 4, 8
MOE_SIZE = (FIRST + MORE) * MOE_M * MOE_B


@pytest.mark.slow
@pytest.mark.parametrize("first,then", [("gradients", "parameters"), ("optimizer", "gradients"),
                                        ("parameters", "optimizer")])
def test_experts_no_token_chose_are_left_alone_saved_and_resumed_as_torch_does(tmp_path, first, then):
    """A mixture of experts written the eager way (an expert no token chose gets no gradient: torch's
    AdamW skips it, its step count stays, no weight decay; 32 experts, each expert's layers a sync
    unit of their own) on 2 x 2 ranks sharded at ``first`` for FIRST + MORE steps, resumed from FIRST
    at ``then``: weights, which parameters have AdamW state and each one's step count and moments as
    the plain loop's. Before: the replicas' reduce-scatters fell out of step (an expert's unit sent by
    the replica that used it only: gloo's "Received data size doesn't match", a rank aborted); on
    units that held a used parameter too (16 experts of width 16), the sharded optimizer stepped an
    unchosen expert on a zero gradient (decayed, moments shrunk: 8e-3 from the plain loop after 3
    steps) and the checkpoint gave every parameter of a unit the same step count (3 where torch had
    1) and a state to experts never chosen; ZeRO-3 stopped after --timeout (its backward regathered
    an expert's unit when it unpacked a saved weight: on the replicas that used it only)."""
    shape = {"model_spec": MOE, "micro_batches": MOE_M, "batch_size": MOE_B, "size": MOE_SIZE}
    plan = make_plan(MOE, [1], [2, 2], micro_batches=MOE_M, batch_size=MOE_B)
    ckpt = tmp_path / "ckpt"
    run(tmp_path, sharded(plan, first, first), "first", ckpt, "--steps", str(FIRST + MORE), "--checkpoint-every",
        str(FIRST), size=MOE_SIZE)
    reference, at_first = plain_loop(FIRST + MORE, **shape), plain_loop(FIRST, **shape)
    assert len(at_first[1]) < len(at_first[0])                # some expert not chosen yet: no state at FIRST
    assert len({float(st["step"]) for st in reference[1].values()}) > 1      # nor on every step after
    check_state(ckpt, FIRST, *at_first)
    check_state(ckpt, FIRST + MORE, *reference)
    shutil.rmtree(step_dir(ckpt, FIRST + MORE))
    run(tmp_path, sharded(plan, then, then), "second", ckpt, "--steps", str(FIRST + MORE), "--resume",
        size=MOE_SIZE)
    check_state(ckpt, FIRST + MORE, *reference)
