"""Fusing: the fused model directory gives the unfused model's logits, loads in mlx-lm, and is
written in Hugging Face layout (config, shards and index, tokenizer); quantized bases, full
fine-tunes and bad output paths."""

import json
import shutil

import pytest

import mlx.core as mx

from mlxft import adapters, models
from mlxft.errors import UserError
from mlxft.fuse import fuse, main as fuse_main

from adapter_runs import adapted, base_model, logits, max_rel_diff, synthetic_run, trained_run


def mlx_lm_logits(path):
    """Logits of the model mlx-lm's loader makes of a directory (its tokenizer aside)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    return logits(model)


@pytest.mark.parametrize("family,kind", [("llama", "trained"), ("lfm2", "dora")])
def test_fused_equals_unfused_and_loads_in_mlx_lm(family, kind, llama_dir, lfm2_dir, runs_root, tmp_path, tokenizer):
    trained_with = tokenizer  # every test model uses Qwen3's tokenizer
    model_dir = {"llama": llama_dir, "lfm2": lfm2_dir}[family]
    run = trained_run(runs_root, model_dir) if kind == "trained" else synthetic_run(runs_root, model_dir, "dora", num_layers=2)
    unfused = logits(adapted(run))
    base = logits(base_model(model_dir))
    assert max_rel_diff(unfused, base) > 1e-2  # the adapter changes the model: the comparison means something

    out = fuse(str(run), None, tmp_path / "fused")  # --model defaults to the run's recorded base
    from mlx_lm import load

    model, tokenizer = load(str(out))  # what users run: model and tokenizer from the directory
    assert max_rel_diff(logits(model), unfused) < 1e-5
    text = "<|im_start|>user\nWhat is 1 plus 2?<|im_end|>"
    assert tokenizer.encode(text) == trained_with.encode(text) and tokenizer.chat_template == trained_with.chat_template

    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family and config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "float32" and "quantization" not in config
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(mx.load(str(out / "model.safetensors")))
    if family == "lfm2":  # PyTorch's Conv1d layout (channels, 1, kernel), not mlx-lm's
        assert mx.load(str(out / "model.safetensors"))["model.layers.0.conv.conv.weight"].shape == (64, 1, 3)


def test_quantized_base_fuses_exactly_with_dequantize(llama_dir, runs_root, tmp_path):
    run = synthetic_run(runs_root, llama_dir, "lora", quantize=4)  # QLoRA: the run quantized its base on load
    loaded = adapters.load_with_adapter(None, str(run))
    unfused = logits(loaded.model)

    exact = fuse(str(run), None, tmp_path / "dequantized", dequantize=True)
    assert "quantization" not in json.loads((exact / "config.json").read_text())
    assert max_rel_diff(mlx_lm_logits(exact), unfused) < 1e-5

    requantized = fuse(str(run), None, tmp_path / "quantized")
    config = json.loads((requantized / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert max_rel_diff(mlx_lm_logits(requantized), unfused) < 0.5  # loads; re-quantizing is lossy


def test_a_bfloat16_qlora_run_is_loaded_in_float32_on_the_base_it_trained_on(llama_dir, runs_root, tmp_path):
    # Training cast to bfloat16, then quantized; quantizing the float32 weights instead (as fuse's
    # float32 load did) gives other groups' scales, so the merged model was not the trained one.
    import yaml
    from mlx.utils import tree_flatten

    run = tmp_path / "run"
    shutil.copytree(synthetic_run(runs_root, llama_dir, "lora", quantize=4), run)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["model"]["dtype"] = "bfloat16"
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    trained, *_ = models.load(str(llama_dir), "bfloat16", 4, 32)
    loaded = adapters.load_with_adapter(None, str(run), dtype="float32").model
    base = {k.replace(".linear.", "."): v for k, v in tree_flatten(loaded.parameters())}  # under the adapters
    quantized = {k: v for k, v in tree_flatten(trained.parameters()) if k.endswith((".scales", ".biases", ".weight"))}
    assert quantized and all(k in base for k in quantized)
    for k, v in quantized.items():
        if k.endswith(("scales", "biases")):
            assert base[k].dtype == mx.float32  # computed in the dtype asked for
        same_dtype = base[k].dtype == v.dtype  # packed uint32 weights compare as they are
        assert mx.array_equal(*((base[k], v) if same_dtype else (base[k].astype(mx.float32), v.astype(mx.float32)))), k


def test_full_fine_tune_fuses_to_its_weights_and_shards(llama_dir, runs_root, tmp_path):
    run = synthetic_run(runs_root, llama_dir, "full")
    unfused = logits(adapted(run))
    out = fuse(str(run), str(llama_dir), tmp_path / "full", max_shard_gb=0.001)  # 1 MB shards
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert max_rel_diff(mlx_lm_logits(out), unfused) < 1e-6
    trained = mx.load(str(run / "adapters.safetensors"))
    written = {}
    for shard in shards:
        written.update(mx.load(str(out / shard)))
    name = "model.layers.1.mlp.up_proj.weight"
    assert mx.array_equal(written[name], trained[name])


def test_fuse_refuses_bad_output_paths(llama_dir, runs_root, tmp_path, capsys):
    run = synthetic_run(runs_root, llama_dir, "lora")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    assert fuse_main(["--adapter", str(run), "--out", str(tmp_path / "taken")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert fuse_main(["--adapter", str(run), "--out", str(run / "fused"), "--overwrite"]) == 2
    assert "inside" in capsys.readouterr().err
    # --adapter naming the weights file: the check compared with the file, so a directory in
    # the run (a checkpoint) was replaced under --overwrite.
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (copy / "checkpoint-5").mkdir()
    (copy / "checkpoint-5" / "optimizer.safetensors").write_text("precious")
    assert fuse_main(["--adapter", str(copy / "adapters.safetensors"), "--out", str(copy / "checkpoint-5"),
                      "--overwrite"]) == 2
    assert "is inside the adapter directory" in capsys.readouterr().err
    assert (copy / "checkpoint-5" / "optimizer.safetensors").read_text() == "precious"
    for here in (".", "..", str(tmp_path / "new") + "/.."):  # a ValueError traceback, after the model had loaded
        assert fuse_main(["--adapter", str(run), "--out", here]) == 2
        assert "name a directory of its own to write" in capsys.readouterr().err
    # An output containing the adapter, reached through a symlink: --overwrite would delete it.
    anc = tmp_path / "anc"
    shutil.copytree(run, anc / "run1")
    (tmp_path / "link").symlink_to(anc / "run1")
    assert fuse_main(["--adapter", str(tmp_path / "link"), "--out", str(anc), "--overwrite"]) == 2
    assert "contains the adapter directory" in capsys.readouterr().err
    assert (anc / "run1" / "adapters.safetensors").exists()
    # A base laid out as the hub cache lays it: the snapshot's files are links into blobs/,
    # and --out blobs --overwrite deleted the weights.
    hub = tmp_path / "hub"
    (hub / "blobs").mkdir(parents=True)
    (hub / "snapshots" / "abc").mkdir(parents=True)
    for file in llama_dir.iterdir():
        shutil.copy(file, hub / "blobs" / file.name)
        (hub / "snapshots" / "abc" / file.name).symlink_to(f"../../blobs/{file.name}")
    assert fuse_main(["--adapter", str(run), "--model", str(hub / "snapshots" / "abc"), "--out", str(hub / "blobs"),
                      "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"holds {(hub / 'blobs').resolve()}/" in err and ", a file of the base model" in err
    assert sorted(p.name for p in (hub / "blobs").iterdir()) == sorted(p.name for p in llama_dir.iterdir())
    # Beside the linked files, a new directory touches none of them; dangling links and loops count for nothing.
    (hub / "snapshots" / "abc" / "stale").symlink_to("/nonexistent-file")
    (hub / "snapshots" / "abc" / "loop1").symlink_to("loop2")
    (hub / "snapshots" / "abc" / "loop2").symlink_to("loop1")
    assert fuse_main(["--adapter", str(run), "--model", str(hub / "snapshots" / "abc"),
                      "--out", str(hub / "blobs" / "fused")]) == 0
    assert fuse_main(["--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--adapter" in err
    with pytest.raises(UserError, match="does not exist"):
        fuse(str(tmp_path / "no-run"), None, tmp_path / "y")
    assert not (tmp_path / "y").exists()
    for size in (0.0, float("nan"), float("inf")):  # nan and inf had failed after loading the model
        with pytest.raises(UserError, match="--max-shard-size must be a number of GB > 0"):
            fuse(str(run), None, tmp_path / "y", max_shard_gb=size)
    assert not (tmp_path / "y").exists()


def test_a_base_with_transformers_dtype_key_is_told_the_written_dtype(llama_dir, tmp_path):
    # transformers 4.56+ writes (and 5 reads) "dtype"; only "torch_dtype" was set, so a float32
    # fuse of a base whose config said "dtype": "bfloat16" loaded in bfloat16, silently.
    base = tmp_path / "base"
    shutil.copytree(llama_dir, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    out = fuse(None, str(base), tmp_path / "fused", dtype="float32")
    written = json.loads((out / "config.json").read_text())
    assert written["dtype"] == written["torch_dtype"] == "float32"


def test_experts_left_stacked_are_said_to_load_in_mlx_lm_only(tmp_path, capsys):
    # mlx-lm stacks a mixture of experts on load; written stacked, transformers found none of
    # the base's expert tensors and started them at random without an error.
    from conftest import LLAMA_CONFIG, write_model

    base = write_model(tmp_path / "mixtral", {**LLAMA_CONFIG, "model_type": "mixtral", "num_local_experts": 4,
                                              "num_experts_per_tok": 2})
    weights = mx.load(str(base / "model.safetensors"))
    for name in [n for n in weights if ".switch_mlp." in n]:  # each expert apart, as the hub stores them
        stacked = weights.pop(name)
        prefix, projection = name.split(".switch_mlp.")
        short = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}[projection.split(".")[0]]
        for expert in range(stacked.shape[0]):
            weights[f"{prefix}.experts.{expert}.{short}.weight"] = stacked[expert]
    mx.save_safetensors(str(base / "model.safetensors"), weights)
    expected = logits(base_model(base))
    capsys.readouterr()
    out = fuse(None, str(base), tmp_path / "fused")
    printed = capsys.readouterr()
    assert "tensors are written as mlx-lm names or lays them out, not as the base stores them" in printed.err
    assert "transformers does not" in printed.out
    assert max_rel_diff(mlx_lm_logits(out), expected) < 1e-6
    fuse(None, str(out), tmp_path / "again")  # a base already in mlx-lm's layout: nothing renamed
    assert "mlx-lm names or lays them out" not in capsys.readouterr().err


def test_a_convolution_kernel_in_mlx_lms_layout_is_said_to_load_in_mlx_lm_only(tmp_path, capsys):
    # A Mamba base stores its conv kernel as PyTorch does, (channels, 1, kernel); mlx-lm's layout
    # was written under the same name without a word, and transformers refused the result.
    from conftest import write_model

    mamba = {"model_type": "mamba", "vocab_size": 8256, "hidden_size": 32, "intermediate_size": 64,
             "state_size": 8, "num_hidden_layers": 2, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True,
             "time_step_rank": 4, "tie_word_embeddings": True}
    base = write_model(tmp_path / "mamba", mamba)
    weights = mx.load(str(base / "model.safetensors"))
    weights = {k: v.swapaxes(1, 2) if k.endswith("conv1d.weight") else v for k, v in weights.items()}
    mx.save_safetensors(str(base / "model.safetensors"), weights)
    expected = logits(base_model(base))
    capsys.readouterr()
    out = fuse(None, str(base), tmp_path / "fused")
    printed = capsys.readouterr()
    assert "tensors are written as mlx-lm names or lays them out" in printed.err and "conv1d.weight" in printed.err
    assert "transformers does not" in printed.out
    assert max_rel_diff(mlx_lm_logits(out), expected) < 1e-6


def test_an_untied_head_of_another_name_stays_untied(tmp_path):
    # InternLM2 names its untied head `output`: the head was taken for tied (no `lm_head.`), and
    # neither mlx-lm nor mlxft could load the result (`output.weight` not in the model).
    from conftest import write_model

    internlm2 = {"model_type": "internlm2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 8256,
                 "bias": False, "tie_word_embeddings": False, "rope_theta": 10000.0}
    base = write_model(tmp_path / "internlm2", internlm2)
    out = fuse(None, str(base), tmp_path / "fused")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert max_rel_diff(mlx_lm_logits(out), logits(base_model(base))) < 1e-6


def test_parameters_a_family_keeps_in_float32_stay_float32(tmp_path):
    # mlx-lm's conversion keeps Nemotron-H's A_log and its routing bias in float32: mlxft cast
    # them with the rest, which moved which experts a token went to.
    from conftest import write_model
    from mlx.utils import tree_flatten
    from test_moe import NEMOTRON_H

    base = write_model(tmp_path / "nemotron", NEMOTRON_H)
    kept = ("A_log", "e_score_correction_bias")
    model = models.load(str(base), "float32")[0]
    models.cast(model, mx.bfloat16)
    dtypes = {name: value.dtype for name, value in tree_flatten(model.parameters())}
    assert {d for n, d in dtypes.items() if any(k in n for k in kept)} == {mx.float32}
    assert models.compute_dtype(model) == mx.bfloat16
    out = fuse(None, str(base), tmp_path / "fused", dtype="bfloat16")
    written = mx.load(str(out / "model.safetensors"))
    assert {v.dtype for n, v in written.items() if any(k in n for k in kept)} == {mx.float32}
    assert written["backbone.embeddings.weight"].dtype == mx.bfloat16
