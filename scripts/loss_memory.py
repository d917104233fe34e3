"""What the frozen-head training loss holds on this device, with either way of scoring a chunk.

    python scripts/loss_memory.py                      # bf16 logits, 32k vocabulary, 1024 tokens
    python scripts/loss_memory.py --vocab 128256 --hidden 2048 --tokens 4096 --chunk 512

Compiles the gradient of :func:`mlxft.loss.head_cross_entropy` with respect to the hidden states
of a random frozen head, and prints its peak over the inputs, unpaced and paced
(:mod:`mlxft.memory`), scored as the CPU scores (a float32 copy of the logits) and as a GPU
scores (MLX's softmax in the logits' dtype), whichever device runs it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlxft  # noqa: F401,E402 - optimized BLAS before MLX on Linux


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()

    import mlx.core as mx
    import mlx.nn as nn

    from mlxft import loss, memory

    dtype = getattr(mx, args.dtype)
    model = nn.Module()
    model.lm_head = nn.Linear(args.hidden, args.vocab, bias=False)
    model.lm_head.set_dtype(dtype)
    model.freeze()
    hidden = mx.random.normal((args.tokens, args.hidden)).astype(dtype)
    targets = mx.random.randint(0, args.vocab, (args.tokens,))
    weights = mx.ones((args.tokens,))
    mx.eval(hidden, targets, weights, model.parameters())
    print(f"{mx.default_device()}, {args.tokens} tokens in chunks of {args.chunk}, vocabulary {args.vocab}, {args.dtype}; "
          f"a chunk's logits: {args.chunk * args.vocab * dtype.size / 1e6:.1f} MB")
    for name, scores in (("float32 copy (CPU)", loss._scores_on_cpu), ("softmax (GPU)", loss._scores_from_softmax)):
        grad = mx.compile(mx.grad(lambda h: loss.head_cross_entropy(model, h, targets, weights, chunk=args.chunk,
                                                                    scores=scores)[0]))
        print(f"{name:20} unpaced {memory._probe(grad, hidden) / 1e6:8.1f} MB, paced {memory._paced_probe(grad, hidden) / 1e6:8.1f} MB")


if __name__ == "__main__":
    main()
