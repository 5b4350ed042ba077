#!/usr/bin/env bash
# `make demo-alexnet`: the old demo: hybridpipe's three steps on AlexNet (synthetic data, random labels).
#
#   1. profile alexnet-small (CIFAR-sized AlexNet) at 16 samples per micro-batch;
#   2. partition it for examples/clusters/local4.json into a HYBRID plan: 2 stages x 2 replicas.
#      (For a model this small on one machine the optimal plan is plain data parallelism: its
#      2.2 MiB of gradients sync in about a millisecond over loopback. The demo asks for
#      `--strategy params --stages 2` so that it shows both pipelining and replica sync; the
#      partitioner prints how data parallelism would compare.)
#   3. train 60 steps (over 256 synthetic samples) with `torchrun --standalone --nproc-per-node 4 -m hybridpipe.launch`, then merge the
#      ranks' timelines.
#
# Environment: PY (python with hybridpipe installed, default .venv/bin/python), OUT (default
# out/demo), STEPS (default 60). Takes about 1-2 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
OUT=${OUT:-out/demo-alexnet}
STEPS=${STEPS:-60}
HP=("$PY" -m hybridpipe.cli)
mkdir -p "$OUT"
start=$(date +%s)

echo "== 1/4 profile alexnet-small (16 samples per micro-batch, one thread like each worker)"
OMP_NUM_THREADS=1 "${HP[@]}" profile alexnet-small --batch-size 16 --repeats 3 --quiet -o "$OUT/profile.json"

echo
echo "== 2/4 partition for 4 local workers (examples/clusters/local4.json): 2 stages x 2 replicas"
"${HP[@]}" partition "$OUT/profile.json" --cluster examples/clusters/local4.json \
    --strategy params --stages 2 --micro-batches 4 -o "$OUT/plan.json"

echo
echo "== 3/4 train: torchrun --standalone --nproc-per-node 4 -m hybridpipe.launch --plan $OUT/plan.json --steps $STEPS"
rm -rf "$OUT/run" "$OUT/checkpoints"
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 -m hybridpipe.launch \
    --plan "$OUT/plan.json" --steps "$STEPS" --lr 0.05 --dataset-size 256 \
    --run-dir "$OUT/run" --checkpoint-dir "$OUT/checkpoints" --timeout 120
echo "  final checkpoint: $OUT/checkpoints/ (one state_dict: \`hybridpipe merge-checkpoint $OUT/checkpoints -o model.pt\`)"

echo
echo "== 4/4 timeline of the last steps (open the JSON in https://ui.perfetto.dev)"
"${HP[@]}" timeline "$OUT/run" -o "$OUT/run/timeline.json" --png "$OUT/run/timeline.png"

echo
echo "demo done in $(( $(date +%s) - start )) s; everything is under $OUT/"
