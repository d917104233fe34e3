"""Benchmark MLX's Linux CPU backend with its bundled reference BLAS against the BLAS mlxft loads.

    python scripts/bench_blas.py [--model DIR]   # default: SmolLM2-135M-Instruct (built-in)

Settings: MLX's own BLAS, the scipy-openblas32 shim, the system's OpenBLAS and Intel MKL in
this environment (each where installed), and what mlxft picks by default. Each setting runs in a
fresh process (the BLAS is chosen before MLX starts): float32 matmul GFLOP/s, and the median time
of a LoRA training step (``--batch`` rows of ``--length`` tokens). Results go to
benchmarks/blas.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = r"""
import json, sys, time, statistics
import mlxft, mlxft._blas as blas
import mlx.core as mx, mlx.optimizers as optim, numpy as np
from mlxft import builtin, lora, models
from mlxft.config import AdapterConfig
from mlxft.data import Example, make_batch
from mlxft.loss import loss_fn
from mlxft.step import build_step

a, b = mx.random.normal((1024, 1024)), mx.random.normal((1024, 1024))
mx.eval(a @ b)
t = time.perf_counter(); reps = 3
for _ in range(reps): mx.eval(a @ b)
gflops = 2 * 1024**3 * reps / (time.perf_counter() - t) / 1e9

model, _, _, _ = models.load(builtin.resolve(sys.argv[1]), "float32")
lora.apply(model, AdapterConfig(), 0)
rng = np.random.default_rng(0)
count, length = int(sys.argv[3]), int(sys.argv[4])
rows = [Example(rng.integers(0, 1000, length + 1).astype(np.int32), np.arange(length + 1) > length // 2) for _ in range(count)]
batch = make_batch(rows, count, 32).arrays()
step = build_step(model, optim.AdamW(learning_rate=1e-4), loss_fn)
times = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter(); result, _ = step(batch, None, True); mx.eval(step.state, result.loss_sum)
    times.append(time.perf_counter() - t)
print(json.dumps({"blas": blas.loaded or "mlx bundled reference", "matmul_gflops": gflops,
                  "step_seconds": statistics.median(times[1:]), "tokens_per_step": count * length}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=32, help="tokens a row")
    parser.add_argument("--out", default="benchmarks/blas.json")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mlxft import _blas

    system = [p for p in _blas._CANDIDATES if os.path.exists(p)][:1] or [ctypes.util.find_library("openblas") or ""]
    labels = {"none": "MLX's own", "scipy-openblas32": "scipy-openblas32", **{c: "system OpenBLAS" for c in system if c},
              **{c: "MKL (environment)" for c in _blas._mkl_candidates()[:1]}, "": "mlxft's default"}
    results = []
    for choice, label in labels.items():
        env = {**os.environ, "MLXFT_BLAS": choice}
        proc = subprocess.run([sys.executable, "-c", PROBE, args.model, str(args.steps), str(args.batch), str(args.length)],
                              env=env, capture_output=True, text=True, check=True)
        results.append({**json.loads(proc.stdout.strip().splitlines()[-1]), "setting": label})
    base, fast = results[0], results[-1]
    summary = {"model": args.model, "results": results,
               "matmul_speedup": fast["matmul_gflops"] / base["matmul_gflops"],
               "step_speedup": base["step_seconds"] / fast["step_seconds"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'setting':18} {'BLAS':60} {'matmul GFLOP/s':>15} {'LoRA step s':>12}")
    for r in results:
        print(f"{r['setting'][-18:]:18} {r['blas'][-60:]:60} {r['matmul_gflops']:15.1f} {r['step_seconds']:12.2f}")
    print(f"speed-up: matmul {summary['matmul_speedup']:.1f}x, training step {summary['step_speedup']:.1f}x")


if __name__ == "__main__":
    main()
