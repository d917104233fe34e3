"""Attention with its own backward pass, keeping only the q, k and v projections' outputs
(mlxft.fastmath.attention_lora), as --recompute-mlp computes it off the CPU."""

import mlx.core as mx
import pytest

from mlxft import fastmath, lora, memory, models
from mlxft.config import AdapterConfig
from tests.test_short_conv import assert_fused_mixer_computes_as_mlx_lm, mixer_model


def _model(model_dir, fused: bool, targets=("all",)):
    return mixer_model(model_dir, False, fused, targets)


def _attentions(model):
    return [layer.self_attn for layer in model.layers if "self_attn" in layer]


def _counting(monkeypatch):
    taken, attention_lora = [], fastmath.attention_lora
    monkeypatch.setattr(fastmath, "attention_lora", lambda *a: taken.append(a[0]) or attention_lora(*a))
    return taken


@pytest.mark.parametrize("compiled,checkpointed", [(False, False), (True, False), (True, True)])
def test_the_fused_attention_changes_neither_loss_nor_gradients(model_dir, compiled, checkpointed, monkeypatch):
    plain, fused = _model(model_dir, False), _model(model_dir, True)
    assert_fused_mixer_computes_as_mlx_lm(plain, fused, compiled, checkpointed, _counting(monkeypatch),
                                          len(_attentions(fused)))


def test_an_attention_layer_keeps_its_projections_outputs_only(model_dir):
    """On the CPU (float32, mlxft's blocked attention) a Llama layer drops the output projection's
    input; an LFM2 layer also the queries and keys after their norms."""
    plain, fused = _model(model_dir, False), _model(model_dir, True)
    x = mx.random.normal((4, 64, plain.args.hidden_size), key=mx.random.key(2))
    layers = [(before, after) for before, after in zip(plain.layers, fused.layers) if "self_attn" in before]
    assert layers
    queries_and_keys = 1.5  # 4 query heads and 2 key heads of 16 dimensions, at a width of 64
    expected = 1 + (queries_and_keys if models.family(plain) == "lfm2" else 0)  # arrays of [4, 64, 64]
    for before, after in layers:
        saved = memory._kept_for_backward(before, None, x) - memory._kept_for_backward(after, None, x)
        # Measured: 1.25 (Llama) and 2.94 (LFM2); the rest is the smaller arrays around them.
        assert expected <= saved / x.nbytes <= expected + 0.5, saved / x.nbytes


def test_generation_and_a_frozen_output_projection_take_mlx_lm_s_attention(model_dir, monkeypatch):
    """With a cache (generation) mlx-lm's module fills it; an output projection without LoRA is
    not what the fused function takes. Both compute as mlx-lm does."""
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.array([[5, 17, 230, 9, 41]])
    parts = models.LAYER_PARTS["lfm2" if "lfm2" in str(model_dir) else "llama"]
    for targets in (("all",), (f"{parts.mlp}.{parts.projections[0]}",)):
        plain, fused = _model(model_dir, False, targets), _model(model_dir, True, targets)
        plain_cache, fused_cache = make_prompt_cache(plain), make_prompt_cache(fused)
        taken = _counting(monkeypatch)
        for step in (tokens, tokens[:, -1:]):
            assert mx.allclose(fused(step, cache=fused_cache), plain(step, cache=plain_cache), atol=1e-5)
        assert not taken
        assert mx.allclose(fused(tokens), plain(tokens), atol=1e-5)
        assert len(taken) == (len(_attentions(fused)) if targets == ("all",) else 0)
        monkeypatch.undo()


def test_it_goes_with_recompute_mlp_off_the_cpu_and_the_estimate_prices_it(model_dir, monkeypatch):
    """Plain runs keep mlx-lm's attention (on the CPU the fused one cost 5-9% of the tokens/s); a
    layer whose MLP is recomputed takes it off the CPU, and so does the estimate's probe of such
    a layer there."""
    model, *_ = models.load(str(model_dir), "float32")
    lora.apply(model, AdapterConfig(targets=["all"], rank=4), seed=0)
    assert fastmath.enable(model, recompute_mlp=True)
    taken = _counting(monkeypatch)
    model(mx.array([[5, 17, 230, 9, 41]]))
    assert not taken  # the CPU
    monkeypatch.setattr(fastmath, "_recomputes_attention", lambda: True)
    model, *_ = models.load(str(model_dir), "float32")
    lora.apply(model, AdapterConfig(targets=["all"], rank=4), seed=0)
    assert fastmath.enable(model, recompute_mlp=True, first=1)
    taken = _counting(monkeypatch)
    model(mx.array([[5, 17, 230, 9, 41]]))
    first_attention = next(i for i, layer in enumerate(model.layers) if "self_attn" in layer)
    assert taken == ([model.layers[0].self_attn] if first_attention == 0 else [])
    plain = next(layer for layer in model.layers[1:] if "self_attn" in layer)
    x = mx.random.normal((2, 8, model.args.hidden_size))
    taken.clear()
    with fastmath.mlp_recomputed(plain, models.family(model)) as recomputing:
        assert recomputing
        plain.self_attn(plain.operator_norm(x) if "operator_norm" in plain else x, mask="causal")
    assert taken == [plain.self_attn]
    taken.clear()
    plain.self_attn(x, mask="causal")
    assert not taken
    assert fastmath.recompute_mlps(model)
    plain.self_attn(x, mask="causal")
    assert taken == [plain.self_attn]
