"""Adapter directories in and out: mlxft <-> PEFT <-> mlx-lm round trips keep every tensor, a
real mlx-lm run loads (for evaluation and for continued training), and malformed or
mismatched directories are refused with one clear line."""

import json
import re
import shutil

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxft import adapters, checkpoint
from mlxft.config import AdapterConfig
from mlxft.errors import UserError
from mlxft.export import export, main as export_main

from adapter_runs import base_model, logits, max_rel_diff, mlx_lm_run, synthetic_run
from conftest import LLAMA_CONFIG, write_model


def as_numpy(weights):
    return {k: np.array(v.astype(mx.float32)) for k, v in weights.items()}


@pytest.mark.parametrize("family,finetune,num_layers", [("llama", "dora", -1), ("lfm2", "lora", 2)])
def test_mlxft_to_peft_to_mlxft_keeps_every_tensor(family, finetune, num_layers, llama_dir, lfm2_dir, runs_root, tmp_path):
    model_dir = {"llama": llama_dir, "lfm2": lfm2_dir}[family]
    run = synthetic_run(runs_root, model_dir, finetune, num_layers=num_layers)
    original, spec = adapters.load_adapter_dir(run)
    assert spec.source == "mlxft" and spec.fine_tune_type == finetune and spec.base_model == str(model_dir)

    peft_dir = export(run, "peft", tmp_path / "peft")
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["use_dora"] == (finetune == "dora") and sorted(config["target_modules"]) == sorted(spec.targets)
    assert config["layers_to_transform"] == (None if num_layers == -1 else [1, 2])
    assert (peft_dir / "tokenizer.json").is_file()  # the run's tokenizer travels with the adapter

    # Read PEFT's file with an independent reader: names and (r, in) / (out, r) orientation.
    raw = load_file(str(peft_dir / "adapter_model.safetensors"))
    ours = as_numpy(original)
    assert len(raw) == len(ours)
    for name, value in ours.items():
        stem, leaf = name.rsplit(".", 1)
        key = "base_model.model." + stem + {"lora_a": ".lora_A.weight", "lora_b": ".lora_B.weight", "m": ".lora_magnitude_vector"}[leaf]
        np.testing.assert_array_equal(raw[key], value.T if leaf != "m" else value)

    back, back_spec = adapters.load_adapter_dir(peft_dir)
    assert back_spec.source == "peft" and back_spec.fine_tune_type == finetune
    assert (back_spec.rank, back_spec.scale, sorted(back_spec.targets)) == (spec.rank, spec.scale, sorted(spec.targets))
    assert set(back) == set(original)
    for name, value in as_numpy(back).items():
        np.testing.assert_array_equal(value, ours[name])

    # ... and on to mlx-lm's layout (the base tells how many layers a PEFT adapter spans).
    mlx_dir = export(peft_dir, "mlx-lm", tmp_path / "mlx", model=str(model_dir))
    again, again_spec = adapters.load_adapter_dir(mlx_dir)
    assert again_spec.source == "mlxft" and set(again) == set(original)
    for name, value in as_numpy(again).items():
        np.testing.assert_array_equal(value, ours[name])
    model = adapters.attach(base_model(model_dir), again_spec, again)
    reference = adapters.attach(base_model(model_dir), spec, original)
    np.testing.assert_array_equal(logits(model), logits(reference))
    from mlx_lm.utils import load_adapters  # mlx-lm's own loader reads the converted directory

    np.testing.assert_array_equal(logits(load_adapters(base_model(model_dir), str(mlx_dir))), logits(reference))


def test_rslora_scale_and_alpha_only_configs(llama_dir, runs_root, tmp_path):
    run = synthetic_run(runs_root, llama_dir, "lora", targets=["attn"])
    peft_dir = export(run, "peft", tmp_path / "peft")
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    config.update(use_rslora=True, lora_alpha=6.0)  # scale = 6 / sqrt(4) = 3
    (peft_dir / "adapter_config.json").write_text(json.dumps(config))
    _, spec = adapters.load_adapter_dir(peft_dir)
    assert spec.scale == 3.0 and spec.alpha == 12.0

    # An mlx-lm style config that gives alpha instead of scale (mlx-lm itself would refuse it).
    config = json.loads((run / "adapter_config.json").read_text())
    mlx_dir = tmp_path / "alpha-only"
    mlx_dir.mkdir()
    weights, _ = checkpoint.load_adapter_weights(run / "adapters.safetensors")
    mx.save_safetensors(str(mlx_dir / "adapters.safetensors"), weights)  # no mlxft header
    del config["lora_parameters"]["scale"]
    config["lora_parameters"]["alpha"] = 10.0
    (mlx_dir / "adapter_config.json").write_text(json.dumps(config))
    _, spec = adapters.load_adapter_dir(mlx_dir)
    assert spec.source == "mlx-lm" and spec.scale == 2.5


def test_mlx_lm_run_loads_for_evaluation_and_training(lfm2_dir, runs_root, chat_data, tmp_path):
    from mlx_lm import load as mlx_lm_load

    run = mlx_lm_run(runs_root, lfm2_dir)
    stored = mx.load(str(run / "adapters.safetensors"))
    weights, spec = adapters.load_adapter_dir(run)
    assert spec.source == "mlx-lm" and (spec.rank, spec.scale, spec.alpha, spec.num_layers) == (4, 3.0, 12.0, 2)
    assert spec.base_model == str(lfm2_dir)  # mlx-lm records the model it trained on
    assert set(weights) == set(stored) and all(mx.array_equal(weights[k], stored[k]) for k in stored)

    # Evaluation: the same logits as mlx-lm's own loader gives, base found from the run.
    loaded = adapters.load_with_adapter(None, str(run))
    expected, _ = mlx_lm_load(str(lfm2_dir), adapter_path=str(run))
    assert max_rel_diff(logits(loaded.model), logits(expected)) < 1e-6
    assert sorted(k for k, _ in tree_flatten(loaded.model.trainable_parameters())) == sorted(stored)

    # Continued training: the run's layout with the adapter's weights as the starting point.
    settings = adapters.run_settings(run)
    assert settings == {"finetune": "lora", "rank": 4, "alpha": 12.0, "dropout": 0.0, "num_layers": 2,
                        "targets": sorted(spec.targets)}
    model = base_model(lfm2_dir)
    targets = adapters.start_from(model, AdapterConfig(**settings), run, seed=7)
    assert targets == sorted(spec.targets)
    trainable = dict(tree_flatten(model.trainable_parameters()))
    assert set(trainable) == set(stored) and all(mx.array_equal(trainable[k], stored[k]) for k in stored)

    # On the command line --init-adapter alone: the layout flags left unset take the adapter's.
    from mlxft import config as cfg
    from mlxft.train import main as train_main, parser

    common = ["--model", str(lfm2_dir), "--data", str(chat_data), "--max-steps", "1", "--no-memory-estimate"]
    assert train_main([*common, "--init-adapter", str(run), "--output-dir", str(tmp_path / "continued")]) == 0
    adapter = yaml.safe_load((tmp_path / "continued" / "config.yaml").read_text())["adapter"]
    assert (adapter["finetune"], adapter["rank"], adapter["alpha"], adapter["num_layers"]) == ("lora", 4, 12.0, 2)
    assert set(mx.load(str(tmp_path / "continued" / "adapters.safetensors"))) == set(stored)
    # mlx-lm's default of 16 layers on a base with fewer means all of them (the base's
    # config.json tells); a --num-layers that is given stands.
    sixteen = _copy(run, tmp_path, "sixteen")
    recorded = json.loads((sixteen / "adapter_config.json").read_text())
    (sixteen / "adapter_config.json").write_text(json.dumps({**recorded, "num_layers": 16}))
    for flags, expected in (([], -1), (["--num-layers", "1"], 1)):
        resolved = cfg.resolve(parser().parse_args([*common, "--init-adapter", str(sixteen), *flags]), None)
        assert (resolved.adapter.num_layers, resolved.adapter.rank) == (expected, 4)


def test_an_mlx_lm_full_fine_tune_continues_on_its_whole_layers(llama_dir, runs_root, chat_data, tmp_path, capsys):
    # mlx-lm's full fine-tuning trains every weight of the last N layers, norms included.
    from mlxft.train import main as train_main

    run = mlx_lm_run(runs_root, llama_dir, full_layers=1)
    stored = mx.load(str(run / "adapters.safetensors"))
    assert any("layernorm" in k for k in stored) and all(k.startswith("model.layers.1.") for k in stored)
    settings = adapters.run_settings(run)
    assert (settings["finetune"], settings["targets"], settings["num_layers"]) == ("full", ["layers"], 1)
    for change, flag in [({"targets": ["default"]}, "--targets layers"), ({"num_layers": -1}, "--num-layers 1")]:
        model = base_model(llama_dir)
        with pytest.raises(UserError, match=flag):
            adapters.start_from(model, AdapterConfig(**{**settings, **change}), run)
        assert not checkpoint.trainable_weights(model)  # refused: still frozen
    model = base_model(llama_dir)
    assert adapters.start_from(model, AdapterConfig(**settings), run) == ["layers"]
    trainable = checkpoint.trainable_weights(model)
    assert set(trainable) == set(stored) and all(mx.array_equal(trainable[k], stored[k]) for k in stored)

    # On the command line --init-adapter alone continues it, and mlxft's run after it; a layout
    # flag that is given must agree.
    common = ["--model", str(llama_dir), "--data", str(chat_data), "--max-steps", "1", "--no-memory-estimate"]
    assert train_main([*common, "--init-adapter", str(run), "--targets", "all", "--output-dir", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "pass --targets layers" in err
    first, second = tmp_path / "first", tmp_path / "second"
    assert train_main([*common, "--init-adapter", str(run), "--output-dir", str(first)]) == 0
    assert train_main([*common, "--init-adapter", str(first), "--output-dir", str(second)]) == 0
    for out in (first, second):
        assert set(mx.load(str(out / "adapters.safetensors"))) == set(stored)
        adapter = yaml.safe_load((out / "config.yaml").read_text())["adapter"]
        assert (adapter["finetune"], adapter["targets"], adapter["num_layers"]) == ("full", ["layers"], 1)


def test_start_from_refuses_another_layout(llama_dir, runs_root):
    run = synthetic_run(runs_root, llama_dir, "lora")
    for change, flag in [({"rank": 8}, "--rank 4"), ({"alpha": 4.0}, "--alpha 8"), ({"targets": ["mlp"]}, "--targets"),
                         ({"finetune": "dora"}, "--finetune lora")]:
        model = base_model(llama_dir)
        with pytest.raises(UserError, match=flag):
            adapters.start_from(model, AdapterConfig(**{**adapters.run_settings(run), **change}), run)
        assert not any("lora" in k for k, _ in tree_flatten(model.parameters()))  # refused before any change
    model = base_model(llama_dir)
    model.unfreeze()  # as mlx_lm.load gives it: every weight had been taken for a tensor the adapter lacked
    adapters.start_from(model, AdapterConfig(**adapters.run_settings(run)), run)
    assert set(checkpoint.trainable_weights(model)) == set(checkpoint.load_adapter_weights(run / "adapters.safetensors")[0])


def _copy(run, tmp_path, name="bad"):
    target = tmp_path / name
    shutil.copytree(run, target)
    return target


def _break_peft(peft_dir, **changes):
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    config.update(changes)
    (peft_dir / "adapter_config.json").write_text(json.dumps(config))
    return peft_dir


def test_malformed_adapter_directories(llama_dir, runs_root, tmp_path):
    run = synthetic_run(runs_root, llama_dir, "lora")
    peft_dir = export(run, "peft", tmp_path / "peft")

    def refused(path, match):
        with pytest.raises(UserError, match=match):
            adapters.load_adapter_dir(path)

    refused(tmp_path / "missing", "does not exist")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "holds no adapter")

    truncated = _copy(run, tmp_path, "truncated")
    data = (truncated / "adapters.safetensors").read_bytes()
    (truncated / "adapters.safetensors").write_bytes(data[: len(data) // 2])
    refused(truncated, "truncated")

    plain = tmp_path / "no-config"  # mlx-lm layout without its adapter_config.json
    plain.mkdir()
    mx.save_safetensors(str(plain / "adapters.safetensors"), checkpoint.load_adapter_weights(run / "adapters.safetensors")[0])
    refused(plain, "no adapter_config.json")
    (plain / "adapter_config.json").write_text("{not json")
    refused(plain, "not a readable JSON")
    (plain / "adapter_config.json").write_text(json.dumps({"num_layers": 2, "lora_parameters": {"rank": 4}}))
    refused(plain, "no 'scale'")
    (plain / "adapter_config.json").write_text(json.dumps({"num_layers": 2, "lora_parameters": {"rank": 8, "scale": 2.0}}))
    refused(plain, "does not have rank 8")
    # Python's JSON reads NaN, and a dropout as text: refused by name rather than in a traceback.
    (plain / "adapter_config.json").write_text('{"num_layers": 2, "lora_parameters": {"rank": 8, "scale": NaN}}')
    refused(plain, "'scale' must be a finite number, got nan")
    (plain / "adapter_config.json").write_text('{"num_layers": 2, "lora_parameters": {"rank": NaN, "scale": 2.0}}')
    refused(plain, "'rank' must be an integer, got nan")
    (plain / "adapter_config.json").write_text(json.dumps({"num_layers": 2, "lora_parameters": {
        "rank": 8, "scale": 2.0, "dropout": "0.1x"}}))
    refused(plain, "'dropout' must be a finite number, got '0.1x'")
    (plain / "adapter_config.json").write_text(json.dumps({"num_layers": 2, "lora_parameters": {
        "rank": 8, "scale": 2.0, "dropout": 1.5}}))
    refused(plain, r"'dropout' must be in \[0, 1\)")
    # A number as the base was read as a model named "123".
    (plain / "adapter_config.json").write_text(json.dumps({"num_layers": 2, "model": 123, "lora_parameters": {
        "rank": 8, "scale": 2.0}}))
    refused(plain, "field 'model' must be a string, got 123; fix or remove it")
    refused(_break_peft(_copy(peft_dir, tmp_path, "base"), base_model_name_or_path=["a"]),
            r"field 'base_model_name_or_path' must be a string, got \[\"a\"\]")

    # The header's numbers went through float(): "nan" fused a model of NaNs with exit 0.
    for key, value, message in (("scale", "nan", "scale must be a finite number, got 'nan'"),
                                ("dropout", "2.0", r"dropout must be in \[0, 1\), got '2.0'"),
                                ("rank", "0", "rank must be >= 1, got '0'")):
        header = _copy(run, tmp_path, f"header-{key}")
        weights, meta = mx.load(str(header / "adapters.safetensors"), return_metadata=True)
        mx.save_safetensors(str(header / "adapters.safetensors"), weights, metadata={**meta, key: value})
        refused(header, f"adapters.safetensors: the LoRA header's {message}; the file is damaged")
    # A full fine-tune's mlx-lm config: its rank read with int() (a traceback).
    (plain / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full", "num_layers": 2,
                                                           "lora_parameters": {"rank": "abc", "scale": 2.0}}))
    refused(plain, "'rank' must be an integer, got 'abc'")
    # Integer tensors were cast to numbers and fused.
    ints = _copy(run, tmp_path, "ints")
    weights, meta = mx.load(str(ints / "adapters.safetensors"), return_metadata=True)
    mx.save_safetensors(str(ints / "adapters.safetensors"), {k: v.astype(mx.int32) for k, v in weights.items()},
                        metadata=meta)
    with pytest.raises(UserError, match="ints: tensor .* is int32, not floating point"):
        adapters.load_with_adapter(str(llama_dir), str(ints))

    refused(_break_peft(_copy(peft_dir, tmp_path, "ia3"), peft_type="IA3"), "peft_type 'IA3'")
    refused(_break_peft(_copy(peft_dir, tmp_path, "dora"), use_dora=True), "use_dora is True")
    refused(_break_peft(_copy(peft_dir, tmp_path, "pattern"), rank_pattern={"q_proj": 8}), "rank_pattern")
    refused(_break_peft(_copy(peft_dir, tmp_path, "extra"), modules_to_save=["lm_head"]), "modules_to_save")
    refused(_break_peft(_copy(peft_dir, tmp_path, "bias"), bias="all"), "bias='all'")
    refused(_break_peft(_copy(peft_dir, tmp_path, "r0"), r=0), "r must be >= 1, got 0")  # had divided by it
    refused(_break_peft(_copy(peft_dir, tmp_path, "rs"), r=-4, use_rslora=True), "r must be >= 1, got -4")
    refused(_break_peft(_copy(peft_dir, tmp_path, "drop"), lora_dropout="high"), "'lora_dropout' must be a finite")
    pickled = _copy(peft_dir, tmp_path, "bin")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    refused(pickled, "adapter_model.bin")
    renamed = _copy(peft_dir, tmp_path, "names")
    mx.save_safetensors(str(renamed / "adapter_model.safetensors"), {"model.layers.0.q.lora_A.weight": mx.zeros((4, 64))})
    refused(renamed, "does not start with 'base_model.model.'")


def test_mismatched_adapters_are_refused_and_leave_the_model_as_it_was(llama_dir, lfm2_dir, runs_root, tmp_path):
    llama_run = synthetic_run(runs_root, llama_dir, "lora")

    def refused(model_dir, path, match):
        weights, spec = adapters.load_adapter_dir(path)
        model = base_model(model_dir)
        with pytest.raises(UserError, match=match):
            adapters.attach(model, spec, weights)
        assert not any("lora" in k for k, _ in tree_flatten(model.parameters()))  # the base is as it was

    refused(lfm2_dir, llama_run, "trained on a llama model but the base is lfm2")
    peft_dir = export(llama_run, "peft", tmp_path / "peft")  # PEFT records no model type
    refused(lfm2_dir, peft_dir, "targets mlp.down_proj, which the base's layers do not have")
    narrow = write_model(tmp_path / "narrow", {**LLAMA_CONFIG, "hidden_size": 32, "intermediate_size": 64})
    refused(narrow, peft_dir, r"has shape \(\d+, \d+\) but the model expects")
    deeper = write_model(tmp_path / "deep", {**LLAMA_CONFIG, "num_hidden_layers": 3})
    refused(deeper, llama_run, "outside the last 2 of the base.s 3 layers")

    # The CLI says it in one line, exit code 2.
    assert export_main(["--adapter", str(tmp_path / "nowhere"), "--format", "peft", "--out", str(tmp_path / "o")]) == 2
    full = synthetic_run(runs_root, llama_dir, "full")
    # A whole model's full fine-tune in mlx-lm's layout (embeddings too) is not mlx-lm's whole layers.
    whole = export(full, "mlx-lm", tmp_path / "full-mlx-lm")
    settings = adapters.run_settings(whole)
    assert (settings["targets"], settings["num_layers"]) == (["default"], -1)
    with pytest.raises(UserError, match="full fine-tune"):
        export(full, "peft", tmp_path / "full-peft")
    assert not (tmp_path / "full-peft").exists()
    with pytest.raises(UserError, match="not empty"):
        export(llama_run, "peft", peft_dir)
    with pytest.raises(UserError, match="inside the adapter directory"):
        export(llama_run, "mlx-lm", llama_run / "sub", overwrite=True)
    # An output that contains an input: --overwrite would have deleted it.
    anc = tmp_path / "anc"
    shutil.copytree(llama_run, anc / "run1")
    with pytest.raises(UserError, match="contains the adapter directory"):
        export(anc / "run1", "mlx-lm", anc, overwrite=True)
    (anc / "base").mkdir()
    (anc / "base" / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    with pytest.raises(UserError, match="contains the base model"):
        export(llama_run, "peft", anc, model=str(anc / "base"), overwrite=True)
    assert sorted(p.name for p in anc.iterdir()) == ["base", "run1"] and (anc / "run1" / "adapters.safetensors").exists()


def _peft_dir(path, r, config, layers=(0, 1), mods=(("self_attn.q_proj", 64), ("self_attn.v_proj", 32))):
    path.mkdir()
    mx.random.seed(0)
    w = {}
    for i in layers:
        for mod, out in mods:
            w[f"base_model.model.model.layers.{i}.{mod}.lora_A.weight"] = 0.1 * mx.random.normal((r, 64))
            w[f"base_model.model.model.layers.{i}.{mod}.lora_B.weight"] = 0.1 * mx.random.normal((out, r))
    mx.save_safetensors(str(path / "adapter_model.safetensors"), w, metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, **config}))
    return path


def test_a_run_config_that_is_not_utf8_is_passed_over_like_one_that_is_not_yaml(llama_dir, runs_root, tmp_path):
    # Only its defaults are read; a Latin-1 byte (an editor's save) was a UnicodeDecodeError.
    run = tmp_path / "run"
    shutil.copytree(synthetic_run(runs_root, llama_dir), run)
    with open(run / "config.yaml", "ab") as f:
        f.write(b"# notes: caf\xe9\n")
    weights, spec = adapters.load_adapter_dir(run)
    assert weights and spec.run_config is None


def test_alpha_hint_of_a_scale_refusal_is_accepted(llama_dir, tmp_path):
    # rsLoRA r=32, lora_alpha=32: scale 32/sqrt(32), alpha = 181.0193...; ':g' printed 181.019.
    peft_dir = _peft_dir(tmp_path / "peft", 32, {"lora_alpha": 32, "use_rslora": True})
    targets = ["self_attn.q_proj", "self_attn.v_proj"]
    with pytest.raises(UserError) as err:
        adapters.start_from(base_model(llama_dir), AdapterConfig(targets=targets, rank=32, alpha=16.0), peft_dir)
    hinted = float(re.search(r"pass --alpha (\S+)$", str(err.value)).group(1))
    adapters.start_from(base_model(llama_dir), AdapterConfig(targets=targets, rank=32, alpha=hinted), peft_dir)


def test_mlx_lm_adapter_with_more_layers_than_the_base_survives_export(llama_dir, tmp_path):
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = base_model(llama_dir)
    linear_to_lora_layers(model, 16, {"rank": 4, "scale": 2.0, "dropout": 0.0})  # mlx-lm's default on 2 layers
    mx.random.seed(3)
    weights = {k: 0.05 * mx.random.normal(v.shape) if k.endswith("lora_b") else v
               for k, v in tree_flatten(model.trainable_parameters())}
    src = tmp_path / "mlx-lm"
    src.mkdir()
    mx.save_safetensors(str(src / "adapters.safetensors"), weights)
    (src / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 16, "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0}}))
    expected = logits(adapters.load_with_adapter(str(llama_dir), str(src)).model)
    out = export(str(src), "mlx-lm", tmp_path / "exported")
    assert max_rel_diff(logits(adapters.load_with_adapter(str(llama_dir), str(out)).model), expected) < 1e-6


def test_peft_config_without_lora_alpha_uses_peft_default(tmp_path):
    peft_dir = _peft_dir(tmp_path / "peft", 4, {"target_modules": ["q_proj"]}, mods=(("self_attn.q_proj", 64),))
    _, spec = adapters.load_adapter_dir(peft_dir)
    assert spec.scale == pytest.approx(8 / 4)  # peft.LoraConfig(lora_alpha=8 by default).lora_alpha / r


def test_a_qlora_run_exported_for_mlx_lm_keeps_its_quantized_base(llama_dir, runs_root, tmp_path):
    # The run quantized a float base on load; mlx-lm's layout has no field for that, so the
    # export used to load onto the float base in mlxft and say nothing about mlx-lm.
    from mlx_lm.tuner.utils import load_adapters

    from mlxft import RunConfig, Trainer, models
    from adapter_runs import data_dir

    run = tmp_path / "qlora"
    Trainer(RunConfig.from_dict({
        "model": {"model": str(llama_dir), "quantize": 4, "quantize_group_size": 32},
        "data": {"data": str(data_dir(runs_root))}, "optim": {"learning_rate": 2e-2, "warmup_steps": 0},
        "train": {"output_dir": str(run), "batch_size": 4, "max_steps": 2, "log_every": 100}})).train()
    recorded = {"bits": 4, "dtype": "float32", "group_size": 32}
    assert json.loads((run / "adapter_config.json").read_text())["base_quantization"] == recorded
    trained = logits(adapters.load_with_adapter(None, str(run)).model)

    notes = []
    out = export(run, "mlx-lm", tmp_path / "mlx-lm", say=notes.append)
    assert not (out / "config.yaml").exists()  # nothing of the run's own config travels
    assert json.loads((out / "adapter_config.json").read_text())["base_quantization"] == recorded
    assert notes and "quantized on load to 4 bits (group size 32, float32)" in notes[0]
    assert "-q --q-bits 4 --q-group-size 32 --dtype float32" in notes[0]
    assert max_rel_diff(logits(adapters.load_with_adapter(None, str(out)).model), trained) < 1e-6
    base, _, _, _ = models.load(str(llama_dir), "float32", 4, 32)  # what the note's conversion gives mlx-lm
    load_adapters(base, str(out))
    assert max_rel_diff(logits(base), trained) < 1e-5

    peft_notes = []
    export(run, "peft", tmp_path / "peft", say=peft_notes.append)
    assert "transformers loads the base as it is" in peft_notes[0]
    quiet = []
    export(synthetic_run(runs_root, llama_dir), "mlx-lm", tmp_path / "plain", say=quiet.append)
    assert quiet == []
    damaged = tmp_path / "damaged"  # an mlx-lm layout, whose adapter_config.json mlxft reads
    shutil.copytree(mlx_lm_run(runs_root, llama_dir), damaged)
    config = json.loads((damaged / "adapter_config.json").read_text())
    (damaged / "adapter_config.json").write_text(json.dumps({**config, "base_quantization": {"bits": 4}}))
    with pytest.raises(UserError, match="adapter_config.json: base_quantization must be an object with bits, "
                                        "group_size and dtype"):
        adapters.load_adapter_dir(damaged)


def test_init_adapter_from_a_qlora_run_keeps_training_over_the_quantized_base(llama_dir, runs_root, tmp_path):
    # The layout came from the adapter but the quantization did not: the run went on over the
    # float base, and its own adapter recorded no quantization.
    from mlxft import config as cfg
    from mlxft.train import parser

    run = synthetic_run(runs_root, llama_dir, "lora", quantize=4)
    common = ["--model", str(llama_dir), "--data", "d", "--init-adapter", str(run)]
    resolved = cfg.resolve(parser().parse_args(common), None)
    assert (resolved.model.quantize, resolved.model.quantize_group_size) == (4, 32)
    given = cfg.resolve(parser().parse_args([*common, "--quantize", "0"]), None)  # a flag that is given stands
    assert given.model.quantize == 0
    float_run = synthetic_run(runs_root, llama_dir, "lora")
    plain = cfg.resolve(parser().parse_args(["--model", str(llama_dir), "--data", "d", "--init-adapter", str(float_run)]), None)
    assert plain.model.quantize == 0


def _per_layer_peft(path):
    """A PEFT adapter whose layers adapt different modules (q_proj in layer 0, v_proj in layer 1)."""
    path.mkdir()
    mx.random.seed(5)
    w = {}
    for i, (mod, out) in enumerate((("self_attn.q_proj", 64), ("self_attn.v_proj", 32))):
        w[f"base_model.model.model.layers.{i}.{mod}.lora_A.weight"] = 0.1 * mx.random.normal((4, 64))
        w[f"base_model.model.model.layers.{i}.{mod}.lora_B.weight"] = 0.1 * mx.random.normal((out, 4))
    mx.save_safetensors(str(path / "adapter_model.safetensors"), w, metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}))
    return path, w


def test_a_peft_adapter_whose_layers_adapt_different_modules_loads_and_round_trips(llama_dir, tmp_path):
    peft_dir, stored = _per_layer_peft(tmp_path / "peft")
    loaded = adapters.load_with_adapter(str(llama_dir), str(peft_dir)).model
    q0, v0, v1 = loaded.layers[0].self_attn.q_proj, loaded.layers[0].self_attn.v_proj, loaded.layers[1].self_attn.v_proj
    key = "base_model.model.model.layers.{}.self_attn.{}.lora_B.weight"
    np.testing.assert_array_equal(np.array(q0.lora_b), np.array(stored[key.format(0, "q_proj")].T))
    np.testing.assert_array_equal(np.array(v1.lora_b), np.array(stored[key.format(1, "v_proj")].T))
    assert not np.any(np.array(v0.lora_b))  # held by no tensor: a fresh adapter that changes nothing
    expected = logits(loaded)
    # Through mlx-lm's layout and back to PEFT's: the same model, and PEFT told the layers it holds.
    mlx_dir = export(peft_dir, "mlx-lm", tmp_path / "mlx")
    assert max_rel_diff(logits(adapters.load_with_adapter(str(llama_dir), str(mlx_dir)).model), expected) < 1e-6
    again = export(mlx_dir, "peft", tmp_path / "peft-again")
    assert json.loads((again / "adapter_config.json").read_text())["layers_to_transform"] == [0, 1]
    assert max_rel_diff(logits(adapters.load_with_adapter(str(llama_dir), str(again)).model), expected) < 1e-6


def test_a_peft_adapter_on_the_first_layer_exports_its_layer_list(tmp_path):
    peft_dir = _peft_dir(tmp_path / "peft", 4, {"lora_alpha": 8}, layers=(0,))
    out = export(peft_dir, "peft", tmp_path / "out")
    assert json.loads((out / "adapter_config.json").read_text())["layers_to_transform"] == [0]  # was omitted: every layer


def test_an_mlxft_adapter_missing_a_tensor_is_refused_not_filled(llama_dir, runs_root, tmp_path):
    damaged = _copy(synthetic_run(runs_root, llama_dir, "lora"), tmp_path)
    weights, metadata = checkpoint.load_adapter_weights(damaged / "adapters.safetensors")
    dropped = sorted(k for k in weights if ".layers.1." in k)
    mx.save_safetensors(str(damaged / "adapters.safetensors"), {k: v for k, v in weights.items() if k not in dropped},
                        metadata=metadata)
    weights, spec = adapters.load_adapter_dir(damaged)
    with pytest.raises(UserError, match=r"no tensor for parameter model\.layers\.1\."):
        adapters.attach(base_model(llama_dir), spec, weights)
    copied = tmp_path / "copied"  # the two files mlx-lm needs, taken out of the run
    copied.mkdir()
    for name in ("adapters.safetensors", "adapter_config.json"):
        shutil.copy(damaged / name, copied / name)
    weights, spec = adapters.load_adapter_dir(copied)
    with pytest.raises(UserError, match=r"no tensor for parameter model\.layers\.1\."):
        adapters.attach(base_model(llama_dir), spec, weights)


def test_an_adapter_config_that_disagrees_with_the_header_is_refused(llama_dir, runs_root, tmp_path):
    edited = _copy(synthetic_run(runs_root, llama_dir, "lora"), tmp_path)
    config = json.loads((edited / "adapter_config.json").read_text())
    header = config["lora_parameters"]["scale"]
    config["lora_parameters"]["scale"] = header * 2  # mlx-lm would load this one, mlxft the header's
    (edited / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=rf"adapter_config.json: lora_parameters.scale is {header * 2!r} but "
                                        rf"adapters.safetensors's header says {header!r}"):
        adapters.load_adapter_dir(edited)
    for keys in (7, ["self_attn.q_proj", 3]):  # were compared by sorting them: a TypeError's traceback
        config["lora_parameters"].update(scale=header, keys=keys)
        (edited / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(UserError, match=r"adapter_config.json: lora_parameters.keys must be a list of module "
                                            rf"names, got {re.escape(repr(keys))}; put back the list"):
            adapters.load_adapter_dir(edited)


@pytest.mark.parametrize("change,match", [({"alora_invocation_tokens": [5, 6]}, "'alora_invocation_tokens' is set"),
                                          ({"layer_replication": [[0, 2], [1, 2]]}, "'layer_replication' is set"),
                                          ({"lora_bias": True}, "'lora_bias' is set"),
                                          ({"init_lora_weights": "pissa_niter_4"}, "changed the base's weights"),
                                          ({"init_lora_weights": "olora"}, "changed the base's weights")])
def test_peft_lora_variants_are_refused_not_loaded_as_plain_lora(tmp_path, change, match):
    peft_dir = _peft_dir(tmp_path / "peft", 4, {"lora_alpha": 8, **change})
    with pytest.raises(UserError, match=match):
        adapters.load_adapter_dir(peft_dir)
    plain = _peft_dir(tmp_path / "plain", 4, {"lora_alpha": 8, "alora_invocation_tokens": None, "lora_bias": False,
                                              "init_lora_weights": "gaussian", "use_qalora": False})
    adapters.load_adapter_dir(plain)


def test_export_records_a_relative_base_path_as_absolute(llama_dir, runs_root, tmp_path, monkeypatch):
    run = synthetic_run(runs_root, llama_dir, "lora")
    shutil.copytree(llama_dir, tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    out = export(run, "peft", tmp_path / "peft", model="base")
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "base")


def test_export_refuses_a_base_that_is_missing_or_of_another_family(llama_dir, lfm2_dir, runs_root, tmp_path):
    # Both were written into the exported adapter_config.json, which then named a base no one could use.
    run = synthetic_run(runs_root, llama_dir, "lora")
    with pytest.raises(UserError, match=f"model directory {tmp_path}/nowhere does not exist; check --model"):
        export(run, "peft", tmp_path / "a", model=str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match=r"--model .* is a lfm2 model, but .* was trained on a llama model"):
        export(run, "peft", tmp_path / "b", model=str(lfm2_dir))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_export_from_before_the_header_said_partial_still_loads(llama_dir, tmp_path):
    peft_dir = _peft_dir(tmp_path / "peft", 4, {"lora_alpha": 8}, layers=(0,))
    out = export(peft_dir, "mlx-lm", tmp_path / "mlx", model=str(llama_dir))
    expected = logits(adapters.load_with_adapter(str(llama_dir), str(out)).model)
    weights, metadata = checkpoint.load_adapter_weights(out / "adapters.safetensors")
    assert metadata.pop("partial") == "true"  # as earlier versions wrote it: without the entry
    mx.save_safetensors(str(out / "adapters.safetensors"), weights, metadata=metadata)
    assert max_rel_diff(logits(adapters.load_with_adapter(str(llama_dir), str(out)).model), expected) < 1e-6


def test_a_run_tokenizer_that_does_not_parse_falls_back_to_the_bases(tmp_path):
    # The tokenizers library raises a bare Exception for a tokenizer.json it cannot read (one a
    # newer version wrote): generate, evaluate and fuse ended in a 40-line traceback.
    from conftest import tokenizer_files

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_files() / name, tmp_path / name)
    saved = json.loads((tmp_path / "tokenizer.json").read_text())
    saved["model"]["type"] = "FromTheFuture"
    (tmp_path / "tokenizer.json").write_text(json.dumps(saved))
    assert adapters.run_tokenizer(tmp_path, {}) is None


def _hub_cache(root, repo_id, model_dir):
    """``model_dir``'s files as huggingface-hub caches ``repo_id`` under ``root``."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return root


def test_an_mlx_lm_adapter_of_16_layers_continues_on_a_hub_base_of_fewer(llama_dir, runs_root, tmp_path, monkeypatch):
    # Only a local directory's config.json was read: on a repo id the 16 stood and the run was
    # refused as "16 exceeds the model's 2 layers". The hub cache holds its config.json.
    from huggingface_hub import constants

    from mlxft import config as cfg
    from mlxft.train import parser

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(_hub_cache(tmp_path / "hub", "acme/tiny-llama", llama_dir)))
    run = tmp_path / "sixteen"
    shutil.copytree(mlx_lm_run(runs_root, llama_dir), run)
    recorded = json.loads((run / "adapter_config.json").read_text())
    (run / "adapter_config.json").write_text(json.dumps({**recorded, "num_layers": 16}))
    args = ["--model", "acme/tiny-llama", "--data", "d", "--init-adapter", str(run)]
    assert cfg.resolve(parser().parse_args(args), None).adapter.num_layers == -1
    uncached = cfg.resolve(parser().parse_args([*args, "--revision", "v2"]), None)  # nothing to read: as recorded
    assert uncached.adapter.num_layers == 16


def _quantized_copy(model_dir, out):
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(model_dir)
    model, config = quantize_model(model, config, 32, 4)
    save_model(out, model)
    save_config(config, out / "config.json")
    for name in model_dir.iterdir():
        if name.name.startswith("tokenizer") or name.name == "special_tokens_map.json":
            shutil.copy(name, out / name.name)
    return out


def test_a_qlora_adapter_continues_on_a_base_already_quantized(llama_dir, runs_root, chat_data, tmp_path):
    # The adapter's --quantize 4 was copied into the run and then refused as if the user had
    # passed it: "model ... is already quantized; drop --quantize".
    from mlxft import config as cfg
    from mlxft.train import main as train_main, parser

    run = synthetic_run(runs_root, llama_dir, "lora", quantize=4)
    quantized = _quantized_copy(llama_dir, tmp_path / "quantized")
    common = ["--model", str(quantized), "--data", str(chat_data), "--init-adapter", str(run)]
    resolved = cfg.resolve(parser().parse_args(common), None)
    assert (resolved.model.quantize, resolved.model.quantize_dtype) == (0, "")
    out = tmp_path / "continued"
    assert train_main([*common, "--max-steps", "1", "--no-memory-estimate", "--output-dir", str(out)]) == 0
    assert "base_quantization" not in json.loads((out / "adapter_config.json").read_text())


def test_a_bfloat16_qlora_adapter_continued_in_float32_starts_from_its_own_base(llama_dir, runs_root, tmp_path):
    # The base was quantized from float32 weights rather than the bfloat16 ones the adapter
    # trained over: other scales, and a start 5e-3 to 6e-2 off (relative logits).
    from mlx.utils import tree_flatten

    from mlxft import RunConfig, Trainer
    from mlxft import config as cfg
    from mlxft.train import parser
    from adapter_runs import data_dir

    run = tmp_path / "run"
    shutil.copytree(synthetic_run(runs_root, llama_dir, "lora", quantize=4), run)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["model"]["dtype"] = "bfloat16"
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    args = ["--model", str(llama_dir), "--data", str(data_dir(runs_root)), "--init-adapter", str(run),
            "--dtype", "float32", "--output-dir", str(tmp_path / "continued"), "--max-steps", "1"]
    config = cfg.resolve(parser().parse_args(args), None)
    assert (config.model.quantize, config.model.quantize_dtype) == (4, "bfloat16")
    trainer = Trainer(config)
    expected = adapters.load_with_adapter(None, str(run), dtype="float32").model
    assert max_rel_diff(logits(trainer.model), logits(expected)) < 1e-6
    frozen = {k: v for k, v in tree_flatten(trainer.model.parameters()) if k.endswith((".scales", ".biases"))}
    assert frozen and all(v.dtype == mx.float32 for v in frozen.values())  # computed in the run's dtype
    trainer.train()
    assert json.loads((tmp_path / "continued" / "adapter_config.json").read_text())["base_quantization"] == {
        "bits": 4, "group_size": 32, "dtype": "bfloat16"}
    assert RunConfig.from_dict(yaml.safe_load((tmp_path / "continued" / "config.yaml").read_text())).model.quantize_dtype == "bfloat16"
