#!/usr/bin/env bash
# mlxft's memory levers on the H200 anchor workload (bf16, LoRA r8 on all linears, B=8,
# T=512 fixed rows), one process per variant, with mlx-lm's trainer once as the reference.
# VARIANTS (one per line: a tag, then MLX variables such as MLX_MAX_MB_PER_BUFFER=25 and bench.py
# flags) picks the set; results go to $1.
set -euo pipefail
out=${1:-benchmarks}
mkdir -p "$out"
common=(--dtype bfloat16 --batch-size 8 --rows 128 --steps 30 --warmup 10 --workload chat --fixed-length 512)
default_variants='default
memory-limit-10 --memory-limit 10
ckpt --grad-checkpoint
ckpt-memory-limit-6 --grad-checkpoint --memory-limit 6
ckpt-clear-cache --grad-checkpoint --clear-cache-above 0
loss-chunk-1024 --loss-chunk 1024
ckpt-chunk-memory-limit-6 --grad-checkpoint --loss-chunk 1024 --memory-limit 6
graph-cap-1000 MLX_MAX_MB_PER_BUFFER=1000
ckpt-graph-cap-100 MLX_MAX_MB_PER_BUFFER=100 --grad-checkpoint
ckpt-graph-cap-25 MLX_MAX_MB_PER_BUFFER=25 --grad-checkpoint'
for model in ${MODELS:-lfm2-1.2b}; do
  if [ -z "${SKIP_MLX_LM:-}" ]; then
    { python3 scripts/bench.py --model config:$model "${common[@]}" --only mlx-lm || echo "RESULT failed"; } \
      | sed "s/^RESULT /RESULT mlx-lm $model /" | tee -a "$out/memory-levers-$model.txt"
  fi
  while read -r tag flags; do
    [ -n "$tag" ] || continue
    variables=$(tr ' ' '\n' <<< "$flags" | grep '^MLX_' | paste -sd' ' || true)
    flags=$(tr ' ' '\n' <<< "$flags" | grep -v '^MLX_' | paste -sd' ' || true)
    # shellcheck disable=SC2086  # variables and flags are words
    { env $variables python3 scripts/bench.py --model config:$model "${common[@]}" $flags --only mlxft || echo "RESULT failed"; } \
      | sed "s/^RESULT /RESULT $tag $model /" | tee -a "$out/memory-levers-$model.txt"
  done <<< "${VARIANTS:-$default_variants}"
done
