"""The compiled training step: token-weighted gradient accumulation, clipping, guarded update.

Each micro-batch contributes the gradient of its *summed* loss, so a window of K
micro-batches divided by the window's total supervised-token count is exactly the gradient
of one batch holding all their tokens (mlx-lm averages per-batch means instead, which
over-weights short batches). The update clips the global norm and is discarded, leaving
weights and optimizer moments untouched, when that norm is not finite. Adapters' many small
tensors go through that update as one vector (:class:`FlatTrainables`).

The step is one function compiled once over the explicit state ``[model.state,
optimizer.state, mx.random.state]``; its Python-level switches (first micro-batch of a
window, last micro-batch) select among a few traced variants per batch shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

_SCHEDULE_KEYS = ("step", "learning_rate")


@dataclass
class StepResult:
    loss_sum: mx.array  # summed loss of the window so far
    tokens: mx.array  # supervised tokens of the window so far
    grad_norm: mx.array | None  # global norm before clipping, on the last micro-batch
    applied: mx.array | None  # whether the update was finite and applied


def _where_tree(keep, new, old):
    return tree_map(lambda n, o: mx.where(keep, n, o), new, old)


class FlatTrainables:
    """The trainable parameters laid end to end in one vector, and back.

    Adapters are hundreds of small tensors; clipping, the non-finite guard and the optimizer
    then cost a few GPU kernels each (on an H200, 11 ms a step for Llama-3.2-1B's LoRA against
    2.4 ms for one vector). Laid flat they cost a handful, and the parameters read back as
    views of the updated vector. Used when every trainable parameter shares one dtype and
    they are a small part of the model (adapters, not full fine-tuning).
    """

    KEY = "_flat_trainables"  # the optimizer state entry of the flat moments

    def __init__(self, template):
        self.template = template  # the trainable tree's structure, leaves ignored
        self.names, self.shapes = zip(*[(k, v.shape) for k, v in tree_flatten(template)])
        self.sizes = [math.prod(shape) for shape in self.shapes]

    @staticmethod
    def suits(model: nn.Module) -> bool:
        trainable = tree_flatten(model.trainable_parameters())
        dtypes = {v.dtype for _, v in trainable}
        count = sum(v.size for _, v in trainable)
        return len(trainable) > 1 and len(dtypes) == 1 and 4 * count <= sum(v.size for _, v in tree_flatten(model.parameters()))

    def flatten(self, tree) -> mx.array:
        flat = dict(tree_flatten(tree))
        return mx.concatenate([flat[name].reshape(-1) for name in self.names])

    def views(self, vector: mx.array) -> dict[str, mx.array]:
        """Each parameter's slice of ``vector``, by its flattened name."""
        views, offset = {}, 0
        for name, shape, size in zip(self.names, self.shapes, self.sizes):
            views[name] = vector[offset:offset + size].reshape(shape)
            offset += size
        return views

    def unflatten(self, vector: mx.array):
        views = self.views(vector)
        return tree_map_with_path(lambda path, _: views[path], self.template)

    def adopt_state(self, optimizer: optim.Optimizer) -> None:
        """Move per-parameter optimizer state (a restored checkpoint's) into flat moments, in place."""
        per_param = {k: v for k, v in optimizer.state.items() if k not in _SCHEDULE_KEYS and k != self.KEY}
        moments = dict(tree_flatten(per_param))
        keys = sorted({name[len(self.names[0]) + 1:] for name in moments if name.startswith(self.names[0] + ".")})
        for key in per_param:
            del optimizer.state[key]
        if keys:
            optimizer.state[self.KEY] = {k: mx.concatenate([moments[f"{n}.{k}"].reshape(-1) for n in self.names])
                                         for k in keys}

    def state_tree(self, optimizer: optim.Optimizer) -> dict:
        """The optimizer state per parameter, as a tree-laid optimizer would hold it (checkpoints)."""
        flat = optimizer.state.get(self.KEY, {})
        moments = {k: self.views(v) for k, v in flat.items()}
        tree = {k: v for k, v in optimizer.state.items() if k in _SCHEDULE_KEYS}
        tree.update(tree_map_with_path(lambda path, _: {k: moments[k][path] for k in moments}, self.template))
        return tree


def build_step(
    model: nn.Module,
    optimizer: optim.Optimizer,
    loss: Callable,
    max_grad_norm: float = 0.0,
    reduce: Callable[[object], object] | None = None,
    flat: bool | None = None,
):
    """Return ``step(batch, window, update, loss_scale) -> (StepResult, window)``.

    ``loss(model, *batch) -> (mean_loss, ntokens)``. ``window`` carries the running
    ``(grad_sum, loss_sum, tokens)`` between micro-batches (None starts a new one);
    ``update=True`` ends the window and applies the optimizer. ``loss_scale`` (an array)
    multiplies the loss before differentiation and divides the gradients after, so float16
    gradients do not underflow (see :class:`LossScaler`). ``reduce`` sums a tree across
    data-parallel ranks (identity when training on one process). ``flat`` lays the trainable
    parameters end to end for the update (default: when :meth:`FlatTrainables.suits`); the
    window's gradient sum is then one vector. ``step.layout`` is that layout (None per tensor),
    for :func:`gradient_tree`, :func:`gradient_window` and :func:`optimizer_state`.
    """
    layout = FlatTrainables(model.trainable_parameters()) if (FlatTrainables.suits(model) if flat is None else flat) else None
    if layout is not None:
        layout.adopt_state(optimizer)
        optimizer.init({FlatTrainables.KEY: layout.flatten(model.trainable_parameters())})
    else:
        optimizer.init(model.trainable_parameters())

    def summed(model, *batch_and_scale):
        *batch, loss_scale = batch_and_scale
        mean, ntokens = loss(model, *batch)
        # The reported sum is unscaled; only the differentiated value carries the scale.
        scaled = mean * ntokens * loss_scale
        return scaled, (mean * ntokens, ntokens)

    value_and_grad = nn.value_and_grad(model, summed)
    state = [model.state, optimizer.state, mx.random.state]
    clip_to = max_grad_norm if max_grad_norm > 0 else float("inf")

    def update_tree(grads, tokens, loss_scale):
        grads = tree_map(lambda g: g / (mx.maximum(tokens, 1) * loss_scale), grads)
        grads, norm = optim.clip_grad_norm(grads, clip_to)
        finite = mx.isfinite(norm)
        old_params = model.trainable_parameters()
        # A structural copy: the optimizer rewrites its nested state dicts in place.
        old_moments = tree_map(lambda x: x, {k: v for k, v in optimizer.state.items() if k not in _SCHEDULE_KEYS})
        optimizer.update(model, grads)
        model.update(_where_tree(finite, model.trainable_parameters(), old_params))
        new_moments = {k: optimizer.state[k] for k in old_moments}
        optimizer.state.update(_where_tree(finite, new_moments, old_moments))
        return norm, finite

    def update_flat(grads, tokens, loss_scale):
        # Read from the model each step, not kept as state: a resume or a user may replace them.
        params = layout.flatten(model.trainable_parameters())
        grads = grads / (mx.maximum(tokens, 1) * loss_scale)  # before squaring: float16 loss scales are large
        norm = mx.sqrt(grads.square().sum())
        finite = mx.isfinite(norm)
        if max_grad_norm > 0:
            grads = grads * mx.minimum(max_grad_norm / (norm + 1e-6), 1.0)
        old_moments = dict(optimizer.state.get(FlatTrainables.KEY, {}))
        new = optimizer.apply_gradients({FlatTrainables.KEY: grads}, {FlatTrainables.KEY: params})
        model.update(layout.unflatten(mx.where(finite, new[FlatTrainables.KEY], params)))
        if old_moments:
            moments = optimizer.state[FlatTrainables.KEY]
            optimizer.state[FlatTrainables.KEY] = {k: mx.where(finite, moments[k], old) for k, old in old_moments.items()}
        return norm, finite

    @partial(mx.compile, inputs=state, outputs=state)
    def compiled(batch, window, update, loss_scale):
        (_, (loss_sum, tokens)), grads = value_and_grad(model, *batch, loss_scale)
        if layout is not None:
            grads = layout.flatten(grads)
        if window is not None:
            prev_grads, prev_loss, prev_tokens = window
            grads = tree_map(mx.add, grads, prev_grads)
            loss_sum, tokens = loss_sum + prev_loss, tokens + prev_tokens
        if not update:
            return loss_sum, tokens, grads, None, None
        if reduce is not None:  # data-parallel: the window's sums over every rank
            grads, loss_sum, tokens = reduce((grads, loss_sum, tokens))
        norm, finite = (update_tree if layout is None else update_flat)(grads, tokens, loss_scale)
        return loss_sum, tokens, None, norm, finite

    unit_scale = mx.array(1.0)

    def step(batch, window, update: bool, loss_scale: mx.array | None = None):
        scale = unit_scale if loss_scale is None else loss_scale
        loss_sum, tokens, grads, norm, applied = compiled(batch, window, update, scale)
        next_window = None if update else (grads, loss_sum, tokens)
        return StepResult(loss_sum, tokens, norm, applied), next_window

    step.state = state
    step.layout = layout
    return step


def gradient_tree(grads, layout: FlatTrainables | None):
    """A window's gradient sum per parameter (what checkpoints store)."""
    return grads if layout is None else layout.unflatten(grads)


def gradient_window(tree, layout: FlatTrainables | None):
    """A per-parameter gradient sum (a restored window) as the step holds it."""
    return tree if layout is None else layout.flatten(tree)


def optimizer_state(optimizer: optim.Optimizer, layout: FlatTrainables | None) -> dict:
    """The optimizer state per parameter, whichever layout the step uses (what checkpoints store)."""
    return optimizer.state if layout is None else layout.state_tree(optimizer)


class LossScaler:
    """Dynamic loss scaling for float16: halve on overflow (the step is skipped), double after
    ``growth_interval`` finite steps in a row. Disabled, it keeps the scale at 1."""

    def __init__(self, enabled: bool, scale: float = 2.0**15, growth_interval: int = 1000):
        self.enabled = enabled
        self.scale = scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0
        self._array = mx.array(self.scale)

    @property
    def array(self) -> mx.array:
        return self._array

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale, self.good_steps = self.scale * 2.0, 0
        else:
            self.scale, self.good_steps = max(self.scale / 2.0, 1.0), 0
        self._array = mx.array(self.scale)

    def state(self) -> dict:
        return {"enabled": self.enabled, "scale": self.scale, "good_steps": self.good_steps}

    def load(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self._array = mx.array(self.scale)
