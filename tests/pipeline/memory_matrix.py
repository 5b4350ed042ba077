"""The memory-prediction matrix of issue 28 item 9: Hugging Face families x schedules x optimizers
on 4 stages, the partitioner's per-stage prediction (``stagememory.memory_bytes``) next to what the
engine's ``MemoryMeter`` measured (its per-step peak) in an in-process pipeline (threads).

Used by tests/pipeline/test_memory_families.py and benchmarks/memory_prediction.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hybridpipe.partitioner.plan import Plan
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search.modelcosts import ModelCosts, model_costs
from hybridpipe.partitioner.search.objective import StageSpec
from hybridpipe.partitioner.search.options import Options
from hybridpipe.partitioner.search.sharding import NONE
from hybridpipe.partitioner.search.stagememory import (
    inflight_micro_batches,
    memory_bytes,
    split_micro_batches,
    transient_bytes,
)
from hybridpipe.partitioner.search.virtual import worker_bytes, worker_places
from hybridpipe.pipeline.splitback import backward_input
from hybridpipe.profiles.profiler import profile_model
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import make_plan, train_pipeline
from tests.pipeline.hf_models import GPT2, LLAMA

BATCH, MICRO_BATCHES, STEPS = 2, 4, 2

FAMILIES = {     # name: (spec, cuts of 4 stages)
    "gpt2-tied": (GPT2, [0, 3, 4]),
    "llama-tied": (LLAMA, [1, 2, 3]),      # tied embedding and head, rotary cos/sin into every layer stage
    "mistral": ("hf:mistral[num_hidden_layers=2,hidden_size=32,intermediate_size=64,num_attention_heads=2,"
                "num_key_value_heads=1,vocab_size=128,seq=8]", [1, 2, 3]),
    "distilbert-mlm": ("hf:distilbert[n_layers=2,dim=32,hidden_dim=64,n_heads=2,vocab_size=128,seq=8,dropout=0]",
                       [0, 1, 2]),
    "bart": ("hf:BartForConditionalGeneration[encoder_layers=2,decoder_layers=2,d_model=32,encoder_ffn_dim=64,"
             "decoder_ffn_dim=64,encoder_attention_heads=2,decoder_attention_heads=2,vocab_size=128,"
             "max_position_embeddings=64,seq=8,labels=8,dropout=0]", [2, 4, 7]),
    "resnet": ("tests.pipeline.memory_models:hf_resnet", [0, 1, 2]),
    "convnext": ("tests.pipeline.memory_models:hf_convnext", [0, 1, 2]),
}

FULL_SIZE = {    # not in the tests (a minute to profile): benchmarks/memory_prediction.py --families gpt2-124m
    "gpt2-124m": ("hf:gpt2[seq=256]", [5, 10, 14]),       # the last stage: ln_f, lm_head (tied), 50k logits, loss
}


@dataclass(frozen=True)
class StageMemory:
    stage: int
    nodes: str                  # first..last node names
    measured: int               # the meter's peak over the steps
    predicted: float            # stagememory.memory_bytes less transient_bytes (what the stage holds)

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted


def measure(family: str, schedule: str, optimizer: str) -> list[StageMemory]:
    """Per stage of ``family`` on 4 stages: the meter's peak and the partitioner's prediction; for a
    schedule with 2 chunks per rank (zbv), per rank of 2 (the V's chunks 0 + 3 and 1 + 2)."""
    spec, cuts = {**FAMILIES, **FULL_SIZE}[family]
    torch.manual_seed(0)
    costs = model_costs(profile_model(resolve_model(spec), batch_size=BATCH, repeats=1, warmup=0, progress=False,
                                      split_backward=backward_input))
    kind = get_schedule(schedule)
    virtual = 2 if kind.chunked else 1
    plan = make_plan(spec, cuts, [1] * ((len(cuts) + 1) // virtual), schedule=schedule, micro_batches=MICRO_BATCHES,
                     batch_size=BATCH, shared_capture=True, virtual_stages=virtual)
    plan = dataclasses.replace(plan, optimizer=optimizer)
    results: dict = {}
    train_pipeline(plan, STEPS, step_results=results, shared_capture=True, optimizer=optimizer)
    p = len(plan.stages)
    opts = Options(schedule=kind, micro_batches=MICRO_BATCHES, optimizer=optimizer)
    if virtual > 1:
        return _per_rank(costs, plan, results, opts)
    rows = []
    for s, st in enumerate(plan.stages):
        i, j = st.first_node, st.last_node
        # the meter counts what the stage holds, not its kernels' temporaries (stagememory.transient_bytes),
        # which only an allocator sees: tests/pipeline/test_memory_transient.py
        predicted = (memory_bytes(costs, i, j, inflight_micro_batches(kind, MICRO_BATCHES, p - s, 1, p), opts,
                                  split=split_micro_batches(kind, MICRO_BATCHES, p - s, 1, p))
                     - transient_bytes(costs, i, j))
        rows.append(StageMemory(s, f"{costs.names[i]}..{costs.names[j]}",
                                max(r.peak_memory_bytes for r in results[s]), predicted))
    return rows


def _per_rank(costs: ModelCosts, plan: Plan, results: dict, opts: Options) -> list[StageMemory]:
    """Each rank's meter peak next to ``virtual.worker_bytes`` over its chunks (less the transient)."""
    specs = [StageSpec(st.first_node, st.last_node, st.ranks) for st in plan.stages]
    rows = []
    for g, (ranks, place) in enumerate(worker_places(specs, opts)):
        mine = [c for c, sp in enumerate(specs) if sp.ranks == ranks]
        total, _ = worker_bytes(costs, specs, mine, [NONE] * len(mine), opts.schedule, place, opts, len(mine))
        predicted = total - max(transient_bytes(costs, specs[c].first, specs[c].last) for c in mine)
        names = " + ".join(f"{costs.names[specs[c].first]}..{costs.names[specs[c].last]}" for c in mine)
        rows.append(StageMemory(g, names, max(r.peak_memory_bytes for r in results[g]), predicted))
    return rows
