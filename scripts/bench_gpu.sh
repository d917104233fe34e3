#!/usr/bin/env bash
# The H200 benchmark set behind the README's GPU figures: mlx-lm's trainer against mlxft on
# the anchor workload (bf16, LoRA r8 on all linears, B=8, T=512 fixed rows) and on chat SFT
# with variable lengths, plus mlxft's levers one at a time. Results: JSON files in $1.
set -euo pipefail
out=${1:-benchmarks}
mkdir -p "$out"
common=(--dtype bfloat16 --batch-size 8 --rows 128 --steps 30 --warmup 10)
for model in ${MODELS:-lfm2-1.2b llama-3.2-1b}; do
  python3 scripts/bench.py --model config:$model "${common[@]}" --workload chat --fixed-length 512 \
    --out "$out/bench-$model-fixed512.json"
  python3 scripts/bench.py --model config:$model "${common[@]}" --workload chat --max-len 512 --pack \
    --out "$out/bench-$model-chat-packed.json"
  python3 scripts/bench.py --model config:$model "${common[@]}" --workload chat --fixed-length 512 \
    --grad-checkpoint --only mlxft | sed "s/^RESULT /RESULT grad-checkpoint $model /"
  python3 scripts/bench.py --model config:$model "${common[@]}" --workload chat --fixed-length 512 \
    --lora-float32 --only mlxft | sed "s/^RESULT /RESULT lora-float32 $model /"
  python3 scripts/bench.py --model config:$model "${common[@]}" --workload chat --fixed-length 512 \
    --clear-cache-above 0 --only mlxft | sed "s/^RESULT /RESULT clear-cache $model /"
done
