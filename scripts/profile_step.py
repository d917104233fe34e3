"""Where a compiled step's GPU time goes, and how long the GPU waits for the host.

    python scripts/profile_step.py --model config:lfm2-1.2b
    python scripts/profile_step.py --model config:lfm2-1.2b --size longest --recompute-mlp
    python scripts/profile_step.py --model config:lfm2-1.2b --size epoch --steps 32

CUDA only, and it needs PyTorch, whose profiler reads the CUDA driver's kernel records (CUPTI)
for every kernel the process launches, MLX's included; mlxft itself does not depend on it.
Builds mlxft's Trainer on the benchmark's synthetic chat rows (``scripts/bench.py``), compiles
one micro-batch of the chosen size, then records 10 steps queued the way the trainer queues
them. ``--size epoch`` takes instead the 16 micro-batches of the benchmark's first epoch, in its
order, each compiled first, and records them in turn: what changing shapes from step to step
costs, against one shape repeated. Prints per step: the wall time, the kernels launched, their summed time, the time at
least one kernel ran (``busy``), the idle gaps between kernels by length, and the kernels that
took the most time. Recording adds host time to every launch, so the wall time here is longer
than without it; compare runs made with this script only.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlxft  # noqa: F401,E402 - optimized BLAS before MLX on Linux

GAP_BOUNDS_US = (0, 5, 20, 100, 1000)


def busy_and_gaps(intervals: list[tuple[float, float]]) -> tuple[float, dict[int, list[float]]]:
    """Time covered by at least one interval, and the uncovered gaps between them by lower bound."""
    busy, gaps, end = 0.0, {b: [] for b in GAP_BOUNDS_US}, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            if end is not None:
                gap = start - end
                gaps[max(b for b in GAP_BOUNDS_US if gap >= b)].append(gap)
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy, gaps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="config:lfm2-1.2b", help="model dir, builtin:..., or config:NAME")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--size", choices=("longest", "middle", "shortest", "epoch"), default="middle",
                   help="which 8 of the 128 chat rows, by length (middle: about 2,800 tokens), or the "
                        "benchmark's first epoch of micro-batches in turn")
    p.add_argument("--grad-checkpoint", action="store_true")
    p.add_argument("--recompute-mlp", action="store_true")
    p.add_argument("--loss-chunk", type=int, default=0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=12, help="kernels listed, by summed time")
    args = p.parse_args()

    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        sys.exit("profile_step.py profiles CUDA kernels; MLX runs on the CPU here")
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        sys.exit("profile_step.py needs PyTorch with CUDA (pip install torch) for its profiler")

    from bench import load_model, probe_epoch, probe_sizes, probe_trainer
    from mlxft.data import make_batch

    model, vocab = load_model(args.model, args.dtype)
    rows, by_size = probe_sizes(vocab)
    trainer = probe_trainer(args.model, model, rows, args.grad_checkpoint, args.loss_chunk, 8,
                            recompute_mlp=args.recompute_mlp)
    step = trainer.step
    chosen = probe_epoch(rows) if args.size == "epoch" else [by_size[args.size]]
    batches = [make_batch(examples, 8, 32).arrays() for examples in chosen]
    for batch in batches * 3 if len(batches) == 1 else batches * 2:  # compile each shape, reach the repeated step
        done, _ = step(batch, None, True)
        mx.eval(done.loss_sum, step.state)
    mx.synchronize()
    mx.reset_peak_memory()
    n = args.steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        tic = time.perf_counter()
        for i in range(n):
            done, _ = step(batches[i % len(batches)], None, True)
            mx.async_eval(done.loss_sum, step.state)
        mx.eval(done.loss_sum)
        mx.synchronize()
        wall = time.perf_counter() - tic
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not kernels:
        sys.exit("the profiler recorded no kernels: is MLX running on CUDA?")
    busy, gaps = busy_and_gaps([(s, e) for _, s, e in kernels])
    tokens = sum(batches[i % len(batches)][0].size for i in range(n)) / n
    print(f"{args.model} {args.size} ({tokens:.0f} tokens a step), mlx {mx.__version__}, "
          f"peak {mx.get_peak_memory() / 1e9:.2f} GB; per step: wall {wall / n * 1e3:.2f} ms, "
          f"{len(kernels) / n:.0f} kernels, kernel time {sum(e - s for _, s, e in kernels) / n / 1e3:.2f} ms, "
          f"busy {busy / n / 1e3:.2f} ms, under 10 us: {sum(e - s < 10 for _, s, e in kernels) / n:.0f} kernels")
    print("idle gaps per step: " + ", ".join(f">= {b} us: {len(g) / n:.0f} ({sum(g) / n / 1e3:.2f} ms)"
                                               for b, g in gaps.items()))
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, start, stop in kernels:
        by_name[name[:100]][0] += 1
        by_name[name[:100]][1] += stop - start
    for name, (count, total) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"  {total / n / 1e3:7.3f} ms {count / n:6.0f}x  {name}")


if __name__ == "__main__":
    main()
