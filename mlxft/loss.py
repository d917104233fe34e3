"""The training objective: token-weighted, masked cross-entropy returning ``(loss, ntokens)``.

Batches name the supervised positions explicitly (see :class:`mlxft.data.Batch`). For
architectures with a plain output head only those positions are projected to the
vocabulary, so the full ``[B, T, vocab]`` logits never exist; for the rest the logits are
computed as the model defines them and the same positions are read out of them. With
``chunk`` the supervised positions are scored a chunk at a time, each chunk's logits
recomputed in the backward pass (with a frozen head, :func:`head_cross_entropy` instead). At
MLX's default evaluation width several chunks' logits are alive together; at the width mlxft
sets on CUDA and the CPU (one branch at a time, see :func:`mlxft._gpu.narrow_evaluation`)
they are computed one after another, but the backend still allocates the chunks it has
queued, which on the CPU is most of them unless evaluation is paced
(:func:`mlxft.memory.pacing_limit`). Chunking saved 1 GB for a 128k vocabulary on CUDA (at
the default width) and 12% of a checkpointed step's peak on the CPU (at width 1; benchmarks/README.md).
The cross-entropy's own backward (:func:`token_cross_entropy`) returns the logits' gradient in
the logits' dtype from one fused expression, so no float32 ``[N, vocab]`` tensor outlives the
forward pass.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxft import packing
from mlxft.fastmath import input_gradient
from mlxft.models import head_projection, hidden_states, logits_transformed, output_head


def perplexity(loss: float) -> float:
    """exp(loss), the same in training's records and in evaluation; a float holds it up to a
    loss of 709, so larger losses read as exp(700)."""
    return math.exp(min(loss, 700.0))


def _log_partition_and_softmax(wide: mx.array) -> tuple[mx.array, mx.array]:
    """``logsumexp(wide, -1)`` (keeping the axis) and ``softmax(wide)`` over the last axis, on the CPU.

    Both come from one pass of exponentials: MLX's CPU logsumexp runs a scalar exp, while the
    exp of a compiled elementwise expression is built for the processor (:mod:`mlxft._jit`):
    over 1216 x 32000 float32 logits on this repository's Xeon, logsumexp took 460 ms, the
    compiled exp 143. The exponentials cost a float32 array of the logits' shape, which the
    softmax needs anyway."""
    top = wide.max(axis=-1, keepdims=True)
    exps = mx.exp(wide - top)
    total = exps.sum(axis=-1, keepdims=True)
    return top + mx.log(total), exps * (1 / total)


def _scores_on_cpu(logits: mx.array, targets: mx.array, smoothing: float):
    """``(log-partition, picked logit, mean logit or None, probabilities)``, float32, from a
    float32 copy of the logits (see :func:`_log_partition_and_softmax`)."""
    wide = logits.astype(mx.float32)
    lse, probs = _log_partition_and_softmax(wide)
    picked = mx.take_along_axis(wide, targets[:, None], axis=-1)
    return lse, picked, wide.mean(-1, keepdims=True) if smoothing else None, probs


def _scores_from_softmax(logits: mx.array, targets: mx.array, smoothing: float):
    """:func:`_scores_on_cpu`'s four, the probabilities in the logits' dtype, without a float32
    copy of the logits: for a GPU, where MLX's softmax is one kernel accumulating in float32.

    A half-precision chunk's float32 copy is twice the logits (Llama-3.2-1B, 512 tokens: 263
    MB), and a GPU backend allocates every chunk it has queued. The log-partition comes from the
    largest probability, ``lse = max(logits) - log(max(softmax))``, which is at least 1/vocab,
    so its log never overflows; rounded to bfloat16 it is exact to 2**-8 of itself, so a token's
    loss to 0.004 at most, and unbiased. The gradient is the rounded probabilities less the target,
    as before but for the target's own entry, rounded twice."""
    probs = mx.softmax(logits, axis=-1, precise=True)
    top = logits.max(axis=-1, keepdims=True).astype(mx.float32)
    lse = top - mx.log(probs.max(axis=-1, keepdims=True).astype(mx.float32))
    picked = mx.take_along_axis(logits, targets[:, None], axis=-1).astype(mx.float32)
    mean = logits.astype(mx.float32).mean(-1, keepdims=True) if smoothing else None
    return lse, picked, mean, probs


def _device_scores():
    """How this device scores a chunk: a float32 copy of the logits on the CPU, the softmax elsewhere."""
    return _scores_on_cpu if mx.default_device() == mx.cpu else _scores_from_softmax


def loss_and_logit_gradient(scores, logits: mx.array, targets: mx.array, smoothing: float):
    """Per-token (label-smoothed) cross-entropy, float32 ``[N]``, and its gradient with respect to
    ``logits`` in their dtype (softmax less the smoothed target), from ``scores``' four."""
    lse, picked, mean, probs = scores(logits, targets, smoothing)
    ce = lse - picked if not smoothing else lse - (1 - smoothing) * picked - smoothing * mean
    hit = mx.arange(logits.shape[-1]) == targets[:, None]
    target = (1 - smoothing) * hit + smoothing / logits.shape[-1] if smoothing else hit
    return ce[:, 0], (probs - target).astype(logits.dtype)


@functools.cache
def _token_cross_entropy(smoothing: float):
    """The per-token cross-entropy with this label smoothing, as a function with its own backward."""

    @mx.custom_function
    def forward(logits: mx.array, targets: mx.array):
        # Float32 per-token losses, and the log-partition the backward pass reuses.
        wide = logits.astype(mx.float32)
        lse = mx.logsumexp(wide, axis=-1)
        picked = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0].astype(mx.float32)
        ce = lse - picked if not smoothing else lse - (1 - smoothing) * picked - smoothing * wide.mean(axis=-1)
        return ce, lse

    @forward.vjp
    def backward(primals, cotangents, outputs):
        # Autograd of the forward would keep the float32 copy of the logits and scatter the
        # target term into a float32 [N, vocab] zero tensor. Written out, softmax minus the
        # (smoothed) target is one elementwise expression, which a compiled step fuses into a
        # kernel writing the logits' own dtype. The log-partition's cotangent is ignored.
        logits, targets = primals
        probs = mx.exp(logits.astype(mx.float32) - outputs[1][:, None])
        hit = mx.arange(logits.shape[-1]) == targets[:, None]
        target = (1 - smoothing) * hit + smoothing / logits.shape[-1] if smoothing else hit
        grad = (probs - target) * cotangents[0][:, None]
        return grad.astype(logits.dtype), mx.zeros_like(targets)

    return forward


def token_cross_entropy(logits: mx.array, targets: mx.array, label_smoothing: float = 0.0) -> mx.array:
    """``nn.losses.cross_entropy(logits, targets, label_smoothing, reduction="none")`` in float32,
    whose gradient reaches the logits in their dtype without float32 ``[N, vocab]`` temporaries."""
    return _token_cross_entropy(float(label_smoothing))(logits, targets)[0]


def cross_entropy(logits: mx.array, targets: mx.array, weights: mx.array, label_smoothing: float = 0.0):
    """Mean cross-entropy over tokens with weight 1 (weights are 0/1) and their count."""
    ce = token_cross_entropy(logits, targets, label_smoothing)
    ntokens = weights.sum()
    return (ce * weights).sum() / mx.maximum(ntokens, 1), ntokens


def _hidden(model: nn.Module, inputs, positions, doc_positions, segments) -> mx.array:
    """Final hidden states ``[N, D]`` at the flattened supervised ``positions``."""
    if doc_positions is not None:
        hidden = packing.hidden_states(model, inputs, doc_positions, segments)
    else:
        hidden = hidden_states(model, inputs)
    return hidden.reshape(-1, hidden.shape[-1])[positions]


def _head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The output head's module (``lm_head`` or the tied embedding) and the function projecting
    hidden states to logits through it (a plain-head architecture's, with its family's transform
    of the logits where it has one)."""
    module = model.lm_head if "lm_head" in model else model.model.embed_tokens
    return module, output_head(model) or head_projection(model)


def chunked_cross_entropy(model: nn.Module, hidden, targets, weights, label_smoothing: float, chunk: int):
    # The head's parameters enter each checkpoint as inputs, so a trained head (full
    # fine-tuning, tied embeddings) still receives its gradient.
    module, project = _head(model)

    def chunk_loss(start):
        # Targets and weights are closed over: only the head and the hidden states are differentiated.
        def loss(params, h):
            # The head holds the chunk's parameters only while it projects: left there, a
            # trace's placeholders (the compiled memory probe's) outlived the trace.
            kept = module.trainable_parameters()
            module.update(params)
            try:
                ce = token_cross_entropy(project(h), targets[start:start + chunk], label_smoothing)
            finally:
                module.update(kept)
            return (ce * weights[start:start + chunk]).sum()

        return mx.checkpoint(loss)

    params = module.trainable_parameters()
    total = sum(chunk_loss(i)(params, hidden[i:i + chunk]) for i in range(0, hidden.shape[0], chunk))
    ntokens = weights.sum()
    return total / mx.maximum(ntokens, 1), ntokens


def _head_chunk_logits() -> int:
    """The logits in a chunk of :func:`head_cross_entropy` when --loss-chunk is not set. The CPU:
    about 8M (SmolLM2-135M, 4 x 224 tokens: 128-token chunks peaked 0.09 GB lower than 320, as
    fast). A GPU: about 64M, since more launches cost time there and its backend queues far
    ahead anyway (Llama-3.2-1B chat on the H200: 39k tokens/s in chunks of 64 tokens, 44-51k
    in chunks of 512)."""
    return 2**23 if mx.default_device() == mx.cpu else 2**26


def frozen_head(model: nn.Module) -> nn.Module | None:
    """The output head module (``lm_head`` or the tied embedding) when the architecture's split is
    plain and nothing in the head trains: what :func:`head_cross_entropy` needs."""
    if output_head(model) is None or logits_transformed(model):
        return None
    head = _head(model)[0]
    plain = type(head) in (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)
    return head if plain and not tree_flatten(head.trainable_parameters()) else None


def head_cross_entropy(model: nn.Module, hidden, targets, weights, label_smoothing: float = 0.0, chunk: int = 0,
                       scores=None):
    """:func:`cross_entropy` of a :func:`frozen_head`'s logits, whose gradient with respect to
    ``hidden`` is computed in the forward pass, a chunk of ``chunk`` tokens at a time.

    The cross-entropy's gradient is ``softmax - target`` times the per-token cotangent, so the
    forward pass can already compute each token's ``(softmax - target) @ head`` and keep that
    ``[N, D]`` array instead of the ``[N, vocab]`` logits: no logits outlive their chunk and
    nothing is recomputed (the backward pass scales the kept rows). Only for training: the
    forward pass does the backward pass's matmul as well. ``scores``: how a chunk is scored
    (:func:`_scores_on_cpu` or :func:`_scores_from_softmax`; default: this device's)."""
    head, project = _head(model)
    smoothing = float(label_smoothing)
    scores = scores or _device_scores()

    @mx.custom_function
    def scored(hidden, targets):
        ce, grad_logits = loss_and_logit_gradient(scores, project(hidden), targets, smoothing)
        return ce, input_gradient(head, grad_logits)

    @scored.vjp
    def scored_vjp(primals, cotangents, outputs):
        hidden, targets = primals
        return (cotangents[0][:, None] * outputs[1]).astype(hidden.dtype), mx.zeros_like(targets)

    if not chunk:
        chunk = max(64, _head_chunk_logits() // head["weight"].shape[0] // 64 * 64)  # weight: [vocab, ...]
    total = None
    for start in range(0, hidden.shape[0], chunk):
        ce = scored(hidden[start:start + chunk], targets[start:start + chunk])[0]
        part = (ce * weights[start:start + chunk]).sum()
        total = part if total is None else total + part
    ntokens = weights.sum()
    return total / mx.maximum(ntokens, 1), ntokens


def hidden_loss(model: nn.Module, hidden, targets, weights, label_smoothing: float = 0.0, chunk: int = 0,
                training: bool = False):
    """``(loss, ntokens)`` from the supervised final hidden states ``[N, D]`` (plain heads only).
    ``training`` with a :func:`frozen_head`: :func:`head_cross_entropy`; otherwise in recomputed
    chunks when ``chunk`` is set and smaller than ``N``."""
    if training and frozen_head(model) is not None:
        return head_cross_entropy(model, hidden, targets, weights, label_smoothing, chunk)
    if chunk and hidden.shape[0] > chunk:
        return chunked_cross_entropy(model, hidden, targets, weights, label_smoothing, chunk)
    return cross_entropy(output_head(model)(hidden), targets, weights, label_smoothing)


def loss_fn(model: nn.Module, inputs, positions, targets, weights, doc_positions=None, segments=None,
            label_smoothing: float = 0.0, chunk: int = 0, training: bool = False):
    """``(loss, ntokens)`` of one batch: the loss the trainer differentiates (``training``, see
    :func:`hidden_loss`) and reports."""
    if output_head(model) is None and doc_positions is None:  # the model's own logits, read at the positions
        logits = model(inputs)
        return cross_entropy(logits.reshape(-1, logits.shape[-1])[positions], targets, weights, label_smoothing)
    hidden = _hidden(model, inputs, positions, doc_positions, segments)
    return hidden_loss(model, hidden, targets, weights, label_smoothing, chunk, training)


def evaluation_loss(model: nn.Module, inputs, positions, targets, weights, doc_positions=None, segments=None,
                    chunk: int = 0):
    """``(loss, ntokens)`` as :func:`loss_fn` gives it, for evaluation (no backward pass). With
    ``chunk``, each chunk's logits are reduced and evaluated before the next chunk's exist:
    built as one lazy graph, MLX computes the chunks side by side and holds all their logits
    (2,048 tokens over a 152k vocabulary: 1.24 GB in chunks of 512, as whole), so validation
    would peak where --loss-chunk kept training low."""
    if not chunk or output_head(model) is None or targets.shape[0] <= chunk:
        return loss_fn(model, inputs, positions, targets, weights, doc_positions, segments, chunk=chunk)
    hidden = _hidden(model, inputs, positions, doc_positions, segments)
    head, total = output_head(model), mx.array(0.0)
    for start in range(0, hidden.shape[0], chunk):
        ce = token_cross_entropy(head(hidden[start:start + chunk]), targets[start:start + chunk])
        total = total + (ce * weights[start:start + chunk]).sum()
        mx.eval(total)
    ntokens = weights.sum()
    return total / mx.maximum(ntokens, 1), ntokens
