#!/usr/bin/env bash
# `make demo`: a small byte-level GPT learns Python from the standard library's own sources, on 4
# worker processes, with a hybrid plan the partitioner itself picks as the fastest.
#
#   1. profile gpt[layers=4,width=128,heads=4,seq=64,vocab=256] at 8 samples per micro-batch;
#   2. partition it (strategy optimal) for examples/clusters/demo-2x2-slow.json: 2 hosts x 2 workers,
#      10 Gbit/s inside a host, 50 Mbit/s between them. Syncing every weight across that link costs
#      more than sending the activations at one cut, so the partitioner picks a hybrid plan (stages
#      on different hosts, replicas inside a host); the demo checks that and prints the prediction
#      against pure data parallelism. The workers then run on this machine, as the plan places them;
#   3. train with hybridpipe.launch (a thin client of the Python API, hybridpipe.Trainer): Adam,
#      cosine learning-rate schedule with warm-up, clipping at global norm 1, shuffled samples of
#      Lib/**/*.py (95% of the files), held-out loss on the other 5% every EVAL_EVERY steps;
#   4. the timeline and the loss curve as PNGs.
#
# Environment: PY (default .venv/bin/python), OUT (default out/demo), STEPS (default 200),
# EVAL_EVERY (default 20). About 2 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
OUT=${OUT:-out/demo}
STEPS=${STEPS:-200}
EVAL_EVERY=${EVAL_EVERY:-20}
MODEL="gpt[layers=4,width=128,heads=4,seq=64,vocab=256]"
CLUSTER=examples/clusters/demo-2x2-slow.json
DATA="hybridpipe.profiles.corpus:python_stdlib[seq=64]"
HELD_OUT="hybridpipe.profiles.corpus:python_stdlib[split=held-out,seq=64]"
HP=("$PY" -m hybridpipe.cli)
mkdir -p "$OUT"
start=$(date +%s)

echo "== 1/4 profile $MODEL (8 samples per micro-batch, one thread like each worker)"
OMP_NUM_THREADS=1 "${HP[@]}" profile "$MODEL" --batch-size 8 --repeats 3 --quiet -o "$OUT/profile.json"

echo
echo "== 2/4 partition for $CLUSTER (the partitioner's own choice; every other strategy compared)"
"${HP[@]}" partition "$OUT/profile.json" --cluster "$CLUSTER" --optimizer adam --micro-batches 4 --compare \
    -o "$OUT/plan.json"
"${HP[@]}" partition "$OUT/profile.json" --cluster "$CLUSTER" --optimizer adam --micro-batches 4 --strategy dp \
    -o "$OUT/plan-dp.json" > /dev/null
"$PY" - "$OUT/plan.json" "$OUT/plan-dp.json" <<'PYEOF'
import json, sys
plan, dp = (json.load(open(p)) for p in sys.argv[1:3])
shape = " + ".join(f"{len(s['ranks'])}" for s in plan["stages"])
hybrid = len(plan["stages"]) >= 2 and any(len(s["ranks"]) > 1 for s in plan["stages"])
print(f"  the partitioner chose {len(plan['stages'])} stages with {shape} replicas: "
      f"{'a hybrid plan' if hybrid else 'NOT a hybrid plan'}, predicted {plan['predicted_step_ms']:.0f} ms/step "
      f"vs {dp['predicted_step_ms']:.0f} ms for pure data parallelism "
      f"({dp['predicted_step_ms'] / plan['predicted_step_ms']:.2f}x slower)")
sys.exit(0 if hybrid else 1)
PYEOF

echo
echo "== 3/4 train: torchrun --standalone --nproc-per-node 4 -m hybridpipe.launch --plan $OUT/plan.json --steps $STEPS ..."
rm -rf "$OUT/run" "$OUT/checkpoints"
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 -m hybridpipe.launch \
    --plan "$OUT/plan.json" --steps "$STEPS" --optimizer adam --lr 0.003 --lr-schedule cosine --warmup-steps 10 \
    --clip-grad-norm 1.0 --dataset "$DATA" --shuffle --eval-dataset "$HELD_OUT" --eval-every "$EVAL_EVERY" \
    --eval-batches 4 --run-dir "$OUT/run" --checkpoint-dir "$OUT/checkpoints" --timeout 120
echo "  held-out loss (nats per byte) after each evaluation:"
"$PY" - "$OUT/run" <<'PYEOF'
import json, sys, pathlib
rows = [json.loads(l) for l in (pathlib.Path(sys.argv[1]) / "metrics" / "rank-00000.jsonl").read_text().splitlines()]
held = [(r["step"] + 1, r["eval_loss"]) for r in rows if "eval_loss" in r]
print("   ", "  ".join(f"step {s}: {v:.3f}" for s, v in held))
PYEOF

echo
echo "== 4/4 timeline and loss curve (open the JSON in https://ui.perfetto.dev)"
"${HP[@]}" timeline "$OUT/run" -o "$OUT/run/timeline.json" --png "$OUT/run/timeline.png"
"$PY" examples/plot_loss.py "$OUT/run" -o "$OUT/run/loss.png" --title "$MODEL on Lib/**/*.py, plan $OUT/plan.json"

echo
echo "demo done in $(( $(date +%s) - start )) s; everything is under $OUT/"
