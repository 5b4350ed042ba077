"""hybridpipe.pipeline: a model + plan -> this rank's stage; schedules as instruction lists; the engine.

    stage = build_stage(model, plan, rank, loss=spec.loss, leaf_modules=spec.leaf_modules)
    # or, with virtual stages (interleaved-1f1b, zbv): stages = build_stages(...), one per model chunk
    topo = Topology.from_plan(plan)
    engine = PipelineEngine(stage, topo, rank, plan.kind, transport=channels, sync=hdp,
                            optimizer=opt, data=MicroBatches(dataset, plan.batch_size, plan.micro_batches))
    engine.run_step(step, drain=is_last_step)

Pure parts (no processes):

* the stage: ``plancheck.py`` (the plan checked against the captured model, once, and the stages
  built from it), ``stage.py`` (a node range cut out of the captured graph, ``profiles/cut.py``),
  ``values.py`` (what crosses a boundary), ``chunks.py`` (a rank's model chunks as one module),
  ``splitback.py`` (a backward split in input and weight gradients; ``weightgrads.py``, the weight
  half's formulas for matrix products and layer norms; ``splitplan.py``, its cut kept across
  micro-batches), ``stash.py`` (pipedream's
  weight versions), ``tied.py`` (tied weights' copies summed), ``buffer_writes.py`` (which buffers
  a forward changes), ``batch_stats.py`` (running statistics that replicas combine exactly and
  recomputation does not count twice), ``tokens.py`` (the token-weighted loss's bookkeeping);
* the schedules: ``instructions.py`` (the instruction set), ``schedules.py`` (every schedule of
  ``partitioner/schedule_registry.py`` expanded into per-rank lists), ``validate.py`` (a symbolic
  run of all ranks' lists), ``simulator.py`` / ``simtrace.py`` (a timed run, its trace and picture);
* the engine: ``engine.py`` runs a rank's list (``ports.py``: its transport and syncs),
  ``inflight.py`` holds its micro-batches between instructions, ``engine_state.py`` checkpoints
  them, ``evaluation.py`` the forward-only step, ``memory.py`` measures what it holds, ``data.py``
  feeds it.

``inprocess.py`` runs a whole pipeline on threads (tests, debugging).
"""

from hybridpipe.pipeline.data import MicroBatches
from hybridpipe.pipeline.engine import PipelineEngine
from hybridpipe.pipeline.plancheck import CheckedPlan, build_stage, build_stages, check_plan
from hybridpipe.pipeline.ports import LocalSync
from hybridpipe.pipeline.schedules import Topology, channel_edges, check_schedulable, rank_program, transfer_program
from hybridpipe.pipeline.stage import Activation, PipelineStage, build_stage_index
from hybridpipe.pipeline.step_result import StepResult

__all__ = [
    "MicroBatches", "LocalSync", "PipelineEngine", "StepResult", "Topology", "channel_edges", "check_schedulable",
    "rank_program", "transfer_program", "Activation", "PipelineStage", "build_stage", "build_stage_index",
    "build_stages", "CheckedPlan", "check_plan",
]
