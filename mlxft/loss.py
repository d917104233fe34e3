"""The training objective: token-weighted, masked cross-entropy returning ``(loss, ntokens)``.

Batches name the supervised positions explicitly (see :class:`mlxft.data.Batch`). For
architectures with a plain output head only those positions are projected to the
vocabulary, so the full ``[B, T, vocab]`` logits never exist; for the rest the logits are
computed as the model defines them and the same positions are read out of them. With
``chunk`` the supervised positions are scored a chunk at a time, each chunk's logits
recomputed in the backward pass, so at most ``[chunk, vocab]`` of them are alive at once.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxft import packing
from mlxft.models import hidden_states, output_head


def cross_entropy(logits: mx.array, targets: mx.array, weights: mx.array, label_smoothing: float = 0.0):
    """Mean cross-entropy over tokens with weight 1 (weights are 0/1) and their count."""
    ce = nn.losses.cross_entropy(
        logits.astype(mx.float32), targets, label_smoothing=label_smoothing, reduction="none"
    )
    ntokens = weights.sum()
    return (ce * weights).sum() / mx.maximum(ntokens, 1), ntokens


def _hidden(model: nn.Module, inputs, positions, doc_positions, segments) -> mx.array:
    """Final hidden states ``[N, D]`` at the flattened supervised ``positions``."""
    if doc_positions is not None:
        hidden = packing.hidden_states(model, inputs, doc_positions, segments)
    else:
        hidden = hidden_states(model, inputs)
    return hidden.reshape(-1, hidden.shape[-1])[positions]


def chunked_cross_entropy(model: nn.Module, hidden, targets, weights, label_smoothing: float, chunk: int):
    # The head's parameters enter each checkpoint as inputs, so a trained head (full
    # fine-tuning, tied embeddings) still receives its gradient.
    module = model.lm_head if "lm_head" in model else model.model.embed_tokens
    project = module if "lm_head" in model else module.as_linear

    def chunk_loss(start):
        # Targets and weights are closed over: only the head and the hidden states are differentiated.
        def loss(params, h):
            module.update(params)
            logits = project(h).astype(mx.float32)
            ce = nn.losses.cross_entropy(logits, targets[start:start + chunk], label_smoothing=label_smoothing,
                                         reduction="none")
            return (ce * weights[start:start + chunk]).sum()

        return mx.checkpoint(loss)

    params = module.trainable_parameters()
    total = sum(chunk_loss(i)(params, hidden[i:i + chunk]) for i in range(0, hidden.shape[0], chunk))
    ntokens = weights.sum()
    return total / mx.maximum(ntokens, 1), ntokens


def hidden_loss(model: nn.Module, hidden, targets, weights, label_smoothing: float = 0.0, chunk: int = 0):
    """``(loss, ntokens)`` from the supervised final hidden states ``[N, D]`` (plain heads only),
    in recomputed chunks when ``chunk`` is set and smaller than ``N``."""
    if chunk and hidden.shape[0] > chunk:
        return chunked_cross_entropy(model, hidden, targets, weights, label_smoothing, chunk)
    return cross_entropy(output_head(model)(hidden), targets, weights, label_smoothing)


def loss_fn(model: nn.Module, inputs, positions, targets, weights, doc_positions=None, segments=None,
            label_smoothing: float = 0.0, chunk: int = 0):
    """``(loss, ntokens)`` of one batch: the loss the trainer differentiates and reports."""
    if output_head(model) is None and doc_positions is None:  # the model's own logits, read at the positions
        logits = model(inputs)
        return cross_entropy(logits.reshape(-1, logits.shape[-1])[positions], targets, weights, label_smoothing)
    hidden = _hidden(model, inputs, positions, doc_positions, segments)
    return hidden_loss(model, hidden, targets, weights, label_smoothing, chunk)
