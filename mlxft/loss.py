"""The training objective: token-weighted, masked cross-entropy returning ``(loss, ntokens)``.

Batches name the supervised positions explicitly (see :class:`mlxft.data.Batch`). For
architectures with a plain output head only those positions are projected to the
vocabulary, so the full ``[B, T, vocab]`` logits never exist; for the rest the logits are
computed as the model defines them and the same positions are read out of them.
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


def supervised_logits(model: nn.Module, inputs: mx.array, positions: mx.array, doc_positions=None, segments=None):
    """Logits ``[N, vocab]`` at the flattened ``positions`` of ``inputs`` ``[B, T]``.

    ``doc_positions`` and ``segments`` describe a packed batch (see :mod:`mlxft.packing`)."""
    head = output_head(model)
    if doc_positions is not None:
        hidden = packing.hidden_states(model, inputs, doc_positions, segments)
    elif head is None:
        logits = model(inputs)
        return logits.reshape(-1, logits.shape[-1])[positions]
    else:
        hidden = hidden_states(model, inputs)
    return head(hidden.reshape(-1, hidden.shape[-1])[positions])


def loss_fn(model: nn.Module, inputs, positions, targets, weights, doc_positions=None, segments=None,
            label_smoothing: float = 0.0):
    """``(loss, ntokens)`` of one batch: the loss the trainer differentiates and reports."""
    logits = supervised_logits(model, inputs, positions, doc_positions, segments)
    return cross_entropy(logits, targets, weights, label_smoothing)
