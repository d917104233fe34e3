"""LoRA projections of a norm's output recompute the norm: same results, less kept."""

import pytest

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxft import fastmath, lora, memory, models, normed
from mlxft.config import AdapterConfig
from mlxft.data import make_batch
from tests.test_loss import _rows, assert_same_loss_and_gradients


def _lora_model(model_dir, dropout=0.0):
    model, *_ = models.load(str(model_dir), "float32")
    lora.apply(model, AdapterConfig(rank=4, dropout=dropout), seed=0)
    # Non-zero B so every adapter moves the output and receives a full gradient.
    model.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape, key=mx.random.key(1)) * 0.05,
                                   model.trainable_parameters()))
    fastmath.enable(model)
    return model


def _loss_and_grads(model, batch, compiled):
    from mlxft.loss import loss_fn

    value_and_grad = nn.value_and_grad(model, lambda m, *b: loss_fn(m, *b, training=True)[0])
    if compiled:
        step = mx.compile(lambda *b: value_and_grad(model, *b), inputs=model.state, outputs=model.state)
        loss, grads = step(*batch)
    else:
        loss, grads = value_and_grad(model, *batch)
    return loss.item(), dict(tree_flatten(grads))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_recomputed_norms_change_neither_loss_nor_gradients(model_dir, compiled, checkpointed):
    batch = make_batch(_rows(4) + _rows(5), 6, 8).arrays()
    plain = _lora_model(model_dir)
    recorded = _lora_model(model_dir)
    assert normed.enable(recorded)
    if checkpointed:
        models.checkpoint_layers(plain, 1)
        models.checkpoint_layers(recorded, 1)
    taken = []
    lora_of_normed = normed.lora_of_normed
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(normed, "lora_of_normed", lambda *a: taken.append(a[0]) or lora_of_normed(*a))
        recomputed = _loss_and_grads(recorded, batch, compiled)
    # Every projection that reads a norm's output: q, k and v (LFM2's convolution layers: its
    # input projection), gate and up.
    fewest_per_layer = {"llama": 5, "lfm2": 3}[models.family(plain)]
    assert len(taken) >= fewest_per_layer * len(plain.layers)
    assert_same_loss_and_gradients(recomputed, _loss_and_grads(plain, batch, compiled), spread=1e-5)


def test_a_layer_no_longer_keeps_its_norms_outputs(model_dir):
    """Two [tokens, hidden] arrays a layer fewer, in every kind of layer (and the adapters'
    [tokens, rank] products of them, recomputed as well)."""
    plain = _lora_model(model_dir)
    recorded = _lora_model(model_dir)
    normed.enable(recorded)
    x = mx.random.normal((4, 64, plain.args.hidden_size), key=mx.random.key(2))
    for before, after in zip(plain.layers, recorded.layers):
        saved = memory._kept_for_backward(before, None, x) - memory._kept_for_backward(after, None, x)
        assert 2 <= saved / x.nbytes <= 2.6, (saved / x.nbytes, type(before).__name__)


def test_what_does_not_read_a_norm_computes_as_before(model_dir):
    """Active dropout (its mask would have to be kept), a single decoded token, and arrays that
    only equal a norm's output take the plain LoRA path."""
    with_dropout = _lora_model(model_dir, dropout=0.1)
    normed.enable(with_dropout)
    taken = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(normed, "lora_of_normed", lambda *a: taken.append(a[0]))
        with_dropout(mx.array([[5, 6, 7, 8]]))
        assert not taken
        model = _lora_model(model_dir)
        normed.enable(model)
        model(mx.array([[5]]))  # one token: generation, no backward pass
        assert not taken
    norm = next(m for m in model.layers[0].children().values() if isinstance(m, nn.RMSNorm))
    x = mx.random.normal((1, 3, model.args.hidden_size))
    normed._Recorded.outputs = {}
    try:
        out = norm(x)
        assert normed.norm_input(out).x is x
        assert normed.norm_input(out + 0) is None
    finally:
        normed._Recorded.outputs = None
    assert normed.norm_input(out) is None  # outside a layer nothing is recorded
