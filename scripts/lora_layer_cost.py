"""What one LoRA layer adds to a compiled training step on this device, by how it is computed.

    python scripts/lora_layer_cost.py                  # 1,024 tokens
    python scripts/lora_layer_cost.py --tokens 32

A stack of 32 frozen 2048x2048 linears (``--dim`` sets the width; bf16 on a GPU, float32 on the
CPU) is differentiated compiled, once plain (its value and the input gradient: the forward and
backward matmuls of a frozen layer) and once per way of computing a rank-8 adapter on each of
them; each is queued 30 times as the trainer queues steps (``mx.async_eval``). The time over the
plain stack, divided by the 32 layers, is what an adapter costs a step: the H200's figures are in
``benchmarks/h200-lora-layer-cost.txt``. The plain stack must return its value: asked for the
input gradient alone, MLX leaves out the forward matmuls, which nothing then reads, and the
adapters would be charged for them. The ways:

- ``mlxft``: the adapters stay float32 and are cast to the input's dtype (mlxft's LoRA arithmetic);
- ``2d``: the same on ``[tokens, D]`` rows, the batch axis flattened once for the stack;
- ``bf16 adapters``: adapters already in the compute dtype, no casts;
- ``addmm``: the adapter's product added by the second matmul (``mx.addmm``);
- ``own backward``: mlxft's ``lora_gradients`` as the vjp of a custom function.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlxft  # noqa: F401,E402 - optimized BLAS before MLX on Linux
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from mlxft.fastmath import lora_gradients  # noqa: E402

LAYERS, RANK, SCALE = 32, 8, 2.0


def plain(weights, adapters, x):
    for w in weights:
        x = x @ w.T
    return x.astype(mx.float32).sum()


def frozen_step():
    """The plain stack's compiled step: its value and the gradient with respect to its input."""
    return mx.compile(mx.value_and_grad(plain, argnums=2))


def as_mlxft(weights, adapters, x):
    for w, (a, b) in zip(weights, adapters):
        x = x @ w.T + (SCALE * ((x @ a.astype(x.dtype)) @ b.astype(x.dtype))).astype(x.dtype)
    return x.astype(mx.float32).sum()


def flattened(weights, adapters, x):
    shape = x.shape
    return as_mlxft(weights, adapters, x.reshape(-1, shape[-1]))


def in_compute_dtype(weights, adapters, x):
    for w, (a, b) in zip(weights, adapters):
        x = x @ w.T + (x @ a.astype(x.dtype)) @ (SCALE * b).astype(x.dtype)
    return x.astype(mx.float32).sum()


def with_addmm(weights, adapters, x):
    x = x.reshape(-1, x.shape[-1])
    for w, (a, b) in zip(weights, adapters):
        x = mx.addmm(x @ w.T, x @ a.astype(x.dtype), b.astype(x.dtype), alpha=SCALE)
    return x.astype(mx.float32).sum()


def own_backward(weights, adapters, x):
    for w, (a, b) in zip(weights, adapters):
        frozen = nn.Linear(w.shape[1], w.shape[0], bias=False)
        frozen.weight = w

        @mx.custom_function
        def layer(x, a, b, frozen=frozen):
            return frozen(x) + (SCALE * ((x @ a.astype(x.dtype)) @ b.astype(x.dtype))).astype(x.dtype)

        @layer.vjp
        def layer_vjp(primals, cotangent, output, frozen=frozen):
            return lora_gradients(frozen, SCALE, *primals[:1], cotangent, *primals[1:])

        x = layer(x, a, b)
    return x.astype(mx.float32).sum()


def time_step(fn, *args, repeats: int = 30) -> float:
    """Milliseconds per call, queued as the trainer queues its steps."""
    for _ in range(3):
        mx.eval(fn(*args))
    mx.synchronize()
    tic = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
        mx.async_eval(out)
    mx.eval(out)
    mx.synchronize()
    return (time.perf_counter() - tic) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024, help="tokens in the micro-batch (one row)")
    p.add_argument("--dim", type=int, default=2048, help="each linear's width (2048: LFM2-1.2B's and Llama-3.2-1B's)")
    args = p.parse_args()
    dim = args.dim
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    mx.random.seed(0)
    weights = [(0.02 * mx.random.normal((dim, dim))).astype(dtype) for _ in range(LAYERS)]
    adapters = [(0.01 * mx.random.normal((dim, RANK)), 0.01 * mx.random.normal((RANK, dim))) for _ in range(LAYERS)]
    x = mx.random.normal((1, args.tokens, dim)).astype(dtype)
    mx.eval(weights, adapters, x)
    cast = [(a.astype(dtype), b.astype(dtype)) for a, b in adapters]
    base_step = frozen_step()
    base = time_step(lambda: base_step(weights, None, x))
    print(f"{mx.default_device()}, {args.tokens} tokens, {LAYERS} layers of {dim}x{dim}, {dtype}")
    print(f"plain stack: {base:.2f} ms a step, {base / LAYERS * 1e3:.0f} us a layer (forward and input gradient)")
    for name, fn, params in (("mlxft", as_mlxft, adapters), ("2d", flattened, adapters),
                             ("bf16 adapters", in_compute_dtype, cast), ("addmm", with_addmm, adapters),
                             ("own backward", own_backward, adapters)):
        step = mx.compile(mx.value_and_grad(fn, argnums=1))
        ms = time_step(lambda: step(weights, params, x))
        print(f"{name}: {ms:.2f} ms a step, {(ms - base) / LAYERS * 1e3:.0f} us an adapter", flush=True)


if __name__ == "__main__":
    main()
