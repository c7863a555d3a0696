#!/usr/bin/env bash
# For a GPU host: the lossless tests on CUDA, then a short benchmark and a batch sweep, in one call of a few minutes;
# then the hybrid and sliding-window presets (qwen3.5-4b, gpt-oss-20b) where their files are in the hub cache
# (elsewhere each says in one line what to download).
# Results go to ${OUT:-gpu-out}/. Assumes torch with CUDA is already installed in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out}"
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python -m pip install -q -r <(grep -v '^torch==' requirements.txt) 2>&1 | tail -2 || true
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
SPECFLASH_TEST_DEVICE=cuda timeout 300 python -m pytest -q -m "not slow" tests/test_gpu.py 2>&1 | tee "$out/lossless.txt"
timeout 200 python -m specflash bench --model smollm2-135m --device cuda --methods ar,pld,hf-pld,dflash,ptd \
  --prompts-per-domain 2 --max-new-tokens 96 --repeats 3 --out "$out/bench.json" 2>&1 | tee "$out/bench.txt"
timeout 200 python -m specflash bench --model smollm2-135m --device cuda --methods ar,dflash,adaflash,adaflash:head \
  --batch-sizes 1,4,16,32 --prompts-per-domain 2 --max-new-tokens 64 --repeats 3 --out "$out/bench-batch.json" 2>&1 \
  | tee "$out/bench-batch.txt"
for preset in qwen3.5-4b gpt-oss-20b; do
  timeout 300 python -m specflash bench --model "$preset" --device cuda --methods ar,pld,dflash \
    --prompts-per-domain 1 --max-new-tokens 64 --repeats 1 --out "$out/bench-$preset.json" 2>&1 \
    | tee "$out/bench-$preset.txt" || true
done
