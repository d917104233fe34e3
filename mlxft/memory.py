"""Device memory: which device, MLX's limits, the allocator cache, and the pre-run estimate.

Everything goes through MLX's device-neutral memory API, so Metal, CUDA and the CPU share
one path; only the wired limit is Metal's alone (unified memory that must stay resident).

The peak-memory estimate adds what is known exactly (weights, adapters, their
gradients and optimizer moments) to what is measured on the device at the run's batch
shape. What each layer keeps for the backward pass is read off the device, not inferred from
a peak: the forward pass of a vector-Jacobian product through one layer of each kind is
evaluated with its backward pass left pending, and whatever it leaves allocated is what the
backward will read (a checkpointed layer leaves nothing but what it was given). That figure
is the same from run to run on a GPU, where peaks of eager passes are not (Llama-3.2-1B on an
H200: one layer's peak-based share read 0.29 GB in one run and 0.72 in another). One eager
forward and backward pass through a layer gives what it needs in passing, and the output head
and loss are probed compiled, at the largest supervised-token count.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlxft import _gpu, fastmath
from mlxft.config import WHOLE_LAYERS
from mlxft.models import compute_dtype, family, is_checkpointed
from mlxft.packing import DocumentLayout, is_attention_layer

GB = 1e9


def device_kind() -> str:
    """The backend MLX computes on: ``Metal``, ``CUDA`` or ``CPU``."""
    if mx.default_device() == mx.cpu:
        return "CPU"
    if mx.metal.is_available():
        return "Metal"
    return "CUDA" if hasattr(mx, "cuda") and mx.cuda.is_available() else "CPU"


def device_description() -> str:
    info = _gpu.device_info()
    kind = device_kind()
    name = info.get("device_name") or info.get("architecture") or ""
    size = info.get("memory_size")
    return kind + (f" ({name}" + (f", {size / GB:.0f} GB" if size else "") + ")" if name else "")


@dataclass(frozen=True)
class Limits:
    """MLX's memory and allocator-cache limits, which are the process's: a run that sets its
    own puts these back when it ends, for whatever the process runs next (another Trainer in a
    user's script). Metal's wired limit is left as set, as mlx-lm leaves it."""
    memory: int
    cache: int

    @classmethod
    def now(cls) -> "Limits":
        cache = mx.set_cache_limit(1 << 62)  # MLX gives its cache limit back only when setting one;
        mx.set_cache_limit(cache)  # raising it for an instant frees nothing
        return cls(mx.get_memory_limit(), cache)

    def restore(self) -> None:
        mx.set_memory_limit(self.memory)
        mx.set_cache_limit(self.cache)


def configure(memory_limit_gb: float, cache_limit_gb: float) -> str:
    """Apply the limits; on Metal wire the recommended working set as mlx-lm does. Returns a summary."""
    notes = []
    if mx.metal.is_available():
        working_set = _gpu.device_info().get("max_recommended_working_set_size")
        if working_set:
            mx.set_wired_limit(int(working_set))
            notes.append(f"wired limit {working_set / GB:.1f} GB")
    if memory_limit_gb > 0:
        mx.set_memory_limit(int(memory_limit_gb * GB))
    if cache_limit_gb >= 0:
        mx.set_cache_limit(int(cache_limit_gb * GB))
    notes.append(f"memory limit {mx.get_memory_limit() / GB:.1f} GB")
    if device_kind() == "CUDA":
        cap, variable = os.environ.get(_gpu.GRAPH_MB_VARIABLE), _gpu.GRAPH_MB_VARIABLE
        notes.append(f"CUDA graphs of up to {cap}M input elements ({variable})" if cap
                     else f"CUDA graphs of MLX's default size ({variable} unset)")
    width = os.environ.get(_gpu.EVAL_WIDTH_VARIABLE)
    notes.append(f"evaluation width {width} ({_gpu.EVAL_WIDTH_VARIABLE})" if width
                 else f"MLX's default evaluation width ({_gpu.EVAL_WIDTH_VARIABLE} unset)")
    return ", ".join(notes)


def release_cache(threshold_gb: float) -> None:
    """Return cached buffers to the system once the cache outgrows ``threshold_gb``."""
    if threshold_gb >= 0 and mx.get_cache_memory() > threshold_gb * GB:
        mx.clear_cache()


# The default cache limit over the run's estimated peak: the estimate's tolerance (it has come
# within a quarter of the measured peak), so the largest step's freed buffers stay cached.
CACHE_OVER_ESTIMATE = 1.25


def bound_cache(limit: int) -> int | None:
    """Lower MLX's allocator-cache limit to ``limit`` bytes where it is higher; returns the limit
    it replaced, or None where MLX's was already at or under it (as on the CPU).

    MLX's own default on Metal and CUDA is the memory limit, so freed buffers of every shape a
    variable-length run meets stay cached: on an H200 the cache of a chat run reached 41-137 GB
    by its last step, and on a Mac it would hold the laptop's memory up to MLX's collection
    limit however little the run needs. Bounded near the run's estimated peak, the process holds
    at most a little over twice what its largest step needs, at the same speed (H200, LFM2-1.2B
    chat, ``--recompute-mlp``, a 6 GB cache limit against MLX's: 40.0k and 43.3k tokens/s against
    38.2k and 43.0k). mlx-lm's trainer empties the cache after every step instead, which took
    mlxft from 66k to 38k tokens/s on that GPU."""
    previous = mx.set_cache_limit(limit)
    if previous <= limit:
        mx.set_cache_limit(previous)
        return None
    return previous


@dataclass
class Estimate:
    weights: float
    training_state: float
    activations: float
    loss: float
    recompute_savings: tuple[int, ...] = ()
    """Per layer, in model order: the bytes it would stop keeping for the backward pass if it
    were recomputed (0 for a layer already recomputed or not trained)."""
    recompute_peaks: tuple[int, ...] = ()
    """Per layer: what its backward pass would hold over its input if it were recomputed."""
    transient: int = 0
    """The most any layer's backward pass holds over what the layers keep (in ``activations``)."""
    loss_queued_ahead: float = 0
    """How much of ``loss`` is the backend queueing chunks ahead of the one it computes, which
    pacing takes off (see :func:`pacing_limit`)."""
    paced: bool = False
    """Whether this is the run paced (:meth:`pace`)."""
    recompute_mlp_savings: tuple[int, ...] = ()
    """Per layer: the bytes it would stop keeping if its MLP computed gate and up again
    (``--recompute-mlp``; 0 where that does not apply or already does)."""
    recompute_mlp_transient: int = 0
    """``transient`` with those MLPs recomputing gate and up in their backward pass."""
    update: float = 0
    """What the optimizer's update allocates beside the training state, once the backward pass
    has freed the activations: new parameters, masters and moments (see :func:`estimate`)."""

    @property
    def total(self) -> float:
        return self._peak(self.activations + self.loss)

    def _peak(self, backward: float) -> float:
        """The run's peak with ``backward`` bytes at the backward pass's peak: that pass's or the
        update's, which comes after it."""
        return self.weights + self.training_state + max(backward, self.update)

    def total_recomputing(self, first: int) -> float:
        """The estimate with the first ``first`` layers recomputed: each one stops keeping its
        activations, and the one being recomputed holds them again during its backward pass."""
        recomputed = self.recompute_peaks[:first]
        return self._peak(self.activations + self.loss - sum(self.recompute_savings[:first])
                          + max(max(recomputed, default=0) - self.transient, 0))

    def total_recomputing_mlp(self, first: int | None = None) -> float:
        """The estimate with ``--recompute-mlp`` in the first ``first`` layers (None: every layer):
        their gate and up are no longer kept, and each of their MLPs' backward pass holds them
        again while it runs; a layer that still keeps them holds its own transient."""
        layers = len(self.recompute_mlp_savings)
        first = layers if first is None else first
        transient = self.recompute_mlp_transient if first >= layers else max(self.transient,
                                                                              self.recompute_mlp_transient)
        return self._peak(self.activations + self.loss - sum(self.recompute_mlp_savings[:first])
                          - self.transient + transient)

    def mlp_layers_to_recompute(self, limit: float) -> int | None:
        """The fewest first layers whose MLPs to recompute (``--recompute-mlp-layers``) for the
        estimate to fit ``limit`` bytes; None when even every layer's would not."""
        return _fewest_first(self.recompute_mlp_savings, self.total_recomputing_mlp, limit)

    def layers_to_recompute(self, limit: float) -> int | None:
        """The fewest first layers to recompute (``--checkpoint-layers``) for the estimate to fit
        ``limit`` bytes; None when recomputing more layers cannot bring it under (or adds nothing)."""
        return _fewest_first(self.recompute_savings, self.total_recomputing, limit)

    def pace(self) -> Estimate:
        """The same run paced: a fifth of the loss's queue is left as the limit's headroom."""
        return replace(self, loss=self.loss - 0.8 * self.loss_queued_ahead, paced=True)

    def describe(self) -> str:
        update = f", at the optimizer's update {self.update / GB:.2f} more" \
            if self.update > self.activations + self.loss else ""
        return (f"{self.total / GB:.2f} GB (weights {self.weights / GB:.2f}, adapters + gradients + optimizer "
                f"{self.training_state / GB:.2f}, activations {self.activations / GB:.2f}, "
                f"loss {self.loss / GB:.2f}{update})")


def _fewest_first(savings: tuple[int, ...], total_with, limit: float) -> int | None:
    """The fewest first layers ``n`` whose last saves something and with which ``total_with(n)``
    fits ``limit``; None when no count does."""
    for first in range(1, len(savings) + 1):
        if savings[first - 1] and total_with(first) <= limit:
            return first
    return None


def _nbytes(tree) -> int:
    return sum(v.nbytes for _, v in tree_flatten(tree))


@contextlib.contextmanager
def _no_garbage_collection():
    """Python's cyclic collector held off while a probe reads MLX's memory counters: arrays held
    in reference cycles (left by earlier work in the process) freed mid-probe would be
    subtracted from what the probe allocated (seen in the test suite: a layer's kept bytes
    read 0.3 of its input lower)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _probe(fn, *args) -> int:
    """Extra bytes at the peak of evaluating ``fn(*args)`` over what is already allocated."""
    mx.eval(args)
    mx.synchronize()
    mx.clear_cache()
    with _no_garbage_collection():
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(fn(*args))
        peak = mx.get_peak_memory() - base
    mx.clear_cache()
    return max(peak, 0)


def _paced_probe(fn, *args) -> int:
    """:func:`_probe` with MLX pacing evaluation as tightly as it can: under a memory limit of one
    byte it waits for every queued operation before queueing the next."""
    limit = mx.set_memory_limit(1)
    try:
        return _probe(fn, *args)
    finally:
        mx.set_memory_limit(limit)


def _layer_call(layer, layout):
    mask = (layout.mask if layout is not None else "causal") if is_attention_layer(layer) else None

    def call(h):
        if isinstance(mask, str):
            try:
                return layer(h, mask, cache=layout)
            except AttributeError:  # attention that takes only an array mask (Gemma 2's soft-capped scores)
                from mlx_lm.models.base import create_causal_mask

                return layer(h, create_causal_mask(h.shape[1]), cache=layout)
        return layer(h, mask, cache=layout)

    return call


def _layer_peak(layer: nn.Module, layout, x: mx.array) -> int:
    """The peak of a forward and backward pass (gradients of the trainable parameters) through
    ``layer``, as the trainer's step runs it; through a layer with none (an LFM2 convolution
    under attention-only --targets), the gradient of its input, which carries the others'."""
    saved = layer.trainable_parameters()
    call = _layer_call(layer, layout)

    def forward(params, h):
        layer.update(params)
        return call(h).astype(mx.float32).sum()

    argnums = 0 if tree_flatten(saved) else 1
    try:
        return _probe(mx.value_and_grad(forward, argnums=argnums), saved, x)
    finally:  # the traced update leaves the graph's arrays in the layer
        layer.update(saved)


def _kept_for_backward(layer: nn.Module, layout, x: mx.array) -> int:
    """The bytes ``layer`` keeps from its forward pass for its backward pass, input included:
    what the forward of a pending vector-Jacobian product leaves allocated besides its output."""
    saved = layer.trainable_parameters()
    flat = tree_flatten(saved)
    names, values = [k for k, _ in flat], [v for _, v in flat]
    call = _layer_call(layer, layout)

    def forward(*arrays):
        layer.update(tree_unflatten(list(zip(names, arrays[:-1]))))
        return call(arrays[-1])

    mx.eval(x, values)
    mx.synchronize()
    # From an empty cache, as in _probe: a cached block handed to a smaller request counts whole,
    # so what earlier work left cached would move the figure (CI saw it 12% high).
    mx.clear_cache()
    try:
        with _no_garbage_collection():
            base = mx.get_active_memory()
            out, pending = mx.vjp(forward, [*values, x], [mx.zeros_like(x)])
            mx.eval(out)
            mx.synchronize()
            kept = mx.get_active_memory() - base - out[0].nbytes
        del out, pending
    finally:
        layer.update(saved)
        mx.clear_cache()
    # The input is the probe's own argument, already allocated; in the step it is the previous
    # layer's output, kept by every layer (normalisation or recomputation needs it).
    return max(kept, 0) + x.nbytes


def estimate(model: nn.Module, batch: int, length: int, supervised: int, optimizer_state,
             window: bool, packed: bool, loss_of_hidden, may_pace: bool = True) -> Estimate:
    """The peak memory of training ``model`` on micro-batches of ``batch`` x ``length`` tokens with
    ``supervised`` supervised positions. ``loss_of_hidden`` maps the ``[supervised, D]`` final
    hidden states to the scalar objective (output head included). ``may_pace``: whether the run
    could be paced; if not, the loss is not probed paced and ``loss_queued_ahead`` is 0."""
    trainable = _nbytes(model.trainable_parameters())
    # Half-precision trainables' gradients are summed in float32 (mlxft.step).
    working = sum(v.size * (4 if v.dtype in (mx.float16, mx.bfloat16) else v.itemsize)
                  for _, v in tree_flatten(model.trainable_parameters()))
    # Parameters, their gradient, the optimizer's (initialised) state, masters included, and the
    # open window's gradient sum when accumulating.
    state = trainable + working * (1 + int(window)) + _nbytes(optimizer_state)
    # The compiled step's update writes new parameters, masters and moments while it still holds
    # the old ones: MLX reuses an input's buffer for an output only where the input has no other
    # holder, which the outputs of the previous step's fused update (siblings of one kernel) do
    # not reliably meet. Full fine-tuning of SmolLM2-135M at batch 1 on the CPU peaked at the
    # update, 0.92 GB over its gradients and state where all of it would be 1.62 GB; priced whole.
    update = trainable + _nbytes(optimizer_state)
    weights = _nbytes(model.parameters()) - trainable
    layers = list(model.layers)
    dim = model.args.hidden_size
    dtype = compute_dtype(model)
    layout = None
    if packed:
        layout = DocumentLayout(mx.broadcast_to(mx.arange(length), (batch, length)), mx.zeros((batch, length), mx.int32),
                                dtype)
    x = mx.random.normal((batch, length, dim)).astype(dtype)
    # Layers that run alike: the same kind, checkpointed or not, MLP recomputed or not, trained or not.
    kinds: dict[tuple, list] = {}
    model_family = family(model)
    # The backward pass runs through every layer from the first trained one on, trained or not:
    # --targets may leave some kinds of layer untrained (LFM2's convolutions under attention-only
    # targets), and those that follow a trained layer keep their activations all the same.
    first = next((i for i, layer in enumerate(layers) if tree_flatten(layer.trainable_parameters())), len(layers))
    for i, layer in enumerate(layers):
        kind = "attention" if is_attention_layer(layer) else type(layer).__name__
        trained = i >= first
        kinds.setdefault((kind, is_checkpointed(layer), fastmath.recomputes_mlp(layer, model_family), trained),
                         []).append(layer)
    activations, transient, mlp_transient = 0, 0, 0
    savings, peaks = {}, {}  # id(layer) -> what recomputing it would save, and hold while it runs
    mlp_savings = {}  # id(layer) -> what recomputing its MLP's gate and up would save
    for (_, checkpointed, _, trained), members in kinds.items():
        if not trained:
            # Before the first trained layer (--num-layers N trains the last N): on no path from
            # a trainable parameter to the loss, so the backward pass skips them and their
            # activations are freed as the forward pass goes; only its own peak counts.
            untrained = _probe(_layer_call(members[0], layout), x)
            transient, mlp_transient = max(transient, untrained), max(mlp_transient, untrained)
            continue
        kept = _kept_for_backward(members[0], layout, x)
        peak = _layer_peak(members[0], layout, x)
        activations += kept * len(members)
        transient = max(transient, peak - kept)
        if checkpointed:
            mlp_transient = max(mlp_transient, peak - kept)
            continue
        # Recomputed, a layer keeps its input alone, and holds the rest again in its turn.
        savings.update((id(layer), kept - x.nbytes) for layer in members)
        peaks.update((id(layer), peak - x.nbytes) for layer in members)
        with fastmath.mlp_recomputed(members[0], model_family) as recomputing:
            kept_mlp, peak_mlp = (_kept_for_backward(members[0], layout, x), _layer_peak(members[0], layout, x)) \
                if recomputing else (kept, peak)
        mlp_transient = max(mlp_transient, peak_mlp - kept_mlp)
        mlp_savings.update((id(layer), max(kept - kept_mlp, 0)) for layer in members)
    hidden = mx.random.normal((max(supervised, 1), dim)).astype(dtype)
    # Compiled as in the step: the loss's backward is an elementwise expression that only a
    # compiled graph fuses (eagerly it allocates float32 [N, vocab] temporaries the step does not).
    # Chunked, its peak depends on how many chunks the backend has queued ahead of the one it
    # computes (MLX's CPU backend allocates an operation's output when it queues it, most of a
    # chunked loss at once), so it can differ between two probes: the estimate takes the
    # largest. Probed paced as well, the difference is what pacing takes off.
    loss_grad = mx.compile(mx.grad(loss_of_hidden))
    loss_bytes = max(_probe(loss_grad, hidden) for _ in range(3))
    queued_ahead = max(loss_bytes - _paced_probe(loss_grad, hidden), 0) if may_pace else 0
    # Every layer's input gradient flows through the embedding output of [batch, length, dim].
    embedding = batch * length * dim * dtype.size
    return Estimate(weights, state, activations + transient + embedding, loss_bytes,
                    tuple(savings.get(id(layer), 0) for layer in layers),
                    tuple(peaks.get(id(layer), 0) for layer in layers), transient, queued_ahead,
                    recompute_mlp_savings=tuple(mlp_savings.get(id(layer), 0) for layer in layers),
                    recompute_mlp_transient=mlp_transient, update=update)


def can_pace(estimate: Estimate | None) -> bool:
    """Whether the loss queues a twentieth of the run's peak or more ahead, and pacing would take
    it off: not where the optimizer's update, which pacing does not lower, peaks as high. Where
    pacing is not allowed (:func:`may_pace_here`), the estimate was made without the paced
    probe and its queue is 0."""
    # The paced estimate keeps a fifth of the queue (Estimate.pace).
    return estimate is not None and estimate.total - estimate.pace().total > 0.8 * 0.05 * estimate.total


def may_pace_here() -> bool:
    """Whether pacing is allowed on this device: not on Metal, where it is unmeasured."""
    return device_kind() != "Metal"


def pacing_limit(estimate: Estimate) -> int:
    """The memory limit that paces a run, given its :meth:`Estimate.pace`.

    MLX waits for queued work once past its memory limit, so a limit under the unpaced peak
    stops the backend queueing the loss's chunks ahead of the one it computes. The limit is
    the paced estimate less the smaller of the loss and the layers' backward transient, which
    do not overlap. The paced loss keeps a fifth of the queue as headroom, since a limit below
    what a step needs makes MLX wait for every operation (SmolLM2-135M on the CPU: 3x the
    step time with the limit 0.4 GB under). Never under what the optimizer's update needs."""
    held = estimate.weights + estimate.training_state
    backward = held + estimate.activations + estimate.loss
    return int(max(backward - min(estimate.transient, estimate.loss), held + estimate.update))


def is_out_of_memory(err: BaseException) -> bool:
    """Whether an MLX error is an allocation failure (Metal, CUDA or CPU wording)."""
    text = str(err).lower()
    return any(w in text for w in ("out of memory", "outofmemory", "insufficient memory", "unable to allocate",
                                   "attempting to allocate", "malloc"))


def layers_to_fit(config, estimate: Estimate | None, limit: float | None) -> int | None:
    """How many first layers the run should recompute for ``estimate`` to fit ``limit``: the
    fewest that do, or every layer when none does. None when there is nothing to price: no
    estimate, one that fits already, every layer recomputed already, ``--checkpoint-keep-mlp``
    (whose layers the estimate does not price), or no layer that would keep less."""
    model = config.model
    if estimate is None or limit is None or estimate.total <= limit or model.checkpoint_keep_mlp \
            or (model.grad_checkpoint and not model.checkpoint_layers) or not any(estimate.recompute_savings):
        return None
    return estimate.layers_to_recompute(limit) or len(estimate.recompute_savings)


def mlp_recomputation_fits(config, estimate: Estimate | None, limit: float | None) -> bool:
    """Whether recomputing the MLPs' gate and up (``--recompute-mlp``) in more layers would bring
    ``estimate`` under ``limit``: a run over it with MLPs left that keep them, whose estimate
    priced that setting."""
    model = config.model
    return (estimate is not None and limit is not None and estimate.total > limit
            and not model.checkpoint_keep_mlp and any(estimate.recompute_mlp_savings)
            and estimate.total_recomputing_mlp() <= limit)


def mlp_layers_to_fit(config, estimate: Estimate | None, limit: float | None) -> int | None:
    """How many first layers' MLPs the run should recompute for ``estimate`` to fit ``limit``:
    the fewest that do, counted from the first layer; None where :func:`mlp_recomputation_fits`
    says no."""
    return estimate.mlp_layers_to_recompute(limit) if mlp_recomputation_fits(config, estimate, limit) else None


def _mlp_hint(config, estimate: Estimate, first: int) -> str:
    """``first`` from :func:`mlp_layers_to_fit` as flags, with the estimate they give."""
    every = first >= len(estimate.recompute_mlp_savings)
    flags = [] if config.model.recompute_mlp else ["--recompute-mlp"]
    if not every:
        flags.append(f"--recompute-mlp-layers {first}")
    elif config.model.recompute_mlp:
        flags.append("--recompute-mlp-layers 0")
    return f"{' '.join(flags)} (estimated {estimate.total_recomputing_mlp(first) / GB:.2f} GB)"


def prefers_mlp_recomputation(config, estimate: Estimate | None, limit: float | None) -> bool:
    """Whether to advise (and ``--fit-memory`` to apply) ``--recompute-mlp`` before checkpointing:
    when it fits and checkpointing would recompute more than half of the layers. Computing gate
    and up again cost a fifth to a half of what recomputing every layer did: on the CPU
    (SmolLM2-135M chat) 5% of the tokens/s against 26%, on the H200 (Llama-3.2-1B and LFM2-1.2B
    chat) a few percent to a fifth against a fifth to a third."""
    if not mlp_recomputation_fits(config, estimate, limit):
        return False
    first = layers_to_fit(config, estimate, limit)  # every layer where none is enough
    return first is None or 2 * first > len(estimate.recompute_savings)


def _recompute_hint(config, estimate: Estimate | None, limit: float | None) -> str | None:
    """:func:`layers_to_fit` as flags, with the estimate they give; plain ``--grad-checkpoint``
    when it has no count (an estimate that said the run fits has been shown wrong by the run)."""
    model = config.model
    first = layers_to_fit(config, estimate, limit)
    if first is None:
        return None if model.grad_checkpoint else "--grad-checkpoint"
    if first >= len(estimate.recompute_savings):  # 0 = every layer
        flags = "--checkpoint-layers 0" if model.grad_checkpoint else "--grad-checkpoint"
    else:
        flags = ("" if model.grad_checkpoint else "--grad-checkpoint ") + f"--checkpoint-layers {first}"
    return f"{flags} (estimated {estimate.total_recomputing(first) / GB:.2f} GB)"


def _smaller_batch_hint(batch_size: int, accum: int, ranks: int) -> str | None:
    """The batch split into the fewest more accumulated micro-batches that each rank can still
    share evenly (the same effective batch), or None where it cannot be split."""
    for parts in range(2, batch_size + 1):
        smaller = batch_size // parts
        if batch_size % parts == 0 and smaller % ranks == 0 and smaller >= ranks:
            return f"--batch-size {smaller} with --grad-accum-steps {accum * parts} (same effective batch)"
    return None


LOSS_CHUNK_HINT = 1024  # supervised positions a chunk: what the advice offers a trained head


def advice(config, estimate: Estimate | None = None, limit: float | None = None, ranks: int = 1,
           quantized: bool = False, longest: int | None = None, resume: str | None = None,
           scored_at_once: int = 0) -> str:
    """The settings that bring a run's memory down, most effective first. Given the run's
    ``estimate`` and the ``limit`` it passed, recomputation is advised for as few layers as fit
    (the rest keep their activations and their speed), and ``--recompute-mlp`` for as few
    layers' MLPs as fit, first when checkpointing would take more than half of the layers.
    ``longest``: the training set's longest row, which a shorter --max-seq-length must cut.
    ``scored_at_once``: the positions the largest micro-batch's loss scores through a trained
    output head in one piece, which --loss-chunk would score a chunk at a time (0: none).
    ``resume``: the checkpoint a stopped run continues from, with which the advice says which
    settings a resume takes, which need its ``--force`` and which only a new run can have."""
    hints = []  # (flags, what resuming with them needs: "" nothing, "force" or "new" a new run)
    recompute = _recompute_hint(config, estimate, limit)
    if recompute:
        hints.append((recompute, ""))
    mlp_layers = mlp_layers_to_fit(config, estimate, limit)
    if mlp_layers is not None:
        mlp = (_mlp_hint(config, estimate, mlp_layers), "")
        hints.insert(0 if prefers_mlp_recomputation(config, estimate, limit) else len(hints), mlp)
    # Each hint below must be a setting validation takes and that differs from the run's own.
    # Resuming checks the settings in checkpoint.RESUME_FIXED and RESUME_FORCEABLE.
    smaller_batch = _smaller_batch_hint(config.train.batch_size, config.train.grad_accum_steps, ranks)
    if smaller_batch:
        hints.append((smaller_batch, "force"))
    length = min(config.data.max_seq_length, longest or config.data.max_seq_length)  # halving more cuts nothing
    if length // 2 >= 2:
        hints.append((f"--max-seq-length {length // 2}", "force"))
    if scored_at_once > LOSS_CHUNK_HINT:  # frozen heads chunk anyway, and fewer make one chunk
        hints.append((f"--loss-chunk {LOSS_CHUNK_HINT}", ""))
    if config.train.clear_cache_above != 0:
        hints.append(("--clear-cache-above 0", ""))
    if config.adapter.finetune == "full":
        whole_layers = WHOLE_LAYERS in config.adapter.targets  # a target LoRA cannot take
        hints.append(("--finetune lora" + (" --targets default" if whole_layers else ""), "new"))
    elif not config.model.quantize and not quantized:
        hints.append(("--quantize 4", "new"))
    if resume is None:
        return "lower memory with " + ", or ".join(flags for flags, _ in hints)
    resumable = [flags + (" and --force" if needs == "force" else "") for flags, needs in hints if needs != "new"]
    fresh = [flags for flags, needs in hints if needs == "new"]
    ways = [f"lower memory with {', or '.join(resumable)}, and continue with --resume {resume}"] if resumable else []
    if fresh:
        ways.append(("or " if ways else "") + f"start a new run with {', or '.join(fresh)}")
    return "; ".join(ways)
