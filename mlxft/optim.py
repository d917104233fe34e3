"""Optimizers from ``mlx.optimizers`` and the learning-rate schedule they follow.

Step k (1-based) of T uses ``learning_rate_at(k)``. With W warmup steps, steps 1..W warm up
linearly, step k at ``peak * k / W``, so step W uses the peak. Steps W+1..T then decay over
``progress = (k - W - 1) / (T - W)``: the constant schedule keeps the peak, the linear one uses
``peak + (min - peak) * progress`` and the cosine one
``min + (peak - min) * (1 + cos(pi * progress)) / 2``, where ``min`` is ``min_learning_rate``.
Step W+1 thus uses the peak and step T stays one decay step above ``min`` (which step T+1 would
reach), so every step trains, even the only step of a one-step run.

The schedule counts every optimizer step, applied or not. Adam's bias correction counts only
the updates applied (:data:`APPLIED_KEY`): a step discarded for non-finite gradients or a
window without a supervised token leaves the moments as they were, so they have been updated
fewer times than the schedule has stepped, and correcting them by the step count would shrink
every later update.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from mlxft.config import OptimConfig
from mlxft.errors import UserError


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


APPLIED_KEY = "applied_updates"  # the optimizer state entry counting the updates applied


class _CountsAppliedUpdates:
    """Adam's update, bias-corrected by the count of updates applied rather than steps taken.

    The count sits in the optimizer state, so the step's guard puts it back with the moments
    when it discards an update, and checkpoints save it with them."""

    def init(self, parameters):
        super().init(parameters)
        # A state a caller assigned without it (an older checkpoint's) takes every step it has
        # taken as applied, as those runs computed. A copy: one array twice in the compiled
        # step's state is one input the compiled function cannot tell apart.
        self.state.setdefault(APPLIED_KEY, mx.array(self.step))

    def apply_gradients(self, gradients, parameters):
        if not self._initialized:
            self.init(gradients)
        self.state[APPLIED_KEY] = self.state[APPLIED_KEY] + 1
        return super().apply_gradients(gradients, parameters)

    def apply_single(self, gradient, parameter, state):
        if not self.bias_correction:
            return super().apply_single(gradient, parameter, state)
        # MLX's Adam corrects by ``self.step``; the same arithmetic by the applied count.
        lr = self.learning_rate.astype(gradient.dtype)
        (b1, b2), applied = self.betas, self.state[APPLIED_KEY]
        m = state["m"] = b1 * state["m"] + (1 - b1) * gradient
        v = state["v"] = b2 * state["v"] + (1 - b2) * mx.square(gradient)
        c1 = (lr / (1 - b1**applied)).astype(gradient.dtype)
        c2 = mx.rsqrt(1 - b2**applied).astype(gradient.dtype)
        return parameter - c1 * m / (mx.sqrt(v) * c2 + self.eps)


class Adam(_CountsAppliedUpdates, optim.Adam):
    """MLX's Adam, bias-corrected by the updates applied."""


class AdamW(optim.AdamW, Adam):
    """MLX's AdamW (its weight decay, then :class:`Adam`'s update)."""


MASTER_KEY = "_master_weights"  # the optimizer state entry of half-precision trainables' float32 masters


def load_state(optimizer: optim.Optimizer, saved: dict[str, mx.array], source: str) -> None:
    """Put a checkpoint's optimizer state (flat names, as ``source`` holds them) in place, into
    the dict the step holds, once ``optimizer.init`` has laid out this run's.

    Every per-parameter entry must be there in its shape (MLX would fail later, or train on
    silently with fresh moments); the scalar counters may be missing. Checkpoints from before
    the applied count have none: every step they took counts as applied, which is what their
    runs' bias correction assumed. Masters that do not fit are rebuilt by the step."""
    expected = dict(tree_flatten(optimizer.state))
    for name, value in expected.items():
        if value.ndim == 0:  # a counter
            continue
        if name not in saved:
            raise UserError(f"{source} has no {name!r}; the checkpoint is damaged or not this run's: resume from "
                            "an earlier one")
        if saved[name].shape != value.shape:
            raise UserError(f"{source}: {name!r} has shape {tuple(saved[name].shape)}, but this run's parameter "
                            f"needs {tuple(value.shape)}; the checkpoint is damaged or not this run's")
    for name, value in saved.items():
        known = expected.get(name)
        if name.startswith(MASTER_KEY + ".") or (known is not None and (known.ndim or value.ndim == 0)):
            continue
        what = "holds a non-scalar" if known is not None else "holds"
        raise UserError(f"{source} {what} {name!r}, which this run's optimizer does not; the checkpoint is "
                        "damaged or not this run's: resume from an earlier one")
    saved = tree_unflatten(list(saved.items()))
    optimizer.state.update(saved)
    if isinstance(optimizer, _CountsAppliedUpdates) and APPLIED_KEY not in saved and "step" in saved:
        optimizer.state[APPLIED_KEY] = mx.array(saved["step"])


def build_optimizer(config: OptimConfig, total_steps: int) -> optim.Optimizer:
    """The optimizer with the schedule attached (MLX passes the 0-based update count)."""

    def schedule(count):
        return learning_rate_at(count + 1, config, total_steps)

    if config.optimizer == "adamw":
        return AdamW(learning_rate=schedule, weight_decay=config.weight_decay, bias_correction=config.bias_correction)
    if config.optimizer == "adam":
        return Adam(learning_rate=schedule, bias_correction=config.bias_correction)
    return optim.SGD(learning_rate=schedule, momentum=config.momentum, weight_decay=config.weight_decay)
