"""Loading models, choosing what trains (LoRA, DoRA, QLoRA, full, subsets), config handling."""

import argparse

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxft import config as cfg
from mlxft import lora, models
from mlxft.config import AdapterConfig, RunConfig
from mlxft.errors import UserError


def trainable_names(model):
    return {k for k, _ in tree_flatten(model.trainable_parameters())}


def test_default_targets_per_family(llama_dir, lfm2_dir):
    llama, _, _, _ = models.load(str(llama_dir), "float32")
    assert lora.apply(llama, AdapterConfig(), 0) == [
        "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj",
        "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj",
    ]
    lfm2, _, _, _ = models.load(str(lfm2_dir), "float32")
    assert lora.apply(lfm2, AdapterConfig(targets=["attn"]), 0) == [
        "conv.in_proj", "conv.out_proj", "self_attn.k_proj", "self_attn.out_proj", "self_attn.q_proj", "self_attn.v_proj",
    ]
    names = trainable_names(lfm2)
    assert names and all(n.endswith(("lora_a", "lora_b")) for n in names)
    assert not any("feed_forward" in n for n in names)


def test_last_n_layers_and_mlp_subset(llama_dir):
    model, _, _, _ = models.load(str(llama_dir), "float32")
    lora.apply(model, AdapterConfig(targets=["mlp"], num_layers=1), 0)
    names = trainable_names(model)
    assert names == {f"model.layers.1.mlp.{p}.{ab}" for p in ("gate_proj", "up_proj", "down_proj") for ab in ("lora_a", "lora_b")}


def test_a_rank_past_every_adapted_layer_is_refused(llama_dir):
    # A rank of 2**31 - 1 passed the config check and crashed MLX (a segfault, exit 139).
    for quantize in (0, 4):
        model, _, _, _ = models.load(str(llama_dir), "float32", quantize=quantize, group_size=32)
        with pytest.raises(UserError, match=r"adapter.rank: 65 is more than the widest adapted layer's 64 "
                                             r"\(mlp.down_proj: 128 -> 64\), where no layer gains from it; use "
                                             r"--rank 64 or less"):
            lora.apply(model, AdapterConfig(rank=65), 0)
        assert not trainable_names(model)  # refused before any layer changed
    # A layer narrower than the rank beside wider ones (k_proj: 64 -> 32; an MoE router, 1 wide) trains.
    lora.apply(model, AdapterConfig(rank=33), 0)


def test_dora_and_full(llama_dir):
    model, _, _, _ = models.load(str(llama_dir), "float32")
    lora.apply(model, AdapterConfig(finetune="dora", targets=["self_attn.q_proj"]), 0)
    assert {n.rsplit(".", 1)[-1] for n in trainable_names(model)} == {"lora_a", "lora_b", "m"}

    model, _, _, _ = models.load(str(llama_dir), "float32")
    lora.apply(model, AdapterConfig(finetune="full", targets=["attn"]), 0)
    names = trainable_names(model)
    assert "model.layers.0.self_attn.q_proj.weight" in names and not any("mlp" in n or "embed" in n for n in names)

    model, _, _, _ = models.load(str(llama_dir), "float32")
    lora.apply(model, AdapterConfig(finetune="full"), 0)
    trainable, total = models.count_parameters(model)
    assert trainable == total

    # Whole layers, as mlx-lm's full fine-tuning trains: norms too, nothing outside the layers.
    model, _, _, _ = models.load(str(llama_dir), "float32")
    assert lora.apply(model, AdapterConfig(finetune="full", targets=["layers"], num_layers=1), 0) == ["layers"]
    last = dict(tree_flatten(model.model.layers[-1].parameters()))
    assert trainable_names(model) == {f"model.layers.{len(model.layers) - 1}.{k}" for k in last}
    assert any("layernorm" in k for k in last)


def test_a_group_size_that_leaves_layers_unquantized_is_refused(llama_dir):
    # The tiny model's widths are 64 and 128: at 128 mlx-lm quantized only the down projections,
    # and the run recorded a 4-bit base.
    with pytest.raises(UserError, match="--quantize-group-size 128 does not divide this model's layer width 64, so "
                                        "those layers would stay unquantized; use --quantize-group-size 64"):
        models.load(str(llama_dir), "float32", quantize=4, group_size=128)


def test_a_few_small_layers_left_unquantized_are_mlx_lm_s_choice():
    # Mamba's dt_proj (width 96 at group size 64) stays in float in mlx-lm; that was no reason to refuse.
    model = nn.Sequential(nn.Linear(128, 512), nn.Linear(96, 4))
    models._check_group_size(model, 64)
    with pytest.raises(UserError, match="layer width 96, so those layers would stay unquantized; use "
                                        "--quantize-group-size 32"):
        models._check_group_size(nn.Sequential(nn.Linear(128, 512), nn.Linear(96, 512)), 64)


def test_qlora_on_a_quantized_base(llama_dir, capsys):
    model, _, _, _ = models.load(str(llama_dir), "float32", quantize=4, group_size=32)
    assert models.is_quantized(model)
    # mlx-lm's report of the bits per weight went to stdout, before generate's answer and into evaluate --json.
    printed = capsys.readouterr()
    assert printed.out == "" and "bits per weight" in printed.err
    lora.apply(model, AdapterConfig(rank=4), 0)
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer.linear, nn.QuantizedLinear)
    trainable, total = models.count_parameters(model)
    assert 0 < trainable < total
    with pytest.raises(UserError, match="unquantized base"):
        fresh, _, _, _ = models.load(str(llama_dir), "float32", quantize=4, group_size=32)
        lora.apply(fresh, AdapterConfig(finetune="full"), 0)


def test_dtype_choice(llama_dir):
    model, _, _, _ = models.load(str(llama_dir), "bfloat16")
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
    assert models.resolve_dtype("auto") == (mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16)


def test_model_errors_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="does not exist"):
        models.resolve_model_path(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        models.resolve_model_path(str(tmp_path / "empty"))
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"model.revision \(--revision\) 'v2' applies to a hub repo id, but .*empty "
                                        "is a local directory"):  # it was ignored without a word
        models.resolve_model_path(str(tmp_path / "empty"), revision="v2")
    assert models.resolve_model_path(str(tmp_path / "empty")) == tmp_path / "empty"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="not in the local hub cache|cannot download|not found") as err:
        models.resolve_model_path("someone-who-does-not-exist/tiny-model-xyz")
    assert "\n" not in str(err.value)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read when the library was imported
    # The revision asked for, and the setting that stopped the download.
    with pytest.raises(UserError, match="tiny-model-xyz at revision v9 is not in the local hub cache, and "
                                        "HF_HUB_OFFLINE is set; unset it"):
        models.resolve_model_path("someone-who-does-not-exist/tiny-model-xyz", revision="v9")


def test_config_layers_and_errors(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  model: m\ndata:\n  data: d\noptim:\n  learning_rate: 0.001\nadapter:\n  targets: [attn, mlp]\n")
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    args = parser.parse_args(["--learning-rate", "0.002", "--targets", "self_attn.q_proj,mlp", "--no-completion-only"])
    config = cfg.resolve(args, str(path))
    assert config.optim.learning_rate == 0.002 and config.model.model == "m"
    assert config.adapter.targets == ["self_attn.q_proj", "mlp"] and config.data.completion_only is False
    assert config.train.batch_size == cfg.TrainConfig().batch_size

    for text, message in [
        ("optim:\n  lr: 1\n", "unknown key 'optim.lr'"),
        ("nonsense:\n  a: 1\n", "unknown section 'nonsense'"),
        ("train:\n  batch_size: two\n", "train.batch_size: expected an integer"),
        ("optim:\n  optimizer: lion\n", "'lion' is not one of"),
        ("train:\n  epochs: 1\n bad: [1\n", r"run.yaml line \d+: invalid YAML"),
        # mlx_lm.lora's flat layout, said to be so rather than a field at a time.
        ('model: "m"\ntrain: true\niters: 4\n', r"run.yaml looks like an mlx_lm.lora config \('iters' is "
                                                 r"train.max_steps\); mlxft's config puts each field in a section"),
        ("model:\n  model: m\nlora_parameters:\n  rank: 8\n", r"\('lora_parameters' is adapter.rank/alpha/dropout\)"),
        ('model: "m"\n', r"looks like an mlx_lm.lora config \('model: m' is a flat key\)"),
        ("data: [4]\n", "section 'data' must be a mapping of fields"),
    ]:
        path.write_text(text)
        with pytest.raises(UserError, match=message):
            cfg.resolve(parser.parse_args([]), str(path))
    with pytest.raises(UserError, match="no model given"):
        cfg.validate(RunConfig())
    partial = RunConfig.from_dict({"model": {"model": "m", "checkpoint_layers": 2}, "data": {"data": "d"}})
    with pytest.raises(UserError, match="model.checkpoint_layers: applies to checkpointed runs; add --grad-checkpoint"):
        cfg.validate(partial)
    for adapter in ({"targets": ["layers"]}, {"finetune": "full", "targets": ["layers", "mlp"]}):
        whole = RunConfig.from_dict({"model": {"model": "m"}, "data": {"data": "d"}, "adapter": adapter})
        with pytest.raises(UserError, match="adapter.targets: 'layers' .* stands alone and needs --finetune full"):
            cfg.validate(whole)
    both = RunConfig.from_dict({"model": {"model": "m", "grad_checkpoint": True, "checkpoint_keep_mlp": True,
                                          "recompute_mlp": True}, "data": {"data": "d"}})
    with pytest.raises(UserError, match="model.recompute_mlp: recomputes what --checkpoint-keep-mlp keeps"):
        cfg.validate(both)
    keep_mlp = RunConfig.from_dict({"model": {"model": "m", "checkpoint_keep_mlp": True}, "data": {"data": "d"}})
    with pytest.raises(UserError, match="model.checkpoint_keep_mlp: applies to checkpointed runs; add --grad-checkpoint"):
        cfg.validate(keep_mlp)


def test_config_takes_paths_and_numpy_numbers_from_scripts(tmp_path):
    """Research scripts build configs from pathlib.Path and NumPy scalars: they are stored as
    plain str / int / float (the saved config.yaml must stay plain), and the old refusals hold."""
    config = RunConfig.from_dict({
        "model": {"model": tmp_path / "model"}, "data": {"data": tmp_path / "data", "max_seq_length": np.int64(512)},
        "optim": {"learning_rate": np.float32(0.5), "warmup_steps": np.int32(3), "weight_decay": np.int64(0)},
        "train": {"output_dir": tmp_path / "run", "batch_size": np.uint8(2), "memory_limit": np.float64(1.5)},
    })
    assert config.model.model == str(tmp_path / "model") and config.train.output_dir == str(tmp_path / "run")
    assert config.data.data == str(tmp_path / "data")
    values = [config.data.max_seq_length, config.optim.warmup_steps, config.train.batch_size,
              config.optim.learning_rate, config.optim.weight_decay, config.train.memory_limit]
    assert values == [512, 3, 2, 0.5, 0.0, 1.5]
    assert [type(v) for v in values] == [int, int, int, float, float, float]
    assert RunConfig.from_dict({"model": {"quantize": np.int64(4)}}).model.quantize == 4  # choices still apply
    for section, key, value, message in [
        ("train", "batch_size", True, "expected an integer"),
        ("train", "batch_size", np.bool_(True), "expected an integer"),
        ("train", "batch_size", 2.0, "expected an integer"),
        ("train", "batch_size", np.float64(2.5), "expected an integer"),
        ("optim", "learning_rate", np.bool_(True), "expected a number"),
        ("optim", "learning_rate", False, "expected a number"),
        ("model", "model", 3, "expected a string or path"),
        ("model", "quantize", np.int64(3), "3 is not one of"),
    ]:
        with pytest.raises(UserError, match=f"config: {section}.{key}: {message}"):
            RunConfig.from_dict({section: {key: value}})
    # Assigned to the dataclasses directly they crashed the save (yaml cannot write them) with
    # a traceback, after the run directory was made; validation now coerces them alike.
    assigned = RunConfig()
    assigned.model.model, assigned.optim.learning_rate, assigned.train.batch_size = tmp_path, np.float32(0.5), np.int64(2)
    assigned.data.data = tmp_path
    cfg.validate(assigned)
    assert (assigned.model.model, assigned.optim.learning_rate, assigned.train.batch_size) == (str(tmp_path), 0.5, 2)
    assert [type(v) for v in (assigned.optim.learning_rate, assigned.train.batch_size)] == [float, int]
    # What scripts have always been able to assign stays accepted: a tuple, None, a whole float.
    assigned.adapter.targets, assigned.train.resume, assigned.train.max_steps = ("self_attn.q_proj",), None, 2.0
    cfg.validate(assigned)
    assert (assigned.adapter.targets, assigned.train.resume, assigned.train.max_steps) == (["self_attn.q_proj"], "", 2)
    assert type(assigned.train.max_steps) is int
    for value in ("4", 2.5):
        assigned.train.batch_size = value
        with pytest.raises(UserError, match=f"config field train.batch_size: expected an integer, got {value!r}"):
            cfg.validate(assigned)
    # A misplaced or misspelt field was ignored (the rate stayed 1e-4); a section replaced by a dict a TypeError.
    for change, message in ((lambda c: setattr(c.train, "learning_rate", 1e-3), "unknown key 'train.learning_rate'"),
                            (lambda c: setattr(c.optim, "lr", 1e-3), "unknown key 'optim.lr'"),
                            (lambda c: setattr(c, "trian", c.train), "unknown section 'trian'"),
                            (lambda c: setattr(c, "train", {"batch_size": 2}), "section 'train' is a dict, not "
                                                                                "TrainConfig")):
        bad = RunConfig()
        change(bad)
        with pytest.raises(UserError, match=message):
            cfg.validate(bad)


def test_default_targets_of_an_unfamiliar_layout_are_every_linear_even_beside_a_named_one():
    unfamiliar = ["blk.a_proj", "blk.b_proj", "out_proj"]  # no attention or feed-forward names
    assert lora.resolve_targets(["default"], unfamiliar) == unfamiliar
    # Naming one module as well had left `default` to that module alone.
    assert lora.resolve_targets(["out_proj", "default"], unfamiliar) == unfamiliar
    familiar = ["mlp.up_proj", "other", "self_attn.q_proj"]
    assert lora.resolve_targets(["other", "default"], familiar) == familiar
    assert lora.resolve_targets(["default"], familiar) == ["mlp.up_proj", "self_attn.q_proj"]
