"""hybridpipe.pipeline: a model + plan -> this rank's stage; schedules as instruction lists; the engine.

    stage = build_stage(model, plan, rank, loss=spec.loss, leaf_modules=spec.leaf_modules)
    # or, with virtual stages (interleaved-1f1b, zbv): stages = build_stages(...), one per model chunk
    topo = Topology.from_plan(plan)
    engine = PipelineEngine(stage, topo, rank, plan.schedule, transport=channels, sync=hdp,
                            optimizer=opt, data=MicroBatches(dataset, plan.batch_size, plan.micro_batches))
    engine.run_step(step, drain=is_last_step)

Pure parts (no processes): split.py / stage.py (graph cutting), schedules.py (gpipe, 1f1b,
pipedream), validate.py (symbolic check of all ranks' lists), simulator.py (timed simulation),
buffer_writes.py (which buffers a forward changes), batch_stats.py (running statistics that
replicas combine exactly and recomputation does not count twice).
inprocess.py runs a whole pipeline on threads (tests, debugging).
"""

from hybridpipe.pipeline.data import MicroBatches
from hybridpipe.pipeline.engine import LocalSync, PipelineEngine, StepResult
from hybridpipe.pipeline.schedules import Topology, channel_edges, check_schedulable, rank_program, transfer_program
from hybridpipe.pipeline.stage import Activation, PipelineStage, build_stage, build_stage_index, build_stages

__all__ = [
    "MicroBatches", "LocalSync", "PipelineEngine", "StepResult", "Topology", "channel_edges", "check_schedulable",
    "rank_program", "transfer_program", "Activation", "PipelineStage", "build_stage", "build_stage_index",
    "build_stages",
]
