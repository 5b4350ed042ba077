"""zb-h1's split backward vs a plain backward: the compute each costs on one stage, one thread.

    python benchmarks/split_backward.py                # GPT-2 12 x 256 (vocabulary 8192), stage 1 of 4
    python benchmarks/split_backward.py --stage 2 --repeats 20

The model is captured and cut into ``--ranges`` (block ranges; default the compute-balanced cut of
the GPT-2 runs in RESULTS.md); stage ``--stage``'s forward runs on the previous stages' output and
is then backpropagated three ways, alternating in ABBA order: ``PipelineStage.backward`` (one
autograd pass), hybridpipe's ``backward_input`` + ``backward_weight`` (zb-h1's B and W), and
torch's own ``stage_backward_input`` + ``stage_backward_weight``
(``torch.distributed.pipelining._backward``). Thread CPU time (``time.thread_time``) and the
thread's minor page faults (the allocator mapping fresh memory) per micro-batch, median of
``--repeats``; ``--order pipeline``: over one step of ``--micro-batches`` in each way's schedule's
order on this stage (1f1b's for the plain backward, zb-h1's for the splits: its micro-batches in
flight, each W after the next micro-batch's B), the gradients accumulated over the step. Also,
load-independent: each way's aten ops per half of one micro-batch and the bytes held between its
halves. ``--compare-with FILE``: a fourth way, an older ``splitback.py`` (e.g. ``git show
5bfd261:hybridpipe/pipeline/splitback.py > /tmp/old_splitback.py``) on the same stage, called as
the stage calls ours (its own cut plans where it keeps them). Results:
``benchmarks/results/split_backward[_TAG].json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import machine, pyplot, result_paths, setup_logging, write_results  # noqa: E402
from hybridpipe.pipeline import build_stage_index  # noqa: E402
from hybridpipe.pipeline.splitplan import SplitPlans  # noqa: E402
from hybridpipe.profiles.capture import capture_model  # noqa: E402
from hybridpipe.profiles.zoo import resolve_model  # noqa: E402

GPT2 = "hf:gpt2[n_layer=12,n_embd=256,n_head=4,vocab_size=8192,seq=128,dropout=0]"


def _module(path: str):
    """A ``splitback.py`` loaded from ``path`` (an older version, to time beside this one)."""
    spec = importlib.util.spec_from_file_location("splitback_compared", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _halves(st, way: str, older) -> tuple[Callable, Callable | None]:
    """``way``'s backward of one micro-batch on stage ``st`` as (first half (act, grads) -> what the
    second needs, second half or None): plain, ours (B, W), torch's own split, an older splitback."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    params = list(st.module.parameters())
    if way == "plain":
        return st.backward, None
    if way == "ours":
        return (lambda act, grads: st.backward_input(act, grads)[1]), st.backward_weight
    if way == "older":
        # its own cut plans where it keeps them (splitplan.py, since splitc), as the stage keeps ours
        kept = {"plans": SplitPlans()} if "plans" in inspect.signature(older.backward_input).parameters else {}

        def first(act, grads):          # as PipelineStage.backward_input calls ours
            outs, out_grads = st._roots(act, grads, None)
            return older.backward_input(outs, out_grads, list(act.inputs.values()), list(st.module.parameters()),
                                        **kept)
        return first, older.backward_weight

    def torch_first(act, grads):
        outs = list(act.outputs.values())
        return stage_backward_input(outs, [grads[k] for k in act.outputs],
                                    [t for t in act.inputs.values() if t.requires_grad], iter(params))[1]
    return torch_first, lambda groups: stage_backward_weight(iter(params), groups)


def _order(way: str, order: str, stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """The ops one step runs on ``stage``: ``single``: F, B, W of one micro-batch at a time;
    ``pipeline``: the schedule's own order (a plain backward: 1f1b's; a split one: zb-h1's, its W
    of a micro-batch after the next one's B, with 1f1b's micro-batches in flight)."""
    from hybridpipe.partitioner.schedule_registry import one_f_one_b_ops, zb_h1_ops

    mine = list(range(micro_batches))
    if order == "single":
        return [(op, m) for m in mine for op in ("F", "B", "W")]
    warm = stages - stage                   # Topology.warm / defer with one replica a stage
    if way == "plain":
        return list(one_f_one_b_ops(mine, warm))
    return list(zb_h1_ops(mine, warm, stages - warm))


def _step(st, inputs, first: Callable, second: Callable | None, ops: list[tuple[str, int]]) -> tuple[float, float, int]:
    """One step's ``ops``: thread CPU ms of the first and second halves and minor faults, per micro-batch
    (the forwards not counted); gradients accumulate over the step, as a flushed schedule's do."""
    acts: dict[int, object] = {}
    owed: dict[int, object] = {}
    spent = [0.0, 0.0]
    faults = 0
    for op, m in ops:
        if op == "F":
            acts[m] = st.forward(inputs)
            continue
        if op == "W" and second is None:
            continue
        act = acts[m]
        grads = {k: torch.ones_like(v) for k, v in act.outputs.items()} if op == "B" else {}
        f0, t0 = _faults(), time.thread_time()
        if op == "B":
            owed[m] = first(act, grads)
        else:
            second(owed.pop(m))
        spent[op == "W"] += time.thread_time() - t0
        faults += _faults() - f0
        if op == "W" or second is None:
            del acts[m]
    n = len({m for _, m in ops})
    for p in st.module.parameters():
        p.grad = None
    return spent[0] * 1e3 / n, spent[1] * 1e3 / n, faults // n


def _counts(st, inputs, first: Callable, second: Callable | None) -> dict[str, object]:
    """Load-independent: the aten ops each half of one micro-batch runs, and the bytes (by storage)
    the first half leaves for the second (what it holds and recorded, ``WeightWork``)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))
    act = st.forward(inputs)
    grads = {k: torch.ones_like(v) for k, v in act.outputs.items()}
    with Count() as b:
        work = first(act, grads)
    held = None                 # the plain backward holds nothing; torch's split keeps the graph (not counted)
    if hasattr(work, "held"):
        held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (*work.held(), *work.recorded())}.values())
    out: dict[str, object] = {"first_ops": dict(b.ops), "held_bytes": held}
    if second is not None:
        with Count() as w:
            second(work)
        out["second_ops"] = dict(w.ops)
    for p in st.module.parameters():
        p.grad = None
    return out


def measure(model: str, ranges: list[tuple[int, int]], index: int, batch: int, repeats: int,
            compare_with: str | None = None, order: str = "single", micro_batches: int = 8) -> dict[str, object]:
    """Milliseconds of thread CPU per micro-batch: plain backward, our input and weight halves, torch's
    (and an older splitback's), each way in ``order`` (:func:`_order`); minor page faults per
    micro-batch; each way's aten ops per half and bytes held between them (:func:`_counts`)."""
    torch.set_num_threads(1)
    spec = resolve_model(model)
    x = spec.example_input(batch, torch.Generator().manual_seed(0))
    captured = capture_model(spec.build(), x, leaf_modules=spec.leaf_modules)
    stages = [build_stage_index(captured, ranges, i, loss=spec.loss) for i in range(index + 1)]
    inputs = stages[0].data_inputs(x)
    for st in stages[:-1]:
        inputs = {k: v.detach() for k, v in st.forward(inputs).outputs.items()}
    st = stages[-1]
    if st.is_last:
        raise SystemExit("pick a stage before the last (its backward starts from the loss, not from gradients)")
    older = _module(compare_with) if compare_with else None
    ways = ("plain", "ours", "torch") + (("older",) if older else ())
    halves = {w: _halves(st, w, older) for w in ways}
    ops = {w: _order(w, order, len(ranges), index, micro_batches if order == "pipeline" else 1) for w in ways}
    for way in ways:                                    # warm-up (the cut plans made)
        _step(st, inputs, *halves[way], ops[way])
    counts = {w: _counts(st, inputs, *halves[w]) for w in ways}
    got: dict[str, list] = {w: [] for w in ways}
    for r in range(repeats):                            # ABBA: each way after the one before and after it
        for way in ways if r % 2 == 0 else ways[::-1]:
            got[way].append(_step(st, inputs, *halves[way], ops[way]))
    med = {w: (statistics.median(a for a, _, _ in v), statistics.median(b for _, b, _ in v),
               statistics.median(a + b for a, b, _ in v), statistics.median(f for _, _, f in v))
           for w, v in got.items()}
    out: dict[str, object] = {f"{w}_faults": med[w][3] for w in ways}
    for w in ways[1:]:
        out.update({f"{w}_input_ms": med[w][0], f"{w}_weight_ms": med[w][1], f"{w}_ms": med[w][2],
                    f"{w}_vs_plain": med[w][2] / med["plain"][2]})
    return {"plain_ms": med["plain"][2], **out, "counts": counts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=GPT2)
    p.add_argument("--ranges", default="0-5,6-9,10-13,14-16", help="the stages' block ranges")
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out-dir")
    p.add_argument("--tag", default="")
    p.add_argument("--compare-with", help="an older splitback.py, timed as a fourth way")
    p.add_argument("--order", choices=("single", "pipeline"), default="single",
                   help="single: each micro-batch's F, B, W in turn; pipeline: one step of 1f1b's order "
                        "(plain) and zb-h1's (the splits) on this stage of the --ranges pipeline")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches a step (--order pipeline)")
    a = p.parse_args(argv)
    if a.compare_with and not Path(a.compare_with).is_file():
        p.error(f"--compare-with {a.compare_with}: no such file (give a saved splitback.py, e.g. "
                "git show REV:hybridpipe/pipeline/splitback.py > old.py)")
    setup_logging(False)
    ranges = [(int(r.split("-")[0]), int(r.split("-")[1])) for r in a.ranges.split(",")]
    got = measure(a.model, ranges, a.stage, a.batch_size, a.repeats, a.compare_with, a.order, a.micro_batches)
    result = {"benchmark": "split_backward", "machine": machine(), "command": " ".join(sys.argv), "model": a.model,
              "ranges": ranges, "stage": a.stage, "batch_size": a.batch_size, "repeats": a.repeats,
              "order": a.order, "micro_batches": a.micro_batches if a.order == "pipeline" else 1, **got}
    json_path, png_path = result_paths("split_backward" + (f"_{a.tag}" if a.tag else ""), False, a.out_dir)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar([0], [got["plain_ms"]], color="#7f7f7f", label="plain backward")
    for i, who in ((1, "ours"), (2, "torch")):
        ax.bar([i], [got[f"{who}_input_ms"]], color="#1f77b4", label="input half" if i == 1 else None)
        ax.bar([i], [got[f"{who}_weight_ms"]], bottom=[got[f"{who}_input_ms"]], color="#ff7f0e",
               label="weight half" if i == 1 else None)
    ax.set_xticks([0, 1, 2], ["plain", "hybridpipe split", "torch split"])
    ax.set_ylabel("thread CPU ms per micro-batch")
    ax.set_title(f"stage {a.stage}: split / plain = {got['ours_vs_plain']:.2f}x (torch {got['torch_vs_plain']:.2f}x)",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    write_results(json_path, result, fig, png_path)
    print(f"plain {got['plain_ms']:.1f} ms; ours {got['ours_input_ms']:.1f} + {got['ours_weight_ms']:.1f} = "
          f"{got['ours_ms']:.1f} ms ({got['ours_vs_plain']:.2f}x); torch {got['torch_input_ms']:.1f} + "
          f"{got['torch_weight_ms']:.1f} = {got['torch_ms']:.1f} ms ({got['torch_vs_plain']:.2f}x); minor faults "
          f"plain {got['plain_faults']:.0f}, ours {got['ours_faults']:.0f}, torch {got['torch_faults']:.0f}")
    if a.compare_with:
        print(f"older ({a.compare_with}) {got['older_input_ms']:.1f} + {got['older_weight_ms']:.1f} = "
              f"{got['older_ms']:.1f} ms ({got['older_vs_plain']:.2f}x), faults {got['older_faults']:.0f}")
    for w, c in got["counts"].items():
        ln = [c.get(k, {}).get("native_layer_norm_backward", 0) for k in ("first_ops", "second_ops")]
        print(f"{w}: aten ops {sum(c['first_ops'].values())} + {sum(c.get('second_ops', {}).values())}, "
              f"layer norm backward {ln[0]} + {ln[1]}"
              + ("" if c["held_bytes"] is None else f", held between the halves {c['held_bytes'] / 2**20:.1f} MiB"))
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
