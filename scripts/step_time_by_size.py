"""How a compiled step's time scales with its micro-batch: where it stops shrinking, the host bounds it.

    python scripts/step_time_by_size.py --model config:lfm2-1.2b
    python scripts/step_time_by_size.py --model config:lfm2-1.2b --grad-checkpoint
    python scripts/step_time_by_size.py --model config:lfm2-1.2b --targets feed_forward.w2

Builds mlxft's Trainer on the benchmark's synthetic chat rows (``scripts/bench.py``), then repeats
one micro-batch 20 times for each of four sizes: the 8 longest rows, 8 rows from the middle, the
8 shortest, and one row of 32 tokens. Each step is queued the way the trainer queues it
(``mx.async_eval``) and the time until the last one is done is divided by 20; ``queue_ms`` is the
time spent in the calls alone and ``peak_gb`` the peak over those 20 steps. A step of 32 tokens
leaves the device almost nothing to do, so its time is what queueing a step costs the host.
``--targets`` adapts fewer linears than all of them: the difference is what the adapters cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlxft  # noqa: F401,E402 - optimized BLAS before MLX on Linux


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="config:lfm2-1.2b", help="model dir, builtin:..., or config:NAME")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--grad-checkpoint", action="store_true", help="with --loss-chunk 512, as the benchmark's checkpointed rows")
    p.add_argument("--checkpoint-layers", type=int, default=0, help="recompute only the first N layers (with --grad-checkpoint)")
    p.add_argument("--checkpoint-keep-mlp", action="store_true", help="keep the MLP's gate and up (with --grad-checkpoint)")
    p.add_argument("--targets", default="all", help="comma-separated LoRA targets, as mlxft's --targets (default all)")
    args = p.parse_args()

    import mlx.core as mx
    import numpy as np

    from bench import ENVIRONMENT, load_model, probe_sizes, probe_trainer
    from mlxft.data import Example, make_batch

    model, vocab = load_model(args.model, args.dtype)
    rows, by_size = probe_sizes(vocab)
    trainer = probe_trainer(args.model, model, rows, args.grad_checkpoint, 512 if args.grad_checkpoint else 0, 8,
                            targets=tuple(args.targets.split(",")), checkpoint_layers=args.checkpoint_layers,
                            checkpoint_keep_mlp=args.checkpoint_keep_mlp)
    step = trainer.step
    result = {"args": vars(args), "device": str(mx.default_device()),
              "environment": {k: os.environ.get(k) for k in ENVIRONMENT}}
    tiny = [Example(r.ids[:32], r.mask[:32] | (np.arange(32) > 20)) for r in rows[:1]]
    sizes = tuple((label, chosen, 8) for label, chosen in by_size.items()) + (("32 tokens", tiny, 1),)
    for label, chosen, batch_size in sizes:
        batch = make_batch(chosen, batch_size, 32).arrays()
        for _ in range(3):  # compile this shape
            done, _ = step(batch, None, True)
            mx.eval(done.loss_sum, step.state)
        mx.synchronize()
        mx.reset_peak_memory()
        queue = 0.0
        tic = time.perf_counter()
        for _ in range(20):
            t0 = time.perf_counter()
            done, _ = step(batch, None, True)
            mx.async_eval(done.loss_sum, step.state)
            queue += time.perf_counter() - t0
        mx.eval(done.loss_sum)
        mx.synchronize()
        wall = time.perf_counter() - tic
        result[label] = {"tokens": int(batch[0].size), "queue_ms": round(queue / 20 * 1e3, 2),
                         "step_ms": round(wall / 20 * 1e3, 2), "peak_gb": round(mx.get_peak_memory() / 1e9, 2)}
        print(f"{label:10} {result[label]}", flush=True)
    print("RESULT", json.dumps(result))


if __name__ == "__main__":
    main()
