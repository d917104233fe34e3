"""What the update half of a step costs over Llama-3.2-1B's LoRA parameters (224 tensors).

    python scripts/bench_update.py

The loss is a cheap function of the parameters, so the time is the update: mlx-lm's (Adam
alone), mlxft's per tensor (token normalisation, global-norm clipping, the non-finite guard)
and mlxft's flat layout (the same work on one vector; see ``mlxft.step.FlatTrainables``).
Through this script on the lent H200 (MLX 0.32.4 CUDA): 5.1, 10.1 and 5.9 ms (written out by
hand over the same shapes: 3.1-3.6, 11.1-13.6 and 2.3-2.4 ms). On the 2-core CPU it gives about
19, 29 and 38 ms: copying into one vector costs more than the kernels it saves there, under 1% of
a CPU step.
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlxft  # noqa: F401,E402 - optimized BLAS before MLX on Linux
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402

from mlxft.step import build_step  # noqa: E402

LINEARS = [(2048, 2048), (2048, 512), (2048, 512), (2048, 2048), (2048, 8192), (2048, 8192), (8192, 2048)]


class Adapters(nn.Module):
    """LoRA-shaped trainable tensors of 16 layers, and a frozen weight the size of the rest."""

    def __init__(self):
        super().__init__()
        self.frozen = mx.zeros((100_000_000,), mx.bfloat16)
        self.layers = [{f"a{i}": mx.random.normal((d_in, 8)) * 0.01 for i, (d_in, _) in enumerate(LINEARS)}
                       | {f"b{i}": mx.random.normal((8, d_out)) * 0.01 for i, (_, d_out) in enumerate(LINEARS)}
                       for _ in range(16)]
        self.freeze(keys=["frozen"])


def loss(model, weights):
    total = sum((p * weights).sum() for layer in model.layers for p in layer.values())
    return total, mx.array(1000.0)


def timed(step, state, repeats=50):
    for _ in range(5):
        mx.eval(state, step())
    tic = time.perf_counter()
    for _ in range(repeats):
        mx.eval(state, step())
    return (time.perf_counter() - tic) / repeats


def main():
    weight = mx.array(0.5)
    for name in ("mlx-lm (Adam alone)", "mlxft per tensor", "mlxft flat"):
        model = Adapters()
        opt = optim.Adam(learning_rate=1e-4)
        if name.startswith("mlx-lm"):
            value_and_grad = nn.value_and_grad(model, loss)
            state = [model.state, opt.state]

            @partial(mx.compile, inputs=state, outputs=state)
            def plain(weights):
                (value, _), grads = value_and_grad(model, weights)
                opt.update(model, grads)
                return value

            seconds = timed(lambda: plain(weight), state)
        else:
            step = build_step(model, opt, loss, max_grad_norm=1.0, flat=name.endswith("flat"))
            seconds = timed(lambda: step((weight,), None, True)[0].loss_sum, step.state)
        print(f"{name:22} {seconds * 1e3:6.2f} ms per step")


if __name__ == "__main__":
    main()
