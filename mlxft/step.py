"""The compiled training step: token-weighted gradient accumulation, clipping, guarded update.

Each micro-batch contributes the gradient of its *summed* loss, so a window of K
micro-batches divided by the window's total supervised-token count is exactly the gradient
of one batch holding all their tokens (mlx-lm averages per-batch means instead, which
over-weights short batches). The update clips the global norm and is discarded, leaving
weights and optimizer moments untouched, when that norm is not finite.

The step is one function compiled once over the explicit state ``[model.state,
optimizer.state, mx.random.state]``; its Python-level switches (first micro-batch of a
window, last micro-batch) select among a few traced variants per batch shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map

_SCHEDULE_KEYS = ("step", "learning_rate")


@dataclass
class StepResult:
    loss_sum: mx.array  # summed loss of the window so far
    tokens: mx.array  # supervised tokens of the window so far
    grad_norm: mx.array | None  # global norm before clipping, on the last micro-batch
    applied: mx.array | None  # whether the update was finite and applied


def _where_tree(keep, new, old):
    return tree_map(lambda n, o: mx.where(keep, n, o), new, old)


def build_step(
    model: nn.Module,
    optimizer: optim.Optimizer,
    loss: Callable,
    max_grad_norm: float = 0.0,
    reduce: Callable[[object], object] | None = None,
):
    """Return ``step(batch, window, update) -> (StepResult, window)``.

    ``loss(model, *batch) -> (mean_loss, ntokens)``. ``window`` carries the running
    ``(grad_sum, loss_sum, tokens)`` between micro-batches (None starts a new one);
    ``update=True`` ends the window and applies the optimizer. ``reduce`` sums a tree
    across data-parallel ranks (identity when training on one process).
    """
    optimizer.init(model.trainable_parameters())

    def summed(model, *batch):
        mean, ntokens = loss(model, *batch)
        return mean * ntokens, ntokens

    value_and_grad = nn.value_and_grad(model, summed)
    state = [model.state, optimizer.state, mx.random.state]
    clip_to = max_grad_norm if max_grad_norm > 0 else float("inf")

    @partial(mx.compile, inputs=state, outputs=state)
    def compiled(batch, window, update):
        (loss_sum, tokens), grads = value_and_grad(model, *batch)
        if window is not None:
            prev_grads, prev_loss, prev_tokens = window
            grads = tree_map(mx.add, grads, prev_grads)
            loss_sum, tokens = loss_sum + prev_loss, tokens + prev_tokens
        if not update:
            return loss_sum, tokens, grads, None, None
        total = tokens
        if reduce is not None:
            grads, total = reduce((grads, tokens))
        grads = tree_map(lambda g: g / mx.maximum(total, 1), grads)
        grads, norm = optim.clip_grad_norm(grads, clip_to)
        finite = mx.isfinite(norm)
        old_params = model.trainable_parameters()
        # A structural copy: the optimizer rewrites its nested state dicts in place.
        old_moments = tree_map(lambda x: x, {k: v for k, v in optimizer.state.items() if k not in _SCHEDULE_KEYS})
        optimizer.update(model, grads)
        model.update(_where_tree(finite, model.trainable_parameters(), old_params))
        new_moments = {k: optimizer.state[k] for k in old_moments}
        optimizer.state.update(_where_tree(finite, new_moments, old_moments))
        return loss_sum, tokens, None, norm, finite

    def step(batch, window, update: bool):
        loss_sum, tokens, grads, norm, applied = compiled(batch, window, update)
        next_window = None if update else (grads, loss_sum, tokens)
        return StepResult(loss_sum, tokens, norm, applied), next_window

    step.state = state
    return step
