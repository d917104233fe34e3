"""--recompute-mlp: the MLP's gate and up projections computed again in the backward pass."""

import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxft import RunConfig, fastmath, lora, memory, models, normed
from mlxft.config import AdapterConfig, validate
from mlxft.data import Dataset, Example, make_batch
from mlxft.errors import UserError
from mlxft.trainer import Trainer
from tests.test_loss import _rows, assert_same_loss_and_gradients
from tests.test_normed import _loss_and_grads


def _model(model_dir, recompute: bool, with_normed: bool, finetune: str = "lora", dropout: float = 0.0):
    model, *_ = models.load(str(model_dir), "float32")
    lora.apply(model, AdapterConfig(finetune=finetune, rank=4, dropout=dropout), seed=0)
    # Non-zero B so every adapter moves the output and receives a full gradient.
    model.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape, key=mx.random.key(1)) * 0.05,
                                   model.trainable_parameters()))
    assert fastmath.enable(model, recompute)
    if with_normed:
        assert normed.enable(model)  # the CPU: the MLP's input is a recording norm's output
    return model


def _counting_recomputed_mlp(patch):
    taken = []
    recomputed_mlp = fastmath.recomputed_mlp
    patch.setattr(fastmath, "recomputed_mlp", lambda *a: taken.append(a[0]) or recomputed_mlp(*a))
    return taken


# Eager with the MLP's input kept; compiled with it recomputed from the norm (the CPU's path),
# alone and inside --grad-checkpoint.
@pytest.mark.parametrize("compiled,with_normed,checkpointed", [(False, False, False), (True, True, False),
                                                               (True, True, True)])
def test_recomputed_gate_and_up_change_neither_loss_nor_gradients(model_dir, compiled, with_normed, checkpointed):
    batch = make_batch(_rows(4) + _rows(5), 6, 8).arrays()
    plain = _model(model_dir, False, with_normed)
    recomputing = _model(model_dir, True, with_normed)
    if checkpointed:  # every layer recomputed as well: the MLP runs again inside mx.checkpoint
        models.checkpoint_layers(plain)
        models.checkpoint_layers(recomputing)
    with pytest.MonkeyPatch.context() as patch:
        taken = _counting_recomputed_mlp(patch)
        recomputed = _loss_and_grads(recomputing, batch, compiled)
    assert len(taken) == len(plain.layers) * (2 if checkpointed else 1)
    assert_same_loss_and_gradients(recomputed, _loss_and_grads(plain, batch, compiled), spread=1e-5)


def test_a_layer_no_longer_keeps_its_gate_and_up(model_dir):
    plain, recomputing = _model(model_dir, False, False), _model(model_dir, True, False)
    gate_name = models.LAYER_PARTS[models.family(plain)].projections[0]
    x = mx.random.normal((4, 64, plain.args.hidden_size), key=mx.random.key(2))
    for before, after in zip(plain.layers, recomputing.layers):
        mlp = before[models.LAYER_PARTS[models.family(plain)].mlp]
        gate_and_up = 2 * x.shape[0] * x.shape[1] * mlp[gate_name].linear.weight.shape[0] * 4
        # An LFM2 convolution layer's mixer keeps two arrays of x's size fewer as well (the CPU
        # keeps its attention as it is: tests/test_fused_attention.py).
        expected = gate_and_up + (2 * x.nbytes if "conv" in before else 0)
        saved = memory._kept_for_backward(before, None, x) - memory._kept_for_backward(after, None, x)
        assert 0.95 <= saved / expected <= 1.1, saved / expected


def test_what_is_not_three_plain_lora_projections_keeps_the_plain_mlp(llama_dir):
    """DoRA, or an active dropout (its mask would have to be kept): computed as before."""
    for settings in ({"finetune": "dora"}, {"dropout": 0.1}):
        model = _model(llama_dir, True, False, **settings)
        with pytest.MonkeyPatch.context() as patch:
            taken = _counting_recomputed_mlp(patch)
            mx.eval(model(mx.array([[5, 6, 7, 8]])))
        assert not taken, settings


def test_a_run_with_recompute_mlp_trains_as_one_without(llama_dir, tmp_path):
    """Every layer's MLP recomputed, or the first layer's alone (``--recompute-mlp-layers 1``)."""
    rows = [Example(np.arange(10 + i, 40 + i, dtype=np.int32), np.arange(30) >= 10) for i in range(4)]
    losses = []
    for recompute, first in ((False, 0), (True, 0), (True, 1)):
        config = RunConfig.from_dict({
            "model": {"model": str(llama_dir), "dtype": "float32", "recompute_mlp": recompute,
                      "recompute_mlp_layers": first},
            "data": {"data": "in-memory"},
            "train": {"output_dir": str(tmp_path / f"{recompute}-{first}"), "batch_size": 2, "max_steps": 3,
                      "log_every": 1},
        })
        trainer = Trainer(config, datasets=(Dataset(Path("rows"), rows, "completion"), None))
        with pytest.MonkeyPatch.context() as patch:
            taken = _counting_recomputed_mlp(patch)
            result = trainer.train()
        gates = [layer.mlp.gate_proj for layer in trainer.model.layers]
        expected = gates[:first or len(gates)] if recompute else []
        assert {id(gate) for gate in taken} == {id(gate) for gate in expected}
        losses.append(result.train_loss)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5) and losses[2] == pytest.approx(losses[0], rel=1e-5)


def test_recompute_mlp_layers_needs_recompute_mlp_and_no_more_than_the_model_has(llama_dir, tmp_path):
    with pytest.raises(UserError, match="model.recompute_mlp_layers: applies to runs that recompute MLPs"):
        validate(RunConfig.from_dict({"model": {"model": "m", "recompute_mlp_layers": 2}, "data": {"data": "d"}}))
    model = _model(llama_dir, False, False)
    with pytest.raises(UserError, match="model.recompute_mlp_layers: 99 exceeds the model's"):
        fastmath.enable(model, True, 99)


def test_a_family_it_cannot_reach_is_refused_before_the_model_changes(llama_dir, tmp_path):
    # A qwen2 (or mistral) model trained with --recompute-mlp as without, while config.yaml said
    # it recomputed: the flag was dropped silently, where --checkpoint-keep-mlp is refused.
    from mlx_lm import load
    from mlx_lm.tuner.lora import LoRALinear

    model, tokenizer = load(str(llama_dir))
    model.model_type = "qwen2"
    rows = [Example(np.arange(3, 19, dtype=np.int32), np.arange(16) >= 8) for _ in range(4)]
    config = RunConfig.from_dict({"model": {"recompute_mlp": True},
                                  "train": {"output_dir": str(tmp_path / "run"), "batch_size": 2, "max_steps": 1,
                                            "exact_match_rows": 0}})
    with pytest.raises(UserError, match="model.recompute_mlp: not supported for qwen2 models"):
        Trainer(config, model, tokenizer, datasets=(Dataset(Path("rows"), rows, "completion"), None))
    assert not any(isinstance(m, LoRALinear) for _, m in model.named_modules())


@pytest.mark.parametrize("adapter,first,reason", [
    ({"finetune": "full"}, 0, "--finetune full trains the weights themselves"),
    ({"finetune": "dora"}, 0, "--finetune dora trains DoRA layers"),
    ({"dropout": 0.1}, 0, "adapter.dropout is 0.1"),
    ({"targets": ["attn", "mlp.down_proj"]}, 0, "adapter.targets leave mlp.gate_proj, mlp.up_proj without LoRA"),
    ({"num_layers": 1}, 1, "adapter.num_layers 1 adapts none of the first 1 layers"),
])
def test_a_run_whose_adapters_it_cannot_recompute_is_refused(llama_dir, tmp_path, adapter, first, reason):
    # Each of these trained as without --recompute-mlp while config.yaml said it recomputed.
    from mlx_lm import load

    model, tokenizer = load(str(llama_dir))
    rows = [Example(np.arange(3, 19, dtype=np.int32), np.arange(16) >= 8) for _ in range(4)]
    config = RunConfig.from_dict({"model": {"recompute_mlp": True, "recompute_mlp_layers": first}, "adapter": adapter,
                                  "train": {"output_dir": str(tmp_path / "run"), "batch_size": 2, "max_steps": 1,
                                            "exact_match_rows": 0}})
    trainable = {name for name, _ in tree_flatten(model.trainable_parameters())}
    with pytest.raises(UserError, match=f"model.recompute_mlp: .*, and {re.escape(reason)}.*; drop --recompute-mlp"):
        Trainer(config, model, tokenizer, datasets=(Dataset(Path("rows"), rows, "completion"), None))
    assert {name for name, _ in tree_flatten(model.trainable_parameters())} == trainable  # as it came
