"""A vectorised exp for MLX's CPU backend, and the SwiGLU and attention built on it.

On the CPU MLX evaluates ``exp`` one element at a time: 14 ms for 1.5M floats on this
repository's 2-core machine, against 0.3 ms for an add and 0.5 ms for numpy's exp, so the
SiLU of every MLP is a large share of a CPU training step. :func:`exp` rebuilds it from
operations the backend vectorises (Cody-Waite range reduction, a degree-6 polynomial, the
power of two written into the exponent bits): 3.6 ms compiled, with a relative error under
3e-7 (MLX's own: 3e-6); SwiGLU's forward drops from 21.5 to 4.1 ms at that size. It does
not pay where the array outgrows the cache (the cross-entropy over a 49k vocabulary ran
slower with it), and GPUs have a fast exp in hardware, so :func:`active` keeps MLX's there.
MLX's CPU attention spends most of its time in the same exp, so it is written out here with
this one. SmolLM2-135M chat SFT on that machine: 1.26-1.32x mlx-lm's tokens/s over two runs,
against 1.17x before this module (1.37x twice once the benchmark timed every step after warm-up).

The SwiGLU here also has its own backward pass, on every device: it keeps only its two inputs
where autograd keeps the sigmoid and the SiLU as well (tested on a compiled stack of MLPs:
2 against 4 arrays of the MLP's width a block). SmolLM2-135M on the CPU, first 12 layers, 4 rows
of 256 tokens: the compiled step's peak fell from 1,069 to 939 MB. Where the down projection
is a LoRA layer, :func:`swiglu_lora` makes the SwiGLU and that projection one function, so the
SwiGLU's output is not kept for the adapter's gradient either (H200, plain chat: LFM2-1.2B
11.36 -> 10.49 GB at the same speed). With ``--recompute-mlp``, :func:`recomputed_mlp` makes the
whole LoRA MLP one function that keeps only its input and computes gate and up again.
With ``--recompute-mlp`` two more functions of that kind take the layer's mixer:
:func:`short_conv_lora` (LFM2's convolution keeps only its input projection's output) and, off
the CPU, :func:`attention_lora` (Llama and LFM2 attention keeps only q, k and v). What a layer
keeps, in arrays of ``[tokens, hidden]`` (``scripts/layer_kept.py`` on an H100; the CPU, with
the attention's function on, gave the same): Llama-3.2-1B's attention layer 6.6 -> 5.5,
LFM2-1.2B's 7.8 -> 5.5 and its convolution layer 9.0 -> 7.0 (without ``--recompute-mlp``: 14.6,
15.8 and 17.0).
"""

from __future__ import annotations

import contextlib
import sys

import mlx.core as mx
import mlx.nn as nn

from mlxft import models
from mlxft.errors import UserError
from mlxft.lora import plain_lora

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125  # ln 2 split so k * _LN2_HI is exact for the k that occur
_LN2_LO = 1.428606765330187e-06
_ROUND = 12582912.0  # 1.5 * 2**23: adding it rounds a float32 to the nearest integer
_TAYLOR = (1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0)
_LOWEST = -87.0  # below this exp underflows float32's normal range: the result is 0
_HIGHEST = 88.0



def active() -> bool:
    """Whether the step should use :func:`exp` (the CPU) rather than MLX's."""
    return mx.default_device() == mx.cpu


@mx.custom_function
def exp(x: mx.array) -> mx.array:
    """``e**x`` in float32 arithmetic, returned in ``x``'s dtype."""
    x32 = mx.clip(x.astype(mx.float32), _LOWEST, _HIGHEST)
    shifted = x32 * _LOG2E + _ROUND
    k = shifted - _ROUND
    r = (x32 - k * _LN2_HI) - k * _LN2_LO
    poly = mx.array(1.0 / 720, mx.float32)
    for c in _TAYLOR:
        poly = poly * r + c
    # The low bits of ``shifted`` hold k; k + 127 in the exponent field is 2**k.
    scale = mx.view(mx.left_shift(mx.view(shifted, mx.int32) - 0x4B400000 + 127, 23), mx.float32)
    return mx.where(x < _LOWEST, 0.0, poly * scale).astype(x.dtype)


@exp.vjp
def _exp_vjp(primals, cotangent, output):
    return cotangent * output


@mx.custom_function
def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis; the backward pass keeps only the output."""
    weights = exp(x - x.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


@softmax.vjp
def _softmax_vjp(primals, cotangent, output):
    return output * (cotangent - (cotangent * output).sum(axis=-1, keepdims=True))


def _sigmoid(x: mx.array) -> mx.array:
    return 1 / (1 + exp(-x)) if active() else mx.sigmoid(x)


@mx.custom_function
def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x``, whose backward pass keeps only ``gate`` and ``x``."""
    return gate * _sigmoid(gate) * x


@swiglu.vjp
def _swiglu_vjp(primals, cotangent, output):
    # Autograd would keep the sigmoid and the SiLU as well: two more [tokens, hidden] arrays a
    # layer. Recomputing the sigmoid costs one elementwise pass, which the compiled step fuses.
    gate, x = primals
    return _swiglu_input_gradients(cotangent, x, *_recomputed_silu(gate, cotangent))


def _recomputed_silu(gate: mx.array, cotangent: mx.array) -> tuple[mx.array, mx.array]:
    """``sigmoid(gate)`` and ``silu(gate)`` computed again for a backward pass.

    Tied to the cotangent, the recomputed sigmoid is a node of its own: otherwise the compiled
    step's common-subexpression elimination merges it with the forward pass's, which is then
    kept for the backward pass after all."""
    gate = mx.depends(gate, cotangent)
    sigmoid = _sigmoid(gate)
    return sigmoid, gate * sigmoid


def _swiglu_input_gradients(grad, x, sigmoid, silu_gate) -> tuple[mx.array, mx.array]:
    """The gradients of ``silu(gate) * x`` with respect to gate and x, given the output's."""
    return grad * x * (sigmoid + silu_gate * (1 - sigmoid)), grad * silu_gate


# Causal attention runs in blocks of about this many queries, each reading only the keys up to
# its last query (see :func:`attention`).
CAUSAL_BLOCK = 64
_MAX_CAUSAL_BLOCKS = 8


def attention(queries, keys, values, scale: float, mask) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` for ``[B, H, T, D]`` queries attending to
    ``[B, G, T, D]`` keys and values (grouped heads), written out with :func:`exp`.
    ``mask``: None, ``"causal"``, or a boolean or additive array broadcastable to ``[B, H, T, T]``.

    Causal attention skips the keys after each block of queries (with 4 blocks it computes 5/8
    of the ``[T, T]`` scores) and keeps none of its softmax weights for the backward pass (see
    :func:`_causal_in_blocks`). SmolLM2-135M's attention (9 query and 3 key heads) over 4 rows of
    256 tokens, forward and backward on an earlier 2-core Xeon: 21 ms blocked against 33 ms whole.
    Its whole training step on the benchmark's longest chat batch (4 x 256 tokens, a 2-core AMD
    EPYC): 0.81 GB above the model at the paced floor against 0.98 GB when the softmax weights were kept,
    in 11.4 s a step either way (mean of 6; single steps ranged 10.2-13.0 s on that machine).
    Array masks (packed rows) take the whole ``[T, T]`` path, which keeps the weights."""
    batch, heads, length, dims = queries.shape
    if isinstance(mask, str):
        blocks = max(1, min(_MAX_CAUSAL_BLOCKS, round(length / CAUSAL_BLOCK)))
        return _causal_in_blocks(queries, keys, values, scale, blocks)
    groups = keys.shape[1]
    per_group = heads // groups
    # Query head h reads key head h // per_group: group the queries so one matmul serves each.
    grouped = (queries * scale).reshape(batch, groups, per_group * length, dims)
    scores = (grouped @ keys.swapaxes(-1, -2)).reshape(batch, groups, per_group, length, length)
    if isinstance(mask, str):
        steps = mx.arange(length)
        mask = steps[:, None] >= steps[None, :]
    if mask is not None:
        if mask.ndim == 4:  # [B, H or 1, T, T] -> [B, G, H/G or 1, T, T]
            mask = mask.reshape(mask.shape[0], groups, per_group, length, length) if mask.shape[1] == heads \
                else mask[:, :, None]
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    weights = softmax(scores)
    out = weights.reshape(batch, groups, per_group * length, length) @ values
    return out.reshape(batch, heads, length, dims)


def _causal_in_blocks(queries, keys, values, scale: float, blocks: int) -> mx.array:
    """Causal :func:`attention` one block of queries at a time, over the keys up to the block's
    end, with a backward pass that keeps no weights.

    The forward pass keeps each query's log-partition (one float per query and head) instead of
    its ``[T]`` softmax weights; the backward pass recomputes the weights from it, one block at a
    time, so no block's weights outlive the block. That is one more matmul of queries and keys
    (small next to the projections) and one more pass of :func:`exp` over the scores."""
    batch, heads, length, dims = queries.shape
    groups = keys.shape[1]
    per_group = heads // groups
    edges = [length * i // blocks for i in range(blocks + 1)]
    spans = list(zip(edges[:-1], edges[1:]))
    steps = mx.arange(length)

    def block_of(grouped, start, end):  # [B, G, H/G, T, D] -> [B, G, H/G * size, D]
        return grouped[:, :, :, start:end].reshape(batch, groups, per_group * (end - start), dims)

    def scores_of(block, keys, start, end):
        scores = (block @ keys[:, :, :end].swapaxes(-1, -2)).reshape(batch, groups, per_group, end - start, end)
        return mx.where(steps[start:end, None] >= steps[None, :end], scores, -mx.inf)

    @mx.custom_function
    def attend(grouped, keys, values):
        outputs, log_partitions = [], []
        for start, end in spans:
            scores = scores_of(block_of(grouped, start, end), keys, start, end)
            peak = scores.max(axis=-1, keepdims=True)
            weights = exp(scores - peak)
            total = weights.sum(axis=-1, keepdims=True)
            size = end - start
            out = weights.reshape(batch, groups, per_group * size, end) @ values[:, :, :end]
            outputs.append(out.reshape(batch, groups, per_group, size, dims) / total)
            log_partitions.append(peak + mx.log(total))
        return mx.concatenate(outputs, axis=3), mx.concatenate(log_partitions, axis=3)

    @attend.vjp
    def attend_vjp(primals, cotangents, outputs):
        grouped, keys, values = primals
        grad_out, log_partition = cotangents[0], outputs[1]
        grad_queries, grad_keys, grad_values = [], 0, 0
        for start, end in spans:
            size = end - start
            block = block_of(grouped, start, end)
            # Tied to the cotangent, so the compiled step cannot merge it with the forward's scores.
            scores = scores_of(mx.depends(block, grad_out), keys, start, end)
            weights = exp(scores - log_partition[:, :, :, start:end])
            grad_block = block_of(grad_out, start, end)
            grad_weights = (grad_block @ values[:, :, :end].swapaxes(-1, -2)).reshape(weights.shape)
            grad_scores = weights * (grad_weights - (grad_weights * weights).sum(axis=-1, keepdims=True))
            flat_weights = weights.reshape(batch, groups, per_group * size, end)
            flat_scores = grad_scores.reshape(batch, groups, per_group * size, end)
            padding = [(0, 0), (0, 0), (0, length - end), (0, 0)]
            grad_values = grad_values + mx.pad(flat_weights.swapaxes(-1, -2) @ grad_block, padding)
            grad_keys = grad_keys + mx.pad(flat_scores.swapaxes(-1, -2) @ block, padding)
            grad_queries.append((flat_scores @ keys[:, :, :end]).reshape(batch, groups, per_group, size, dims))
        return mx.concatenate(grad_queries, axis=3), grad_keys, grad_values

    grouped = (queries * scale).reshape(batch, groups, per_group, length, dims)
    out, _ = attend(grouped, keys, values)
    return out.reshape(batch, heads, length, dims)


def _attention_for(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        # Training shapes on the CPU only: float32, no cache offset, no quantized cache, no sinks.
        training_shape = queries.dtype == mx.float32 and queries.shape[2] == keys.shape[2]
        plain = sinks is None and not hasattr(cache, "bits") and (not isinstance(mask, str) or mask == "causal")
        if training_shape and plain and active():
            return attention(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache, scale, mask, sinks)

    scaled_dot_product_attention.mlxft_original = original
    return scaled_dot_product_attention


def input_gradient(linear: nn.Module, cotangent: mx.array) -> mx.array:
    """The gradient of a frozen ``linear(x)`` with respect to ``x``: no activation needed.
    (Through ``mx.vjp`` the compiled step also kept the forward product, a [tokens, out] array.)
    ``linear`` may also be an embedding used as its own output head (``as_linear``)."""
    if isinstance(linear, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return mx.quantized_matmul(cotangent, linear["weight"], scales=linear["scales"], biases=linear.get("biases"),
                                   transpose=False, group_size=linear.group_size, bits=linear.bits, mode=linear.mode)
    return cotangent @ linear["weight"]


def lora_gradients(linear: nn.Module, scale: float, x: mx.array, cotangent: mx.array, lora_a: mx.array,
                   lora_b: mx.array, batched: bool = False) -> tuple[mx.array, mx.array, mx.array]:
    """The gradients of a plain LoRA layer's ``linear(x) + scale * (x @ lora_a) @ lora_b`` with
    respect to ``x``, ``lora_a`` and ``lora_b``, given the output's: what the functions with their
    own backward pass share. Computed in ``x``'s dtype, the adapters' gradients returned in theirs.
    ``batched``: keep the leading (row) axis and sum the adapters' gradients over it, where
    flattening a transposed cotangent (attention's q, k and v) would copy it."""
    grad_x, scaled, low_cotangent = lora_input_gradient(linear, scale, cotangent, lora_a, lora_b, x.dtype, batched)
    return (grad_x, *lora_adapter_gradients(x, scaled, low_cotangent, lora_a, lora_b, batched))


def lora_input_gradient(linear: nn.Module, scale: float, cotangent: mx.array, lora_a: mx.array, lora_b: mx.array,
                        dtype: mx.Dtype, batched: bool = False) -> tuple[mx.array, mx.array, mx.array]:
    """:func:`lora_gradients`' gradient with respect to the layer's input, which reads no
    activation, and the scaled and rank-r cotangents that :func:`lora_adapter_gradients` reads."""
    flat_cotangent = cotangent if batched else cotangent.reshape(-1, cotangent.shape[-1])
    scaled = (scale * flat_cotangent).astype(dtype)
    low_cotangent = scaled @ lora_b.astype(dtype).T  # [..., tokens, rank]
    low_input = (low_cotangent @ lora_a.astype(dtype).T).reshape(*cotangent.shape[:-1], lora_a.shape[0])
    return input_gradient(linear, cotangent) + low_input, scaled, low_cotangent


def lora_adapter_gradients(x: mx.array, scaled: mx.array, low_cotangent: mx.array, lora_a: mx.array,
                           lora_b: mx.array, batched: bool = False) -> tuple[mx.array, mx.array]:
    """:func:`lora_gradients`' gradients of ``lora_a`` and ``lora_b`` (each in its own dtype),
    given the layer's input and :func:`lora_input_gradient`'s cotangents."""
    if not batched:
        x = x.reshape(-1, x.shape[-1])
    grad_a = x.swapaxes(-1, -2) @ low_cotangent
    grad_b = (x @ lora_a.astype(x.dtype)).swapaxes(-1, -2) @ scaled
    if batched:
        grad_a, grad_b = grad_a.sum(axis=0), grad_b.sum(axis=0)
    return grad_a.astype(lora_a.dtype), grad_b.astype(lora_b.dtype)


def _lora(module: nn.Module, x: mx.array, lora_a: mx.array, lora_b: mx.array) -> mx.array:
    """A plain LoRA layer's output for ``x``, computed in ``x``'s dtype."""
    low = x @ lora_a.astype(x.dtype)
    return module.linear(x) + (module.scale * (low @ lora_b.astype(x.dtype))).astype(x.dtype)


def swiglu_lora(down: nn.Module, gate: mx.array, up: mx.array) -> mx.array:
    """``down(swiglu(gate, up))`` for a :func:`mlxft.lora.plain_lora` ``down``, whose backward pass keeps
    only ``gate`` and ``up``.

    Unfused, the adapter's ``lora_a`` gradient reads the SwiGLU's output, so the step keeps
    that array as well, half as large as gate and up together, in every layer. Here the
    backward pass recomputes it from them (elementwise); the frozen projection's input gradient
    is the cotangent times its weight, which reads no activation."""
    linear, scale = down.linear, down.scale

    @mx.custom_function
    def fused(gate, up, lora_a, lora_b):
        return _lora(down, swiglu(gate, up), lora_a, lora_b)

    @fused.vjp
    def fused_vjp(primals, cotangent, output):
        gate, up, lora_a, lora_b = primals
        sigmoid, silu_gate = _recomputed_silu(gate, cotangent)
        grad_hidden, grad_a, grad_b = lora_gradients(linear, scale, silu_gate * up, cotangent, lora_a, lora_b)
        return (*_swiglu_input_gradients(grad_hidden, up, sigmoid, silu_gate), grad_a, grad_b)

    return fused(gate, up, down.lora_a, down.lora_b)


def recomputed_mlp(gate: nn.Module, up: nn.Module, down: nn.Module, x: mx.array) -> mx.array:
    """``down(swiglu(gate(x), up(x)))`` for plain LoRA ``gate``, ``up`` and ``down``, whose
    backward pass keeps only ``x`` (nothing, where ``x`` is a recording norm's output:
    :mod:`mlxft.normed`) and computes the gate and up projections again.

    Those two arrays of the MLP's width are most of what a layer keeps (8 of about 17 arrays
    of the hidden width for Llama-3.2-1B and LFM2-1.2B); computing them again costs two of
    the layer's matmuls and their adapters' products, not a whole recomputed layer."""
    from mlxft import normed

    source = normed.norm_input(x)

    @mx.custom_function
    def fused(x, gate_a, gate_b, up_a, up_b, down_a, down_b):
        return _lora(down, swiglu(_lora(gate, x, gate_a, gate_b), _lora(up, x, up_a, up_b)), down_a, down_b)

    @fused.vjp
    def fused_vjp(primals, cotangent, output):
        x, gate_a, gate_b, up_a, up_b, down_a, down_b = primals
        # Tied to the cotangent, so the compiled step cannot merge them with the forward's.
        again = source.again(cotangent) if source is not None else mx.depends(x, cotangent)
        g, u = _lora(gate, again, gate_a, gate_b), _lora(up, again, up_a, up_b)
        sigmoid, silu_gate = _recomputed_silu(g, cotangent)
        grad_hidden, grad_down_a, grad_down_b = lora_gradients(down.linear, down.scale, silu_gate * u, cotangent,
                                                               down_a, down_b)
        grad_g, grad_u = _swiglu_input_gradients(grad_hidden, u, sigmoid, silu_gate)
        grad_x_gate, grad_gate_a, grad_gate_b = lora_gradients(gate.linear, gate.scale, again, grad_g, gate_a, gate_b)
        grad_x_up, grad_up_a, grad_up_b = lora_gradients(up.linear, up.scale, again, grad_u, up_a, up_b)
        return (grad_x_gate + grad_x_up, grad_gate_a, grad_gate_b, grad_up_a, grad_up_b,
                grad_down_a, grad_down_b)

    return fused(x, gate.lora_a, gate.lora_b, up.lora_a, up.lora_b, down.lora_a, down.lora_b)


def short_conv_lora(conv: nn.Module, x: mx.array) -> mx.array:
    """mlx-lm's LFM2 ``ShortConv`` over ``x`` in training (no cache, no mask) for a plain LoRA
    ``out_proj``: ``out_proj(C * conv(B * h))`` with ``B, C, h`` the thirds of ``in_proj(x)``,
    whose backward pass keeps only ``in_proj``'s output.

    Autograd also keeps the convolution's output (for ``C``'s gradient) and the gated product
    (for the adapter's ``lora_a`` gradient): two more ``[tokens, hidden]`` arrays in every
    convolution layer, where the layer keeps about 17. Both come back from ``in_proj``'s output
    in the backward pass: two elementwise products and a depthwise convolution of 3 taps."""
    out_proj, taps = conv.out_proj, conv.conv.weight.shape[1]

    def gated(bch):
        b, c, h = mx.split(bch, 3, axis=-1)
        padded = mx.pad(b * h, [(0, 0), (taps - 1, 0), (0, 0)])
        return b, c, h, padded, conv.conv(padded)

    @mx.custom_function
    def fused(bch, lora_a, lora_b):
        _, c, _, _, convolved = gated(bch)
        return _lora(out_proj, c * convolved, lora_a, lora_b)

    @fused.vjp
    def fused_vjp(primals, cotangent, output):
        bch, lora_a, lora_b = primals
        # Tied to the cotangent, so the compiled step cannot merge it with the forward's.
        b, c, h, padded, convolved = gated(mx.depends(bch, cotangent))
        grad_gated, grad_a, grad_b = lora_gradients(out_proj.linear, out_proj.scale, c * convolved, cotangent,
                                                    lora_a, lora_b)
        grad_padded = mx.vjp(conv.conv, [padded], [grad_gated * c])[1][0]
        grad_product = grad_padded[:, taps - 1:]
        return mx.concatenate([grad_product * h, grad_gated * convolved, grad_product * b], axis=-1), grad_a, grad_b

    return fused(conv.in_proj(x), out_proj.lora_a, out_proj.lora_b)


_SHORT_CONV = "_mlxft_short_conv"


def _short_conv_call(self, x, mask=None, cache=None):
    if type(self).mlxft_recomputed and mask is None and cache is None and plain_lora(self.out_proj):
        return short_conv_lora(self, x)
    return models.call_beneath(self, _SHORT_CONV)(self, x, mask=mask, cache=cache)


class _Returns(nn.Module):
    """A stand-in projection that returns a given array, or (``None``) its own input."""

    def __init__(self, array: mx.array | None, taken: list):
        super().__init__()
        self._array, self._taken = array, taken

    def __call__(self, x):
        if self._array is None:
            self._taken.append(x)
            return x
        return self._array


def _attention_names(attention: nn.Module) -> tuple[str, str, str, str]:
    return "q_proj", "k_proj", "v_proj", "o_proj" if "o_proj" in attention else "out_proj"


def attention_lora(attention: nn.Module, x: mx.array, mask) -> mx.array:
    """An mlx-lm attention module over ``x`` in training (no cache) whose output projection is
    a plain LoRA layer, with a backward pass that keeps only the q, k and v projections' outputs.

    Autograd keeps what follows them as well: the queries and keys again after their norms (LFM2)
    and rotary embedding, the attention's output and its log-partition for the fused kernel's
    backward pass, and that output again as the output projection's input (the adapter's
    ``lora_a`` gradient): 2.5-4 more ``[tokens, hidden]`` arrays an attention layer. Here the
    backward pass computes them again from q, k and v: the norms, the rotary embedding and one
    more forward pass of the attention kernel, small next to the projections. The attention
    itself is mlx-lm's own code, run with stand-ins for the four projections."""
    names = _attention_names(attention)
    out_proj = attention[names[3]]
    plain_call = models.call_beneath(attention, _ATTENTION)

    def attend(q, k, v):
        """The attention's output before its output projection, given the projections' outputs."""
        taken, saved = [], {name: attention[name] for name in names}
        for name, array in zip(names, (q, k, v, None)):
            attention[name] = _Returns(array, taken)
        try:
            plain_call(attention, x, mask=mask, cache=None)
        finally:
            for name, module in saved.items():
                attention[name] = module
        return taken[0]

    @mx.custom_function
    def fused(q, k, v, lora_a, lora_b):
        return _lora(out_proj, attend(q, k, v), lora_a, lora_b)

    @fused.vjp
    def fused_vjp(primals, cotangent, output):
        q, k, v, lora_a, lora_b = primals
        # Tied to the cotangent, so the compiled step cannot merge them with the forward's.
        q, k, v = (mx.depends(array, cotangent) for array in (q, k, v))
        # The output projection's input gradient reads no activation, so one pass of the attention
        # gives both its output (for the adapter's gradients) and q, k and v's gradients.
        grad_attended, scaled, low_cotangent = lora_input_gradient(out_proj.linear, out_proj.scale, cotangent,
                                                                   lora_a, lora_b, cotangent.dtype)
        (attended,), grads = mx.vjp(attend, [q, k, v], [grad_attended])
        return (*grads, *lora_adapter_gradients(attended, scaled, low_cotangent, lora_a, lora_b))

    q, k, v = (attention[name](x) for name in names[:3])
    return fused(q, k, v, out_proj.lora_a, out_proj.lora_b)


_ATTENTION = "_mlxft_attention"


def _attention_call(self, x, mask=None, cache=None):
    if type(self).mlxft_recomputed and cache is None and plain_lora(self[_attention_names(self)[3]]):
        return attention_lora(self, x, mask)
    return models.call_beneath(self, _ATTENTION)(self, x, mask=mask, cache=cache)


def _recomputes_attention() -> bool:
    """Whether ``--recompute-mlp`` layers take :func:`attention_lora` on this device: not on the
    CPU, where the attention's second forward pass is the costly part of it (written out with
    :func:`exp`): SmolLM2-135M chat with ``--recompute-mlp`` ran at 63.4 and 63.8 tokens/s
    against 74.3 for a peak of 0.99 against 1.07 GB. A GPU runs it as one fused kernel."""
    return mx.default_device() != mx.cpu


def _recompute_mixer(layer: nn.Module, recomputed: bool, attention: bool | None = None) -> None:
    """Have ``layer``'s LFM2 convolution take :func:`short_conv_lora`, and its attention (where
    it has q, k, v and an output projection) :func:`attention_lora` where ``attention`` (by
    default: ``recomputed``, off the CPU), or not. They go with ``--recompute-mlp``, a run that
    already gives speed for memory; in a plain run they cost more than they saved: the
    convolution's took LFM2-1.2B's longest chat step from 9.16 to 8.84 GB but each step's host
    time up 2-20 ms (an H100: a 32-token step 40.6 and 49.6 ms against 33.6 and 29.5)."""
    if attention is None:
        attention = recomputed and _recomputes_attention()
    for name, call, marker, fused in (("self_attn", _attention_call, _ATTENTION, attention),
                                      ("conv", _short_conv_call, _SHORT_CONV, recomputed)):
        mixer = layer.get(name)
        if mixer is None or (name == "self_attn" and not all(part in mixer for part in _attention_names(mixer))):
            continue
        models.override_call(mixer, call, marker)
        type(mixer).mlxft_recomputed = fused  # the instance's own class


def _swiglu_mlp(gate: str, up: str, down: str, recompute: bool = False):
    def call(self, x):
        if recompute and plain_lora(self[gate]) and plain_lora(self[up]) and plain_lora(self[down]):
            return recomputed_mlp(self[gate], self[up], self[down], x)
        g, u = self[gate](x), self[up](x)
        if plain_lora(self[down]):
            return swiglu_lora(self[down], g, u)
        return self[down](swiglu(g, u))

    return call


# One MLP call per family and choice, from the names of its projections.
_MLP_CALLS = {(name, recompute): _swiglu_mlp(*parts.projections, recompute=recompute)
              for name, parts in models.LAYER_PARTS.items() for recompute in (False, True)}


_MARKER = "_mlxft_fast_exp"


def _mlp_of(layer: nn.Module, family: str) -> nn.Module | None:
    parts = models.LAYER_PARTS.get(family)
    return layer.get(parts.mlp) if parts is not None else None


def _switchable_mlp(layer: nn.Module, family: str) -> nn.Module | None:
    """``layer``'s MLP where :func:`enable` gave it the call that keeps gate and up and its
    projections are plain LoRA layers (what :func:`recomputed_mlp` takes); else None."""
    mlp = _mlp_of(layer, family)
    if mlp is None or not getattr(type(mlp), _MARKER, False) or type(mlp).__call__ is not _MLP_CALLS[family, False]:
        return None
    return mlp if all(plain_lora(mlp[name]) for name in models.LAYER_PARTS[family].projections) else None


def recomputes_mlp(layer: nn.Module, family: str) -> bool:
    """Whether ``layer``'s MLP computes as under ``--recompute-mlp``."""
    mlp = _mlp_of(layer, family)
    return mlp is not None and type(mlp).__call__ is _MLP_CALLS[family, True]


@contextlib.contextmanager
def mlp_recomputed(layer: nn.Module, family: str):
    """Within: ``layer``'s MLP computes as under ``--recompute-mlp``, where it can (yields
    whether it does); for the memory estimate to price that setting on a run without it."""
    mlp = _switchable_mlp(layer, family)
    if mlp is None:
        yield False
        return
    type(mlp).__call__ = _MLP_CALLS[family, True]  # the instance's own class (models.override_call)
    _recompute_mixer(layer, True)
    try:
        yield True
    finally:
        type(mlp).__call__ = _MLP_CALLS[family, False]
        _recompute_mixer(layer, False)


def recompute_mlps(model: nn.Module, first: int = 0) -> bool:
    """Switch the MLPs of ``model``'s first ``first`` layers (0 = every layer) to ``--recompute-mlp``
    after :func:`enable` (``--fit-memory``); returns whether any could."""
    family = models.family(model)
    switched = False
    for layer in models.first_layers(model, first, "model.recompute_mlp_layers"):
        mlp = _switchable_mlp(layer, family)
        if mlp is not None:
            type(mlp).__call__ = _MLP_CALLS[family, True]
            _recompute_mixer(layer, True)
            switched = True
    return switched


def check_recompute_mlp(model: nn.Module, recompute_mlp: bool) -> None:
    """Refuse --recompute-mlp for a family whose MLPs it cannot reach: the run would say it
    recomputes them and keep everything."""
    family = models.family(model)
    if recompute_mlp and (family, True) not in _MLP_CALLS:
        raise UserError(f"config field model.recompute_mlp: not supported for {family} models (only "
                        f"{', '.join(models.LAYER_PARTS)}); drop --recompute-mlp, or use --grad-checkpoint")


def check_mlps_to_recompute(model: nn.Module, adapter, first: int = 0) -> None:
    """Refuse --recompute-mlp where ``adapter`` (an :class:`mlxft.config.AdapterConfig`) leaves
    no MLP of ``model``'s first ``first`` layers (0 = every layer) that :func:`recomputed_mlp`
    takes, three plain LoRA projections: the run would say it recomputes them and keep
    everything, as before it said so. Read from the config, before the model changes."""
    from mlxft import lora

    check_recompute_mlp(model, True)
    parts = models.LAYER_PARTS[models.family(model)]
    projections = [f"{parts.mlp}.{name}" for name in parts.projections]
    if adapter.finetune != "lora":
        why = (f"--finetune {adapter.finetune} trains " + ("DoRA layers" if adapter.finetune == "dora"
                                                             else "the weights themselves"),
               "--grad-checkpoint, which recomputes whole layers")
    elif adapter.dropout > 0:
        why = (f"adapter.dropout is {adapter.dropout} (its masks are not recomputed)", "--dropout 0")
    else:
        adapted = lora.selected_layers(model, adapter.num_layers)
        targets = lora.resolve_targets(adapter.targets, lora.linear_names(adapted))
        untargeted = [name for name in projections if name not in targets]
        recomputed = {id(layer) for layer in models.first_layers(model, first, "model.recompute_mlp_layers")}
        if untargeted:
            why = (f"adapter.targets leave {', '.join(untargeted)} without LoRA", f"--targets {','.join(projections)} "
                   "as well")
        elif not any(id(layer) in recomputed for layer in adapted):
            why = (f"adapter.num_layers {adapter.num_layers} adapts none of the first {first} layers",
                   "--recompute-mlp-layers 0")
        else:
            return
    raise UserError(f"config field model.recompute_mlp: it recomputes MLPs whose {', '.join(parts.projections)} are "
                    f"plain LoRA layers, and {why[0]}; drop --recompute-mlp, or use {why[1]}")


def enable(model: nn.Module, recompute_mlp: bool = False, first: int = 0) -> bool:
    """Give a supported family's MLPs :func:`swiglu` (same weights, same function) and its
    attention the written-out softmax; returns whether it applied. The MLPs change per
    instance (``recompute_mlp``: :func:`recomputed_mlp` in the first ``first`` layers, 0 =
    every layer, where its projections are plain LoRA layers, and those layers' mixers
    :func:`short_conv_lora` or, off the CPU, :func:`attention_lora`); the softmax is a function of the
    family's mlx-lm module, so it is replaced there for the process, by one that takes
    :func:`attention` only for float32 training shapes on the CPU and mlx-lm's own path
    otherwise. Other families keep mlx-lm's code."""
    check_recompute_mlp(model, recompute_mlp)
    family = models.family(model)
    if (family, False) not in _MLP_CALLS:
        return False
    recomputing = ({id(layer) for layer in models.first_layers(model, first, "model.recompute_mlp_layers")}
                   if recompute_mlp else set())
    module = sys.modules[type(model).__module__]
    if not hasattr(module.scaled_dot_product_attention, "mlxft_original"):
        module.scaled_dot_product_attention = _attention_for(module.scaled_dot_product_attention)
    for layer in model.layers:
        models.override_call(layer[models.LAYER_PARTS[family].mlp], _MLP_CALLS[family, id(layer) in recomputing],
                             _MARKER)
        _recompute_mixer(layer, id(layer) in recomputing)
    return True
