"""The vectorised exp and the MLPs built on it compute what MLX's own functions compute."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from mlxft import RunConfig, fastmath, lora, memory, models
from mlxft.config import AdapterConfig
from mlxft.data import Dataset, Example
from mlxft.loss import loss_fn
from mlxft.trainer import Trainer


def close(a: mx.array, b: mx.array, tolerance: float = 1e-5) -> bool:
    """Equal up to float32 rounding, measured against the larger array's scale (elementwise
    relative tolerances fail on elements that are a cancellation away from zero)."""
    return mx.abs(a - b).max().item() <= tolerance * max(mx.abs(b).max().item(), 1e-3)


def test_exp_matches_a_float64_reference_and_underflows_to_zero():
    x = np.concatenate([np.linspace(-87, 88, 200_001), np.random.default_rng(0).normal(0, 5, 10_000)]).astype(np.float32)
    got = np.array(fastmath.exp(mx.array(x))).astype(np.float64)
    reference = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - reference) / reference) < 5e-7
    assert np.array(fastmath.exp(mx.array([-mx.inf, -1e4, -87.5], mx.float32))).tolist() == [0.0, 0.0, 0.0]
    assert fastmath.exp(mx.array([1.0], mx.bfloat16)).dtype == mx.bfloat16


def test_exp_gradient_is_exp():
    x = mx.random.normal((1000,)) * 4
    assert mx.allclose(mx.grad(lambda v: fastmath.exp(v).sum())(x), mx.exp(x), rtol=1e-5).item()


@pytest.mark.parametrize("cpu_exp", [True, False])
def test_swiglu_and_its_gradients_equal_mlx(cpu_exp, monkeypatch):
    monkeypatch.setattr(fastmath, "active", lambda: cpu_exp)  # False: the GPU's path, mx.sigmoid
    mx.random.seed(0)
    gate, up = mx.random.normal((64, 96)) * 4, mx.random.normal((64, 96))

    def theirs(g, u):
        return (nn.silu(g) * u).sum()

    def ours(g, u):
        return fastmath.swiglu(g, u).sum()

    assert close(ours(gate, up), theirs(gate, up))
    for a, b in zip(mx.grad(ours, argnums=(0, 1))(gate, up), mx.grad(theirs, argnums=(0, 1))(gate, up)):
        assert close(a, b)


def test_compiled_swiglu_keeps_only_its_inputs_for_the_backward_pass():
    """Per MLP block of a compiled gradient, the SwiGLU keeps gate and up (2 units of
    [tokens, width] float32); autograd, or a recomputation that the compiler merges with the
    forward pass's sigmoid, keeps 4 (measured)."""
    tokens, dim, width = 4096, 64, 512

    def peak(blocks):
        keys = iter(mx.random.split(mx.random.key(0), 3 * blocks + 1))
        weights = [[mx.random.normal(shape, key=next(keys)) * 0.1 for shape in ((dim, width), (dim, width), (width, dim))]
                   for _ in range(blocks)]
        x = mx.random.normal((tokens, dim), key=next(keys))
        mx.eval(weights, x)

        def forward(h):
            for gate, up, down in weights:
                h = h + fastmath.swiglu(h @ gate, h @ up) @ down
            return h.sum()

        grad = mx.compile(mx.grad(forward))
        return max(memory._probe(grad, x) for _ in range(2))

    per_block = (peak(12) - peak(4)) / 8 / (tokens * width * 4)
    assert per_block <= 2.6, per_block


@pytest.mark.parametrize("mask", ["none", "causal", "boolean", "additive", "per-head"])
def test_attention_and_its_gradients_equal_mlx_s(mask):
    batch, heads, groups, length, dims = 2, 6, 2, 16, 8
    mx.random.seed(0)
    q, k, v = (mx.random.normal((batch, n, length, dims)) for n in (heads, groups, groups))
    steps = mx.arange(length)
    documents = (steps >= 5)[None, None, :, None] == (steps >= 5)[None, None, None, :]
    causal = steps[:, None] >= steps[None, :]
    boolean = mx.broadcast_to(documents & causal, (batch, 1, length, length))
    masks = {"none": None, "causal": "causal", "boolean": boolean,
             "additive": mx.where(boolean, 0.0, -mx.inf),
             "per-head": mx.broadcast_to(boolean, (batch, heads, length, length))}

    def theirs(q, k, v):
        return (mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=masks[mask]) * v.sum()).sum()

    def ours(q, k, v):
        return (fastmath.attention(q, k, v, 0.3, masks[mask]) * v.sum()).sum()

    assert close(ours(q, k, v), theirs(q, k, v))
    for a, b in zip(mx.grad(ours, argnums=(0, 1, 2))(q, k, v), mx.grad(theirs, argnums=(0, 1, 2))(q, k, v)):
        assert close(a, b)


@pytest.mark.parametrize("length", [96, 200, 224])
def test_causal_attention_in_blocks_equals_mlx_s(length):
    # 2, 3 and 4 blocks of queries, uneven where the length does not divide.
    batch, heads, groups, dims = 2, 6, 2, 8
    mx.random.seed(1)
    q, k, v = (mx.random.normal((batch, n, length, dims)) for n in (heads, groups, groups))

    def theirs(q, k, v):
        return (mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal") * v.sum()).sum()

    def ours(q, k, v):
        return (fastmath.attention(q, k, v, 0.3, "causal") * v.sum()).sum()

    assert round(length / fastmath.CAUSAL_BLOCK) > 1
    assert close(ours(q, k, v), theirs(q, k, v))
    for a, b in zip(mx.grad(ours, argnums=(0, 1, 2))(q, k, v), mx.grad(theirs, argnums=(0, 1, 2))(q, k, v)):
        assert close(a, b)


def test_causal_attention_keeps_no_weights_for_the_backward_pass():
    """Per layer of a compiled gradient through stacked causal attention, what stays for the
    backward pass is about the queries, keys and values (1 unit here; measured 1.26): the
    4 blocks' softmax weights, 5/8 of [T, T] a head (5 units), are recomputed instead."""
    heads, groups, length, dims = 4, 2, 256, 16
    width = heads * dims
    per_layer_qkv = length * (heads + 2 * groups) * dims * 4

    def peak(layers):
        keys = iter(mx.random.split(mx.random.key(0), 4 * layers + 1))
        weights = [[mx.random.normal(shape, key=next(keys)) * 0.1
                    for shape in ((width, width), (width, groups * dims), (width, groups * dims), (width, width))]
                   for _ in range(layers)]
        x = mx.random.normal((1, length, width), key=next(keys))
        mx.eval(weights, x)

        def split(h, n):
            return h.reshape(1, length, n, dims).transpose(0, 2, 1, 3)

        def forward(h):
            for wq, wk, wv, wo in weights:
                out = fastmath.attention(split(h @ wq, heads), split(h @ wk, groups), split(h @ wv, groups),
                                         dims ** -0.5, "causal")
                h = h + out.transpose(0, 2, 1, 3).reshape(1, length, width) @ wo
            return h.sum()

        grad = mx.compile(mx.grad(forward))
        return max(memory._probe(grad, x) for _ in range(2))

    per_layer = (peak(12) - peak(4)) / 8 / per_layer_qkv
    assert per_layer <= 1.6, per_layer


def test_attention_outside_training_shapes_is_mlx_lm_s(llama_dir):
    model, *_ = models.load(str(llama_dir), "float32")
    fastmath.enable(model)
    patched = sys.modules[type(model).__module__].scaled_dot_product_attention
    calls = []

    def original(*args):
        calls.append(args)
        return args[0]

    q, k = mx.zeros((1, 4, 1, 8)), mx.zeros((1, 2, 5, 8))  # one new query against a cache of five
    fallback = fastmath._attention_for(original)
    assert fallback(q, k, k, None, 1.0, None) is q and len(calls) == 1
    assert patched.mlxft_original is not patched


def adapted(model_dir, fast: bool):
    model, *_ = models.load(str(model_dir), "float32")
    lora.apply(model, AdapterConfig(targets=["all"], rank=4, alpha=8.0), seed=0)
    mx.random.seed(1)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.05, model.trainable_parameters()))
    if fast:
        assert fastmath.enable(model) and fastmath.enable(model)  # a second call changes nothing
    return model


def test_fast_mlps_give_the_loss_and_gradients_of_mlx_lm_s(model_dir):
    rng = np.random.default_rng(0)
    inputs = mx.array(rng.integers(10, 5000, size=(2, 24)).astype(np.int32))
    positions = mx.arange(8, 48)
    targets = mx.array(rng.integers(10, 5000, size=40).astype(np.int32))
    weights = mx.ones((40,))
    results = []
    for fast in (False, True):
        model = adapted(model_dir, fast)
        value_and_grad = nn.value_and_grad(model, lambda m, *a: loss_fn(m, *a)[0])
        loss, grads = value_and_grad(model, inputs, positions, targets, weights)
        results.append((loss.item(), dict(tree_flatten(grads))))
    (plain_loss, plain_grads), (fast_loss, fast_grads) = results
    assert abs(plain_loss - fast_loss) < 1e-5 * abs(plain_loss)
    for name, grad in plain_grads.items():
        assert close(fast_grads[name], grad, 1e-4), name
    assert getattr(type(model.layers[0].mlp if "mlp" in model.layers[0] else model.layers[0].feed_forward),
                   "_mlxft_fast_exp", False)


def test_other_families_keep_mlx_lm_s_mlp(llama_dir, monkeypatch):
    model, *_ = models.load(str(llama_dir), "float32")
    monkeypatch.setattr(models, "family", lambda m: "qwen2")
    before = type(model.layers[0].mlp)
    assert not fastmath.enable(model)
    assert type(model.layers[0].mlp) is before


def test_a_trainer_on_the_cpu_takes_the_vectorised_exp(llama_dir, tmp_path):
    assert mx.default_device() == mx.cpu  # this repository's tests run on MLX's CPU backend
    config = RunConfig.from_dict({
        "model": {"model": str(llama_dir), "dtype": "float32"},
        "data": {"data": "in-memory"},
        "train": {"output_dir": str(tmp_path / "run"), "batch_size": 2, "max_steps": 1},
    })
    rows = [Example(np.arange(10, 30, dtype=np.int32), np.arange(20) >= 5) for _ in range(2)]
    trainer = Trainer(config, datasets=(Dataset(Path("rows"), rows, "completion"), None))
    assert all(getattr(type(layer.mlp), "_mlxft_fast_exp", False) for layer in trainer.model.layers)


def lora_down(quantized: bool, dropout: float = 0.0, dtype=mx.float32):
    from mlx_lm.tuner.lora import LoRALinear

    mx.random.seed(3)
    base = nn.Linear(64, 16, bias=False)
    if quantized:
        base = nn.QuantizedLinear.from_linear(base, group_size=32, bits=4)
    else:
        base.set_dtype(dtype)
    down = LoRALinear.from_base(base, r=4, dropout=dropout, scale=2.0)
    down.freeze()
    down.unfreeze(keys=["lora_a", "lora_b"], strict=False)
    down.lora_b = mx.random.normal(down.lora_b.shape) * 0.1  # mlx-lm starts it at zero
    holder = nn.Module()
    holder.down = down
    lora.compute_lora_in_input_dtype(holder)
    return holder.down


@pytest.mark.parametrize("case", ["float32", "bfloat16", "4-bit base"])
def test_swiglu_fused_with_the_lora_down_projection_equals_the_two_apart(case):
    """Loss and every gradient (adapter and inputs) of the fused SwiGLU + LoRA projection equal
    autograd's through ``down(swiglu(gate, up))``."""
    dtype = mx.bfloat16 if case == "bfloat16" else mx.float32
    down = lora_down(case == "4-bit base", dtype=dtype)
    assert lora.plain_lora(down)
    gate, up = (mx.random.normal((2, 12, 64)).astype(dtype) * 3 for _ in range(2))
    weight = mx.random.normal((2, 12, 16)).astype(dtype)

    def run(fused):
        def f(params, g, u):
            down.update(params)
            out = fastmath.swiglu_lora(down, g, u) if fused else down(fastmath.swiglu(g, u))
            return (out * weight).astype(mx.float32).sum()

        loss, grads = mx.value_and_grad(f, argnums=(0, 1, 2))(down.trainable_parameters(), gate, up)
        return loss, dict(tree_flatten(grads[0])), grads[1:]

    (apart_loss, apart_params, apart_inputs), (fused_loss, fused_params, fused_inputs) = run(False), run(True)
    tolerance = 2e-2 if dtype == mx.bfloat16 else 1e-5
    assert close(fused_loss, apart_loss, tolerance)
    assert fused_params.keys() == {"lora_a", "lora_b"}
    for name in fused_params:
        assert fused_params[name].dtype == mx.float32 and close(fused_params[name], apart_params[name], tolerance), name
    for a, b in zip(fused_inputs, apart_inputs):
        assert a.dtype == dtype and close(a.astype(mx.float32), b.astype(mx.float32), tolerance)


def test_only_frozen_dropout_free_lora_projections_are_fused():
    assert not lora.plain_lora(lora_down(False, dropout=0.1))  # its mask would have to be kept
    eval_mode = lora_down(False, dropout=0.1)
    eval_mode.eval()
    assert lora.plain_lora(eval_mode)
    trained_base = lora_down(False)
    trained_base.linear.unfreeze()
    assert not lora.plain_lora(trained_base)  # the weight's own gradient needs the input
    trained_scale = lora_down(False)
    trained_scale.scale = mx.array(2.0)  # a parameter the fused function would take as a constant
    trained_scale.freeze(keys=["scale"], strict=False)
    assert lora.plain_lora(trained_scale)
    trained_scale.unfreeze(keys=["scale"], strict=False)
    assert not lora.plain_lora(trained_scale)
    from mlx_lm.tuner.lora import LoRALinear

    mlx_lm_s_own = LoRALinear.from_base(nn.Linear(8, 8), r=2)  # mlx-lm's float32 LoRA arithmetic
    assert not lora.plain_lora(mlx_lm_s_own)
    assert not lora.plain_lora(nn.Linear(8, 8))


def test_compiled_fused_mlp_keeps_only_gate_and_up_for_the_lora_gradients():
    """A compiled stack of LoRA MLP blocks (every projection adapted): unfused, each keeps the
    norm's input and output, gate, up and the SwiGLU's output (14 units of [tokens, dim] at width
    4 x dim); fused, the SwiGLU's output is recomputed in the backward pass (10 units)."""
    from mlx_lm.models.llama import MLP, ModelArgs
    from mlx_lm.tuner.lora import LoRALinear

    tokens, dim = 2048, 256  # rank 8 against 256: the adapters' own arrays stay small
    args = ModelArgs(model_type="llama", hidden_size=dim, num_hidden_layers=1, intermediate_size=4 * dim,
                     num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=8)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.mlp = nn.RMSNorm(dim), MLP(args)

        def __call__(self, h):
            return h + self.mlp(self.norm(h))

    def per_block(fused: bool, blocks=(2, 6)):
        peaks = []
        for count in blocks:
            mx.random.seed(0)
            stack = nn.Module()
            stack.layers = [Block() for _ in range(count)]
            stack.freeze()
            for block in stack.layers:
                for name in ("gate_proj", "up_proj", "down_proj"):
                    setattr(block.mlp, name, LoRALinear.from_base(getattr(block.mlp, name), r=8))
            lora.compute_lora_in_input_dtype(stack)
            call = fastmath._MLP_CALLS["llama", False]
            for block in stack.layers:
                models.override_call(block.mlp, call, "_mlxft_fast_exp")
            x = mx.random.normal((tokens, dim))
            mx.eval(stack.parameters(), x)

            def loss(model, h):
                for block in model.layers:
                    h = block(h)
                return (h * h).mean()

            value_and_grad = nn.value_and_grad(stack, loss)
            step = mx.compile(lambda h: value_and_grad(stack, h))
            run = lambda: (lambda out: [out[0]] + [g for _, g in tree_flatten(out[1])])(step(x))  # noqa: E731
            mx.eval(run())  # compiles MLX's kernels: a first probe that builds them read 73 units where others read 130
            peaks.append(min(memory._probe(run) for _ in range(3)))  # min: a busy machine lets MLX queue further ahead
        return (peaks[1] - peaks[0]) / (blocks[1] - blocks[0]) / (tokens * dim * 4)

    fused = per_block(True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fastmath, "plain_lora", lambda module: False)
        apart = per_block(False)
    # Measured 10.8-11.9 against 15.9 (a unit's spread from run to run): 4 units fewer.
    assert apart - fused >= 3.0, (fused, apart)
