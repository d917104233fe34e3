"""End to end: the CLI and the Python API train, write a complete run directory, and mlx-lm
loads what they wrote."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxft import RunConfig, Trainer, fine_tune
from mlxft.checkpoint import load_adapter_weights
from mlxft.errors import UserError

from conftest import write_jsonl

RUN_FILES = {"adapters.safetensors", "adapter_config.json", "config.yaml", "training_state.json", "metrics.jsonl"}


def run_cli(*args, cwd=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "mlxft.train", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def config(model_dir, data_dir, out, **train):
    return RunConfig.from_dict({
        "model": {"model": str(model_dir)},
        "data": {"data": str(data_dir)},
        "optim": {"learning_rate": 1e-2, "warmup_steps": 2},
        "train": {"output_dir": str(out), "batch_size": 4, "log_every": 1, **train},
    })


def test_cli_run_writes_every_file(llama_dir, chat_data, tmp_path):
    out = tmp_path / "run"
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(yaml.safe_dump({"adapter": {"rank": 4, "alpha": 8.0}, "train": {"batch_size": 2, "max_steps": 50}}))
    proc = run_cli("--config", yaml_path, "--model", llama_dir, "--data", chat_data, "--output-dir", out,
                   "--max-steps", 4, "--grad-accum-steps", 2, "--eval-every", 2, "--save-every", 2, "--log-every", 1)
    assert proc.returncode == 0, proc.stderr
    assert RUN_FILES <= {p.name for p in out.iterdir()}

    weights, meta = load_adapter_weights(out / "adapters.safetensors")
    assert meta["format"].startswith("mlxft-adapter") and meta["rank"] == "4" and float(meta["alpha"]) == 8.0
    assert float(meta["scale"]) == 2.0 and "self_attn.q_proj" in json.loads(meta["target_modules"])
    assert all(k.endswith(("lora_a", "lora_b")) for k in weights)

    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["fine_tune_type"] == "lora" and adapter_config["lora_parameters"]["rank"] == 4

    state = json.loads((out / "training_state.json").read_text())
    assert state["step"] == 4 and state["total_steps"] == 4  # the flag beat the file's max_steps
    assert state["batch_size"] == 2 and state["grad_accum_steps"] == 2 and state["task"] == "chat"
    for key in ("epoch", "best_val_loss", "learning_rate", "max_seq_length", "train_modules", "model", "dataset", "seed"):
        assert key in state

    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["adapter"]["rank"] == 4 and resolved["train"]["max_steps"] == 4
    assert RunConfig.from_dict(resolved).to_dict() == resolved

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3, 4]
    assert [r["step"] for r in records if r["type"] == "eval"] == [0, 2, 4]  # a baseline, then every 2 steps
    assert all(r["tokens_per_sec"] > 0 and "peak_memory_gb" in r for r in records if r["type"] == "train")
    assert "trainable parameters" in proc.stdout and "saved" in proc.stdout


def test_a_report_right_after_another_times_its_own_step(llama_dir, chat_data, tmp_path):
    # Steps 5 and 6 are read together (the last step is not queued ahead): step 6's window must
    # still span its computation, not the moment between the two reports (it read 2.8e7 tok/s).
    Trainer(config(llama_dir, chat_data, tmp_path / "run", max_steps=6, log_every=5)).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last = [r for r in records if r["type"] == "train"]
    assert (first["step"], last["step"]) == (5, 6)
    # Steps 1-5 include building kernels for new shapes: on a loaded machine step 6 alone ran 6x
    # faster than their mean (CI: 0.022 s against 0.65 / 5). The broken window was 10^4x.
    assert last["seconds"] > 0.02 * first["seconds"] / 5, (first["seconds"], last["seconds"])


def test_mlx_lm_loads_the_adapters_with_the_same_logits(model_dir, chat_data, tmp_path):
    from mlx_lm import load

    trainer = Trainer(config(model_dir, chat_data, tmp_path / "run", max_steps=3))
    trainer.train()
    inputs = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    trainer.model.eval()
    ours = trainer.model(inputs)
    theirs_model, _ = load(str(model_dir), adapter_path=str(tmp_path / "run"))
    theirs = theirs_model(inputs)
    base_model, _ = load(str(model_dir))
    assert not np.allclose(np.array(ours), np.array(base_model(inputs)), atol=1e-4)  # training changed the model
    np.testing.assert_allclose(np.array(theirs), np.array(ours), rtol=1e-5, atol=1e-5)


def test_the_first_report_times_training_not_what_came_before_it(llama_dir, chat_data, tmp_path):
    # Set-up, the memory estimate's probes and the time before train() is called are not
    # training: the first window read 17 tok/s after a script paused 5 s between the two.
    trainer = Trainer(config(llama_dir, chat_data, tmp_path / "run", max_steps=1))
    trainer.reporter._window_start -= 1000.0  # as if the script had waited 1000 s
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["seconds"] < 1000 for r in records if r["type"] == "train"] == [True]


@pytest.mark.parametrize("finetune, lr, ratio", [("full", 3e-3, 0.05), ("lora", 1e-2, 0.85)])
def test_loss_falls_on_a_learnable_task(llama_dir, tmp_path, finetune, lr, ratio):
    """Answer every question with the same phrase: the validation loss falls far below chance.

    LoRA on a 2-layer random model with a frozen random head learns slower than full
    fine-tuning, hence the looser bound.
    """
    rows = [{"prompt": f"Question {i}: what is the code?", "completion": "The code is blue seven."} for i in range(24)]
    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", rows[:20])
    write_jsonl(data / "valid.jsonl", rows[20:])
    cfg = config(llama_dir, data, tmp_path / "run", epochs=3, log_every=100)
    cfg.adapter.finetune, cfg.optim.learning_rate = finetune, lr
    trainer = Trainer(cfg)
    before, _ = trainer.evaluate()
    result = trainer.train()
    assert result.val_loss < ratio * before, (before, result.val_loss)


def test_python_api_full_finetune(llama_dir, chat_data, tmp_path):
    cfg = config(llama_dir, chat_data, tmp_path / "run", max_steps=2)
    cfg.adapter.finetune = "full"
    cfg.optim.learning_rate = 1e-3
    result = fine_tune(cfg)
    weights, meta = load_adapter_weights(result.run_dir / "adapters.safetensors")
    assert meta["fine_tune_type"] == "full" and "model.embed_tokens.weight" in weights
    from mlx_lm import load

    model, _ = load(str(llama_dir), adapter_path=str(result.run_dir))
    assert np.array_equal(np.array(model.model.embed_tokens.weight), np.array(weights["model.embed_tokens.weight"]))


def test_partial_window_is_flushed(llama_dir, chat_data, tmp_path):
    """12 rows, batch 4, accumulation 2: 3 micro-batches per epoch make 2 steps, the last one short."""
    trainer = Trainer(config(llama_dir, chat_data, tmp_path / "run", epochs=2, grad_accum_steps=2))
    assert trainer.total_steps == 4
    updates = []
    original = trainer.step

    def recording(batch, window, update, scale):
        updates.append(update)
        return original(batch, window, update, scale)

    recording.state = original.state
    trainer.step = recording
    trainer.train()
    assert updates == [False, True, True, False, True, True]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rank", "0"], "adapter.rank"),
        (["--targets", "nope_proj"], "'nope_proj' is not a linear module"),
        (["--model", "/definitely/missing"], "does not exist"),
    ],
)
def test_bad_flags_exit_2_with_one_line(llama_dir, chat_data, tmp_path, args, message):
    base = ["--model", llama_dir, "--data", chat_data, "--output-dir", tmp_path / "run", "--max-steps", 1]
    proc = run_cli(*base, *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr


def test_bad_config_file_and_existing_run(llama_dir, chat_data, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  batch_sise: 3\n")
    proc = run_cli("--config", bad, "--model", llama_dir, "--data", chat_data)
    assert proc.returncode == 2 and "unknown key 'train.batch_sise'" in proc.stderr

    out = tmp_path / "run"
    out.mkdir()
    (out / "training_state.json").write_text('{"step": 7}')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = run_cli("--model", llama_dir, "--data", chat_data, "--output-dir", out)
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_help_describes_every_option():
    proc = subprocess.run([sys.executable, "-m", "mlxft.train", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for flag in ("--model", "--data", "--output-dir", "--max-steps", "--epochs", "--batch-size", "--grad-accum-steps",
                 "--learning-rate", "--optimizer", "--seed", "--save-every", "--eval-every", "--config"):
        assert flag in proc.stdout


def test_training_continues_from_an_adapter_directory(llama_dir, chat_data, tmp_path):
    """--init-adapter starts from an adapter directory (formats are covered in test_adapter_formats)."""
    first = Trainer(config(llama_dir, chat_data, tmp_path / "a", max_steps=3))
    first.train()
    cfg = config(llama_dir, chat_data, tmp_path / "b", max_steps=1)
    cfg.adapter.init_adapter = str(tmp_path / "a")
    second = Trainer(cfg)
    for (k, v), (_, w) in zip(sorted(checkpoint_weights(first)), sorted(checkpoint_weights(second))):
        np.testing.assert_array_equal(np.array(v), np.array(w), err_msg=k)
    assert second.evaluate()[0] == pytest.approx(first.evaluate()[0], rel=1e-6)
    cfg.adapter.rank = 4
    cfg.train.output_dir = str(tmp_path / "c")
    with pytest.raises(Exception, match="rank 8 but the run uses 4"):
        Trainer(cfg)


def checkpoint_weights(trainer):
    return tree_flatten(trainer.model.trainable_parameters())


@pytest.mark.parametrize("accum", [1, 2])
def test_queued_steps_report_what_synchronous_steps_report(llama_dir, chat_data, tmp_path, monkeypatch, accum):
    """The next micro-batch is queued before a step's results are read: the same losses, rates
    (warm-up moves them every step), epochs and weights as reading each step before the next."""
    runs = {}
    for run_ahead in (True, False):
        if not run_ahead:
            monkeypatch.setattr(Trainer, "_may_run_ahead", lambda self, step: False)
        cfg = config(llama_dir, chat_data, tmp_path / f"ahead-{run_ahead}", epochs=2, grad_accum_steps=accum, eval_every=0)
        cfg.optim.warmup_steps = 4
        trainer = Trainer(cfg)
        queued, finish = [], trainer._finish
        trainer._finish = lambda steps: (queued.append(len(trainer.pending)), finish(steps))
        trainer.train()
        records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
        train = [{k: r[k] for k in ("step", "epoch", "loss", "learning_rate", "skipped_steps")} for r in records if r["type"] == "train"]
        runs[run_ahead] = (max(queued), train, {k: np.array(v) for k, v in tree_flatten(trainer.model.trainable_parameters())})
    (ahead, train_ahead, weights_ahead), (sync, train_sync, weights_sync) = runs[True], runs[False]
    assert ahead == 1 and sync == 0
    assert len(train_ahead) == trainer.total_steps and train_ahead == train_sync
    assert len({r["learning_rate"] for r in train_ahead}) > 3
    for name, value in weights_sync.items():
        np.testing.assert_array_equal(weights_ahead[name], value, err_msg=name)


def resolve_cli(*args, config_path=None):
    from mlxft import config as cfg
    from mlxft.train import parser

    return cfg.resolve(parser().parse_args(["--model", "m", "--data", "d", *args]), config_path)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--memory-limit", "inf"], "train.memory_limit: must be a finite number"),
        (["--cache-limit", "inf"], "train.cache_limit: must be a finite number"),
        (["--memory-limit", "1e30"], "train.memory_limit: must be 0 to"),
        (["--clear-cache-above", "1e30"], "train.clear_cache_above: must be 0 to"),
        (["--alpha", "inf"], "adapter.alpha: must be a finite number"),
        (["--max-grad-norm", "nan"], "optim.max_grad_norm: must be a finite number"),
        (["--optimizer", "sgd", "--momentum", "-1"], "optim.momentum: must be in [0, 1)"),
        (["--optimizer", "sgd", "--momentum", "1"], "optim.momentum: must be in [0, 1)"),
        (["--momentum", "0.9"], "optim.momentum: applies to --optimizer sgd only"),  # AdamW would ignore it
        (["--optimizer", "sgd", "--bias-correction"], "optim.bias_correction: applies to --optimizer adamw or adam only"),
        # Integers past what MLX takes (shapes, indices, seeds) had passed, then failed in a traceback.
        (["--seed", "-1"], "train.seed: must be 0 to 2**64-1"),
        (["--seed", str(2**64)], "train.seed: must be 0 to 2**64-1"),
        (["--max-steps", "99999999999999999999"], "train.max_steps: must be at most 2,147,483,647"),
        (["--batch-size", "99999999999999999999"], "train.batch_size: must be at most"),
        (["--batch-size", "0"], "train.batch_size: must be >= 1, got 0"),  # had divided by zero in a message
        (["--loss-chunk", "3000000000"], "model.loss_chunk: must be at most"),
        (["--epochs", "0"], "train.epochs: must be >= 1 unless --max-steps is set"),
        # It failed only after the base had been loaded and quantized.
        (["--quantize", "4", "--finetune", "full"], "model.quantize: full fine-tuning trains the base's own weights"),
        # Full fine-tuning trained on as if they were not there.
        (["--finetune", "full", "--dropout", "0.1"], "adapter.dropout: applies to --finetune lora or dora"),
        (["--finetune", "full", "--rank", "16"], "adapter.rank: applies to --finetune lora or dora"),
        # Past about 1e10 seconds the watchdog died in a traceback and no lost peer was noticed.
        (["--dist-timeout", "1e10"], "train.dist_timeout: must be > 0 and at most 1e+06 seconds"),
        # Paths the OS refuses: a traceback, or (not UTF-8) a run that trained, then could not save.
        (["--output-dir", "x" * 300], "train.output_dir: 'xxxx"),
        (["--output-dir", "run\udcff"], "train.output_dir: 'run\\udcff' is not UTF-8 text"),
        (["--data", "d\0x"], "data.data: 'd\\x00x' holds a NUL character"),
    ],
)
def test_out_of_range_values_are_rejected(args, message):
    with pytest.raises(UserError, match=re.escape(message)):
        resolve_cli(*args)


@pytest.mark.parametrize("flag", ["--init-adapter", "--resume"])
def test_a_starting_point_given_empty_is_refused_not_taken_as_none(flag, capsys):
    # `--init-adapter "$RUN"` with RUN unset trained a fresh adapter without a word.
    from mlxft.train import main

    assert main(["--model", "m", "--data", "d", flag, ""]) == 2
    assert re.match(f"^error: {flag} is empty; name ", capsys.readouterr().err)


def test_a_full_run_s_saved_config_spelling_out_adapter_defaults_runs_again(tmp_path):
    # config.yaml names every field, the adapter's defaults included: not a request for an adapter.
    from mlxft.config import AdapterConfig

    path = tmp_path / "run.yaml"
    defaults = {name: getattr(AdapterConfig, name) for name in ("rank", "alpha", "dropout")}
    path.write_text(yaml.safe_dump({"adapter": {"finetune": "full", **defaults}}))
    assert resolve_cli(config_path=path).adapter.finetune == "full"
    path.write_text(yaml.safe_dump({"adapter": {"finetune": "full", **defaults, "rank": 4}}))
    with pytest.raises(UserError, match=re.escape("adapter.rank: applies to --finetune lora or dora")):
        resolve_cli(config_path=path)


def test_yaml_numbers_pyyaml_reads_as_strings(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  learning_rate: 1e-4\n  min_learning_rate: 1e-6\n")
    assert resolve_cli(config_path=path).optim.learning_rate == 1e-4
    for bad, message in [("optim:\n  learning_rate: fast\n", "expected a number, got 'fast'"),
                         ("optim:\n  learning_rate: inf\n", "must be a finite number"),
                         ("train:\n  batch_size: '4'\n", "expected an integer, got '4'"),
                         ("train:\n  memory_limit: 1" + "0" * 400 + "\n", "train.memory_limit: 1" + "0" * 400
                          + " is too large for a number")]:  # was an OverflowError traceback
        path.write_text(bad)
        with pytest.raises(UserError, match=re.escape(message)):
            resolve_cli(config_path=path)



def test_yaml_merge_keys_and_huge_values(tmp_path):
    path = tmp_path / "run.yaml"
    # A merge key was refused as an unknown tag; the explicit key wins over the merged one.
    path.write_text("x: &base {max_steps: 3, batch_size: 2}\ntrain:\n  <<: *base\n  batch_size: 4\n")
    with pytest.raises(UserError, match="unknown section 'x'"):
        resolve_cli(config_path=path)
    path.write_text("train:\n  <<: {max_steps: 3, batch_size: 2}\n  batch_size: 4\n")
    train = resolve_cli(config_path=path).train
    assert (train.max_steps, train.batch_size) == (3, 4)
    # Nine levels of aliases: the error quoted all 10**9 names (minutes and gigabytes, then out of memory).
    levels = ["a0: &a0 [" + ", ".join(["x"] * 10) + "]"]
    levels += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    path.write_text("adapter:\n  targets: {\n" + ",\n".join("    " + line for line in levels) + "}\n")
    with pytest.raises(UserError, match="adapter.targets: expected a list of names, got ") as refused:
        resolve_cli(config_path=path)
    assert len(str(refused.value)) < 400


def test_a_key_given_twice_in_yaml_is_an_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  batch_size: 2\noptim:\n  learning_rate: 1e-4\ntrain:\n  max_steps: 3\n")
    with pytest.raises(UserError, match=re.escape("run.yaml line 5: invalid YAML ('train' is given twice; merge the two)")):
        resolve_cli(config_path=path)
    path.write_text("train:\n  batch_size: 2\n  batch_size: 4\n")
    with pytest.raises(UserError, match="line 3: invalid YAML .'batch_size' is given twice"):
        resolve_cli(config_path=path)

def test_settings_a_run_does_not_use_are_warned_of():
    # They were ignored without a word; refused, they stopped older runs' checkpoints resuming.
    from mlxft.config import inert_settings

    assert inert_settings(resolve_cli()) == []
    assert inert_settings(resolve_cli("--schedule", "constant", "--min-learning-rate", "1e-5",
                                      "--quantize-group-size", "32")) == [
        "optim.min_learning_rate 1e-05 does nothing under the constant schedule (linear and cosine decay to it)",
        "model.quantize_group_size 32 does nothing without --quantize"]


def test_out_of_range_values_that_are_fine_pass():
    assert resolve_cli("--epochs", "0", "--max-steps", "5").train.max_steps == 5  # epochs is ignored then
    assert resolve_cli("--seed", str(2**64 - 1)).train.seed == 2**64 - 1
    assert resolve_cli("--optimizer", "sgd", "--momentum", "0.9").optim.momentum == 0.9


@pytest.mark.parametrize("content, message", [
    ("[]\n", "expected a mapping of sections"),
    ("false\n", "expected a mapping of sections"),
    ("0\n", "expected a mapping of sections"),
    ("train:\n  epochs: 1\n  \x07\n", "line 3: invalid YAML (special characters are not allowed: character #x0007)"),
    ("train:\n  epochs: 1\x00\n", "line 2: invalid YAML"),
    ("train:\n  max_steps: 1\n---\ntrain:\n  max_steps: 2\n", "line 3: a second YAML document starts here; a "
                                                                "config is one document"),
])
def test_a_yaml_that_is_no_config_is_a_one_line_error(tmp_path, content, message):
    path = tmp_path / "run.yaml"
    path.write_text(content)
    with pytest.raises(UserError, match=re.escape(message)) as err:
        resolve_cli(config_path=path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_config_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("# café\ntrain:\n  epochs: 2\n".encode("latin-1"))
    with pytest.raises(UserError, match=re.escape(f"config file {path}: not UTF-8 text")):
        resolve_cli(config_path=path)


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "abc"], "error: argument --batch-size: invalid int value: 'abc'"),
    (["--quantize", "3"], "error: argument --quantize: invalid choice: 3"),
])
def test_argparse_errors_are_one_line(capsys, args, message):
    from mlxft.train import main

    with pytest.raises(SystemExit) as exit:
        main(args)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and err.startswith(message) and "--help" in err


def test_train_file_without_model_is_not_the_default_job(tmp_path, capsys, monkeypatch):
    import mlxft.trainer
    from mlxft.train import main

    monkeypatch.setattr(mlxft.trainer, "fine_tune", lambda config: pytest.fail("ran the default job"))
    path = write_jsonl(tmp_path / "train.jsonl", [{"text": "a"}])
    for flag in ("--train-file", "--valid-file"):
        assert main([flag, str(path)]) == 2
        out, err = capsys.readouterr()
        assert "default job" not in out and err == "error: config field model.model: no model given; pass --model DIR_OR_REPO\n"


def test_one_line_errors_quote_an_empty_message_by_its_type():
    from mlxft.errors import first_line

    assert first_line(ValueError()) == "ValueError"
    assert first_line(RuntimeError("\nwhat went wrong\nthe details")) == "what went wrong"
    # transformers: "Couldn't instantiate the backend tokenizer from one of: \n(1) ..." was quoted up to the colon
    assert first_line(ValueError("cannot load from one of:\n  (1) a file\n(2) the other")) == (
        "cannot load from one of: (1) a file")


def test_a_model_directory_without_a_tokenizer_is_named_in_one_line(llama_dir, chat_data, tmp_path, capsys):
    import shutil

    from mlxft.models import TOKENIZER_FILES
    from mlxft.train import main

    bare = tmp_path / "bare"
    shutil.copytree(llama_dir, bare, ignore=lambda _, names: [n for n in names if n.startswith(("tokenizer", "vocab", "merges"))])
    assert main(["--model", str(bare), "--data", str(chat_data), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: model directory {bare} has no tokenizer") and all(n in err for n in TOKENIZER_FILES)
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()
    # A tokenizer_config.json alone made a tokenizer of a few special tokens that encoded text to
    # nothing: the run trained on the chat template's tokens alone, and generate printed nothing.
    shutil.copy(llama_dir / "tokenizer_config.json", bare / "tokenizer_config.json")
    assert main(["--model", str(bare), "--data", str(chat_data), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"error: model directory {bare}: its tokenizer encodes text to no tokens" in err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_a_local_model_is_recorded_by_its_absolute_path(llama_dir, chat_data, tmp_path, monkeypatch):
    # Recorded as typed, "tiny" failed from another directory, and "./tiny" could not resume it.
    import shutil

    from mlxft import adapters

    shutil.copytree(llama_dir, tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    assert chat_data == tmp_path / "data"
    Trainer(config("tiny", "data", "run", max_steps=2, save_every=1)).train()
    absolute = str((tmp_path / "tiny").resolve())
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["model"]["model"] == absolute and saved["data"]["data"] == str(chat_data.resolve())
    assert load_adapter_weights(tmp_path / "run" / "adapters.safetensors")[1]["base_model"] == absolute
    Trainer(config("./tiny", chat_data, "run", max_steps=3, resume="latest"))
    # A checkpoint written before: its relative name resolves where the resume is run.
    saved = tmp_path / "run" / "checkpoint-1" / "config.yaml"
    saved.write_text(saved.read_text().replace(absolute, "tiny"))
    Trainer(config(absolute, chat_data, "run", max_steps=3, resume=str(tmp_path / "run" / "checkpoint-1")))
    monkeypatch.chdir(tmp_path / "run")
    assert adapters.load_with_adapter(None, str(tmp_path / "run")).model_path == tmp_path / "tiny"


def test_exact_match_on_text_rows_is_refused_up_front(llama_dir, tmp_path):
    # Text rows have no answer to score: it reported 0.0% of 0 rows and recorded that score.
    write_jsonl(tmp_path / "data" / "train.jsonl", [{"text": "plain text " * 5}] * 4)
    with pytest.raises(UserError, match=r"train.exact_match_rows: .*train.jsonl holds text rows, which have no "
                                        "prompt and answer to score; set --exact-match-rows 0"):
        Trainer(config(llama_dir, tmp_path / "data", tmp_path / "run", max_steps=1, exact_match_rows=2))
    assert not (tmp_path / "run").exists()


def test_resume_without_a_config_takes_the_checkpoints_settings(llama_dir, chat_data, tmp_path, capsys):
    # It ran the default job instead, whose settings then refused the resume and suggested
    # --force, which would have trained the user's run on the default job's data.
    from mlxft.train import main

    run = tmp_path / "run"
    assert main(["--model", str(llama_dir), "--data", str(chat_data), "--output-dir", str(run), "--max-steps", "4",
                 "--save-every", "2", "--rank", "4", "--exact-match-rows", "0"]) == 0
    assert main(["--resume", str(run / "checkpoint-2")]) == 0  # continues in the run that holds it
    out = capsys.readouterr().out
    assert f"resuming with the checkpoint's settings ({run / 'checkpoint-2' / 'config.yaml'})" in out
    assert "resumed from" in out and "done: 4 steps" in out
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["adapter"]["rank"] == 4 and saved["data"]["data"] == str(chat_data.resolve())
    assert main(["--resume", "latest", "--output-dir", str(tmp_path / "empty")]) == 2
    assert "has no checkpoint yet" in capsys.readouterr().err


def test_a_model_passed_in_is_frozen_left_as_found_and_never_adapted_twice(llama_dir, tmp_path):
    # mlx_lm.load gives an unfrozen model in evaluation mode. Trained as given, every weight
    # trained; a second run on it wrapped LoRA inside LoRA; a refused run changed it anyway.
    from pathlib import Path

    from mlx_lm import load
    from mlx_lm.tuner.lora import LoRALinear

    from mlxft.data import Dataset, Example

    model, tokenizer = load(str(llama_dir))
    assert not model.training
    rows = [Example(np.arange(3, 19, dtype=np.int32), np.arange(16) >= 8) for _ in range(8)]
    # Neither the model nor the data need naming in the config when the script passes them in.
    cfg = RunConfig.from_dict({"train": {"output_dir": str(tmp_path / "run"), "batch_size": 4, "max_steps": 2,
                                         "exact_match_rows": 2}})
    with pytest.raises(UserError, match=r"exact-match reads prompts and answers from the dataset's JSONL file "
                                        r"\(Dataset.path\), and rows is none"):
        Trainer(cfg, model, tokenizer, datasets=(Dataset(Path("rows"), rows, "completion"), None))
    assert not any(isinstance(m, LoRALinear) for _, m in model.named_modules())  # refused before any change
    cfg.train.exact_match_rows = 0
    trainer = Trainer(cfg, model, tokenizer, datasets=(Dataset(Path("rows"), rows, "completion"), None))
    assert {name.rsplit(".", 1)[-1] for name, _ in tree_flatten(model.trainable_parameters())} == {"lora_a", "lora_b"}
    trainer.train()
    assert not model.training  # as it came
    with pytest.raises(UserError, match="evaluate: this run has no validation set"):
        trainer.evaluate()
    # A dataset passed to evaluate skipped the checks: a loss of 0 over nothing, ids past the vocabulary.
    with pytest.raises(UserError, match="evaluate takes an mlxft.data.Dataset, not list"):
        trainer.evaluate(rows)
    with pytest.raises(UserError, match="the validation dataset has no row with a supervised token"):
        trainer.evaluate(Dataset(Path("none"), [], "completion"))
    with pytest.raises(UserError, match="holds token id 1000000, outside the model's vocabulary"):
        trainer.evaluate(Dataset(Path("far"), [Example([1, 2, 10**6], [1, 1, 1])], "completion"))
    # Rows past max_seq_length were used as they were, where a file's are cut or split.
    too_long = Example(np.arange(3, 3 + cfg.data.max_seq_length + 1), np.ones(cfg.data.max_seq_length + 1, bool))
    with pytest.raises(UserError, match=rf"the validation dataset's example 0 holds {cfg.data.max_seq_length + 1} "
                                        rf"tokens, more than data.max_seq_length \({cfg.data.max_seq_length}\)"):
        trainer.evaluate(Dataset(Path("long"), [too_long], "completion"))
    assert trainer.evaluate(Dataset(Path("rows"), rows, "completion"))[1] == sum(e.supervised for e in rows)
    cfg.train.output_dir = str(tmp_path / "another")
    with pytest.raises(UserError, match="holds LoRA layers already"):
        Trainer(cfg, model, tokenizer, datasets=(Dataset(Path("rows"), rows, "completion"), None))
    nothing = [Example(np.arange(3, 19, dtype=np.int32), np.zeros(16, bool))]
    fresh, _ = load(str(llama_dir))
    for dataset in (nothing, []):
        with pytest.raises(UserError, match="the train dataset has no row with a supervised token"):
            Trainer(cfg, fresh, tokenizer, datasets=(Dataset(Path("rows"), dataset, "completion"), None))
    # Examples built from lists trained; a mask of another length was an IndexError or trained silently;
    # an id past the embedding was read from outside it.
    listed = Example(list(range(3, 19)), [j >= 8 for j in range(16)])
    assert listed.ids.dtype == np.int32 and listed.mask.dtype == bool and listed.supervised == 8
    for mask in (np.ones(15, bool), np.ones(17, bool), np.ones((16, 1), bool)):
        with pytest.raises(UserError, match=r"Example: ids and mask must be 1-D and of one length"):
            Example(np.arange(16), mask)
    with pytest.raises(UserError, match="Example: ids must be integer token ids, got float"):
        Example(np.linspace(0, 1, 4), np.ones(4, bool))
    outside = [Example(np.array([3, 4, fresh.args.vocab_size]), np.ones(3, bool))]
    with pytest.raises(UserError, match=f"the validation dataset's example 0 holds token id {fresh.args.vocab_size}, "
                                        "outside the model's vocabulary"):
        Trainer(cfg, fresh, tokenizer, datasets=(Dataset(Path("rows"), rows, "completion"),
                                                 Dataset(Path("valid"), outside, "completion")))
    # An empty example passed the checks beside a supervised one and failed in NumPy mid-batch.
    with pytest.raises(UserError, match="the train dataset's example 1 holds no tokens; leave it out"):
        Trainer(cfg, fresh, tokenizer, datasets=(Dataset(Path("rows"), [rows[0], Example([], [])], "completion"), None))


def test_api_mistakes_are_one_line_errors_and_leave_the_model_as_it_was(llama_dir, chat_data, tmp_path):
    # A count past the model's layers, --pack or keep-MLP on another family were refused after
    # LoRA went on, so the corrected call was refused for holding adapters; the rest were
    # tracebacks (AttributeError, IndexError) or a tokenizer silently replaced.
    from pathlib import Path

    from mlx_lm import load
    from mlx_lm.tuner.lora import LoRALinear

    from mlxft.data import Dataset, Example
    from mlxft.evaluate import evaluate

    model, tokenizer = load(str(llama_dir))
    rows = Dataset(Path("rows"), [Example(np.arange(3, 19, dtype=np.int32), np.arange(16) >= 8)] * 4, "completion")

    def cfg(exact_match_rows=0, **model_settings):
        return RunConfig.from_dict({"model": model_settings, "data": {"data": str(chat_data)},
                                    "train": {"output_dir": str(tmp_path / "run"), "batch_size": 2, "max_steps": 1,
                                              "exact_match_rows": exact_match_rows}})

    for settings, message in (({"grad_checkpoint": True, "checkpoint_layers": 5}, "checkpoint_layers: 5 exceeds"),
                              ({"recompute_mlp": True, "recompute_mlp_layers": 5}, "recompute_mlp_layers: 5 exceeds")):
        with pytest.raises(UserError, match=message):
            Trainer(cfg(**settings), model, tokenizer, datasets=(rows, None))
        assert not any(isinstance(m, LoRALinear) for _, m in model.named_modules())
    for args, kwargs, message in (
            (({"model": {}},), {}, "take a RunConfig, not dict; build one with RunConfig.from_dict"),
            ((cfg(),), {"tokenizer": tokenizer}, "a tokenizer was passed without its model"),
            ((cfg(), model), {}, "reading the data files needs the model's tokenizer"),
            ((cfg(), model, tokenizer), {"datasets": rows}, "datasets= takes a pair"),
            ((cfg(), model, tokenizer), {"datasets": (rows,)}, "datasets= takes a pair"),
            # These were AttributeErrors, some after the model had changed.
            ((cfg(), (model, tokenizer)), {"datasets": (rows, None)}, r"mlx_lm.load returns \(model, tokenizer\)"),
            ((cfg(), str(llama_dir), tokenizer), {}, "model= takes an MLX model .* set config.model.model instead"),
            ((cfg(), model, model), {}, "tokenizer= takes the model's tokenizer"),
            ((cfg(exact_match_rows=2), model), {"datasets": (rows, None)}, "exact-match generates answers, which needs")):
        with pytest.raises(UserError, match=message):
            Trainer(*args, **kwargs)
    with pytest.raises(UserError, match="Dataset: examples must be a list of mlxft.data.Example, got tuple"):
        Dataset(Path("rows"), [(np.arange(3), np.ones(3, bool))], "completion")
    with pytest.raises(UserError, match="Example: token id 4294967303 is outside the range of token ids"):
        Example(np.array([1, 2, 2**32 + 7]), np.ones(3, bool))  # int32 made it 7
    grown = Dataset(Path("rows"), list(rows.examples[:2]), "completion")
    grown.examples.extend(rows.examples[2:])  # batches read lengths of 2 rows: rows 0-1 trained over and over
    with pytest.raises(UserError, match="the train dataset holds 4 examples but was built with 2; build a new"):
        Trainer(cfg(), model, tokenizer, datasets=(grown, None))
    with pytest.raises(UserError, match="prompt_format 'chatt' is not one of auto, chat, raw"):
        evaluate(model, tokenizer, chat_data / "valid.jsonl", prompt_format="chatt")
    Trainer(cfg(), model, tokenizer, datasets=[rows, None]).train()  # the model as it came still trains


def test_help_lists_every_option_readably(capsys):
    # "11% slower" in --loss-chunk's help made argparse paste the option's whole record there.
    from mlxft.train import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "11% slower" in out and "option_strings" not in out


def test_a_step_without_supervised_tokens_is_skipped_and_said(llama_dir, tmp_path, capsys):
    from pathlib import Path

    from mlxft.data import Dataset, Example

    rows = [Example(np.arange(3, 19, dtype=np.int32), np.arange(16) >= 8),
            Example(np.arange(3, 19, dtype=np.int32), np.zeros(16, bool))]
    cfg = RunConfig.from_dict({"model": {"model": str(llama_dir)},
                               "train": {"output_dir": str(tmp_path / "run"), "batch_size": 1, "max_steps": 2,
                                         "memory_estimate": False, "exact_match_rows": 0, "log_every": 1}})
    result = Trainer(cfg, datasets=(Dataset(Path("rows"), rows, "completion"), None)).train()
    out = capsys.readouterr().out
    assert "no supervised token in this step's rows; update skipped" in out
    # Its logged loss is no loss, not a perfect 0.0, and the run's training loss is the other step's.
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if r["type"] == "train"]
    assert sorted(losses, key=lambda loss: loss is None)[1] is None and losses.count(None) == 1, losses
    assert result.train_loss == next(loss for loss in losses if loss is not None) > 0 and "loss n/a" in out
    state = json.loads((tmp_path / "run" / "training_state.json").read_text())
    assert state["skipped_steps"] == 1


def test_a_relative_data_path_is_recorded_absolute_in_the_training_state(llama_dir, chat_data, tmp_path, monkeypatch):
    from mlxft.train import main

    monkeypatch.chdir(chat_data.parent)
    out = tmp_path / "run"
    assert main(["--model", str(llama_dir), "--data", chat_data.name, "--output-dir", str(out), "--max-steps", "1",
                 "--no-memory-estimate", "--exact-match-rows", "0"]) == 0
    state = json.loads((out / "training_state.json").read_text())
    assert state["dataset"] == str(chat_data / "train.jsonl")  # it had been "data/train.jsonl", as typed


def test_the_python_example_trains_and_a_second_run_is_a_one_line_refusal(llama_dir, chat_data, tmp_path):
    script = Path(__file__).parent.parent / "examples" / "train_from_python.py"
    out = tmp_path / "run"
    first = subprocess.run([sys.executable, str(script), str(llama_dir), str(chat_data), str(out)],
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and "trained 3 steps" in first.stdout, first.stderr
    assert (out / "adapters.safetensors").is_file()
    again = subprocess.run([sys.executable, str(script), str(llama_dir), str(chat_data), str(out)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and again.stderr.startswith("error: output directory")
    assert len(again.stderr.strip().splitlines()) == 1 and "Traceback" not in again.stderr


def test_token_ids_past_the_models_vocabulary_from_a_file_are_one_line_errors(tmp_path, capsys):
    # A tokenizer with tokens the embedding lacks: loaded from JSONL (not built in Python), the
    # ids went unchecked and training read past the embedding table without a word.
    from conftest import CHAT_ROWS, LLAMA_CONFIG, write_model
    from mlxft.evaluate import main as evaluate_main
    from mlxft.train import main

    model = write_model(tmp_path / "model", {**LLAMA_CONFIG, "vocab_size": 4096})  # the chat tokens are 8193 and up
    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", [{"messages": [{"role": "user", "content": "a"}]}, *CHAT_ROWS[:3]])
    assert main(["--model", str(model), "--data", str(data), "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the note of line 1, skipped (nothing supervised)
    assert re.fullmatch(rf"error: {re.escape(str(data / 'train.jsonl'))}: line 2 tokenizes to id \d+, outside the "
                        r"model's vocabulary of 4096: .*", err), err
    assert not (tmp_path / "run").exists()
    assert evaluate_main(["--model", str(model), "--data", str(data / "train.jsonl")]) == 2
    assert "line 2 tokenizes to id" in capsys.readouterr().err


def test_a_batch_size_past_the_datasets_rows_adds_no_padding_rows(llama_dir, tmp_path):
    # Every micro-batch was padded to the batch size: a 4-row validation set at --batch-size 64
    # computed 64 rows (60 of padding), ten times the time, and the estimate priced them all.
    from conftest import CHAT_ROWS

    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", CHAT_ROWS[:5])
    write_jsonl(data / "valid.jsonl", CHAT_ROWS[5:8])
    runs = {}
    for batch_size in (5, 16):
        trainer = Trainer(config(llama_dir, data, tmp_path / f"run-{batch_size}", batch_size=batch_size, max_steps=3,
                                 eval_every=1))
        assert trainer._largest_micro_batch()[0] == 5
        assert trainer.batch(trainer.valid_set, [0, 1, 2]).inputs.shape[0] == 3
        trainer.train()
        runs[batch_size] = trainer
    records = [[json.loads(line) for line in (tmp_path / f"run-{b}" / "metrics.jsonl").read_text().splitlines()]
               for b in (5, 16)]
    assert [r.get("loss", r.get("val_loss")) for r in records[0]] == [r.get("loss", r.get("val_loss")) for r in records[1]]
