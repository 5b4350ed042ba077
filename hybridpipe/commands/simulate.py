"""``hybridpipe simulate PLAN``: predict a plan's step time by simulating its schedule.

Runs the instruction lists the workers would run (hybridpipe.pipeline.schedules) through the
event-driven simulator (hybridpipe.pipeline.simulator) with the plan's per-stage times, its
transfer times and per-layer all-reduce times, and prints the predicted step time, samples/s
and per-stage utilisation next to the partitioner's own prediction. ``--trace`` writes a
Chrome trace (open in https://ui.perfetto.dev or chrome://tracing), ``--png`` a Gantt chart.
"""

from __future__ import annotations

import argparse

from hybridpipe.argtypes import output_file, positive_int
from hybridpipe.commands.show import table
from hybridpipe.errors import UserError
from hybridpipe.limits import require_memory
from hybridpipe.partitioner.cost.calibration import load_calibration
from hybridpipe.partitioner.plan import Plan, load_plan
from hybridpipe.partitioner.plan_options import add_micro_batches_option, add_schedule_option
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.pipeline.schedules import Topology, check_schedulable
from hybridpipe.pipeline.simtrace import draw_timeline, write_chrome_trace
from hybridpipe.pipeline.simulator import SimResult, plan_cost_model, simulate, stage_costs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", help="a plan file written by `hybridpipe partition`")
    parser.add_argument("--trace", type=output_file, metavar="FILE",
                        help="write the simulated timeline as a Chrome trace (JSON)")
    parser.add_argument("--png", type=output_file, metavar="FILE", help="draw the simulated timeline")
    parser.add_argument("--steps", type=positive_int, default=None, metavar="N",
                        help="steps to simulate (default: 3; pipedream: enough to reach its steady state)")
    add_schedule_option(parser)
    add_micro_batches_option(parser)
    parser.add_argument("--calibration", metavar="FILE",
                        help="measured link costs (bench-allreduce output) for transfers the plan gives only in bytes")


def run(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    schedule = get_schedule(args.schedule or plan.schedule)
    topo = Topology(tuple(tuple(s.ranks) for s in plan.stages), args.micro_batches or plan.micro_batches)
    check_simulation_size(topo, args.steps)
    check_schedulable(topo, schedule)
    if all(c.forward_ms == 0 and c.backward_ms == 0 for c in stage_costs(plan)):
        raise UserError(f"{args.plan} has no per-stage times (forward_ms/backward_ms/compute_ms are 0); "
                        "partition a measured profile to get them")
    model = plan_cost_model(plan, load_calibration(args.calibration) if args.calibration else None)
    result = simulate(plan, schedule=schedule, steps=args.steps, micro_batches=topo.micro_batches, cost_model=model)
    print(render(plan, topo, result))
    if args.trace:
        print(f"trace: {write_chrome_trace(result, topo, args.trace)} (open in https://ui.perfetto.dev "
              "or chrome://tracing)")
    if args.png:
        print(f"picture: {draw_timeline(result, topo, args.png, title=f'{plan.model}: {_headline(result)}')}")
    return 0


# measured on `simulate` (4 ranks, 16-512 micro-batches, gpipe/1f1b/pipedream): ~300 bytes kept per
# simulated instruction, 4.3-5.5 instructions per micro-batch and rank; rounded up
BYTES_PER_INSTRUCTION = 400
INSTRUCTIONS_PER_MICRO_BATCH = 6


def check_simulation_size(topo: Topology, steps: int | None, what: str = "simulating") -> None:
    """UserError before any work unless simulating ``steps`` steps of ``topo`` fits in memory
    (arithmetic only: the instruction lists of a huge request are never built)."""
    n_steps = steps if steps is not None else 8 * topo.n_stages + 1        # default_steps' upper bound
    count = n_steps * topo.world_size * topo.micro_batches * topo.virtual_stages * INSTRUCTIONS_PER_MICRO_BATCH
    require_memory(count * BYTES_PER_INSTRUCTION,
                   f"{what} {n_steps} steps of {topo.micro_batches} micro-batches on {topo.world_size} ranks "
                   f"(about {count:,} instructions)", "ask for fewer --steps or --micro-batches")


def _headline(result: SimResult) -> str:
    return f"{result.schedule}, {result.step_ms:.2f} ms per step (simulated)"


def render(plan: Plan, topo: Topology, result: SimResult) -> str:
    """The simulation's summary: per-stage table, step time, throughput, the plan's prediction."""
    costs = stage_costs(plan)
    rows = [[s.index, ",".join(map(str, s.ranks)), s.replicas, f"{c.forward_ms:.2f}", f"{c.backward_ms:.2f}",
             f"{c.send_ms:.2f}", f"{sum(c.allreduce_ms):.2f}", f"{100 * u:.1f}%"]
            for s, c, u in zip(plan.stages, costs, result.utilisation, strict=True)]
    samples = topo.micro_batches * plan.batch_size
    lines = [f"{plan.model}: schedule {result.schedule}, global batch {samples} = {topo.micro_batches} micro-batches "
             f"x {plan.batch_size} samples, {topo.world_size} workers; simulated {result.steps} steps "
             f"(steady state measured over {result.window[1] - result.window[0]:.2f} ms)", "",
             table(["stage", "ranks", "replicas", "fwd ms", "bwd ms", "send ms", "allreduce ms", "utilisation"], rows),
             "",
             f"predicted step time: {result.step_ms:.2f} ms ({1000 * samples / result.step_ms:.1f} samples/s)"
             if result.step_ms > 0 else "predicted step time: 0 ms"]
    if plan.predicted_step_ms > 0 and result.step_ms > 0 and (result.schedule == plan.schedule
                                                             and topo.micro_batches == plan.micro_batches):
        diff = 100 * (plan.predicted_step_ms - result.step_ms) / result.step_ms
        lines.append(f"partitioner's prediction: {plan.predicted_step_ms:.2f} ms ({diff:+.1f}% vs simulated)")
    return "\n".join(lines)
