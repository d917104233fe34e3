"""The compiled training step: token-weighted gradient accumulation, clipping, guarded update.

Each micro-batch contributes the gradient of its *summed* loss, so a window of K
micro-batches divided by the window's total supervised-token count is exactly the gradient
of one batch holding all their tokens (mlx-lm averages per-batch means instead, which
over-weights short batches). The update clips the global norm and is discarded, leaving
weights and optimizer moments untouched, when that norm is not finite. Adapters' many small
tensors go through that update as one vector (:class:`FlatTrainables`), and a half-precision
model's layers get them as one cast of that vector.

Trainable parameters stored in half precision (bfloat16 or float16: full fine-tuning of a
half-precision model) keep float32 master copies in the optimizer state (under
:data:`MASTER_KEY`, so checkpoints save and restore them), with float32 moments and float32
window gradient sums; the update applies to the master and the model gets it rounded back
to its own dtype (a bf16 model stays bf16). Updated in half precision, small steps round
away (a bf16 weight of 0.02 moves in steps of 1.2e-4, so Adam at lr 1e-5 changes nothing),
bf16 moments barely decay (0.999 rounds to 1) and float16's epsilon rounds to 0. Float32
trainables (LoRA adapters, a float32 model) have no masters and train as themselves.

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
from mlx.utils import tree_flatten, tree_map, tree_map_with_path, tree_reduce, tree_unflatten

from mlxft.optim import APPLIED_KEY, MASTER_KEY

_SCHEDULE_KEYS = ("step", "learning_rate")  # advance with every step, applied or discarded
_COUNTERS = _SCHEDULE_KEYS + (APPLIED_KEY,)  # the optimizer state's scalars, not per parameter


_HALF = (mx.float16, mx.bfloat16)


def _working_dtype(dtype):
    """The dtype a parameter's gradient sum, update and optimizer moments use."""
    return mx.float32 if dtype in _HALF else dtype


def _widen(x):
    return x.astype(_working_dtype(x.dtype)) if isinstance(x, mx.array) else x


def _synced(master: mx.array, param: mx.array) -> mx.array:
    """The master, or the parameter itself where the two disagree (weights replaced behind the
    step's back: a user's load). After every update the parameter is the master rounded."""
    return mx.where(master.astype(param.dtype) == param, master, param.astype(mx.float32))


def _init_masters(optimizer: optim.Optimizer, params, layout) -> None:
    """Give half-precision trainables float32 masters (keeping restored ones that fit) and
    float32 optimizer state, in place."""
    state = optimizer.state
    restored = state.pop(MASTER_KEY, None)
    if layout is not None:
        flat = layout.flatten(params)
        if flat.dtype in _HALF:
            fits = isinstance(restored, mx.array) and restored.shape == flat.shape
            state[MASTER_KEY] = restored.astype(mx.float32) if fits else flat.astype(mx.float32)
        if FlatTrainables.KEY in state:
            state[FlatTrainables.KEY] = tree_map(_widen, state[FlatTrainables.KEY])
        return
    half = [(name, p) for name, p in tree_flatten(params) if p.dtype in _HALF]
    if not half:
        return
    restored = dict(tree_flatten(restored)) if isinstance(restored, (dict, list)) else {}
    state[MASTER_KEY] = tree_unflatten([
        (name, restored[name].astype(mx.float32) if name in restored and restored[name].shape == p.shape
         else p.astype(mx.float32)) for name, p in half])
    # Moments a caller initialised (or an older checkpoint saved) in half precision.
    for key in [k for k in state if k not in _SCHEDULE_KEYS and k != MASTER_KEY]:
        state[key] = tree_map(_widen, state[key])


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
        per_param = {k: v for k, v in optimizer.state.items() if k not in _COUNTERS + (self.KEY, MASTER_KEY)}
        master = optimizer.state.get(MASTER_KEY)
        if isinstance(master, (dict, list)):  # per parameter: laid end to end like the parameters
            names = dict(tree_flatten(master))
            if all(name in names for name in self.names):
                optimizer.state[MASTER_KEY] = self.flatten(master)
            else:
                del optimizer.state[MASTER_KEY]
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
        tree = {k: v for k, v in optimizer.state.items() if k in _COUNTERS}
        tree.update(tree_map_with_path(lambda path, _: {k: moments[k][path] for k in moments}, self.template))
        if MASTER_KEY in optimizer.state:
            tree[MASTER_KEY] = self.unflatten(optimizer.state[MASTER_KEY])
        return tree


def _adapter_cast(model: nn.Module, layout: FlatTrainables | None):
    """The half-precision dtype to hand float32 adapters to their layers in, or None.

    Layers that cast their adapters to the input's dtype at every call (mlxft's LoRA) cost two
    casts forward and two back per adapter: on an H200 a few hundred small kernels a step. Cast
    as one vector, and differentiated in that dtype, the adapters compute the same values
    with one cast each way."""
    from mlxft import lora, models

    dtype = models.compute_dtype(model)
    if layout is None or dtype not in _HALF:
        return None
    if any(v.dtype != mx.float32 for _, v in tree_flatten(model.trainable_parameters())):
        return None
    return dtype if lora.only_adapters_cast_per_call(model) else None


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
    multiplies each micro-batch's mean loss before differentiation and divides its gradients
    after, so float16 gradients do not underflow (see :class:`LossScaler`); the window's
    gradient sum is unscaled. ``reduce`` sums a tree across data-parallel ranks (identity
    when training on one process). ``flat`` lays the trainable
    parameters end to end for the update (default: when :meth:`FlatTrainables.suits`); the
    window's gradient sum is then one vector. ``step.layout`` is that layout (None per tensor),
    for :func:`gradient_tree`, :func:`gradient_window` and :func:`optimizer_state`.
    """
    params = model.trainable_parameters()
    layout = FlatTrainables(params) if (FlatTrainables.suits(model) if flat is None else flat) else None
    if layout is not None:
        layout.adopt_state(optimizer)
        optimizer.init({FlatTrainables.KEY: _widen(layout.flatten(params))})
    else:
        optimizer.init(tree_map(_widen, params))
    _init_masters(optimizer, params, layout)
    cast_to = _adapter_cast(model, layout)

    def summed(model, *batch_and_scale):
        *batch, loss_scale = batch_and_scale
        mean, ntokens = loss(model, *batch)
        # The scale multiplies the mean, not the sum, so the backward pass's float16 range does
        # not depend on the token count; the reported sum is unscaled.
        return mean * loss_scale, (mean * ntokens, ntokens)

    value_and_grad = nn.value_and_grad(model, summed)
    state = [model.state, optimizer.state, mx.random.state]
    clip_to = max_grad_norm if max_grad_norm > 0 else float("inf")

    def mean_gradient(g, tokens):
        # Keep the sum's dtype (float32 for half-precision parameters, else the parameter's own).
        return (g / mx.maximum(tokens, 1)).astype(g.dtype)

    def clip_global_norm(grads):
        """``optim.clip_grad_norm(grads, clip_to)``, with each square summed in one order.

        A float32 sum's order follows the array's memory layout: the window's sums from the
        matmul backward are column-major, a window restored from a checkpoint is row-major,
        and the same values then gave norms an ulp apart, so a run resumed inside a window
        clipped by another factor. Laid out 1-D (row-major), every tensor sums alike."""
        def squared_norm(g):
            g = g.reshape(-1)
            return (g.astype(mx.float32) if g.dtype == mx.float16 else g).square().sum()

        norm = mx.sqrt(tree_reduce(lambda acc, g: acc + squared_norm(g), grads, 0.0))
        normalizer = mx.minimum(clip_to / (norm + 1e-6), 1.0)
        return tree_map(lambda g: (g * normalizer).astype(g.dtype), grads), norm

    def applies(norm, tokens):
        # A window without a supervised token has a zero gradient, on which Adam would still
        # step along its moments and decay the weights: no data, no update.
        return mx.isfinite(norm) & (tokens > 0)

    def update_tree(grads, tokens):
        grads = tree_map(lambda g: mean_gradient(g, tokens), grads)
        grads, norm = clip_global_norm(grads)
        finite = applies(norm, tokens)
        old_params = model.trainable_parameters()
        # The optimizer updates the float32 master where a parameter has one (it maps over the
        # gradients' structure, so the state's master entry is not mistaken for a parameter).
        masters = dict(tree_flatten(optimizer.state.get(MASTER_KEY, {})))
        masters = {name: _synced(masters[name], p) for name, p in tree_flatten(old_params) if name in masters}
        current = tree_map_with_path(lambda name, p: masters.get(name, p), old_params)
        # A structural copy: the optimizer rewrites its nested state dicts in place. It holds the
        # applied-update count too, which a discarded update puts back with the moments.
        old_moments = tree_map(lambda x: x, {k: v for k, v in optimizer.state.items()
                                             if k not in _SCHEDULE_KEYS and k != MASTER_KEY})
        new = optimizer.apply_gradients(grads, current)
        new_params = tree_map(lambda n, o: n.astype(o.dtype), new, old_params)
        model.update(_where_tree(finite, new_params, old_params))
        new_moments = {k: optimizer.state[k] for k in old_moments}
        optimizer.state.update(_where_tree(finite, new_moments, old_moments))
        if masters:
            new = dict(tree_flatten(new))
            optimizer.state[MASTER_KEY] = tree_map_with_path(
                lambda name, _: mx.where(finite, new[name], masters[name]), optimizer.state[MASTER_KEY])
        return norm, finite

    def update_flat(grads, tokens, params):
        grads = mean_gradient(grads, tokens)
        norm = mx.sqrt(grads.square().sum())
        finite = applies(norm, tokens)
        if max_grad_norm > 0:
            grads = grads * mx.minimum(max_grad_norm / (norm + 1e-6), 1.0)
        old_moments = dict(optimizer.state.get(FlatTrainables.KEY, {}))
        old_applied = optimizer.state.get(APPLIED_KEY)
        master = optimizer.state.get(MASTER_KEY)
        current = params if master is None else _synced(master, params)
        new = optimizer.apply_gradients({FlatTrainables.KEY: grads}, {FlatTrainables.KEY: current})[FlatTrainables.KEY]
        model.update(layout.unflatten(mx.where(finite, new.astype(params.dtype), params)))
        if master is not None:
            optimizer.state[MASTER_KEY] = mx.where(finite, new, current)
        if old_moments:
            moments = optimizer.state[FlatTrainables.KEY]
            optimizer.state[FlatTrainables.KEY] = {k: mx.where(finite, moments[k], old) for k, old in old_moments.items()}
        if old_applied is not None:
            optimizer.state[APPLIED_KEY] = mx.where(finite, optimizer.state[APPLIED_KEY], old_applied)
        return norm, finite

    @partial(mx.compile, inputs=state, outputs=state)
    def compiled(batch, window, update, loss_scale):
        if layout is not None and (update or cast_to is not None):
            # Read from the model each step, not kept as state: a resume or a user may replace
            # them, or write into one (``a[...] = v`` keeps the array object, so identity is no test).
            trainables = model.trainable_parameters()
            flat_params = layout.flatten(trainables)
            if cast_to is not None:  # the layers get the adapters in the dtype they would cast them to
                model.update(layout.unflatten(flat_params.astype(cast_to)))
        (_, (loss_sum, tokens)), grads = value_and_grad(model, *batch, loss_scale)
        if layout is not None:
            if cast_to is not None:
                model.update(trainables)
            # Laid end to end before any cast: gradients of adapters cast per call arrive in the
            # compute dtype, and the one conversion below widens them all.
            grads = layout.flatten(grads)
        # This micro-batch's summed-loss gradient, unscaled (one rounding to the working dtype).
        weight = tokens / loss_scale
        grads = tree_map(lambda g: (g * weight).astype(_working_dtype(g.dtype)), grads)
        if window is not None:
            prev_grads, prev_loss, prev_tokens = window
            grads = tree_map(mx.add, grads, prev_grads)
            loss_sum, tokens = loss_sum + prev_loss, tokens + prev_tokens
        if not update:
            return loss_sum, tokens, grads, None, None
        if reduce is not None:  # data-parallel: the window's sums over every rank
            grads, loss_sum, tokens = reduce((grads, loss_sum, tokens))
        norm, finite = update_tree(grads, tokens) if layout is None else update_flat(grads, tokens, flat_params)
        return loss_sum, tokens, None, norm, finite

    unit_scale = mx.array(1.0)

    def step(batch, window, update: bool, loss_scale: mx.array | None = None):
        scale = unit_scale if loss_scale is None else loss_scale
        loss_sum, tokens, grads, norm, applied = compiled(batch, window, update, scale)
        next_window = None if update else (grads, loss_sum, tokens)
        return StepResult(loss_sum, tokens, norm, applied), next_window

    def compile_kernels(batch, loss_scale: mx.array | None = None):
        """Compute one micro-batch's gradients and drop them, changing no state: the backend
        builds the step's kernels for this batch's shape here, before a step whose gradient
        sum waits on the other ranks (``update`` False stops short of ``reduce``)."""
        mx.eval(step(batch, None, False, loss_scale)[1])

    step.state = state
    step.layout = layout
    step.adapter_cast = cast_to
    step.compile_kernels = compile_kernels
    return step


def gradient_tree(grads, layout: FlatTrainables | None):
    """A window's gradient sum per parameter (what checkpoints store)."""
    return grads if layout is None else layout.unflatten(grads)


def gradient_window(tree, layout: FlatTrainables | None):
    """A per-parameter gradient sum (a restored window) as the step holds it: in the working
    dtype, as the step sums it (checkpoints written before float32 sums hold half precision)."""
    tree = tree_map(_widen, tree)
    return tree if layout is None else layout.flatten(tree)


def optimizer_state(optimizer: optim.Optimizer, layout: FlatTrainables | None) -> dict:
    """The optimizer state per parameter, whichever layout the step uses (what checkpoints store)."""
    return optimizer.state if layout is None else layout.state_tree(optimizer)


class LossScaler:
    """Dynamic loss scaling for float16: halve on overflow (the step is skipped), double after
    ``growth_interval`` finite steps in a row. Disabled, it keeps the scale at 1. The scale
    multiplies each micro-batch's per-token mean loss, so one start suits any token count."""

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
        """Continue a checkpoint's scaling. One saved with the scaler on while it is off here, or
        off while it is on (a run resumed in another dtype with --force), leaves it as it starts:
        a scale of 1 would leave float16 gradients unprotected, and a disabled scaler never moves
        its scale back to 1, which the non-finite-streak stop waits for."""
        if bool(state.get("enabled", self.enabled)) != self.enabled:
            return
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self._array = mx.array(self.scale)
