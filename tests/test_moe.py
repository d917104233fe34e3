"""LoRA on mixtures of experts (mlx-lm's stacked SwitchLinear projections), Mamba mixers among
the default targets, and resumed runs that keep the modules their checkpoint recorded."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxft import RunConfig, Trainer, adapters, checkpoint, lora, models
from mlxft.config import AdapterConfig
from mlxft.errors import UserError
from mlxft.export import export
from mlxft.fuse import fuse

from conftest import CHAT_ROWS, LLAMA_CONFIG, write_jsonl, write_model

_DENSE = {k: v for k, v in LLAMA_CONFIG.items() if k != "model_type"}
QWEN3_MOE = _DENSE | {"model_type": "qwen3_moe", "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                      "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "norm_topk_prob": True}
MIXTRAL = LLAMA_CONFIG | {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
EXPERTS = ["switch_mlp.down_proj", "switch_mlp.gate_proj", "switch_mlp.up_proj"]


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("qwen3_moe"), QWEN3_MOE)


@pytest.fixture(scope="module")
def moe_data(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("data")
    write_jsonl(directory / "train.jsonl", CHAT_ROWS[:8])
    write_jsonl(directory / "valid.jsonl", CHAT_ROWS[:2])
    return directory


def run_config(model_dir, data_dir, out, adapter=None, **train) -> RunConfig:
    return RunConfig.from_dict({
        "model": {"model": str(model_dir), "dtype": "float32"},
        "data": {"data": str(data_dir)},
        "adapter": adapter or {},
        "optim": {"learning_rate": 1e-2, "warmup_steps": 1},
        "train": {"output_dir": str(out), "batch_size": 2, "log_every": 1, "save_every": 2, "max_steps": 4, **train},
    })


def trainable(model) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}


@pytest.mark.parametrize("config, moe", [(QWEN3_MOE, "mlp"), (MIXTRAL, "block_sparse_moe")])
def test_default_targets_reach_the_experts_as_mlx_lm_does(tmp_path, config, moe):
    # mlxft used to list only nn.Linear modules: an MoE's LoRA trained its attention and router,
    # never the experts, which mlx-lm adapts by default (and Mixtral's whole feed-forward).
    model = models.load(str(write_model(tmp_path / "moe", config)), "float32")[0]
    assert lora.resolve_targets(["mlp"], lora.linear_names(list(model.layers))) == sorted(
        [f"{moe}.gate"] + [f"{moe}.{name}" for name in EXPERTS])
    model.freeze()
    targets = lora.apply(model, AdapterConfig(), seed=0)
    assert {f"{moe}.{name}" for name in EXPERTS} | {f"{moe}.gate"} <= set(targets)
    shapes = dict(tree_flatten(model.trainable_parameters()))
    experts, hidden = config["num_local_experts" if "num_local_experts" in config else "num_experts"], 64
    assert shapes[f"model.layers.0.{moe}.switch_mlp.gate_proj.lora_a"].shape == (experts, 8, hidden)


def test_the_experts_adapters_compute_as_mlx_lm_s_layer(qwen3_moe_dir):
    from mlx_lm.tuner.lora import LoRASwitchLinear

    model = models.load(str(qwen3_moe_dir), "float32")[0]
    model.freeze()
    lora.apply(model, AdapterConfig(), seed=0)
    layer = model.layers[0].mlp.switch_mlp.up_proj
    assert lora.computes_in_input_dtype(layer)
    layer.lora_b = mx.random.normal(layer.lora_b.shape)
    x = mx.random.normal((2, 3, 1, 1, 64))  # as SwitchGLU hands it in
    indices = mx.array([[[0, 2], [1, 3], [3, 0]], [[2, 1], [0, 1], [1, 2]]])
    assert mx.array_equal(layer(x, indices), LoRASwitchLinear.__call__(layer, x, indices))


def test_a_moe_run_trains_the_experts_resumes_exactly_and_fuses(qwen3_moe_dir, moe_data, tmp_path, capsys):
    whole = Trainer(run_config(qwen3_moe_dir, moe_data, tmp_path / "whole"))
    start = trainable(whole.model)
    whole.train()
    end = trainable(whole.model)
    moved = [k for k in end if "switch_mlp" in k and not np.array_equal(start[k], end[k])]
    assert len(moved) == 2 * 3 * 2  # lora_a and lora_b of three stacked projections in both layers

    out = tmp_path / "resumed"
    resumed = Trainer(run_config(qwen3_moe_dir, moe_data, out, resume=str(tmp_path / "whole" / "checkpoint-2")))
    resumed.train()
    assert all(np.array_equal(end[k], v) for k, v in trainable(resumed.model).items())

    # The adapter loads where mlx-lm's own do, and fusing it changes nothing the model computes.
    from mlx_lm import load

    adapted = load(str(qwen3_moe_dir), adapter_path=str(export(out, "mlx-lm", tmp_path / "mlx-lm")))[0]
    fused = load(str(fuse(str(out), None, tmp_path / "fused")))[0]
    tokens = mx.array([[3, 17, 256, 9, 1001]])
    assert float(mx.abs(adapted(tokens) - fused(tokens)).max()) < 1e-4
    assert float(mx.abs(adapted(tokens) - models.load(str(qwen3_moe_dir), "float32")[0](tokens)).max()) > 1e-3

    # mlx-lm's layout has [experts, rank, in] tensors, which a new run may start from.
    weights, spec = adapters.load_adapter_dir(tmp_path / "mlx-lm")
    assert weights["model.layers.1.mlp.switch_mlp.down_proj.lora_b"].shape == (4, 64, 8)
    again = Trainer(run_config(qwen3_moe_dir, moe_data, tmp_path / "again", adapter={"init_adapter": str(tmp_path / "mlx-lm")},
                               max_steps=1))
    assert all(np.array_equal(end[k], v) for k, v in trainable(again.model).items())

    with pytest.raises(UserError, match="stacked projections .* which PEFT cannot load; fuse it instead"):
        export(out, "peft", tmp_path / "peft")
    assert not (tmp_path / "peft").exists()


def test_dora_on_the_experts_is_refused_in_one_line(qwen3_moe_dir, moe_data, tmp_path):
    with pytest.raises(UserError, match=r"DoRA cannot adapt a mixture of experts' stacked projections "
                                        r"\(mlp.switch_mlp.down_proj, .*pass --targets attn"):
        Trainer(run_config(qwen3_moe_dir, moe_data, tmp_path / "dora", adapter={"finetune": "dora"}))
    trainer = Trainer(run_config(qwen3_moe_dir, moe_data, tmp_path / "attn",
                                 adapter={"finetune": "dora", "targets": ["attn"]}))
    assert trainer.targets == sorted(f"self_attn.{p}_proj" for p in "qkvo")


def test_a_resumed_run_adapts_what_its_checkpoint_recorded_not_what_default_reads_now(
        qwen3_moe_dir, moe_data, tmp_path):
    # A checkpoint written when "default" left the experts out: its config says default, its
    # state names the modules. Re-resolving default on resume had asked for tensors it lacks.
    out = tmp_path / "run"
    attention_and_router = ["mlp.gate"] + [f"self_attn.{p}_proj" for p in "qkvo"]
    whole = Trainer(run_config(qwen3_moe_dir, moe_data, out, adapter={"targets": attention_and_router}))
    whole.train()
    saved = out / "checkpoint-2"
    settings = yaml.safe_load((saved / checkpoint.CONFIG_FILE).read_text())
    settings["adapter"]["targets"] = ["default"]
    (saved / checkpoint.CONFIG_FILE).write_text(yaml.safe_dump(settings))
    resumed = Trainer(run_config(qwen3_moe_dir, moe_data, tmp_path / "resumed", resume=str(saved)))
    assert resumed.targets == sorted(attention_and_router)
    resumed.train()
    assert all(np.array_equal(v, trainable(whole.model)[k]) for k, v in trainable(resumed.model).items())

    state = json.loads((saved / checkpoint.TRAINER_STATE).read_text())
    state["train_modules"]["targets"] = ["mlp.shared_expert.up_proj"]  # not in this model's layers
    (saved / checkpoint.TRAINER_STATE).write_text(json.dumps(state))
    with pytest.raises(UserError, match="cannot resume: the checkpoint trains mlp.shared_expert.up_proj, which this "
                                        "model's layers do not have"):
        Trainer(run_config(qwen3_moe_dir, moe_data, tmp_path / "again", resume=str(saved)))


def test_granite_hybrid_mamba_mixers_are_default_and_attn_targets(tmp_path):
    config = _DENSE | {
        "model_type": "granitemoehybrid", "attention_bias": False, "embedding_multiplier": 1.0,
        "attention_multiplier": 0.25, "logits_scaling": 1.0, "residual_multiplier": 1.0,
        "layer_types": ["mamba", "attention"], "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_proj_bias": False,
        "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True,
        "shared_intermediate_size": 128, "position_embedding_type": "rope"}
    model = models.load(str(write_model(tmp_path / "granite", config)), "float32")[0]
    available = lora.linear_names(list(model.layers))
    mamba = [name for name in available if name.startswith("mamba.")]
    assert mamba == ["mamba.in_proj", "mamba.out_proj"]
    assert set(mamba) <= set(lora.resolve_targets(["default"], available))
    assert set(mamba) <= set(lora.resolve_targets(["attn"], available))
    assert not set(mamba) & set(lora.resolve_targets(["mlp"], available))
    # transformers validates this family's config.json as the tokenizer loads; its error is not
    # a ValueError and had come out as a traceback.
    mismatched = write_model(tmp_path / "mismatched", config | {"mamba_d_head": 16})  # mlx-lm builds it
    with pytest.raises(UserError, match="Mamba head state do not match .*; check its config.json"):
        models.load(str(mismatched), "float32")


NEMOTRON_H = {
    "model_type": "nemotron_h", "vocab_size": LLAMA_CONFIG["vocab_size"], "hidden_size": 64, "intermediate_size": 128,
    "max_position_embeddings": 1024, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": 32, "mamba_proj_bias": False,
    "ssm_state_size": 8, "conv_kernel": 4, "n_groups": 1, "mlp_bias": False, "layer_norm_epsilon": 1e-5,
    "use_bias": False, "use_conv_bias": True, "hybrid_override_pattern": ["M", "*", "-", "E"],
    "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32, "n_group": 1, "n_routed_experts": 4,
    "n_shared_experts": 1, "topk_group": 1, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "routed_scaling_factor": 1.0, "tie_word_embeddings": False}


def test_blocks_all_called_mixer_split_into_attn_and_mlp_by_what_they_are(tmp_path):
    # Nemotron-H names every block's module "mixer": Mamba, attention, MLP and experts alike.
    # By that name alone, attn took the experts and mlp selected nothing, and DoRA's refusal
    # sent the user to --targets attn, which it refused again.
    model = models.load(str(write_model(tmp_path / "nemotron", NEMOTRON_H)), "float32")[0]
    available = lora.linear_names(list(model.layers))
    attn, mlp = lora.resolve_targets(["attn"], available), lora.resolve_targets(["mlp"], available)
    assert attn == ["mixer.in_proj", "mixer.k_proj", "mixer.o_proj", "mixer.out_proj", "mixer.q_proj", "mixer.v_proj"]
    assert {"mixer.up_proj", "mixer.down_proj", "mixer.switch_mlp.fc1", "mixer.switch_mlp.fc2",
            "mixer.shared_experts.up_proj", "mixer.shared_experts.down_proj"} <= set(mlp)
    assert sorted(attn + mlp) == lora.resolve_targets(["default"], available) == available
    dora = AdapterConfig(rank=4, finetune="dora", targets=["attn"])
    assert lora.check(model, dora) == attn
    with pytest.raises(UserError, match="DoRA cannot adapt a mixture of experts' stacked projections"):
        lora.check(model, AdapterConfig(rank=4, finetune="dora", targets=["mlp"]))


def test_a_peft_adapter_of_each_expert_is_refused_for_what_it_is(qwen3_moe_dir, tmp_path):
    # transformers' Qwen3-MoE holds each expert as modules of its own, and PEFT adapts them so;
    # the refusal had said the adapter was for another model.
    peft = tmp_path / "peft"
    peft.mkdir()
    tensors = {}
    for layer in range(2):
        for expert in range(4):
            name = f"base_model.model.model.layers.{layer}.mlp.experts.{expert}.gate_proj"
            tensors[f"{name}.lora_A.weight"] = mx.zeros((4, 64))
            tensors[f"{name}.lora_B.weight"] = mx.zeros((32, 4))
    mx.save_safetensors(str(peft / "adapter_model.safetensors"), tensors, metadata={"format": "pt"})
    (peft / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                          "target_modules": ["gate_proj"]}))
    with pytest.raises(UserError, match=r"adapts each expert as a module of its own \(mlp\.experts\.0\.gate_proj\).* "
                                        r"stacks each layer's experts \(mlp\.switch_mlp\.down_proj\)"):
        adapters.load_with_adapter(str(qwen3_moe_dir), str(peft))
