"""Attention forward+backward under each mask kind packing could use, on the current device.

    python scripts/bench_attention.py [--batch 8 --heads 32 --kv-heads 8 --length 512 --head-dim 64]

Packing gives attention a block-diagonal causal mask; this times ``mx.fast.scaled_dot_product_attention``
with the built-in causal mask, a boolean array mask, and an additive array mask, plus the same
attention written out as matmul + softmax, so a slow packed run can be traced to the mask path.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx


def timed(fn, *args, iters: int = 20) -> float:
    for _ in range(3):
        mx.eval(fn(*args))
    tic = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn(*args))
    return (time.perf_counter() - tic) / iters * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    dtype = getattr(mx, args.dtype)
    B, H, G, T, D = args.batch, args.heads, args.kv_heads, args.length, args.head_dim
    q = mx.random.normal((B, H, T, D)).astype(dtype)
    k = mx.random.normal((B, G, T, D)).astype(dtype)
    v = mx.random.normal((B, G, T, D)).astype(dtype)
    steps = mx.arange(T)
    causal = steps[:, None] >= steps[None, :]
    documents = mx.broadcast_to((steps // (T // 4))[None], (B, T))  # four documents per row
    boolean = ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]
    additive = mx.where(boolean, 0.0, -mx.inf).astype(dtype)
    scale = D**-0.5

    def sdpa(mask):
        def loss(q, k, v):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask).astype(mx.float32).sum()
        return mx.compile(mx.value_and_grad(loss, argnums=(0, 1, 2)))

    def written_out(q, k, v):
        kr, vr = mx.repeat(k, H // G, axis=1), mx.repeat(v, H // G, axis=1)
        scores = (q * scale) @ kr.swapaxes(-1, -2)
        scores = mx.where(boolean, scores, mx.array(-mx.inf, scores.dtype))
        return (mx.softmax(scores, axis=-1, precise=True) @ vr).astype(mx.float32).sum()

    results = {
        "sdpa causal": timed(sdpa("causal"), q, k, v),
        "sdpa boolean mask": timed(sdpa(boolean), q, k, v),
        "sdpa additive mask": timed(sdpa(additive), q, k, v),
        "matmul + softmax, boolean mask": timed(mx.compile(mx.value_and_grad(written_out, argnums=(0, 1, 2))), q, k, v),
    }
    print(json.dumps({"device": str(mx.default_device()), "shape": [B, H, G, T, D], "dtype": args.dtype,
                      "ms_forward_backward": results}, indent=2))


if __name__ == "__main__":
    main()
