"""Sibling LoRA projections computed as one (mlxft.projections): the same loss and gradients as
each projection on its own, one copy of the frozen weights, and a fallback wherever the fused
computation would not stand for the members' own."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxft import fastmath, lora, models, projections
from mlxft.config import AdapterConfig
from mlxft.data import Example, make_batch
from mlxft.loss import loss_fn


def close(a: mx.array, b: mx.array, tolerance: float = 1e-5) -> bool:
    return mx.abs(a - b).max().item() <= tolerance * max(mx.abs(b).max().item(), 1e-3)


def adapted(model_dir, quantize: int = 0, targets=("all",), dropout: float = 0.0, checkpoint: str = ""):
    model = models.load(str(model_dir), "float32", quantize, 32)[0]
    lora.apply(model, AdapterConfig(targets=list(targets), rank=4, dropout=dropout), seed=0)
    mx.random.seed(1)
    for _, module in model.named_modules():
        if "lora_b" in module:  # mlx-lm starts it at zero, which would hide B's part of the product
            module.lora_b = mx.random.normal(module.lora_b.shape) * 0.1
    fastmath.enable(model)
    if checkpoint:
        models.checkpoint_layers(model, 0, keep_mlp=checkpoint == "keep-mlp")
    mx.eval(model.parameters())
    return model


def batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = [Example(rng.integers(0, 1000, n), np.arange(n) >= n // 3) for n in (13, 9)]
    return make_batch(rows, 2, 8).arrays()


def loss_and_grads(model, seed: int = 0):
    (loss, _), grads = nn.value_and_grad(model, loss_fn)(model, *batch(seed))
    return loss, dict(tree_flatten(grads))


def counting_group_calls(monkeypatch) -> list:
    calls, call = [], projections.SharedInput.__call__
    monkeypatch.setattr(projections.SharedInput, "__call__", lambda self, x: (calls.append(len(self.members)), call(self, x))[1])
    return calls


@pytest.mark.parametrize("case", ["float32", "4-bit base", "checkpointed", "keep-mlp"])
def test_fused_groups_give_the_loss_and_gradients_of_separate_projections(model_dir, case, monkeypatch):
    quantize = 4 if case == "4-bit base" else 0
    checkpoint = case if case in ("checkpointed", "keep-mlp") else ""
    apart_loss, apart = loss_and_grads(adapted(model_dir, quantize, checkpoint=checkpoint))
    model = adapted(model_dir, quantize, checkpoint=checkpoint)
    groups = projections.fuse(model)
    # gate/up in every layer; q/k/v in each attention layer (LFM2's others mix by convolution)
    assert groups == len(model.layers) + sum("self_attn" in layer for layer in model.layers)
    calls = counting_group_calls(monkeypatch)
    fused_loss, fused = loss_and_grads(model)
    assert calls and set(calls) == {2, 3}
    assert close(fused_loss, apart_loss)
    assert fused.keys() == apart.keys() and len(fused) > 0
    for name in apart:
        assert close(fused[name], apart[name], 1e-4), name


def test_the_compiled_trainer_step_computes_each_group_once(model_dir, monkeypatch):
    model = adapted(model_dir)
    projections.fuse(model)
    calls = counting_group_calls(monkeypatch)
    step = mx.compile(lambda *args: nn.value_and_grad(model, loss_fn)(model, *args),
                      inputs=[model.state], outputs=[model.state])
    (loss, _), grads = step(*batch())
    mx.eval(loss, grads)
    assert len(calls) == 4
    (reference, _), _ = nn.value_and_grad(adapted(model_dir), loss_fn)(adapted(model_dir), *batch())
    assert close(loss, reference)


def test_members_weights_are_views_of_one_array_and_save_as_before(model_dir, tmp_path):
    model = adapted(model_dir, quantize=4)
    before = {k: np.array(v) for k, v in tree_flatten(model.parameters()) if ".linear." in k}
    mx.synchronize()
    active = mx.get_active_memory()
    projections.fuse(model)
    mx.synchronize()
    # The concatenated copies replace the members' own arrays, which are freed.
    assert abs(mx.get_active_memory() - active) < 0.05 * sum(a.nbytes for a in before.values())
    after = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp_path / "w.safetensors"), {k: after[k] for k in before})
    saved = mx.load(str(tmp_path / "w.safetensors"))
    for key, value in before.items():
        assert np.array_equal(np.array(after[key]), value) and np.array_equal(np.array(saved[key]), value), key


def test_replaced_base_weights_active_dropout_and_other_inputs_fall_back(model_dir, monkeypatch):
    model = adapted(model_dir)
    projections.fuse(model)
    attention = next(layer.self_attn for layer in model.layers if "self_attn" in layer)
    q, k = attention.q_proj, attention.k_proj
    x, other = mx.random.normal((1, 5, q.linear.weight.shape[1])), mx.random.normal((1, 5, q.linear.weight.shape[1]))
    calls = counting_group_calls(monkeypatch)
    q(x)
    assert close(k(other), lora._lora_in_input_dtype(k, other)) and len(calls) == 2  # not q's input: computed again
    new_weight = mx.random.normal(k.linear.weight.shape)
    model.load_weights([(name, new_weight) for name, v in tree_flatten(model.parameters()) if v is k.linear.weight],
                       strict=False)
    assert not q._mlxft_group.applies()
    expected = x @ new_weight.T + k.scale * (x @ k.lora_a) @ k.lora_b
    q(x)
    assert close(k(x), expected) and len(calls) == 2
    dropping = adapted(model_dir, dropout=0.5)
    projections.fuse(dropping)
    assert not any(m._mlxft_group.applies() for _, m in dropping.named_modules() if "_mlxft_group" in m.__dict__
                   and "lora_a" in m)
    dropping.eval()  # no dropout when evaluating: fused again
    assert all(m._mlxft_group.applies() for _, m in dropping.named_modules() if "_mlxft_group" in m.__dict__
               and "lora_a" in m)


def test_adapted_members_of_a_group_share_and_the_rest_stay_as_they_are(llama_dir):
    model = adapted(llama_dir, targets=("self_attn.q_proj", "self_attn.v_proj"))
    apart_loss, apart = loss_and_grads(adapted(llama_dir, targets=("self_attn.q_proj", "self_attn.v_proj")))
    assert projections.fuse(model) == 2
    attention = model.layers[0].self_attn
    assert attention.q_proj._mlxft_group is attention.v_proj._mlxft_group
    assert type(attention.k_proj) is nn.Linear
    loss, grads = loss_and_grads(model)
    assert close(loss, apart_loss) and all(close(grads[n], apart[n], 1e-4) for n in apart)
    assert projections.fuse(model) == 2  # idempotent
