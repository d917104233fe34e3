"""Where a training step's peak memory goes: mlxft's compiled step and its parts, one at a time.

    python scripts/trace_step_memory.py --model config:llama-3.2-1b --dtype bfloat16 --grad-checkpoint --loss-chunk 512
    python scripts/trace_step_memory.py --model config:llama-3.2-1b --dtype bfloat16 --grad-checkpoint --layers 8

Builds mlxft's Trainer on the benchmark's synthetic rows (``scripts/bench.py``), takes the
micro-batch of the longest rows, and measures the peak of each phase over the memory already
allocated (the weights, adapters and optimizer state), reset before each: the whole compiled
step (three times; the first includes compiling), two steps queued as the trainer queues them,
the loss without gradients, the body's forward alone, the gradient of the loss with respect to
the final hidden states alone (eager), and an eager value-and-gradient of the loss; then the
compiled step's time. ``--layers N`` keeps the first N layers, so that a change in the step's peak
with N separates what each layer keeps from what the step needs once. The per-phase
figures for Llama-3.2-1B on the H200 in benchmarks/README.md come from this script.
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
from mlxft import _gpu  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="config:llama-3.2-1b", help="model dir, builtin:..., or config:NAME")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--layers", type=int, default=0, help="keep only the first N layers (0: all)")
    p.add_argument("--grad-checkpoint", action="store_true")
    p.add_argument("--loss-chunk", type=int, default=0)
    p.add_argument("--workload", choices=("chat", "fixed"), default="chat",
                   help="chat: rows of 128-512 tokens, 45%% prompt; fixed: 512-token rows, half prompt")
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    if args.grad_checkpoint:  # as the trainer does, before the model's first evaluation
        _gpu.cap_for_checkpointing()

    import mlx.core as mx
    import mlx.nn as nn

    from bench import load_model, probe_trainer, synthetic_rows
    from mlxft import loss, memory, models
    from mlxft.data import make_batch

    model, vocab = load_model(args.model, args.dtype)
    if args.layers:
        model.model.layers = model.model.layers[:args.layers]
    rows = synthetic_rows(128, vocab, "chat", 512, 512 if args.workload == "fixed" else 0, 0)
    rows.sort(key=lambda r: -len(r.ids))
    trainer = probe_trainer(args.model, model, rows, args.grad_checkpoint, args.loss_chunk, args.batch_size)
    batch = make_batch(rows[:args.batch_size], args.batch_size, 32).arrays()
    step, chunk = trainer.step, args.loss_chunk
    result = {"args": vars(args), "device": str(mx.default_device()), "inputs": list(batch[0].shape),
              "supervised": int(batch[3].sum()), "graph_mb": os.environ.get(_gpu.GRAPH_MB_VARIABLE)}

    def measure(name, fn, repeats=3):
        peaks = [round(memory._probe(fn) / 1e9, 3) for _ in range(repeats)]
        base = mx.get_active_memory()
        result[name + "_gb"] = peaks
        result["allocated_gb"] = round(base / 1e9, 3)
        print(f"{name:22} {peaks} GB over {base / 1e9:.3f} GB allocated", flush=True)

    def one_step():
        done, _ = step(batch, None, True)
        return [done.loss_sum, step.state]

    def two_queued():
        first, _ = step(batch, None, True)
        mx.async_eval(step.state, first.loss_sum)
        second, _ = step(batch, None, True)
        return [first.loss_sum, second.loss_sum, step.state]

    measure("step", one_step)
    measure("two_queued_steps", two_queued, 2)
    measure("loss_forward", lambda: loss.loss_fn(model, *batch, chunk=chunk)[0])
    measure("body_forward", lambda: models.hidden_states(model, batch[0]).sum())
    hidden = mx.random.normal((batch[1].shape[0], model.args.hidden_size)).astype(models.compute_dtype(model))
    measure("head_gradient", lambda: mx.grad(lambda h: loss.hidden_loss(model, h, batch[2], batch[3], 0.0, chunk)[0])(hidden))
    value_and_grad = nn.value_and_grad(model, lambda m, *b: loss.loss_fn(m, *b, chunk=chunk)[0])
    measure("eager_value_and_grad", lambda: value_and_grad(model, *batch), 2)

    mx.eval(one_step())
    mx.synchronize()
    tic = time.perf_counter()
    for _ in range(10):
        done, _ = step(batch, None, True)
        mx.async_eval(done.loss_sum, step.state)
    mx.eval(done.loss_sum)
    mx.synchronize()
    result["step_ms"] = round((time.perf_counter() - tic) * 100, 2)
    print(f"{'step time':22} {result['step_ms']} ms")
    print("RESULT", json.dumps(result))


if __name__ == "__main__":
    main()
