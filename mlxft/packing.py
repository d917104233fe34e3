"""Sequence packing with per-document isolation, on top of mlx-lm's own layers.

Packing lays the rows of a micro-batch end to end in as few sequences as possible, so the
step computes on real tokens instead of padding. Each row stays a document of its own:
attention gets a block-diagonal causal mask, rotary positions restart at every document
start, and LFM2's short convolutions read no token of the previous document. The loss and
gradients therefore equal those of the unpacked micro-batch (tests check this).

mlx-lm's layers take ``(x, mask, cache)``; the cache is the one channel through which they
read positions (``rope(x, offset=cache.offset)``). :class:`DocumentLayout` rides on it: its
``offset`` holds each token's position inside its document and it hands keys and values
back untouched. Attention rotary modules are wrapped to apply per-token offsets, and LFM2's
``ShortConv`` gets a subclass with a boundary-aware convolution; parameter names do not change.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxft.errors import UserError
from mlxft.models import call_beneath, override_call

SUPPORTED_FAMILIES = ("llama", "lfm2")


class DocumentLayout:
    """Per-token document positions ``[B, T]`` and the attention mask ``[B, 1, T, T]``.

    The mask is additive in the compute ``dtype``: CUDA's fused attention took 0.60 ms with
    it against 0.94 ms with a boolean mask (0.56 ms causal; `scripts/bench_attention.py`)."""

    def __init__(self, positions: mx.array, segments: mx.array, dtype: mx.Dtype = mx.float32,
                 window: int | None = None):
        self.offset = positions
        same_document = segments[:, :, None] == segments[:, None, :]
        steps = mx.arange(segments.shape[1])
        allowed = same_document & (steps[:, None] >= steps[None, :])
        self.mask = mx.where(allowed[:, None], mx.array(0, dtype), mx.array(-mx.inf, dtype))
        # Sliding-window layers (mlx-lm's ``use_sliding``): a query sees the last ``window`` tokens.
        self.window_mask = None
        if window:
            windowed = allowed & (steps[:, None] < steps[None, :] + window)
            self.window_mask = mx.where(windowed[:, None], mx.array(0, dtype), mx.array(-mx.inf, dtype))

    def update_and_fetch(self, keys, values):
        return keys, values


class DocumentRoPE(nn.Module):
    """A rotary embedding applied at per-token positions when given a ``[B, T]`` offset."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __call__(self, x, offset=0):
        if not (isinstance(offset, mx.array) and offset.ndim == 2):
            return self.inner(x, offset=offset)
        # mx.fast.rope takes one offset per batch entry: make every token its own entry.
        batch, heads, length, dims = x.shape
        tokens = x.transpose(0, 2, 1, 3).reshape(batch * length, heads, 1, dims)
        rotated = self.inner(tokens, offset=offset.reshape(-1))
        return rotated.reshape(batch, length, heads, dims).transpose(0, 2, 1, 3)


_DOCUMENTS = "_mlxft_documents"


def _document_short_conv(self, x, mask=None, cache=None):
    if not isinstance(cache, DocumentLayout):
        return call_beneath(self, _DOCUMENTS)(self, x, mask=mask, cache=cache)
    b, c, h = mx.split(self.in_proj(x), 3, axis=-1)
    bx = b * h
    weight = self.conv.weight  # [channels, kernel, 1]: tap j reads (kernel - 1 - j) steps back
    kernel, length = weight.shape[1], bx.shape[1]
    out = bx * weight[:, kernel - 1, 0]
    for back in range(1, kernel):
        shifted = mx.pad(bx, [(0, 0), (back, 0), (0, 0)])[:, :length]
        inside = (cache.offset >= back)[..., None]  # the token `back` steps earlier is in this document
        out = out + mx.where(inside, shifted, 0) * weight[:, kernel - 1 - back, 0]
    if "bias" in self.conv:
        out = out + self.conv.bias
    return self.out_proj(c * out)


def is_attention_layer(layer: nn.Module) -> bool:
    """Whether a decoder layer attends (LFM2 says so; Llama-style layers have ``self_attn``)."""
    return getattr(layer, "is_attention_layer", hasattr(layer, "self_attn"))


def check_supported(model: nn.Module) -> None:
    family = getattr(model, "model_type", "")
    if family not in SUPPORTED_FAMILIES:
        raise UserError(f"config field data.pack: packing supports the {'/'.join(SUPPORTED_FAMILIES)} families, "
                        f"not {family or type(model).__name__}; drop --pack")
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    for layer in model.layers:
        rope = getattr(getattr(layer, "self_attn", None), "rope", None)
        if isinstance(getattr(rope, "inner", rope), DynamicNTKScalingRoPE):
            # Its frequencies depend on the whole sequence's length, which a packed row does
            # not share with the documents in it.
            raise UserError("config field data.pack: this model's rope_scaling type 'dynamic' rescales positions by "
                            "the sequence length, which packing changes; drop --pack")


def enable(model: nn.Module) -> None:
    """Let ``model``'s layers honour a :class:`DocumentLayout` (idempotent)."""
    check_supported(model)
    for layer in model.layers:
        attention = getattr(layer, "self_attn", None)
        if attention is not None and not isinstance(attention.rope, DocumentRoPE):
            attention.rope = DocumentRoPE(attention.rope)
        conv = getattr(layer, "conv", None)
        if conv is not None:
            override_call(conv, _document_short_conv, _DOCUMENTS)


def hidden_states(model: nn.Module, inputs: mx.array, positions: mx.array, segments: mx.array) -> mx.array:
    """The body's final normalized hidden states of a packed batch (see :func:`enable`)."""
    body = model.model
    h = body.embed_tokens(inputs)
    sliding = any(getattr(layer, "use_sliding", False) for layer in body.layers)
    layout = DocumentLayout(positions, segments, h.dtype, getattr(body, "sliding_window", None) if sliding else None)
    for layer in body.layers:
        sliding_layer = getattr(layer, "use_sliding", False) and layout.window_mask is not None
        mask = layout.window_mask if sliding_layer else layout.mask
        h = layer(h, mask if is_attention_layer(layer) else None, cache=layout)
    norm = body.norm if "norm" in body else body.embedding_norm
    return norm(h)


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each summing to at most ``capacity``; deterministic."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def pack_layout(lengths: list[int], width: int) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    """Bins for rows of ``lengths`` tokens in sequences of ``width``, with per-token document
    positions and segment ids ``[n_bins, width]``; a bin's padding tail is one more segment."""
    bins = first_fit_decreasing(lengths, width)
    positions = np.zeros((len(bins), width), np.int32)
    segments = np.zeros((len(bins), width), np.int32)
    for row, members in enumerate(bins):
        start = 0
        for segment, i in enumerate(members + [None]):
            n = lengths[i] if i is not None else width - start
            positions[row, start:start + n] = np.arange(n)
            segments[row, start:start + n] = segment
            start += n
    return bins, positions, segments
