"""Generate and evaluate from a run directory: the base is found from the run, the prompt gets
the chat template, output streams; the loss is token-weighted and matches the trainer's."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlxft import adapters, data
from mlxft.errors import UserError
from mlxft.evaluate import evaluate, main as evaluate_main
from mlxft.generate import main as generate_main
from mlxft.generation import prompt_ids

from adapter_runs import data_dir, trained_run


def test_generate_cli_streams_the_adapted_models_greedy_answer(llama_dir, runs_root):
    from mlx_lm import generate

    run = trained_run(runs_root, llama_dir)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "mlxft.generate", "--adapter", str(run), "--prompt", "-",
                           "--max-tokens", "6", "--verbose"], input="What is 3 plus 4?", capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "generation: 6 tokens" in proc.stderr or "stop: stop" in proc.stderr

    loaded = adapters.load_with_adapter(None, str(run))  # no --model: the run records its base
    ids = prompt_ids(loaded.tokenizer, [{"role": "user", "content": "What is 3 plus 4?"}])
    assert loaded.tokenizer.decode(ids).startswith("<|im_start|>user\nWhat is 3 plus 4?<|im_end|>")
    expected = generate(loaded.model, loaded.tokenizer, ids, max_tokens=6)
    assert proc.stdout == expected + "\n"


def test_the_tools_load_the_hub_revision_a_run_trained_on(llama_dir, runs_root, tmp_path, monkeypatch, capsys):
    # evaluate, generate and fuse loaded the hub's default branch whatever revision the run used.
    import huggingface_hub

    from mlxft import RunConfig, Trainer
    from mlxft.fuse import main as fuse_main

    fetched = []

    def snapshot_download(name, revision=None, **kwargs):
        fetched.append((name, revision))
        return str(llama_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    run = tmp_path / "run"
    Trainer(RunConfig.from_dict({"model": {"model": "someorg/tiny-llama", "revision": "v1.0"},
                                 "data": {"data": str(data_dir(runs_root))},
                                 "train": {"output_dir": str(run), "max_steps": 1, "memory_estimate": False,
                                           "exact_match_rows": 0}})).train()
    assert fetched == [("someorg/tiny-llama", "v1.0")]
    valid = str(data_dir(runs_root))
    assert evaluate_main(["--adapter", str(run), "--data", valid, "--max-batches", "1"]) == 0
    assert generate_main(["--adapter", str(run), "--prompt", "hi", "--max-tokens", "1"]) == 0
    assert fuse_main(["--adapter", str(run), "--out", str(tmp_path / "fused")]) == 0
    assert evaluate_main(["--adapter", str(run), "--data", valid, "--max-batches", "1", "--revision", "v2"]) == 0
    assert fetched[1:] == [("someorg/tiny-llama", "v1.0")] * 3 + [("someorg/tiny-llama", "v2")]

    # Exported, or copied out without config.yaml, the adapter lost the revision and went on
    # the default branch's weights.
    import shutil

    from mlxft.export import main as export_main

    copied = tmp_path / "copied"
    copied.mkdir()
    for name in ("adapters.safetensors", "adapter_config.json"):
        shutil.copy(run / name, copied / name)
    for fmt in ("peft", "mlx-lm"):
        assert export_main(["--adapter", str(run), "--format", fmt, "--out", str(tmp_path / fmt)]) == 0
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["revision"] == "v1.0"
    del fetched[:]
    for adapter in (copied, tmp_path / "peft", tmp_path / "mlx-lm"):
        assert generate_main(["--adapter", str(adapter), "--prompt", "hi", "--max-tokens", "1"]) == 0
    assert fetched == [("someorg/tiny-llama", "v1.0")] * 3
    # Recorded for another base, the run's revision would name a branch of the wrong repository.
    assert export_main(["--adapter", str(run), "--format", "peft", "--out", str(tmp_path / "other"),
                        "--model", str(llama_dir)]) == 0
    assert json.loads((tmp_path / "other" / "adapter_config.json").read_text())["revision"] is None


def test_evaluate_leaves_the_model_in_the_mode_it_came_in(llama_dir, runs_root):
    run = trained_run(runs_root, llama_dir)
    loaded = adapters.load_with_adapter(None, str(run))
    for mode in (True, False):
        loaded.model.train(mode)
        evaluate(loaded.model, loaded.tokenizer, data_dir(runs_root) / "valid.jsonl", max_batches=1)
        assert loaded.model.training is mode


def test_evaluate_is_token_weighted_and_matches_the_trainer(llama_dir, runs_root, capsys, monkeypatch):
    make_batch = data.make_batch
    run = trained_run(runs_root, llama_dir)
    valid = data_dir(runs_root) / "valid.jsonl"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trainer_loss = [r for r in records if r["type"] == "eval"][-1]

    loaded = adapters.load_with_adapter(None, str(run))
    one = evaluate(loaded.model, loaded.tokenizer, valid, batch_size=1)
    three = evaluate(loaded.model, loaded.tokenizer, valid, batch_size=3)  # a short last batch
    expected_tokens = data.load_dataset(valid, loaded.tokenizer, 2048).supervised_tokens
    assert one.tokens == three.tokens == expected_tokens and one.rows == 5
    assert one.loss == pytest.approx(three.loss, rel=1e-5)
    made = []
    monkeypatch.setattr(data, "make_batch", lambda rows, size, *a, **k: made.append(size) or make_batch(rows, size, *a, **k))
    huge = evaluate(loaded.model, loaded.tokenizer, valid, batch_size=100_000)  # was 100,000 rows of padding
    assert made == [5] and huge.tokens == three.tokens and huge.loss == pytest.approx(three.loss, rel=1e-5)
    monkeypatch.undo()
    chunked = evaluate(loaded.model, loaded.tokenizer, valid, batch_size=3, loss_chunk=4)
    assert chunked.loss == pytest.approx(three.loss, rel=1e-5) and chunked.tokens == three.tokens
    assert one.loss == pytest.approx(trainer_loss["val_loss"], rel=1e-5) and one.tokens == trainer_loss["val_tokens"]

    capsys.readouterr()  # whatever training printed, when this test trained the run
    assert evaluate_main(["--adapter", str(run), "--data", str(valid.parent), "--json", "--batch-size", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["tokens"] == expected_tokens and printed["loss"] == pytest.approx(one.loss, rel=1e-5)
    assert printed["perplexity"] == pytest.approx(math.exp(printed["loss"]), rel=1e-9)
    assert printed["data"].endswith("valid.jsonl")  # no test.jsonl in the directory: valid.jsonl

    assert evaluate_main(["--adapter", str(run), "--data", str(runs_root / "nothing-here")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert generate_main(["--adapter", str(runs_root / "no-run"), "--prompt", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err


def edited_run(runs_root, model_dir, tmp_path, section: str, **fields) -> Path:
    """A copy of the trained run whose config.yaml records ``fields`` in ``section``, as a run
    trained with those settings would."""
    import shutil

    import yaml

    run = tmp_path / "run"
    shutil.copytree(trained_run(runs_root, model_dir), run)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved[section].update(fields)
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    return run


def test_evaluate_encodes_rows_as_the_run_did_unless_told_otherwise(llama_dir, runs_root, tmp_path, capsys):
    run = edited_run(runs_root, llama_dir, tmp_path, "data", prompt_format="raw", max_seq_length=12)
    rows = tmp_path / "qa.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"What is {i} plus {i}?", "completion": f" {2 * i}, of course."}) + "\n"
                            for i in range(4)))

    def printed(*flags):
        capsys.readouterr()
        assert evaluate_main(["--adapter", str(run), "--data", str(rows), "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    loaded = adapters.load_with_adapter(None, str(run))
    as_run = evaluate(loaded.model, loaded.tokenizer, rows, prompt_format="raw", max_seq_length=12)
    as_default = evaluate(loaded.model, loaded.tokenizer, rows)
    assert as_run.tokens != as_default.tokens
    assert printed()["tokens"] == as_run.tokens and printed()["loss"] == pytest.approx(as_run.loss, rel=1e-5)
    given = printed("--prompt-format", "auto", "--max-seq-length", "2048")  # flags given win
    assert given["tokens"] == as_default.tokens
    assert printed("--no-completion-only")["tokens"] > as_run.tokens
    # An export for mlx-lm leaves config.yaml behind: its header carries the settings (it was
    # scored chat-rendered, 28 tokens against the run's 8).
    from mlxft.export import export

    run = export(run, "mlx-lm", tmp_path / "exported", say=lambda *_: None)
    assert not (run / "config.yaml").exists()
    assert printed()["tokens"] == as_run.tokens and printed()["loss"] == pytest.approx(as_run.loss, rel=1e-5)


def test_generate_prompts_a_chat_run_with_the_template_and_a_text_run_raw(llama_dir, runs_root, tmp_path, capsys):
    # Its prompt_format (raw here, from a reused config) shaped no row: chat rows always take the
    # template. generate took it anyway, prompted "hi" raw and refused --system.
    run = edited_run(runs_root, llama_dir, tmp_path, "data", prompt_format="raw")
    assert json.loads((run / "training_state.json").read_text())["task"] == "chat"

    def prompt_tokens(*flags):
        capsys.readouterr()
        assert generate_main(["--adapter", str(run), "--prompt", "hi", "--max-tokens", "1", "--verbose", *flags]) == 0
        return int(re.search(r"prompt: (\d+) tokens", capsys.readouterr().err).group(1))

    assert prompt_tokens() == prompt_tokens("--prompt-format", "chat") != prompt_tokens("--prompt-format", "raw")
    assert prompt_tokens("--system", "be brief") > prompt_tokens()
    # A run trained on plain text rows (prompt_format auto) saw no template: it continues raw text.
    run = edited_run(runs_root, llama_dir, tmp_path / "text", "data", prompt_format="auto")
    state = json.loads((run / "training_state.json").read_text())
    (run / "training_state.json").write_text(json.dumps({**state, "task": "text"}))
    assert prompt_tokens() == prompt_tokens("--prompt-format", "raw") != prompt_tokens("--prompt-format", "chat")


def test_chat_prompts_need_a_template_that_takes_them(tokenizer, monkeypatch):
    hf = tokenizer._tokenizer  # the wrapped transformers tokenizer: its own errors are tracebacks
    user = [{"role": "user", "content": "hi"}]
    monkeypatch.setattr(hf, "chat_template", "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}"
                                             "{% endif %}{{ messages[-1].content }}")
    assert tokenizer.decode(prompt_ids(tokenizer, user, "chat")) == "hi"
    with pytest.raises(UserError, match=r"rejected the prompt's messages \(no system role\); leave out --system"):
        prompt_ids(tokenizer, [{"role": "system", "content": "be brief"}, *user], "chat")
    monkeypatch.setattr(hf, "chat_template", None)
    with pytest.raises(UserError, match="needs a tokenizer with a chat template"):
        prompt_ids(tokenizer, user, "chat")
    assert prompt_ids(tokenizer, user, "auto") == prompt_ids(tokenizer, user, "raw")  # auto: raw without a template


def test_exact_match_prompts_chat_rows_as_training_renders_them_and_passes_over_empty_prompts(
        tokenizer, tmp_path, monkeypatch):
    from mlxft import generation

    rows = [{"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"}]},
            {"messages": [{"role": "assistant", "content": "Hello"}]},  # opens with the answer: nothing to prompt
            {"prompt": "", "completion": "x"},
            {"prompt": "Capital of Spain?", "completion": "Madrid"}]
    path = tmp_path / "valid.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = generation.qa_pairs(path, 10)
    assert [(p.reference, p.chat) for p in pairs] == [("Paris", True), ("Madrid", False)]
    prompted = []
    import importlib

    monkeypatch.setattr(importlib.import_module("mlx_lm.generate"), "batch_generate",  # the package's name is the function
                        lambda model, tok, prompts, **kw: prompted.extend(prompts) or SimpleNamespace(
                            texts=["<think>\n\n</think>\n\nParis", "madrid."]))
    model = SimpleNamespace(eval=lambda: None, train=lambda mode=True: None, training=False)
    score, _ = generation.exact_match(model, tokenizer, pairs, "raw")
    # The chat row keeps its template under --prompt-format raw, as training encodes it; the
    # prompt/completion row is raw. An answer after an empty reasoning block (Qwen3's template
    # trains one) is the answer.
    assert tokenizer.decode(prompted[0]).startswith("<|im_start|>user\nCapital of France?")
    assert tokenizer.decode(prompted[1]) == "Capital of Spain?"
    assert score == 1.0
    with pytest.raises(UserError, match="the prompt is empty"):
        prompt_ids(tokenizer, [{"role": "user", "content": ""}], "raw")


def test_evaluate_refuses_a_negative_cap_and_an_unscored_set(tokenizer, runs_root, monkeypatch):
    from mlxft import loss

    valid = data_dir(runs_root) / "valid.jsonl"
    model = SimpleNamespace(eval=lambda: None, train=lambda mode=True: None, training=False)
    with pytest.raises(UserError, match="--max-batches must be 0 to"):
        evaluate(model, tokenizer, valid, max_batches=-1)
    monkeypatch.setattr(loss, "evaluation_loss", lambda *args, **kwargs: (mx.array(0.0), mx.array(0.0)))  # nothing supervised
    with pytest.raises(UserError, match="no token was scored"):
        evaluate(model, tokenizer, valid)


def test_evaluate_refuses_counts_past_what_training_takes(tokenizer, llama_dir, runs_root, capsys):
    valid = data_dir(runs_root) / "valid.jsonl"
    model = SimpleNamespace(eval=lambda: None, train=lambda mode=True: None, training=False)
    with pytest.raises(UserError, match=r"--batch-size must be 1 to 2,147,483,647, got 2,147,483,648$"):
        evaluate(model, tokenizer, valid, batch_size=2**31)
    for flag in ("--batch-size", "--max-batches", "--max-seq-length", "--loss-chunk"):
        capsys.readouterr()
        assert evaluate_main(["--model", str(llama_dir), "--data", str(valid), flag, "99999999999999999999"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {flag} must be")


def test_evaluate_reports_the_rows_it_scored(tokenizer, runs_root, monkeypatch, tmp_path):
    from mlxft import loss

    valid = data_dir(runs_root) / "valid.jsonl"
    model = SimpleNamespace(eval=lambda: None, train=lambda mode=True: None, training=False)
    monkeypatch.setattr(loss, "evaluation_loss", lambda *args, **kwargs: (mx.array(1.0), mx.array(3.0)))
    assert evaluate(model, tokenizer, valid, batch_size=1, max_batches=1).rows == 1
    assert evaluate(model, tokenizer, valid, batch_size=2, max_batches=2).rows == 4
    assert evaluate(model, tokenizer, valid, batch_size=2).rows == 5
    # A text row longer than --max-seq-length is scored in windows, which were counted as rows.
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "short row"}) + "\n" + json.dumps({"text": "a long row " * 40}) + "\n")
    assert evaluate(model, tokenizer, text, max_seq_length=16).rows == 2


def test_evaluate_defaults_to_the_trainers_declared_defaults(llama_dir, tmp_path, monkeypatch, capsys):
    from mlxft.config import DataConfig

    rows = tmp_path / "qa.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"What is {i} plus {i}?", "completion": f" {2 * i}, of course."}) + "\n"
                            for i in range(4)))
    loaded = adapters.load_with_adapter(str(llama_dir), None)
    expected = evaluate(loaded.model, loaded.tokenizer, rows, prompt_format="raw", max_seq_length=12,
                        completion_only=False)
    assert expected.tokens != evaluate(loaded.model, loaded.tokenizer, rows).tokens
    # No run records settings for the bare base: evaluate takes them from the one declaration.
    monkeypatch.setattr(DataConfig, "prompt_format", "raw")
    monkeypatch.setattr(DataConfig, "max_seq_length", 12)
    monkeypatch.setattr(DataConfig, "completion_only", False)
    capsys.readouterr()
    assert evaluate_main(["--model", str(llama_dir), "--data", str(rows), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == expected.tokens


def test_a_system_message_needs_the_chat_template(tokenizer, llama_dir, monkeypatch, capsys):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with pytest.raises(UserError, match="--system needs the chat template.*drop --system or use --prompt-format chat"):
        prompt_ids(tokenizer, messages, "raw")
    assert generate_main(["--model", str(llama_dir), "--prompt", "hi", "--system", "be brief", "--prompt-format", "raw",
                          "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--system needs the chat template" in err
    monkeypatch.setattr(tokenizer._tokenizer, "chat_template", None)  # auto without a template is raw too
    with pytest.raises(UserError, match="--system needs the chat template"):
        prompt_ids(tokenizer, messages, "auto")


def test_exact_match_answers_are_each_prompts_greedy_continuation(model_dir):
    # The prompts are decoded together, left-padded to the longest: padding must change no
    # prompt's answer, which is checked against a plain argmax over the whole sequence.
    from mlxft import generation, models

    model, tokenizer, *_ = models.load(str(model_dir), dtype="float32")
    questions = ["Hi", "What is the capital of France?", "Name three colours of the rainbow, please, in order"]
    pairs = []
    for question in questions:
        messages = [{"role": "user", "content": question}]
        ids = prompt_ids(tokenizer, messages, "raw")
        answer = []
        for _ in range(6):
            token = mx.argmax(model(mx.array([ids + answer]))[0, -1]).item()
            if token in tokenizer.eos_token_ids:
                break
            answer.append(token)
        pairs.append(generation.QAPair(messages, tokenizer.decode(answer)))
    score, answers = generation.exact_match(model, tokenizer, pairs, "raw", max_tokens=6)
    assert [a.generated for a in answers] == [pair.reference.strip() for pair in pairs]
    assert score == 1.0
    wrong = [pair._replace(reference=pair.reference + " and more") for pair in pairs]
    assert generation.exact_match(model, tokenizer, wrong, "raw", max_tokens=6)[0] == 0.0


def test_prompts_that_are_not_utf8_are_one_line_errors(monkeypatch, capsys, tmp_path):
    # Other bytes reached the tokenizer as lone surrogates (a TypeError traceback); a closed
    # standard input was an AttributeError. All are refused before a model loads.
    import io

    run = str(tmp_path / "no-run")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 ?")))
    assert generate_main(["--adapter", run, "--prompt", "-"]) == 2
    assert "--prompt -: standard input is not UTF-8 text (byte 0xe9 at offset 3); save it as UTF-8" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", None)
    assert generate_main(["--adapter", run, "--prompt", "-"]) == 2
    assert "--prompt -: there is no standard input to read" in capsys.readouterr().err
    assert generate_main(["--adapter", run, "--prompt", "caf\udce9"]) == 2
    assert "--prompt is not UTF-8 text" in capsys.readouterr().err
    assert generate_main(["--adapter", run, "--prompt", "hi", "--system", "\udce9"]) == 2
    assert "--system is not UTF-8 text" in capsys.readouterr().err


def test_evaluate_computes_in_the_runs_dtype_and_names_a_damaged_setting(llama_dir, runs_root, tmp_path, capsys):
    # A run trained in bfloat16 was scored in float32 (the CPU's auto), so its loss was not the
    # trainer's; a config.yaml edited by hand was a TypeError traceback.
    import yaml

    run = edited_run(runs_root, llama_dir, tmp_path, "model", dtype="bfloat16")
    saved = (run / "config.yaml").read_text()
    valid = data_dir(runs_root) / "valid.jsonl"

    def loss(dtype):
        loaded = adapters.load_with_adapter(None, str(run), dtype)
        return evaluate(loaded.model, loaded.tokenizer, valid).loss

    def printed(*flags):
        capsys.readouterr()
        code = evaluate_main(["--adapter", str(run), "--data", str(valid), "--json", *flags])
        out = capsys.readouterr()
        return json.loads(out.out)["loss"] if code == 0 else (code, out.err)

    in_bf16, in_f32 = loss("bfloat16"), loss("float32")
    assert in_bf16 != in_f32
    assert printed() == pytest.approx(in_bf16, rel=1e-6)
    assert printed("--dtype", "float32") == pytest.approx(in_f32, rel=1e-6)
    for section, field, value, message in (
            ("data", "max_seq_length", "2048x", "field data.max_seq_length is '2048x', which is not a whole number"),
            ("data", "completion_only", "yes", "field data.completion_only is 'yes', which is not true or false"),
            ("model", "dtype", "bf16", "field model.dtype is 'bf16', not one of auto, float32, bfloat16, float16")):
        broken = yaml.safe_load((run / "config.yaml").read_text())
        broken[section][field] = value
        (run / "config.yaml").write_text(yaml.safe_dump(broken))
        code, err = printed()
        assert code == 2 and f"{run / 'config.yaml'}: {message}" in err and "Traceback" not in err
        (run / "config.yaml").write_text(saved)


@pytest.mark.parametrize("damage", ["missing hidden_size", "layers as text", "not an object"])
def test_a_base_with_a_damaged_config_is_a_one_line_error(llama_dir, tmp_path, capsys, damage):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(llama_dir, base)
    config = json.loads((base / "config.json").read_text())
    if damage == "missing hidden_size":
        del config["hidden_size"]
    elif damage == "layers as text":
        config["num_hidden_layers"] = "two"
    else:
        config = [1, 2]
    (base / "config.json").write_text(json.dumps(config))
    for main in (evaluate_main, generate_main):
        flags = ["--data", str(tmp_path)] if main is evaluate_main else ["--prompt", "hi"]
        if main is evaluate_main:
            (tmp_path / "valid.jsonl").write_text(json.dumps({"prompt": "q", "completion": "a"}) + "\n")
        assert main(["--model", str(base), *flags]) == 2
        err = capsys.readouterr().err
        assert f"cannot load model from {base}" in err and "Traceback" not in err


def test_only_a_fault_of_the_recorded_base_points_to_it(llama_dir, runs_root, monkeypatch):
    from mlxft import models

    run = trained_run(runs_root, llama_dir)
    with pytest.raises(UserError, match=r"cannot load model .*\(the base recorded in .*; pass --model to use another\)"):
        with monkeypatch.context() as patch:  # the recorded base is gone or damaged
            patch.setattr("mlx_lm.utils.load_model", lambda path: (_ for _ in ()).throw(ValueError("damaged")))
            adapters.load_with_adapter(None, str(run))

    def refuse_dtype(model, dtype):
        raise UserError("this dtype is refused here")

    monkeypatch.setattr(models, "finish_loading", refuse_dtype)  # the base is no cause of it
    with pytest.raises(UserError) as refused:
        adapters.load_with_adapter(None, str(run))
    assert str(refused.value) == "this dtype is refused here"


def test_training_and_evaluation_report_one_perplexity(tmp_path):
    # The trainer's records capped the exponent at 50, evaluate at 700: past a loss of 50 the
    # logged perplexity was off by orders of magnitude.
    import io

    from mlxft.loss import perplexity
    from mlxft.report import Reporter

    record = Reporter(tmp_path, 1, stream=io.StringIO()).eval(1, 60.0, 10)
    assert record["val_ppl"] == pytest.approx(math.exp(60.0)) == perplexity(60.0)


def test_an_empty_adapter_is_refused_not_read_as_the_base_alone(llama_dir, chat_data, tmp_path, capsys):
    # `--adapter "$RUN"` with RUN unset scored, generated from or re-wrote the base model without a word.
    from mlxft.evaluate import main as evaluate_main
    from mlxft.export import main as export_main
    from mlxft.fuse import main as fuse_main
    from mlxft.generate import main as generate_main

    for main, args in [(evaluate_main, ["--data", str(chat_data)]), (generate_main, ["--prompt", "hi"]),
                       (fuse_main, ["--out", str(tmp_path / "fused")]),
                       (export_main, ["--format", "peft", "--out", str(tmp_path / "peft")])]:
        assert main(["--model", str(llama_dir), "--adapter", "", *args]) == 2
        assert capsys.readouterr().err.startswith("error: --adapter is empty;")
    assert not (tmp_path / "fused").exists() and not (tmp_path / "peft").exists()


def test_a_tiny_temperature_is_greedy_and_a_prompt_past_the_context_is_warned_of(llama_dir, capsys):
    # --temp 1e-38 overflowed the logits to inf and sampled random text from NaNs.
    answers = []
    for temp in ("0", "1e-38"):
        assert generate_main(["--model", str(llama_dir), "--prompt", "What is 1 plus 2?", "--max-tokens", "6",
                              "--temp", temp]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1]
    # The tiny model's context is 1024 tokens; the prompt ran past it without a word.
    assert generate_main(["--model", str(llama_dir), "--prompt", "hello " * 1100, "--max-tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert "warning: the prompt's " in err and "pass the model's context of 1024 tokens" in err


def test_a_wrapped_models_context_is_read_from_its_text_model(tmp_path, capsys):
    # Gemma 3 keeps max_position_embeddings under text_config: a prompt past it had no warning.
    from conftest import LLAMA_CONFIG, write_model

    text = {k: v for k, v in LLAMA_CONFIG.items() if k != "model_type"} | {
        "model_type": "gemma3_text", "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 64,
        "sliding_window_pattern": 2}
    model = write_model(tmp_path / "gemma3", {"model_type": "gemma3", "text_config": text,
                                              "vocab_size": text["vocab_size"], "vision_config": {}})
    assert generate_main(["--model", str(model), "--prompt", "hello " * 1100, "--max-tokens", "1"]) == 0
    assert "pass the model's context of 1024 tokens" in capsys.readouterr().err


def test_evaluate_takes_the_built_in_task_a_run_records(tmp_path, monkeypatch):
    # The default job's config records data: builtin:capitals; evaluate took it for a missing path.
    from mlxft import builtin
    from mlxft.evaluate import data_file

    monkeypatch.setenv("MLXFT_CACHE", str(tmp_path / "cache"))
    assert data_file(builtin.DATA_NAME) == tmp_path / "cache" / "data" / "capitals" / "valid.jsonl"
    with pytest.raises(UserError, match="unknown built-in 'builtin:other'"):
        data_file("builtin:other")
