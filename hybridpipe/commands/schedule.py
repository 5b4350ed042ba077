"""``hybridpipe schedule PLAN``: print (or draw) the instruction lists every rank runs in a step.

One line per rank in a compact notation (``F3`` forward of micro-batch 3, ``B3`` its backward
(``Bi3`` / ``W3`` the input and weight halves of a split backward, zb-h1),
``<a3@1`` receive its activations from rank 1, ``>g3@0`` send its gradients to rank 0, ``sync3``
the backward that starts the all-reduce, ``wait`` its end, ``step(x0.25)`` the optimizer step
with the gradient scale); ``--rank R`` lists one rank's instructions in full. pipedream's lists
differ while the pipeline fills and when it drains, so its warm-up, steady and draining steps
are shown. ``--png`` draws the schedule's timeline (simulated with the plan's stage times, or
with forward 1 / backward 2 when the plan has none).
"""

from __future__ import annotations

import argparse
import textwrap

from hybridpipe.argtypes import nonneg_int, output_file, positive_int
from hybridpipe.commands.simulate import check_simulation_size
from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import load_plan
from hybridpipe.partitioner.plan_options import add_micro_batches_option, add_schedule_option
from hybridpipe.partitioner.schedule_registry import Schedule, get_schedule
from hybridpipe.pipeline.instructions import short
from hybridpipe.pipeline.schedules import Topology, check_schedulable, rank_program, settle_phase
from hybridpipe.pipeline.simtrace import draw_timeline
from hybridpipe.pipeline.simulator import StageCosts, simulate_topology, stage_costs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", help="a plan file written by `hybridpipe partition`")
    parser.add_argument("--rank", type=nonneg_int, metavar="R", help="list only this rank's instructions, one per line")
    add_schedule_option(parser)
    add_micro_batches_option(parser)
    parser.add_argument("--png", type=output_file, metavar="FILE", help="draw the schedule (simulated timeline)")
    parser.add_argument("--steps", type=positive_int, default=None, metavar="N", help="steps to draw with --png")


def steps_to_show(topo: Topology, schedule: Schedule) -> list[tuple[str, int, bool]]:
    """(title, phase, drain) of the distinct lists a schedule uses."""
    if schedule.flushed:
        return [("every step", 0, True)]
    settle = settle_phase(topo, schedule)
    shown = [("first step after a start (the pipeline fills)", 0, False)]
    shown += [(f"step {p} after a start", p, False) for p in range(1, settle)]
    shown += [("steady step", settle, False), ("draining step (last, or before a checkpoint)", settle, True)]
    return shown


def run(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    schedule = get_schedule(args.schedule or plan.schedule)
    topo = Topology(tuple(tuple(s.ranks) for s in plan.stages), args.micro_batches or plan.micro_batches)
    check_simulation_size(topo, args.steps if args.png else 1, "listing" if not args.png else "drawing")
    check_schedulable(topo, schedule)
    ranks = [r for rs in topo.groups for r in rs]
    if args.rank is not None and args.rank not in ranks:
        raise UserError(f"rank {args.rank} is not in the plan (ranks 0..{topo.world_size - 1})")
    chunks = f" ({topo.virtual_stages} model chunks per rank)" if topo.virtual_stages > 1 else ""
    print(f"{plan.model}: schedule {schedule.name}, {topo.micro_batches} micro-batches per step, "
          f"{topo.n_stages} stages{chunks}, {topo.world_size} ranks")
    for title, phase, drain in steps_to_show(topo, schedule):
        print(f"\n{title}:")
        for r in ([args.rank] if args.rank is not None else ranks):
            stages = topo.stages_of(r)
            prog = rank_program(topo, r, schedule, phase=phase, drain=drain)
            where = f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"
            head = f"rank {r} ({where}, replica {topo.replica_of(r)})"
            if args.rank is not None:
                print(head + ":")
                print("\n".join(f"  {i:3d}  {ins}" for i, ins in enumerate(prog)))
            else:
                text = " ".join(short(x, stages=len(stages) > 1) for x in prog)
                print(textwrap.fill(text, width=120, initial_indent=f"{head}: ",
                                    subsequent_indent=" " * 4))
    if args.png:
        costs = stage_costs(plan)
        if all(c.forward_ms == 0 and c.backward_ms == 0 for c in costs):
            costs = [StageCosts(1.0, 2.0, 0.0, 0, ()) for _ in costs]
        result = simulate_topology(topo, schedule, costs, steps=args.steps)
        path = draw_timeline(result, topo, args.png,
                             title=f"{plan.model}: {schedule.name}, {topo.micro_batches} micro-batches")
        print(f"\npicture: {path}")
    return 0
