"""LoRA projections of a normalised input that keep the norm's input, not its output.

A transformer layer normalises its input and hands the result to the LoRA projections
that read it (q, k and v, or LFM2's convolution input; the MLP's gate and up). Each
adapter's ``lora_a`` gradient needs that normalised array, so autograd keeps it for the
backward pass: two ``[tokens, hidden]`` arrays a layer, besides the layer's input, which the
norm's own backward pass keeps anyway. Here those projections recompute the norm from the
layer's input in their backward pass (an elementwise pass, no matmul) and the normalised
array is freed once the projections have read it. On the CPU only: see :func:`enable`.

How a projection knows its input is a norm's output: inside a layer (see :func:`enable`),
the layer's two norms record each output they return with the input they normalised; a
plain LoRA projection (see :func:`mlxft.lora.plain_lora`) handed one of those very
arrays takes :func:`lora_of_normed`. Anything else computes as before.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from mlxft import models


class _Recorded:
    """The norm outputs of the layer running now: ``id(output) -> (output, _Source)``. None
    outside a layer, so nothing outlives the layer's call."""

    outputs: dict | None = None


class _Source:
    """What a norm's output was computed from: its input, the norm, and its per-row scale."""

    def __init__(self, x: mx.array, norm: nn.RMSNorm, scale: mx.array):
        self.x, self.norm, self.scale = x, norm, scale

    def again(self, cotangent: mx.array) -> mx.array:
        """The norm's output, computed again for a backward pass: one elementwise pass. Each
        projection computes its own: kept on this object for all of them, the array would
        close a reference cycle through MLX's graph (its vjp closure holds this object) that
        Python cannot collect, and the memory probes' traced arrays would leak."""
        # Tied to the cotangent so the compiled step cannot merge it with the forward's norm.
        return _scaled(mx.depends(self.x, cotangent), self.scale, self.norm["weight"])


def _scaled(x, scale, weight):
    return (x.astype(mx.float32) * scale).astype(x.dtype) * weight


@functools.cache
def _rms_norm(eps: float):
    """``mx.fast.rms_norm`` with this ``eps``, also returning its per-row scale ``1 / rms(x)``
    in float32: with it, recomputing the output is one elementwise pass, without the mean of
    squares (SmolLM2-135M on the CPU, 6 layers: 5.5 ms a layer recomputing with the mean,
    within noise of keeping the output with it). Its backward pass is ``mx.fast.rms_norm``'s."""

    @mx.custom_function
    def forward(x, weight):
        scale = mx.rsqrt(mx.square(x.astype(mx.float32)).mean(axis=-1, keepdims=True) + eps)
        return _scaled(x, scale, weight), scale

    @forward.vjp
    def backward(primals, cotangents, outputs):
        return mx.vjp(lambda x, weight: mx.fast.rms_norm(x, weight, eps), list(primals), [cotangents[0]])[1]

    return forward


def _recording_norm(self, x):
    if _Recorded.outputs is None or x.ndim != 3 or x.shape[1] == 1:  # not one decoded token
        return mx.fast.rms_norm(x, self["weight"], self.eps)
    out, scale = _rms_norm(float(self.eps))(x, self["weight"])
    _Recorded.outputs[id(out)] = (out, _Source(x, self, scale))
    return out


def _recording_layer(plain_call):
    def call(self, *args, **kwargs):
        outer, _Recorded.outputs = _Recorded.outputs, {}
        try:
            return plain_call(self, *args, **kwargs)
        finally:
            _Recorded.outputs = outer

    return call


def norm_input(x: mx.array) -> _Source | None:
    """Where ``x`` came from, when it is the output of a recording norm in the running layer."""
    entry = _Recorded.outputs.get(id(x)) if _Recorded.outputs else None
    return entry[1] if entry is not None and entry[0] is x else None


def lora_of_normed(lora: nn.Module, normed: mx.array, source: _Source) -> mx.array:
    """``lora(normed)`` for a plain LoRA layer, where ``normed`` is the norm output ``source``
    describes: the backward pass recomputes it rather than keeping it."""
    from mlxft.fastmath import _lora, lora_gradients

    linear, scale = lora.linear, lora.scale

    @mx.custom_function
    def projected(normed, lora_a, lora_b):
        return _lora(lora, normed, lora_a, lora_b)

    @projected.vjp
    def projected_vjp(primals, cotangent, output):
        _, lora_a, lora_b = primals
        return lora_gradients(linear, scale, source.again(cotangent), cotangent, lora_a, lora_b, batched=True)

    return projected(normed, lora.lora_a, lora.lora_b)


def enable(model: nn.Module) -> bool:
    """On the CPU, have the layers of a supported family (Llama, LFM2) record their two norms'
    outputs, so their plain LoRA projections take :func:`lora_of_normed`; returns whether it
    applied. Call it before :func:`mlxft.models.checkpoint_layers`, which then recomputes the
    recording layer as it is.

    On the H200 it did not pay: Llama-3.2-1B chat (bf16, B=8) peaked at 9.24 against 9.76 GB
    but ran at 42-47k against 49-51k tokens/s, in every variant tried (flattened or batched
    adapter gradients, MLX's fused norm in the forward pass): a step there is paced by the
    host queueing its operations, and this adds several per projection. Metal is unmeasured."""
    parts = models.LAYER_PARTS.get(models.family(model))
    if parts is None or mx.default_device() != mx.cpu:
        return False
    for layer in model.layers:
        for name in (parts.norm, parts.mlp_norm):
            if type(layer[name]) is nn.RMSNorm:
                models.override_call(layer[name], _recording_norm, "_mlxft_recording")
        models.override_call(layer, _recording_layer(type(layer).__call__), "_mlxft_recording")
    return True
