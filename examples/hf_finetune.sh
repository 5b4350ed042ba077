#!/usr/bin/env bash
# A Hugging Face model in and out: a saved model is fine-tuned on a pipeline, exported in
# Hugging Face format, loaded back with from_pretrained and asked to generate text.
#
#   1. save a tiny GPT-2 with random weights and its tokenizer (save_pretrained) into OUT/pretrained:
#      it stands in for a model you downloaded (examples/hf_text.py);
#   2. profile hf:OUT/pretrained and partition it for 4 workers: 2 stages x 2 replicas, the tied
#      embedding and the LM head in different stages;
#   3. fine-tune on the Zen of Python with hybridpipe.launch on 4 processes (torchrun): every rank
#      reads only its own stage's weights from the safetensors file; AdamW;
#   4. merge-checkpoint --format hf: what save_pretrained writes (config.json, generation_config.json,
#      model.safetensors, the tokenizer files);
#   5. AutoModelForCausalLM.from_pretrained (strictly: no missing or unexpected keys) and generate.
#
# Environment: PY (default .venv/bin/python), OUT (default out/hf-finetune), STEPS (default 60),
# PROMPT (default "Beautiful is"). About a minute on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
OUT=${OUT:-out/hf-finetune}
STEPS=${STEPS:-60}
PROMPT=${PROMPT:-Beautiful is}
HP=("$PY" -m hybridpipe.cli)
MODEL="hf:$OUT/pretrained[seq=32]"
DATA="examples.hf_text:windows[tokenizer=$OUT/pretrained,seq=32]"
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
rm -rf "$OUT"
mkdir -p "$OUT"

echo "== 1/5 a saved model to start from: $OUT/pretrained"
"$PY" examples/hf_text.py save "$OUT/pretrained"
echo "   before fine-tuning: $("$PY" examples/hf_text.py generate "$OUT/pretrained" --prompt "$PROMPT" --tokens 16)"

echo
echo "== 2/5 profile $MODEL and partition it: 2 stages x 2 replicas"
"${HP[@]}" profile "$MODEL" --batch-size 4 --repeats 1 --quiet -o "$OUT/profile.json"
"${HP[@]}" partition "$OUT/profile.json" --cluster examples/clusters/4x1gbit.json --strategy params --stages 2 \
    --optimizer adamw --micro-batches 4 -o "$OUT/plan.json" --quiet

echo
echo "== 3/5 fine-tune: torchrun --nproc-per-node 4 -m hybridpipe.launch --plan $OUT/plan.json --steps $STEPS ..."
"$PY" -m torch.distributed.run --standalone --nproc-per-node 4 -m hybridpipe.launch \
    --plan "$OUT/plan.json" --steps "$STEPS" --optimizer adamw --lr 0.003 --weight-decay 0.01 \
    --dataset "$DATA" --shuffle --checkpoint-dir "$OUT/checkpoints" --run-dir "$OUT/run" --no-progress \
    --no-trace --timeout 120

echo
echo "== 4/5 export: hybridpipe merge-checkpoint $OUT/checkpoints --format hf -o $OUT/finetuned"
"${HP[@]}" merge-checkpoint "$OUT/checkpoints" --format hf -o "$OUT/finetuned"

echo
echo "== 5/5 AutoModelForCausalLM.from_pretrained($OUT/finetuned) generates:"
"$PY" examples/hf_text.py generate "$OUT/finetuned" --prompt "$PROMPT"
