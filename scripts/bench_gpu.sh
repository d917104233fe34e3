#!/usr/bin/env bash
# The H200 benchmark set behind the GPU figures in benchmarks/README.md: mlx-lm's trainer against mlxft on
# the anchor workload (bf16, LoRA r8 on all linears, B=8, T=512 fixed rows) and on chat SFT
# with variable lengths (rows of 128-512 tokens), each with and without mlxft's
# --grad-checkpoint --loss-chunk 512, then chat at several seeds (adapter init and batch order),
# and, given SMOLLM2_DIR (a SmolLM2-135M-Instruct directory), the built-in capitals task at
# several seeds. Both trainers' processes get the CUDA graph cap mlxft sets on import (mlxft's
# checkpointed runs lower their own to 50M). Results: JSON files in $1.
set -euo pipefail
out=${1:-benchmarks}
mkdir -p "$out"
common=(--dtype bfloat16 --batch-size 8 --rows 128)
fixed=(--workload chat --fixed-length 512 --steps 30 --warmup 10)
chat=(--workload chat --max-len 512 --steps 100 --warmup 20)
for model in ${MODELS:-lfm2-1.2b llama-3.2-1b}; do
  python3 scripts/bench.py --model config:$model "${common[@]}" "${chat[@]}" --out "$out/bench-$model-chat-cap200.json"
  python3 scripts/bench.py --model config:$model "${common[@]}" "${fixed[@]}" --out "$out/bench-$model-fixed512-cap200.json"
  python3 scripts/bench.py --model config:$model "${common[@]}" "${chat[@]}" --grad-checkpoint --loss-chunk 512 \
    --out "$out/bench-$model-chat-ckpt-chunk512.json"
  python3 scripts/bench.py --model config:$model "${common[@]}" "${fixed[@]}" --grad-checkpoint --loss-chunk 512 \
    --out "$out/bench-$model-fixed512-ckpt-chunk512.json"
done
for model in ${MODELS:-lfm2-1.2b llama-3.2-1b}; do
  for seed in ${SEEDS:-0 1 2}; do
    python3 scripts/bench.py --model config:$model "${common[@]}" "${chat[@]}" --seed $seed \
      --out "$out/bench-$model-chat-seed$seed.json"
  done
done
if [ -n "${SMOLLM2_DIR:-}" ]; then
  for seed in ${SEEDS:-0 1 2}; do
    python3 scripts/bench.py --model "$SMOLLM2_DIR" --data builtin:capitals --batch-size 4 --steps 60 --warmup 10 \
      --lr 2e-4 --mlx-lm-loss fixed --seed $seed --out "$out/bench-smollm2-135m-instruct-capitals-h200-seed$seed.json"
  done
fi
