"""Packing: a packed micro-batch gives the loss and gradients of the same rows unpacked."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from mlxft import fastmath, lora, models, packing
from mlxft.config import AdapterConfig
from mlxft.data import Example, make_batch
from mlxft.loss import loss_fn


def rows(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(10, 5000, size=n).astype(np.int32)
        mask = np.ones(n, bool)
        mask[: n // 3] = False  # a prompt that is not supervised
        out.append(Example(ids, mask))
    return out


def adapted_model(model_dir, grad_checkpoint=False, fused=False):
    model, *_ = models.load(str(model_dir), "float32")
    lora.apply(model, AdapterConfig(targets=["all"], rank=4, alpha=8.0), seed=0)
    # Non-zero B matrices, so the adapters take part in the function being compared.
    mx.random.seed(1)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.05, model.trainable_parameters()))
    packing.enable(model)
    if fused:  # as the trainer does: --recompute-mlp's MLPs and mixers over packing's layers
        fastmath.enable(model, recompute_mlp=True)
    if grad_checkpoint:
        models.checkpoint_layers(model)
    return model


def loss_and_grads(model, batch):
    value_and_grad = nn.value_and_grad(model, lambda m, *a: loss_fn(m, *a)[0])
    loss, grads = value_and_grad(model, *batch.arrays())
    return loss.item(), dict(tree_flatten(grads))


LENGTHS = [33, 9, 14, 27, 6, 41, 18, 12]


def test_first_fit_decreasing_places_every_row_within_capacity():
    bins = packing.first_fit_decreasing(LENGTHS, 48)
    assert sorted(i for b in bins for i in b) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in b) <= 48 for b in bins)
    assert len(bins) < len(LENGTHS)


def test_packed_batch_layout():
    batch = make_batch(rows(LENGTHS), len(LENGTHS), 8, pack=True)
    unpacked = make_batch(rows(LENGTHS), len(LENGTHS), 8)
    assert batch.inputs.shape[0] < unpacked.inputs.shape[0]
    assert batch.inputs.shape[1] == unpacked.inputs.shape[1]
    assert batch.real_tokens == unpacked.real_tokens and batch.supervised == unpacked.supervised
    # Supervised inputs and targets are the same tokens, in a different place.
    assert sorted(batch.inputs.reshape(-1)[batch.positions[: batch.supervised]]) == sorted(
        unpacked.inputs.reshape(-1)[unpacked.positions[: unpacked.supervised]])
    assert (batch.doc_positions == 0).sum() > batch.inputs.shape[0]  # several documents start in a sequence


@pytest.mark.parametrize("grad_checkpoint", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_packed_loss_and_gradients_equal_unpacked(model_dir, grad_checkpoint, fused):
    model = adapted_model(model_dir, grad_checkpoint, fused)
    examples = rows(LENGTHS)
    packed = make_batch(examples, len(examples), 8, pack=True)
    assert packed.doc_positions is not None
    loss_packed, grads_packed = loss_and_grads(model, packed)
    loss_plain, grads_plain = loss_and_grads(model, make_batch(examples, len(examples), 8))
    assert loss_packed == pytest.approx(loss_plain, rel=1e-5)
    for name, g in grads_plain.items():
        np.testing.assert_allclose(np.array(grads_packed[name]), np.array(g), rtol=1e-4, atol=1e-6, err_msg=name)


def test_without_isolation_the_documents_would_leak(model_dir):
    """The comparison above can fail: the same packed tokens read as one document differ."""
    model = adapted_model(model_dir)
    examples = rows(LENGTHS)
    packed = make_batch(examples, len(examples), 8, pack=True)
    loss_isolated, _ = loss_and_grads(model, packed)
    packed.doc_positions = np.broadcast_to(np.arange(packed.inputs.shape[1], dtype=np.int32), packed.inputs.shape).copy()
    packed.segments = np.zeros_like(packed.segments)
    loss_leaky, _ = loss_and_grads(model, packed)
    assert abs(loss_leaky - loss_isolated) > 1e-3


def test_lfm2_convolution_alone_is_isolated(lfm2_dir):
    """Only the short convolutions see across the boundary when attention and positions are isolated."""
    model = adapted_model(lfm2_dir)
    examples = rows(LENGTHS)
    packed = make_batch(examples, len(examples), 8, pack=True)
    reference, _ = loss_and_grads(model, make_batch(examples, len(examples), 8))
    original = packing._document_short_conv

    def leaky_conv(self, x, mask=None, cache=None):
        return type(self).__mro__[1].__call__(self, x)  # mlx-lm's convolution over the whole sequence

    try:
        packing._document_short_conv = leaky_conv
        for layer in model.layers:
            if "conv" in layer:
                type(layer.conv).__call__ = leaky_conv
        leaky, _ = loss_and_grads(model, packed)
    finally:
        for layer in model.layers:
            if "conv" in layer:
                type(layer.conv).__call__ = original
        packing._document_short_conv = original
    isolated, _ = loss_and_grads(model, packed)
    assert isolated == pytest.approx(reference, rel=1e-5)
    assert abs(leaky - reference) > 1e-4


def test_packing_an_unsupported_family_is_a_clear_error():
    from mlxft.errors import UserError

    class Other(nn.Module):
        model_type = "gemma3"
        layers = []

    with pytest.raises(UserError, match="data.pack"):
        packing.enable(Other())


def test_sliding_window_layers_keep_their_window_when_packed(tmp_path):
    # mlx-lm's Llama gives layers of type sliding_attention a windowed causal mask.
    from conftest import LLAMA_CONFIG, write_model

    config = {**LLAMA_CONFIG, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}
    model = adapted_model(write_model(tmp_path / "sliding", config))
    examples = rows([20, 9, 7])
    unpacked = loss_and_grads(model, make_batch(examples, 3, 8))[0]
    packed = make_batch(examples, 3, 8, pack=True)
    assert packed.doc_positions is not None
    assert loss_and_grads(model, packed)[0] == pytest.approx(unpacked, rel=1e-5)


def test_packing_a_dynamic_rope_model_is_a_clear_error(tmp_path):
    from conftest import LLAMA_CONFIG, write_model
    from mlxft.errors import UserError

    model, *_ = models.load(str(write_model(tmp_path / "dynamic", {**LLAMA_CONFIG, "rope_scaling": {"type": "dynamic", "factor": 2.0}})))
    with pytest.raises(UserError, match="rope_scaling type 'dynamic'.*drop --pack"):
        packing.enable(model)


def test_training_packed_equals_training_unpacked(model_dir, chat_data, tmp_path, monkeypatch):
    from mlxft import RunConfig, fine_tune

    def run(name, pack):
        config = RunConfig.from_dict({
            "model": {"model": str(model_dir), "dtype": "float32"},
            "data": {"data": str(chat_data), "pack": pack, "length_bucket": 64},
            "adapter": {"rank": 4},
            "optim": {"learning_rate": 1e-2, "schedule": "constant", "optimizer": "sgd"},
            "train": {"output_dir": str(tmp_path / name), "batch_size": 6, "max_steps": 4},
        })
        result = fine_tune(config)
        return result, mx.load(str(tmp_path / name / "adapters.safetensors"))

    packed_shapes = []
    original = make_batch

    def spy(*args, **kwargs):
        batch = original(*args, **kwargs)
        packed_shapes.append(batch.doc_positions is not None)
        return batch

    monkeypatch.setattr("mlxft.data.make_batch", spy)
    plain, plain_weights = run("plain", False)
    assert not any(packed_shapes)
    packed, packed_weights = run("packed", True)
    assert all(packed_shapes[len(packed_shapes) // 2:])  # every packed run's batch held several rows per sequence
    assert packed.val_loss == pytest.approx(plain.val_loss, rel=1e-4)
    for name, value in plain_weights.items():
        np.testing.assert_allclose(np.array(packed_weights[name]), np.array(value), rtol=1e-3, atol=1e-5, err_msg=name)
    metrics = [json.loads(x) for x in (tmp_path / "packed" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["type"] == "train" for r in metrics)
