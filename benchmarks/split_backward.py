"""zb-h1's split backward vs a plain backward: the compute each costs on one stage, one thread.

    python benchmarks/split_backward.py                # GPT-2 12 x 256 (vocabulary 8192), stage 1 of 4
    python benchmarks/split_backward.py --stage 2 --repeats 20

The model is captured and cut into ``--ranges`` (block ranges; default the compute-balanced cut of
the GPT-2 runs in RESULTS.md); stage ``--stage``'s forward runs on the previous stages' output and
is then backpropagated three ways, alternating: ``PipelineStage.backward`` (one autograd pass),
hybridpipe's ``backward_input`` + ``backward_weight`` (zb-h1's B and W), and torch's own
``stage_backward_input`` + ``stage_backward_weight`` (``torch.distributed.pipelining._backward``).
Thread CPU time (``time.thread_time``) and the thread's minor page faults (the allocator mapping
fresh memory), median of ``--repeats``. ``--compare-with FILE``: a fourth way, alternating with
the others, an older ``splitback.py`` (e.g. ``git show 5bfd261:hybridpipe/pipeline/splitback.py >
/tmp/old_splitback.py``) on the same stage. Results: ``benchmarks/results/split_backward[_TAG].json``
and ``.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import machine, pyplot, result_paths, setup_logging, write_results  # noqa: E402
from hybridpipe.pipeline import build_stage_index  # noqa: E402
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


def measure(model: str, ranges: list[tuple[int, int]], index: int, batch: int, repeats: int,
            compare_with: str | None = None) -> dict[str, float]:
    """Milliseconds of thread CPU: plain backward, our input and weight halves, torch's (and an
    older splitback's); minor page faults per backward."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

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

    def run(way: str) -> tuple[float, float, int]:
        act = st.forward(inputs)
        grads = {k: torch.ones_like(v) for k, v in act.outputs.items()}
        params = list(st.module.parameters())
        f0 = _faults()
        t0 = time.thread_time()
        if way == "plain":
            st.backward(act, grads)
            t1 = time.thread_time()
        elif way == "ours":
            _, work = st.backward_input(act, grads)
            t1 = time.thread_time()
            st.backward_weight(work)
        elif way == "older":
            assert older is not None
            outs, out_grads = st._roots(act, grads)
            work = older.backward_input(outs, out_grads, list(act.inputs.values()), params)
            t1 = time.thread_time()
            older.backward_weight(work)
        else:
            outs = list(act.outputs.values())
            _, groups = stage_backward_input(outs, [grads[k] for k in act.outputs],
                                             [t for t in act.inputs.values() if t.requires_grad], iter(params))
            t1 = time.thread_time()
            stage_backward_weight(iter(params), groups)
        t2 = time.thread_time()
        faults = _faults() - f0
        for p in params:
            p.grad = None
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3, faults
    ways = ("plain", "ours", "torch") + (("older",) if older else ())
    for way in ways:                                    # warm-up
        run(way)
    got: dict[str, list] = {w: [] for w in ways}
    for _ in range(repeats):
        for way in ways:
            got[way].append(run(way))
    med = {w: (statistics.median(a for a, _, _ in v), statistics.median(b for _, b, _ in v),
               statistics.median(a + b for a, b, _ in v), statistics.median(f for _, _, f in v))
           for w, v in got.items()}
    out = {f"{w}_faults": med[w][3] for w in ways}
    for w in ways[1:]:
        out.update({f"{w}_input_ms": med[w][0], f"{w}_weight_ms": med[w][1], f"{w}_ms": med[w][2],
                    f"{w}_vs_plain": med[w][2] / med["plain"][2]})
    return {"plain_ms": med["plain"][2], **out}


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
    a = p.parse_args(argv)
    if a.compare_with and not Path(a.compare_with).is_file():
        p.error(f"--compare-with {a.compare_with}: no such file (give a saved splitback.py, e.g. "
                "git show REV:hybridpipe/pipeline/splitback.py > old.py)")
    setup_logging(False)
    ranges = [(int(r.split("-")[0]), int(r.split("-")[1])) for r in a.ranges.split(",")]
    got = measure(a.model, ranges, a.stage, a.batch_size, a.repeats, a.compare_with)
    result = {"benchmark": "split_backward", "machine": machine(), "command": " ".join(sys.argv), "model": a.model,
              "ranges": ranges, "stage": a.stage, "batch_size": a.batch_size, "repeats": a.repeats, **got}
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
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
