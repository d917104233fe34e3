"""LFM2's short convolution with its own backward pass (mlxft.fastmath.short_conv_lora), as
--recompute-mlp computes it."""

import mlx.core as mx
import pytest
from mlx.utils import tree_map

from mlxft import fastmath, lora, memory, models
from mlxft.config import AdapterConfig
from mlxft.data import make_batch
from tests.conftest import LFM2_CONFIG, write_model
from tests.test_loss import _rows, assert_same_loss_and_gradients
from tests.test_normed import _loss_and_grads


@pytest.fixture(scope="module")
def biased_lfm2_dir(tmp_path_factory):
    """An LFM2 whose convolutions and projections have biases (the anchor model's have none)."""
    return write_model(tmp_path_factory.mktemp("lfm2-bias"), {**LFM2_CONFIG, "conv_bias": True})


def mixer_model(model_dir, conv: bool, attention: bool, targets=("all",)):
    """A float32 LoRA model whose mixers compute as --recompute-mlp has them (``conv``: the
    fused convolution, ``attention``: the fused attention), its MLPs left as they are."""
    model, *_ = models.load(str(model_dir), "float32")
    lora.apply(model, AdapterConfig(targets=list(targets), rank=4), seed=0)
    # Non-zero B so every adapter moves the output and receives a full gradient.
    model.update(tree_map(lambda p: mx.random.normal(p.shape, key=mx.random.key(1)) * 0.05,
                          model.trainable_parameters()))
    assert fastmath.enable(model)
    for layer in model.layers:
        fastmath._recompute_mixer(layer, conv, attention=attention)
    return model


def _model(model_dir, fused: bool, targets=("all",)):
    return mixer_model(model_dir, fused, False, targets)


def assert_fused_mixer_computes_as_mlx_lm(plain, fused, compiled: bool, checkpointed: bool, taken: list,
                                          mixers: int) -> None:
    """Loss and gradients of ``fused`` equal ``plain``'s on a batch of rows of several lengths;
    ``taken`` (the fused function's calls) fills only while ``fused`` runs, once per mixer, twice
    inside mx.checkpoint."""
    batch = make_batch(_rows(4) + _rows(5), 6, 8).arrays()
    if checkpointed:  # the mixer runs again inside mx.checkpoint
        models.checkpoint_layers(plain)
        models.checkpoint_layers(fused)
    expected = _loss_and_grads(plain, batch, compiled)
    assert not taken
    actual = _loss_and_grads(fused, batch, compiled)
    assert len(taken) == mixers * (2 if checkpointed else 1) > 0
    assert_same_loss_and_gradients(actual, expected, spread=1e-5)


def _convolutions(model):
    return [layer.conv for layer in model.layers if "conv" in layer]


@pytest.mark.parametrize("compiled,checkpointed", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("biased", [False, True])
def test_the_fused_convolution_changes_neither_loss_nor_gradients(lfm2_dir, biased_lfm2_dir, compiled,
                                                                   checkpointed, biased, monkeypatch):
    directory = biased_lfm2_dir if biased else lfm2_dir
    plain, fused = _model(directory, False), _model(directory, True)
    taken = []
    short_conv_lora = fastmath.short_conv_lora
    monkeypatch.setattr(fastmath, "short_conv_lora", lambda conv, x: taken.append(conv) or short_conv_lora(conv, x))
    assert_fused_mixer_computes_as_mlx_lm(plain, fused, compiled, checkpointed, taken, len(_convolutions(fused)))


def test_a_convolution_layer_keeps_two_arrays_fewer(lfm2_dir):
    plain, fused = _model(lfm2_dir, False), _model(lfm2_dir, True)
    x = mx.random.normal((4, 64, plain.args.hidden_size), key=mx.random.key(2))
    layers = [(before, after) for before, after in zip(plain.layers, fused.layers) if "conv" in before]
    assert layers
    for before, after in layers:
        saved = memory._kept_for_backward(before, None, x) - memory._kept_for_backward(after, None, x)
        # (at this width the out_proj adapter's rank-4 product is a sixteenth of an array more)
        assert 0.95 <= saved / (2 * x.nbytes) <= 1.1, saved / x.nbytes


def test_generation_and_a_frozen_out_proj_take_mlx_lm_s_convolution(lfm2_dir):
    """With a cache (generation) the convolution carries state; an out_proj without LoRA is not
    what the fused function takes. Both compute as mlx-lm does."""
    from mlx_lm.models.cache import make_prompt_cache

    for targets in (("all",), ("self_attn.q_proj",)):
        plain, fused = _model(lfm2_dir, False, targets), _model(lfm2_dir, True, targets)
        tokens = mx.array([[5, 17, 230, 9, 41]])
        plain_cache, fused_cache = make_prompt_cache(plain), make_prompt_cache(fused)
        taken = []
        original, fastmath.short_conv_lora = fastmath.short_conv_lora, lambda *a: taken.append(a) or original(*a)
        try:
            for step in (tokens, tokens[:, -1:]):
                assert mx.allclose(fused(step, cache=fused_cache), plain(step, cache=plain_cache), atol=1e-5)
            assert mx.allclose(fused(tokens), plain(tokens), atol=1e-5)
        finally:
            fastmath.short_conv_lora = original
        assert len(taken) == (len(_convolutions(fused)) if targets == ("all",) else 0)
