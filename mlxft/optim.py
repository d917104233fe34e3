"""Optimizers from ``mlx.optimizers`` and the learning-rate schedule they follow.

Step k (1-based) of T uses ``learning_rate_at(k)``. With W warmup steps, steps 1..W warm up
linearly, step k at ``peak * k / W``, so step W uses the peak. Steps W+1..T then decay over
``progress = (k - W - 1) / (T - W)``: the constant schedule keeps the peak, the linear one uses
``peak + (min - peak) * progress`` and the cosine one
``min + (peak - min) * (1 + cos(pi * progress)) / 2``, where ``min`` is ``min_learning_rate``.
Step W+1 thus uses the peak and step T stays one decay step above ``min`` (which step T+1 would
reach), so every step trains, even the only step of a one-step run.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.optimizers as optim

from mlxft.config import OptimConfig


def learning_rate_at(step, config: OptimConfig, total_steps: int):
    """The rate of 1-based optimizer ``step`` (a Python number or an mx.array)."""
    peak, floor, warmup = config.learning_rate, config.min_learning_rate, config.warmup_steps
    is_array = isinstance(step, mx.array)
    step = step.astype(mx.float32) if is_array else float(step)
    minimum = mx.minimum if is_array else min
    maximum = mx.maximum if is_array else max
    cos = mx.cos if is_array else math.cos
    if warmup > 0:
        warm = peak * minimum(step / warmup, 1.0)
    else:  # an array in, an array out: the optimizer casts the rate with .astype
        warm = mx.full(step.shape, peak) if is_array else peak
    if config.schedule == "constant":
        return warm
    span = max(total_steps - warmup, 1)
    # 0-based over the decay steps: the first uses the peak, the last stays above the floor.
    progress = minimum(maximum(step - warmup - 1, 0.0) / span, 1.0)
    if config.schedule == "linear":
        decayed = peak + (floor - peak) * progress
    else:
        decayed = floor + (peak - floor) * 0.5 * (1.0 + cos(math.pi * progress))
    if is_array:
        return mx.where(step <= warmup, warm, decayed)
    return warm if step <= warmup else decayed


def build_optimizer(config: OptimConfig, total_steps: int) -> optim.Optimizer:
    """The optimizer with the schedule attached (MLX passes the 0-based update count)."""

    def schedule(count):
        return learning_rate_at(count + 1, config, total_steps)

    if config.optimizer == "adamw":
        return optim.AdamW(learning_rate=schedule, weight_decay=config.weight_decay,
                           bias_correction=config.bias_correction)
    if config.optimizer == "adam":
        return optim.Adam(learning_rate=schedule, bias_correction=config.bias_correction)
    return optim.SGD(learning_rate=schedule, momentum=config.momentum, weight_decay=config.weight_decay)
