"""Never lose work: exact resume, crash-safe checkpoints, signals, retention, bad input."""

import errno
import json
import os
import re
import signal
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxft import RunConfig, Trainer, adapters, checkpoint, models
from mlxft.errors import UserError
from mlxft.export import export
from mlxft.step import LossScaler, gradient_tree
from mlxft.trainer import TrainingStopped, check_output_dir

from conftest import CHAT_ROWS, LLAMA_CONFIG, write_jsonl, write_model


def config(model_dir, data_dir, out, **train):
    return RunConfig.from_dict({
        "model": {"model": str(model_dir)},
        "data": {"data": str(data_dir)},
        "adapter": {"dropout": 0.1},  # dropout makes the random state part of the test
        "optim": {"learning_rate": 5e-3, "warmup_steps": 2, "bias_correction": True},  # its applied count resumes too
        "train": {"output_dir": str(out), "batch_size": 2, "grad_accum_steps": 2, "epochs": 2, "log_every": 1,
                  "save_every": 2, "keep_checkpoints": 0, **train},
    })


def weights(model):
    return {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}


@pytest.fixture(scope="module")
def uninterrupted(llama_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    write_jsonl(data / "train.jsonl", CHAT_ROWS[:11])  # 6 micro-batches / epoch: 3 windows, the last short
    trainer = Trainer(config(llama_dir, data, tmp_path_factory.mktemp("full") / "run"))
    trainer.train()
    return data, weights(trainer.model), trainer.optimizer.state["step"].item()


def tiny_checkpoint(run_dir, name="checkpoint-2", run_id="run-a", step=2):
    """A real checkpoint directory of a two-parameter model: for tests of the files alone."""
    state = {"step": step, "epoch": 0, "batch_index": 0, "total_steps": 9, "window_real_tokens": 0, "skipped_steps": 0,
             "nonfinite_streak": 0, "best_val_loss": None, "last_val_loss": None,
             "loss_scaler": {"enabled": False, "scale": 1.0, "good_steps": 0}, "run_id": run_id}
    meta = checkpoint.adapter_metadata("lora", 8, 16.0, 0.0, ["*"], 1, "llama")
    return checkpoint.save_checkpoint(run_dir, name, nn.Linear(2, 2), meta, {"step": mx.array(step)}, None, state,
                                      RunConfig().to_dict())


def files(directory):
    """Every file's bytes but the run lock's, which holds the pid of the last run that took it."""
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file() and p.name != ".mlxft.lock"}


def stop_after(trainer, micro_batches):
    original, count = trainer._micro_step, [0]

    def counting(batches):
        original(batches)
        count[0] += 1
        if count[0] == micro_batches:
            trainer.stop.request(signal.SIGTERM)

    trainer._micro_step = counting


@pytest.mark.parametrize("interrupt_at", [1, 4, 6, 9])  # inside a window, on a boundary, at an epoch's end, across
def test_interrupt_and_resume_equals_uninterrupted(llama_dir, uninterrupted, tmp_path, interrupt_at):
    data, expected, expected_steps = uninterrupted
    out = tmp_path / "run"
    first = Trainer(config(llama_dir, data, out))
    stop_after(first, interrupt_at)
    with pytest.raises(TrainingStopped) as stopped:
        first.train()
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert stopped.value.checkpoint.name.endswith("-emergency")
    assert (out / "latest").resolve() == stopped.value.checkpoint.resolve()
    window_file = stopped.value.checkpoint / "window.safetensors"
    assert window_file.exists() == (interrupt_at % 2 == 1 and interrupt_at % 6 != 0)

    resumed = Trainer(config(llama_dir, data, out, resume="latest"))
    assert resumed.step_count == first.step_count and resumed.batch_index == first.batch_index % 6
    assert resumed.run_id == first.run_id  # so its pruning counts the first part's checkpoints
    resumed.train()
    assert resumed.optimizer.state["step"].item() == expected_steps
    got = weights(resumed.model)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def request_checkpoint_after(trainer, micro_batches):
    original, count = trainer._micro_step, [0]

    def counting(batches):
        original(batches)
        count[0] += 1
        if count[0] in micro_batches:
            trainer.request_checkpoint()  # as `kill -USR1` does

    trainer._micro_step = counting


def test_a_requested_checkpoint_holds_whole_steps_and_training_goes_on(llama_dir, uninterrupted, tmp_path):
    data, expected, expected_steps = uninterrupted
    out = tmp_path / "run"
    first = Trainer(config(llama_dir, data, out, save_every=0))
    # After micro-batch 1 the first window is open: the checkpoint waits for step 1 to end.
    # After micro-batch 4 step 2 has just ended.
    request_checkpoint_after(first, {1, 4})
    first.train()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    for step in (1, 2):
        saved = out / f"checkpoint-{step}"
        assert json.loads((saved / "trainer_state.json").read_text())["step"] == step
        assert not (saved / "window.safetensors").exists()
    for name, value in weights(first.model).items():  # saving on the way changed nothing
        np.testing.assert_array_equal(value, expected[name], err_msg=name)

    resumed = Trainer(config(llama_dir, data, out, save_every=0, resume=str(out / "checkpoint-1")))
    resumed.train()
    assert resumed.optimizer.state["step"].item() == expected_steps
    for name, value in weights(resumed.model).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_a_requested_checkpoint_already_saved_is_not_saved_twice(llama_dir, uninterrupted, tmp_path, capsys):
    out = tmp_path / "run"
    trainer = Trainer(config(llama_dir, uninterrupted[0], out, save_every=1, max_steps=2))
    request_checkpoint_after(trainer, {2})  # step 1 ends here, and save_every saves it
    saves = []
    original = trainer.save_checkpoint
    trainer.save_checkpoint = lambda kind, **kw: saves.append((kind, trainer.step_count)) or original(kind, **kw)
    trainer.train()
    assert saves == [("step", 1), ("final", 2)]
    assert "checkpoint at step 1 is saved already" in capsys.readouterr().out


def test_a_stop_logs_the_steps_since_the_last_record(llama_dir, uninterrupted, tmp_path):
    # With --log-every 2 a stop after step 3 dropped step 3's record: the resumed run starts
    # after it, and its step-4 record held step 4 alone.
    data = uninterrupted[0]
    every_step = tmp_path / "every"
    Trainer(config(llama_dir, data, every_step)).train()
    expected = {r["step"]: r["loss"] for r in map(json.loads, (every_step / "metrics.jsonl").read_text().splitlines())
                if r["type"] == "train"}
    out = tmp_path / "run"
    trainer = Trainer(config(llama_dir, data, out, log_every=2))
    stop_after(trainer, 6)  # two micro-batches a step: after step 3
    with pytest.raises(TrainingStopped):
        trainer.train()
    Trainer(config(llama_dir, data, out, log_every=2, resume="latest")).train()
    logged = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    assert [r["step"] for r in logged] == [2, 3, 4, 6]
    for record in logged[1:3]:  # each holds its own step alone
        assert record["loss"] == pytest.approx(expected[record["step"]], rel=1e-6)


def test_resume_refuses_other_settings(llama_dir, uninterrupted, tmp_path):
    data = uninterrupted[0]
    out = tmp_path / "run"
    first = Trainer(config(llama_dir, data, out, max_steps=2))
    first.train()
    other_rank = config(llama_dir, data, out, resume="latest", max_steps=4)
    other_rank.adapter.rank = 4
    with pytest.raises(UserError, match=r"adapter.rank is 4 but the checkpoint was trained with 8"):
        Trainer(other_rank)
    longer = config(llama_dir, data, out, resume="latest", max_steps=4)
    longer.data.max_seq_length = 512
    with pytest.raises(UserError, match=r"data.max_seq_length is 512 but .* 2048 \(pass --force"):
        Trainer(longer)
    longer.train.force = True
    assert Trainer(longer).step_count == 2
    in_bf16 = config(llama_dir, data, out, resume="latest", max_steps=4)
    in_bf16.model.dtype = "bfloat16"
    with pytest.raises(UserError, match=r"model.dtype is 'bfloat16' but .* \(pass --force"):
        Trainer(in_bf16)


def test_resume_refuses_other_base_weights_under_the_same_model_name(llama_dir, uninterrupted, tmp_path, capsys):
    # A hub id that moved on, or a directory saved over: the name matches, the weights do not.
    model, out = tmp_path / "model", tmp_path / "run"
    shutil.copytree(llama_dir, model)
    Trainer(config(model, uninterrupted[0], out, max_steps=2)).train()
    state = json.loads((out / "latest" / "trainer_state.json").read_text())
    assert state["base_weights"] == models.weights_fingerprint(llama_dir)  # a copy is the same model
    weights_file = model / "model.safetensors"
    tensors = mx.load(str(weights_file))
    mx.save_safetensors(str(weights_file), {name: value * 1.01 for name, value in tensors.items()})
    resumed = config(model, uninterrupted[0], out, resume="latest", max_steps=4)
    with pytest.raises(UserError, match=r"the weights in .*model differ from those the checkpoint was trained on "
                                        r".*\(pass --force"):
        Trainer(resumed)
    resumed.train.force = True
    assert Trainer(resumed).step_count == 2
    assert "forced: base model weights changed" in capsys.readouterr().out
    # Loading the run's adapter on the base it recorded says so too (evaluate, generate, fuse),
    # and so does its export for mlx-lm, the copy users share.
    adapters.load_with_adapter(None, str(out))
    assert f"warning: the weights in {model} differ from those {out} was trained on" in capsys.readouterr().err
    exported = export(out, "mlx-lm", tmp_path / "exported")
    adapters.load_with_adapter(None, str(exported))
    assert f"warning: the weights in {model} differ from those {exported} was trained on" in capsys.readouterr().err
    # A new run starting from the adapter on that base, too.
    continued = config(model, uninterrupted[0], tmp_path / "continued", max_steps=1)
    continued.adapter.init_adapter = str(out)
    Trainer(continued)
    assert f"warning: the weights in {model} differ from those {out} was trained on" in capsys.readouterr().err


def test_the_weights_fingerprint_tells_any_one_changed_tensor_and_reads_older_records(tmp_path):
    # A LoRA fused into one projection of one layer and saved over the base changes that tensor
    # alone; samples spread across the file (the first fingerprints) miss many such tensors.
    model = write_model(tmp_path / "model", {**LLAMA_CONFIG, "num_hidden_layers": 12})
    weights_file = model / "model.safetensors"
    original = mx.load(str(weights_file))
    mx.save_safetensors(str(weights_file), original)  # laid out as the changed copies below are
    before = models.weights_fingerprint(model)
    older = models.weights_fingerprint(model, like="0" * 32)  # the scheme of the first fingerprints
    assert models.fingerprint_scheme(older) == "" and models.fingerprint_scheme(before) != ""
    missed_by_the_file_samples = 0
    for name in original:
        mx.save_safetensors(str(weights_file), {**original, name: original[name] + 1e-3})
        assert models.weights_fingerprint(model) != before, name
        missed_by_the_file_samples += models.weights_fingerprint(model, like=older) == older
    assert missed_by_the_file_samples > 10
    mx.save_safetensors(str(weights_file), original)
    assert models.weights_fingerprint(model) == before


def test_a_checkpoint_with_the_first_fingerprint_resumes_on_the_same_weights(llama_dir, uninterrupted, tmp_path):
    model, out = tmp_path / "model", tmp_path / "run"
    shutil.copytree(llama_dir, model)
    Trainer(config(model, uninterrupted[0], out, max_steps=2)).train()
    state_file = out / "latest" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["base_weights"] = models.weights_fingerprint(model, like="0" * 32)
    state_file.write_text(json.dumps(state))
    assert Trainer(config(model, uninterrupted[0], out, resume="latest", max_steps=4)).step_count == 2
    tensors = mx.load(str(model / "model.safetensors"))
    mx.save_safetensors(str(model / "model.safetensors"), {name: value * 1.01 for name, value in tensors.items()})
    with pytest.raises(UserError, match="differ from those the checkpoint was trained on"):
        Trainer(config(model, uninterrupted[0], out, resume="latest", max_steps=4))


def test_resume_refuses_another_quantization_group_unless_forced(tmp_path):
    saved = RunConfig.from_dict({"model": {"model": "m", "quantize": 4}, "data": {"data": "d"}}).to_dict()
    other = RunConfig.from_dict({"model": {"model": "m", "quantize": 4, "quantize_group_size": 32},
                                 "data": {"data": "d"}}).to_dict()
    with pytest.raises(UserError, match=r"model.quantize_group_size is 32 but .* 64 \(pass --force"):
        checkpoint.check_resume(saved, other, "chat", "chat", force=False)
    assert checkpoint.check_resume(saved, other, "chat", "chat", force=True) == ["model.quantize_group_size: 64 -> 32"]
    for config in (saved, other):  # unquantized, the group size means nothing
        config["model"]["quantize"] = 0
    assert checkpoint.check_resume(saved, other, "chat", "chat", force=False) == []


def test_overwrite_starting_from_another_runs_checkpoint_replaces_the_old_run(llama_dir, uninterrupted, tmp_path):
    data = uninterrupted[0]
    source = Trainer(config(llama_dir, data, tmp_path / "a", max_steps=2))
    source.train()
    old = Trainer(config(llama_dir, data, tmp_path / "b", max_steps=3, save_every=1, grad_accum_steps=1))
    old.train()
    with pytest.raises(UserError, match="already holds a run"):
        Trainer(config(llama_dir, data, tmp_path / "b", resume=str(tmp_path / "a" / "final"), max_steps=3))
    new = Trainer(config(llama_dir, data, tmp_path / "b", resume=str(tmp_path / "a" / "final"), max_steps=3,
                         overwrite=True))
    # Before the new run saves anything, nothing of the old one may pass for it.
    assert not (tmp_path / "b" / "latest").exists()
    assert not [p for p in (tmp_path / "b").iterdir() if p.name.startswith("checkpoint-")]
    assert (tmp_path / "b" / "metrics.jsonl").read_text() == ""
    new.train()
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and min(steps) >= 2  # only the new run's records, from where it started
    assert json.loads((tmp_path / "b" / "latest" / "trainer_state.json").read_text())["run_id"] == new.run_id


def test_resume_refuses_other_training_data(llama_dir, uninterrupted, tmp_path, capsys):
    data, out = tmp_path / "data", tmp_path / "run"
    shutil.copytree(uninterrupted[0], data)
    Trainer(config(llama_dir, data, out, max_steps=2)).train()
    rows = (data / "train.jsonl").read_text().splitlines()
    rows[3] = rows[3].replace("plus", "times")  # one edited row: the same count, other tokens
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    resumed = config(llama_dir, data, out, resume="latest", max_steps=4)
    with pytest.raises(UserError, match=r"training data differs from the checkpoint's .*\(pass --force"):
        Trainer(resumed)
    resumed.train.force = True
    assert Trainer(resumed).step_count == 2
    assert "forced: training data changed" in capsys.readouterr().out


def test_resume_drops_the_metrics_of_steps_it_trains_again(llama_dir, uninterrupted, tmp_path, capsys):
    # As after a SIGKILL at step 4: logged up to there, the last checkpoint at step 2, a line cut short.
    data, out = uninterrupted[0], tmp_path / "run"
    Trainer(config(llama_dir, data, out, max_steps=4)).train()
    metrics = out / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"type": "train", "st')
    before = [json.loads(line) for line in metrics.read_text().splitlines()[:-1]]
    assert max(r["step"] for r in before) == 4
    shutil.rmtree(out / "final")
    (out / "latest").unlink()
    os.symlink("checkpoint-2", out / "latest")
    Trainer(config(llama_dir, data, out, max_steps=4, resume="latest")).train()
    assert "metrics.jsonl: removed 3 records of steps after 2" in capsys.readouterr().out  # steps 3, 4, the cut line
    after = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["type"], r["step"]) for r in after] == [(r["type"], r["step"]) for r in before]


def test_retention_keeps_the_newest_and_never_final_emergency_or_others(tmp_path):
    for step in (2, 4, 6, 8):
        tiny_checkpoint(tmp_path, f"checkpoint-{step}", step=step)
    tiny_checkpoint(tmp_path, "checkpoint-3-emergency", step=3)
    tiny_checkpoint(tmp_path, "final", step=9)
    tiny_checkpoint(tmp_path, "checkpoint-1", run_id="run-b", step=1)  # an earlier run's
    (tmp_path / "checkpoint-5").mkdir()  # a user's own, not mlxft's
    (tmp_path / "checkpoint-5" / "notes.txt").write_text("mine")
    (tmp_path / "latest").unlink()
    os.symlink("checkpoint-4", tmp_path / "latest")  # e.g. resumed from there: never pruned
    checkpoint.prune_checkpoints(tmp_path, keep=2, run_id="run-a", step=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-3-emergency", "checkpoint-4", "checkpoint-5",
                                                         "checkpoint-6", "checkpoint-8", "final", "latest"]


def test_resuming_an_older_checkpoint_rewinds_latest_and_prunes_only_its_own_branch(llama_dir, uninterrupted,
                                                                                    tmp_path, capsys):
    # A run saved checkpoints 2 to 8; the user goes back to 2 (say, with another learning rate).
    # Its metrics past step 2 go at once, so `latest` must name checkpoint-2 from then on: a
    # crash before the first save and `--resume latest` come back to step 2, not to a step
    # whose records are gone.
    data, out = uninterrupted[0], tmp_path / "run"
    settings = dict(epochs=4, max_steps=10)
    Trainer(config(llama_dir, data, out, **settings)).train()
    assert os.readlink(out / "latest") == "final"
    Trainer(config(llama_dir, data, out, **settings, resume=str(out / "checkpoint-2")))
    assert "latest now names checkpoint-2 (it named final" in capsys.readouterr().out
    assert os.readlink(out / "latest") == "checkpoint-2"
    assert max(json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()) == 2
    # Resumed again from there (`latest`), keeping two checkpoints: its saves at steps 4 and 6
    # replace the old run's and prune checkpoint-2. The old run's checkpoint-8, past the step
    # saved, is neither counted (which would delete the new checkpoint-4) nor deleted.
    branch = Trainer(config(llama_dir, data, out, **settings, resume="latest", keep_checkpoints=2))
    stop_after(branch, 8)  # two micro-batches a step: just after step 6's save
    with pytest.raises(TrainingStopped):
        branch.train()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-4", "checkpoint-6", "checkpoint-6-emergency", "checkpoint-8"]
    for step in (4, 6):
        assert json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())["run_id"] == branch.run_id


def test_overwrite_replaces_only_the_old_runs_checkpoints_and_tokenizer(llama_dir, uninterrupted, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    for name in ("checkpoint-8", "checkpoint-9-emergency", "final"):
        tiny_checkpoint(out, name, run_id="old")
    (out / "checkpoint-7").mkdir()  # a user's own, not mlxft's
    (out / "checkpoint-7" / "notes.txt").write_text("mine")
    (out / "tokenizer_config.json").write_text('{"chat_template": "OLD MODEL"}')
    (out / "special_tokens_map.json").write_text("{}")  # the old tokenizer's; this one writes none
    trainer = Trainer(config(llama_dir, uninterrupted[0], out, overwrite=True, max_steps=3, save_every=1,
                             keep_checkpoints=1, grad_accum_steps=1))
    trainer.train()
    assert sorted(p.name for p in out.iterdir() if p.is_dir() and not p.is_symlink()) == ["checkpoint-2", "checkpoint-7", "final"]
    assert (out / "checkpoint-7" / "notes.txt").read_text() == "mine"
    assert (out / "latest").resolve() == (out / "final").resolve()
    assert json.loads((out / "final" / "trainer_state.json").read_text())["run_id"] == trainer.run_id
    assert "OLD MODEL" not in (out / "tokenizer_config.json").read_text()
    assert not (out / "special_tokens_map.json").exists()


def test_a_run_stopped_before_its_first_step_does_not_block_the_same_command(tmp_path):
    # Ctrl-C during the baseline validation left metrics.jsonl with its record alone, and the
    # command run again was refused: "holds metrics.jsonl, which a run would overwrite".
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"type": "eval", "step": 0, "val_loss": 2.0}) + "\n"
                       + json.dumps({"type": "exact_match", "step": 0, "exact_match": 0.0}) + "\n")
    check_output_dir(tmp_path, overwrite=False)
    metrics.write_text("")
    check_output_dir(tmp_path, overwrite=False)
    for trained in ({"type": "train", "step": 1, "loss": 2.0}, {"type": "eval", "step": 4, "val_loss": 1.0}):
        metrics.write_text(json.dumps(trained) + "\n")
        with pytest.raises(UserError, match="holds metrics.jsonl, which a run would overwrite"):
            check_output_dir(tmp_path, overwrite=False)
    metrics.write_text('{"type": "ev')  # cannot tell: a run's
    with pytest.raises(UserError, match="holds metrics.jsonl"):
        check_output_dir(tmp_path, overwrite=False)


def test_the_output_dir_cannot_be_or_hold_the_model_or_starting_adapter(llama_dir, uninterrupted, tmp_path):
    # --overwrite into the model directory deleted its tokenizer files and rewrote others.
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    before = files(model)
    for out in (model, tmp_path):
        with pytest.raises(UserError, match=f"--output-dir {out} (is|contains) the model directory"):
            Trainer(config(model, uninterrupted[0], out, overwrite=True, max_steps=1))
    assert files(model) == before and not (model / "metrics.jsonl").exists()
    run = tmp_path / "run"
    Trainer(config(model, uninterrupted[0], run, max_steps=1)).train()
    continued = config(model, uninterrupted[0], run, overwrite=True, max_steps=1)
    continued.adapter.init_adapter = str(run)
    with pytest.raises(UserError, match="is the starting adapter"):
        Trainer(continued)
    Trainer(config(model, uninterrupted[0], model / "lora", max_steps=1))  # a run inside touches none of its files
    assert {name: data for name, data in files(model).items() if name.parts[0] != "lora"} == before


def test_resuming_past_the_runs_last_step_is_refused_and_keeps_final(llama_dir, uninterrupted, tmp_path):
    # It printed "step 4/2", trained nothing and saved the step-4 weights over `final`.
    out = tmp_path / "run"
    Trainer(config(llama_dir, uninterrupted[0], out, max_steps=6)).train()
    before = files(out)
    with pytest.raises(UserError, match="checkpoint is at step 4, past this run's 2 steps; raise --max-steps"):
        Trainer(config(llama_dir, uninterrupted[0], out, max_steps=2, resume=str(out / "checkpoint-4")))
    assert files(out) == before


def test_output_dir_with_files_a_run_writes_is_refused_unless_overwrite(tmp_path):
    check_output_dir(tmp_path / "new", overwrite=False)
    (tmp_path / "notes.txt").write_text("mine")
    check_output_dir(tmp_path, overwrite=False)
    for name in ("metrics.jsonl", "config.yaml", "checkpoint-1"):
        (tmp_path / name).write_text("mine")
        with pytest.raises(UserError, match=f"holds {name}, which a run would overwrite; choose another --output-dir"):
            check_output_dir(tmp_path, overwrite=False)
        check_output_dir(tmp_path, overwrite=True)  # see the next test for what a run then refuses
        (tmp_path / name).unlink()


def test_overwrite_replaces_checkpoints_but_not_a_users_directory_of_a_checkpoints_name(llama_dir, uninterrupted,
                                                                                          tmp_path):
    # --overwrite removed the earlier run's checkpoints only, and the final save then swapped a
    # user's own final/ (or a file named checkpoint-2, or latest) out and deleted it.
    run = tmp_path / "run"
    Trainer(config(llama_dir, uninterrupted[0], run, max_steps=2)).train()
    for name, make in (("final", "dir"), ("checkpoint-2", "file"), ("checkpoint-1-emergency", "dir"), ("latest", "dir")):
        mine = tmp_path / "mine" / name
        mine.mkdir(parents=True) if make == "dir" else mine.write_text("mine")
        if make == "dir":
            (mine / "notes.txt").write_text("mine")
        os.replace(run / name, tmp_path / "theirs") if (run / name).exists() or (run / name).is_symlink() else None
        os.replace(mine, run / name)
        before = files(run)
        with pytest.raises(UserError, match=f"holds {name}, which no mlxft run wrote and which this run would "
                                            "replace; move it away"):
            Trainer(config(llama_dir, uninterrupted[0], run, overwrite=True, max_steps=2))
        assert files(run) == before
        os.replace(run / name, mine)
        if (tmp_path / "theirs").exists() or (tmp_path / "theirs").is_symlink():
            os.replace(tmp_path / "theirs", run / name)
    # Refused before a model a script passed in changes (it was refused after LoRA went on).
    from mlx_lm import load
    from mlx_lm.tuner.lora import LoRALinear

    (run / "final").rename(tmp_path / "final")
    (run / "final").mkdir()
    model, tokenizer = load(str(llama_dir))
    with pytest.raises(UserError, match="holds final, which no mlxft run wrote"):
        Trainer(config(llama_dir, uninterrupted[0], run, overwrite=True, max_steps=2), model, tokenizer)
    assert not any(isinstance(m, LoRALinear) for _, m in model.named_modules())


def test_a_failed_swap_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    tiny_checkpoint(tmp_path, "final", step=2)
    before = files(tmp_path)
    real_replace, calls = os.replace, []

    def second_rename_fails(src, dst):
        calls.append(dst)
        if Path(dst) == tmp_path / "final" and calls.count(dst) == 1:  # the new directory into place, after
            raise OSError(errno.EIO, "Input/output error")  # the old one was moved aside (not the put-back)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", second_rename_fails)
    with pytest.raises(UserError, match="Input/output error"):
        tiny_checkpoint(tmp_path, "final", step=3)
    monkeypatch.undo()
    assert files(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["final", "latest"]
    assert checkpoint.resolve_checkpoint("latest", tmp_path) == (tmp_path / "final").resolve()


def test_mlx_write_failure_is_a_one_line_error_and_changes_nothing(tmp_path, monkeypatch):
    tiny_checkpoint(tmp_path, "checkpoint-2")
    before = files(tmp_path)

    def disk_full(*args, **kwargs):  # what MLX raises on a full disk
        raise RuntimeError("[write] Unable to write 4096 bytes to file.")

    monkeypatch.setattr(mx, "save_safetensors", disk_full)
    for save in (lambda: tiny_checkpoint(tmp_path, "checkpoint-2"), lambda: tiny_checkpoint(tmp_path, "checkpoint-4"),
                 lambda: checkpoint.save_adapters(tmp_path / "adapters.safetensors", nn.Linear(2, 2), {})):
        with pytest.raises(UserError, match=r"Unable to write 4096 bytes to file; free disk space"):
            save()
    assert files(tmp_path) == before and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_run_files_and_checkpoints_get_the_umask_modes(tmp_path):
    umask = os.umask(0o027)
    try:
        checkpoint.write_text(tmp_path / "config.yaml", "x")
        saved = tiny_checkpoint(tmp_path)
    finally:
        os.umask(umask)
    mode = lambda p: p.stat().st_mode & 0o777  # noqa: E731
    assert (mode(tmp_path / "config.yaml"), mode(saved), mode(saved / "adapters.safetensors")) == (0o640, 0o750, 0o640)


@pytest.mark.parametrize("name, content, message", [
    ("config.yaml", "", r"config.yaml is not a run config"),
    ("config.yaml", "model: 3\n", r"config.yaml is not a run config"),
    ("trainer_state.json", "null", r"trainer_state.json is not a JSON object"),
    ("trainer_state.json", '{"step": 2}', r"trainer_state.json has no 'epoch'"),
])
def test_a_damaged_checkpoint_state_is_a_one_line_error(tmp_path, name, content, message):
    path = tiny_checkpoint(tmp_path)
    checkpoint.load_checkpoint(path)
    (path / name).write_text(content)
    with pytest.raises(UserError, match=message + ".*resume from an earlier one"):
        checkpoint.load_checkpoint(path)


@pytest.mark.parametrize("field, message", [
    ({"step": "2"}, r"has no valid 'step' \(a count, got '2'\)"),
    ({"batch_index": None}, r"has no valid 'batch_index'"),
    ({"epoch": True}, r"has no valid 'epoch'"),
    ({"skipped_steps": -1}, r"has no valid 'skipped_steps'"),
    ({"best_val_loss": "low"}, r"has no valid 'best_val_loss' \(a number or null"),
    ({"loss_scaler": {"enabled": True, "scale": "x", "good_steps": 0}}, r"has no valid 'loss_scaler'"),
])
def test_a_wrongly_typed_checkpoint_field_is_a_one_line_error(tmp_path, field, message):
    # Hand-edited: every field there, one of the wrong type (it would fail later with a traceback).
    path = tiny_checkpoint(tmp_path)
    state = json.loads((path / "trainer_state.json").read_text())
    (path / "trainer_state.json").write_text(json.dumps({**state, **field}))
    with pytest.raises(UserError, match="trainer_state.json " + message + ".*resume from an earlier one"):
        checkpoint.load_checkpoint(path)


def test_resume_refuses_another_optimizer_even_with_force():
    saved, current = RunConfig().to_dict(), RunConfig().to_dict()
    saved["optim"]["optimizer"], current["optim"]["optimizer"] = "sgd", "adamw"
    with pytest.raises(UserError, match=r"optim.optimizer is 'adamw' but the checkpoint was trained with 'sgd'$"):
        checkpoint.check_resume(saved, current, "chat", "chat", force=True)


def test_a_signal_during_the_final_validation_still_saves_the_run(llama_dir, tmp_path):
    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", CHAT_ROWS[:4])
    write_jsonl(data / "valid.jsonl", CHAT_ROWS[:6])  # three validation batches
    out = tmp_path / "run"
    # eval_every=2: the last step's validation is the one at the cadence, which a resume skipped.
    trainer = Trainer(config(llama_dir, data, out, max_steps=2, save_every=0, grad_accum_steps=1, memory_estimate=False,
                             eval_every=2))
    original, final_batches = trainer.batch, []

    def batch(dataset, indices):
        if dataset is trainer.valid_set and trainer.step_count == trainer.total_steps:
            final_batches.append(indices)
            if len(final_batches) == 2:
                handler = signal.getsignal(signal.SIGTERM)
                assert handler == trainer.stop._handle, "SIGTERM is not handled during the final validation"
                handler(signal.SIGTERM, None)  # as the signal would, in the main thread
        return original(dataset, indices)

    trainer.batch = batch
    with pytest.raises(TrainingStopped, match="stopped by SIGTERM") as stopped:
        trainer.train()
    assert stopped.value.exit_code == 128 + signal.SIGTERM and stopped.value.checkpoint == out / "final"
    assert len(final_batches) == 2  # the rest of the validation was skipped
    assert json.loads((out / "final" / "trainer_state.json").read_text())["step"] == 2
    assert json.loads((out / "training_state.json").read_text())["step"] == 2
    # Resumed, it trains nothing, but validates: it used to skip the step's validation as run,
    # and report the previous one's loss as the final.
    resumed = Trainer(config(llama_dir, data, out, max_steps=2, save_every=0, grad_accum_steps=1,
                             memory_estimate=False, eval_every=2, resume="latest"))
    result = resumed.train()
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r["type"] == "eval"]
    assert evals[-1]["step"] == 2 and result.val_loss == evals[-1]["val_loss"] == pytest.approx(resumed.evaluate()[0])


def test_a_save_request_after_the_last_step_is_answered_not_promised(llama_dir, tmp_path, capfd):
    # The loop's save handler covered the final validation and save too: it promised a
    # checkpoint after the current step, again and again, and none came but final.
    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", CHAT_ROWS[:4])
    write_jsonl(data / "valid.jsonl", CHAT_ROWS[:4])
    out = tmp_path / "run"
    trainer = Trainer(config(llama_dir, data, out, max_steps=2, save_every=0, grad_accum_steps=1, memory_estimate=False))
    original = trainer.batch

    def batch(dataset, indices):
        if dataset is trainer.valid_set and trainer.step_count == trainer.total_steps:
            signal.getsignal(signal.SIGUSR1)(signal.SIGUSR1, None)  # as the signal would, in the main thread
        return original(dataset, indices)

    trainer.batch = batch
    trainer.train()
    err = capfd.readouterr().err  # the handler writes to the file descriptor
    assert "SIGUSR1: no training steps are running now" in err and "saving a checkpoint" not in err
    assert not list(out.glob("checkpoint-*"))


def test_sigusr1_as_the_command_ends_does_not_kill_it(llama_dir, uninterrupted, tmp_path):
    # Python's shutdown puts a Python signal handler back to the default, which for SIGUSR1
    # ends the process: exit code 138 after a run that had saved everything.
    proc = cli("--model", llama_dir, "--data", uninterrupted[0], "--output-dir", tmp_path / "run", "--max-steps", 1)
    wait_for(proc, "done: ")
    while proc.poll() is None:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.02)
    assert proc.returncode == 0, proc.stderr.read()


@pytest.mark.parametrize("accum, save_every, limit, saved_at", [
    (2, 2, 2, 2),  # the limit is reached on a step read before the next micro-batch is queued
    (1, 0, 1, 2),  # reached on a step read late: the step queued behind it is in the checkpoint too
])
def test_non_finite_streak_stops_with_an_emergency_checkpoint(llama_dir, uninterrupted, tmp_path, accum, save_every,
                                                               limit, saved_at):
    cfg = config(llama_dir, uninterrupted[0], tmp_path / "run", grad_accum_steps=accum, save_every=save_every)
    cfg.optim.max_nonfinite_steps = limit
    trainer = Trainer(cfg)
    original = trainer.step

    def poisoned(batch, window, update, scale):
        result, window = original(batch, window, update, scale)
        if update:
            result.applied = mx.array(False)
        return result, window

    poisoned.state = original.state
    trainer.step = poisoned
    with pytest.raises(TrainingStopped, match=f"not finite for {limit} steps in a row") as stopped:
        trainer.train()
    assert stopped.value.exit_code == 1 and stopped.value.checkpoint.name == f"checkpoint-{saved_at}-emergency"
    state = json.loads((stopped.value.checkpoint / "trainer_state.json").read_text())
    # The checkpoint describes every step its weights went through.
    assert state["step"] == trainer.optimizer.state["step"].item() == state["skipped_steps"] == saved_at
    assert trainer.skipped_steps == saved_at
    # The resumed run starts after them, so every step the checkpoint holds is in the log.
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "train"] == list(range(1, saved_at + 1))
    # Each record's time is its own steps' (a step queued behind the stopping one had 0.5 ms, at 100x the rate).
    assert all(r["seconds"] > 0.01 for r in records if r["type"] == "train")


def test_float16_counts_only_steps_that_fail_at_the_loss_scales_floor(llama_dir, uninterrupted, tmp_path):
    # The streak counted the overflows that halve the scale, and stopped as the scale reached
    # 1, without one step run at 1: from 2**15, after 15 steps for a limit of 3.
    cfg = config(llama_dir, uninterrupted[0], tmp_path / "run", grad_accum_steps=1, save_every=0, memory_estimate=False)
    cfg.model.dtype, cfg.optim.max_nonfinite_steps = "float16", 3
    trainer = Trainer(cfg)
    trainer.scaler.scale, trainer.scaler._array = 4.0, mx.array(4.0)
    original, scales = trainer.step, []

    def overflowing(batch, window, update, scale):
        scales.append(scale.item())
        result, window = original(batch, window, update, scale)
        result.applied = mx.array(False)
        return result, window

    overflowing.state = original.state
    trainer.step = overflowing
    with pytest.raises(TrainingStopped, match="not finite for 3 steps in a row at the loss scale's floor of 1 "
                                              r"\(step 5\)"):
        trainer.train()
    assert scales == [4.0, 2.0, 1.0, 1.0, 1.0] and trainer.skipped_steps == 5


def test_a_half_precision_window_from_an_older_checkpoint_resumes_in_float32(llama_dir, uninterrupted, tmp_path):
    """mlxft once saved a float16 run's open window in float16; now it sums gradients in float32.
    Such a checkpoint resumes with its window widened as it was saved, and trains to the end."""
    def cfg(**train):
        c = config(llama_dir, uninterrupted[0], tmp_path / "run", memory_estimate=False, max_steps=2, **train)
        c.model.dtype, c.adapter.finetune, c.adapter.dropout, c.adapter.num_layers = "float16", "full", 0.0, 1
        return c

    first = Trainer(cfg())
    stop_after(first, 1)
    with pytest.raises(TrainingStopped) as stopped:
        first.train()
    window_file = stopped.value.checkpoint / "window.safetensors"
    saved = mx.load(str(window_file))
    assert {v.dtype for v in saved.values()} == {mx.float32}
    old = {k: v if k.startswith("mlxft.") else v.astype(mx.float16) for k, v in saved.items()}
    mx.save_safetensors(str(window_file), old)
    resumed = Trainer(cfg(resume="latest"))
    restored = dict(tree_flatten(gradient_tree(resumed.window[0], resumed.layout)))
    assert set(restored) == {k for k in old if not k.startswith("mlxft.")}
    for name, value in restored.items():
        assert value.dtype == mx.float32, name
        np.testing.assert_array_equal(np.array(value), np.array(old[name].astype(mx.float32)), err_msg=name)
    resumed.train()
    assert resumed.step_count == resumed.total_steps and np.isfinite(resumed.reporter.last_train_loss)


def test_loss_scaler_backs_off_grows_and_is_checkpointed(llama_dir, uninterrupted, tmp_path):
    scaler = LossScaler(enabled=True, scale=1024.0, growth_interval=2)
    scaler.update(False)
    assert scaler.scale == 512.0
    scaler.update(True), scaler.update(True)
    assert scaler.scale == 1024.0 and scaler.array.item() == 1024.0
    assert LossScaler(enabled=False).scale == 1.0

    # No memory estimate: its probes are not under test, and float16 matmuls are slow on the CPU.
    cfg = config(llama_dir, uninterrupted[0], tmp_path / "run", max_steps=1, memory_estimate=False)
    cfg.model.dtype = "float16"
    trainer = Trainer(cfg)
    assert trainer.scaler.enabled
    trainer.train()
    state = json.loads((tmp_path / "run" / "final" / "trainer_state.json").read_text())
    assert state["loss_scaler"]["enabled"] and state["loss_scaler"]["scale"] > 1


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_adapter_files_load_in_any_float_dtype(llama_dir, uninterrupted, tmp_path, dtype):
    trainer = Trainer(config(llama_dir, uninterrupted[0], tmp_path / "run", max_steps=1))
    saved = {k: v.astype(dtype) for k, v in tree_flatten(trainer.model.trainable_parameters())}
    path = tmp_path / "a.safetensors"
    mx.save_safetensors(str(path), saved)
    fresh = Trainer(config(llama_dir, uninterrupted[0], tmp_path / "run2", max_steps=1, seed=5))
    loaded, _ = checkpoint.load_adapter_weights(path)
    checkpoint.apply_adapter_weights(fresh.model, loaded, str(path))
    for k, v in tree_flatten(fresh.model.trainable_parameters()):
        assert v.dtype == mx.float32
        np.testing.assert_array_equal(np.array(v), np.array(saved[k].astype(mx.float32)))


def test_mismatched_adapter_changes_nothing(llama_dir, uninterrupted, tmp_path):
    trainer = Trainer(config(llama_dir, uninterrupted[0], tmp_path / "run", max_steps=1))
    before = weights(trainer.model)
    good = dict(tree_flatten(trainer.model.trainable_parameters()))
    names = sorted(good)
    bad = {k: mx.ones(v.shape) for k, v in good.items()}
    bad[names[-1]] = mx.ones((3, 3))  # one wrong shape, after many good tensors
    with pytest.raises(UserError, match=rf"tensor {names[-1]} has shape \(3, 3\)"):
        checkpoint.apply_adapter_weights(trainer.model, bad, "other.safetensors")
    del bad[names[-1]]
    with pytest.raises(UserError, match="no tensor for parameter"):
        checkpoint.apply_adapter_weights(trainer.model, bad, "other.safetensors")
    after = weights(trainer.model)
    assert all(np.array_equal(after[k], before[k]) for k in before)


def test_full_disk_during_a_save_keeps_earlier_checkpoints(llama_dir, uninterrupted, tmp_path, monkeypatch):
    out = tmp_path / "run"
    trainer = Trainer(config(llama_dir, uninterrupted[0], out, max_steps=2, save_every=0))
    trainer.train()
    snapshot = files(out)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mx, "save_safetensors", disk_full)
    with pytest.raises(UserError, match="No space left on device"):
        trainer.save_checkpoint("step")
    with pytest.raises(UserError, match="No space left on device"):
        trainer.save()
    assert files(out) == snapshot
    assert not [p for p in out.iterdir() if p.name.startswith(".") and p.name != ".mlxft.lock"]

    # A disk with no room for even the temporary directory (out of inodes) is the same error.
    monkeypatch.undo()
    monkeypatch.setattr(tempfile, "mkdtemp", disk_full)
    monkeypatch.setattr(tempfile, "TemporaryDirectory", disk_full)
    with pytest.raises(UserError, match="No space left on device"):
        trainer.save_checkpoint("emergency")
    with pytest.raises(UserError, match="No space left on device"):
        checkpoint.save_tokenizer(out, trainer.tokenizer)
    assert files(out) == snapshot


# ----------------------------------------------------------------------------- processes


def cli(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "mlxft.train", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, **kwargs)


def long_run_args(llama_dir, data, out):
    return ["--model", llama_dir, "--data", data, "--output-dir", out, "--batch-size", 2, "--epochs", 200,
            "--save-every", 1, "--keep-checkpoints", 2, "--log-every", 1]


def wait_for(proc, text, timeout=120):
    """Read the run's output up to a line that starts with ``text`` (the pid line mentions checkpoints)."""
    deadline = time.time() + timeout
    for line in proc.stdout:
        if line.startswith(text):
            return
        if time.time() > deadline:
            break
    raise AssertionError(f"never saw {text!r}")


def test_sigterm_saves_an_emergency_checkpoint_and_resume_finishes(llama_dir, uninterrupted, tmp_path):
    out = tmp_path / "run"
    proc = cli(*long_run_args(llama_dir, uninterrupted[0], out))
    wait_for(proc, "step 3/")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err and f"continue with --resume {out / 'latest'}" in err
    latest = (out / "latest").resolve()
    assert latest.name.endswith("-emergency")
    state = json.loads((latest / "trainer_state.json").read_text())
    args = long_run_args(llama_dir, uninterrupted[0], out) + ["--resume", "latest", "--max-steps", state["step"] + 2]
    resumed = subprocess.run([sys.executable, "-m", "mlxft.train", *map(str, args)],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {latest}" in resumed.stdout
    assert json.loads((out / "training_state.json").read_text())["step"] == state["step"] + 2


def test_sigusr1_saves_a_checkpoint_and_the_run_trains_on(llama_dir, uninterrupted, tmp_path):
    out = tmp_path / "run"
    proc = cli(*long_run_args(llama_dir, uninterrupted[0], out), "--save-every", 1000)
    pid_line = next(line for line in proc.stdout if line.startswith("pid "))
    assert f"kill -USR1 {proc.pid} saves a checkpoint" in pid_line
    wait_for(proc, "step 2/")
    proc.send_signal(signal.SIGUSR1)
    wait_for(proc, "checkpoint ")
    wait_for(proc, "step 5/")  # still training
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGUSR1: saving a checkpoint after the current step; training goes on" in err
    (requested,) = [p for p in out.glob("checkpoint-*") if not p.name.endswith("-emergency")]
    assert json.loads((requested / "trainer_state.json").read_text())["step"] >= 2
    assert (out / "adapters.safetensors").exists()  # the run directory's own files, as a periodic save writes


@pytest.mark.parametrize("cause", ["SIGHUP", "closed stdout"])
def test_a_closed_terminal_or_pipe_stops_with_an_emergency_checkpoint(llama_dir, uninterrupted, tmp_path, cause):
    # Both used to end the run with nothing saved since the last checkpoint: SIGHUP (a dropped
    # SSH session) killed it, and a closed pipe (`| head`) raised at the next progress line.
    out = tmp_path / "run"
    # As from a terminal: under nohup (a CI job may run so) SIGHUP is ignored, and stays so.
    proc = cli(*long_run_args(llama_dir, uninterrupted[0], out), "--save-every", 1000,
               preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    wait_for(proc, "step 2/")
    if cause == "SIGHUP":
        proc.send_signal(signal.SIGHUP)
        proc.stdout.read()
        code, reason = 128 + signal.SIGHUP, "SIGHUP"
    else:
        proc.stdout.close()
        code, reason = 128 + signal.SIGPIPE, "a closed standard output"
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == code, err
    assert f"stopped by {reason} at step" in err and f"--resume {out / 'latest'}" in err and "Traceback" not in err, err
    assert (out / "latest").resolve().name.endswith("-emergency")


def test_a_lost_progress_stream_stops_and_the_resumed_run_equals_an_uninterrupted_one(llama_dir, uninterrupted,
                                                                                       tmp_path):
    data, expected, expected_steps = uninterrupted
    out = tmp_path / "run"

    class Gone:  # a pipe whose reader leaves after the first two lines
        writes = 0

        def write(self, text):
            self.writes += 1
            if self.writes > 2:
                raise BrokenPipeError(errno.EPIPE, "Broken pipe")

        def flush(self):
            pass

    first = Trainer(config(llama_dir, data, out))
    first.reporter.stream = Gone()
    with pytest.raises(TrainingStopped, match="stopped by a closed standard output") as stopped:
        first.train()
    assert stopped.value.exit_code == 128 + signal.SIGPIPE and stopped.value.checkpoint.name.endswith("-emergency")
    assert first.step_count < 6
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["type"] == "train"] == list(range(1, first.step_count + 1))  # still recorded
    resumed = Trainer(config(llama_dir, data, out, resume="latest"))
    resumed.train()
    assert resumed.optimizer.state["step"].item() == expected_steps
    for name, value in weights(resumed.model).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_a_run_started_under_nohup_outlives_the_terminal():
    # SIGHUP stops a run with a checkpoint, but one started under nohup (SIGHUP ignored) was
    # stopped all the same at logout: the handler replaced the ignore.
    code = ("import os, signal, time\nsignal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
            "from mlxft.signals import StopRequests\nwith StopRequests() as stop:\n"
            "    os.kill(os.getpid(), signal.SIGHUP)\n    time.sleep(0.2)\n    print(stop.requested)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "False\n", proc.stderr


def test_sigusr1_outside_a_training_loop_is_answered_not_fatal():
    # SIGUSR1's default action ends the process: sent while the model loads, it killed the run.
    code = ("import os, signal, time\nfrom mlxft import signals\nsignals.hold_save_requests()\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\ntime.sleep(0.2)\n"
            "with signals.StopRequests() as stop:\n"  # a stop block outside the loop: answered, not kept
            "    os.kill(os.getpid(), signal.SIGUSR1)\n    time.sleep(0.2)\n    print(stop.save_requested)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "False\n", proc.stderr
    assert proc.stderr.count("nothing to save") == 2, proc.stderr


def test_a_request_from_code_does_not_make_the_first_signal_a_second():
    code = (
        "import os, signal, time\n"
        "from mlxft.signals import StopRequests\n"
        "with StopRequests() as stop:\n"
        "    stop.request(signal.SIGPIPE, 'a closed standard output')\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.2)\n"
        "    print(stop.name, flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "SIGINT\n", proc.stderr


def test_a_refused_resume_leaves_a_model_passed_in_untouched(llama_dir, uninterrupted, tmp_path):
    # The checkpoint was checked after LoRA went on: the caller's model kept the layers, and
    # the corrected call was then refused for holding adapters already.
    from mlx_lm import load
    from mlx_lm.tuner.lora import LoRALinear

    out = tmp_path / "run"
    Trainer(config(llama_dir, uninterrupted[0], out, max_steps=4)).train()
    model, tokenizer = load(str(llama_dir))
    for changes, message in (({"rank": 4}, "adapter.rank is 4"), ({"max_steps": 2}, "past this run's 2 steps")):
        cfg = config(llama_dir, uninterrupted[0], out, resume=str(out / "final"))
        for name, value in changes.items():
            setattr(cfg.adapter if name == "rank" else cfg.train, name, value)
        with pytest.raises(UserError, match=message):
            Trainer(cfg, model, tokenizer)
        assert not any(isinstance(m, LoRALinear) for _, m in model.named_modules())
    with pytest.raises(UserError, match="model.quantize is 4, but the model passed in is not quantized"):
        cfg = config(llama_dir, uninterrupted[0], tmp_path / "q", max_steps=1)
        cfg.model.quantize = 4
        Trainer(cfg, model, tokenizer)


def test_a_checkpoint_computed_in_another_dtype_is_refused_unless_forced(llama_dir, uninterrupted, tmp_path):
    # model.dtype "auto" is bfloat16 on a GPU and float32 on a CPU: the same string resumed a
    # GPU checkpoint in float32 (and a full fine-tune's float32 masters were dropped).
    out = tmp_path / "run"
    Trainer(config(llama_dir, uninterrupted[0], out, max_steps=4)).train()
    state_file = out / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["compute_dtype"] == "float32"
    state_file.write_text(json.dumps({**state, "compute_dtype": "bfloat16"}))  # as a GPU run saves it
    with pytest.raises(UserError, match="the compute dtype \\(model.dtype\\) is 'float32' but the checkpoint was "
                                        "trained with 'bfloat16' \\(pass --force"):
        Trainer(config(llama_dir, uninterrupted[0], out, resume=str(out / "checkpoint-2")))
    Trainer(config(llama_dir, uninterrupted[0], out, resume=str(out / "checkpoint-2"), force=True))


def test_a_run_from_a_starting_adapter_resumes_from_anywhere_once_the_adapter_is_gone(llama_dir, uninterrupted,
                                                                                      tmp_path):
    # init_adapter was recorded as typed and read again on resume, though the checkpoint holds
    # the weights: from another directory, or with the adapter moved, the resume failed.
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    common = ["--model", llama_dir, "--data", uninterrupted[0], "--batch-size", 2, "--exact-match-rows", 0,
              "--no-memory-estimate"]
    run = lambda *args, cwd: subprocess.run([sys.executable, "-m", "mlxft.train", *map(str, args)], cwd=cwd,
                                            capture_output=True, text=True, timeout=300)
    first = run(*common, "--output-dir", "A", "--max-steps", 1, "--rank", 4, cwd=work)
    assert first.returncode == 0, first.stderr
    second = run(*common, "--output-dir", "B", "--init-adapter", "A", "--max-steps", 4, "--save-every", 2, cwd=work)
    assert second.returncode == 0, second.stderr
    saved = yaml.safe_load((work / "B" / "checkpoint-2" / "config.yaml").read_text())
    assert saved["adapter"]["init_adapter"] == str(work / "A") and saved["adapter"]["rank"] == 4
    shutil.rmtree(work / "A")
    resumed = run("--resume", work / "B" / "checkpoint-2", cwd=elsewhere)
    assert resumed.returncode == 0, resumed.stderr
    again = run(*common, "--output-dir", "B", "--init-adapter", "A", "--max-steps", 4, "--resume",
                "B/checkpoint-2", cwd=work)  # the original command: the layout comes from the checkpoint
    assert again.returncode == 0, again.stderr


def test_steps_not_yet_logged_at_a_checkpoint_are_logged_by_the_resumed_run(llama_dir, uninterrupted, tmp_path):
    # The reporter's running window was not saved: resumed from checkpoint-2 with --log-every 3,
    # the step-3 record held step 3's loss alone and steps 1-2 appeared in no record.
    out = tmp_path / "run"
    settings = dict(max_steps=3, save_every=1, log_every=3, grad_accum_steps=1)
    Trainer(config(llama_dir, uninterrupted[0], out, **settings)).train()
    train_records = lambda: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                             if json.loads(line)["type"] == "train"]
    (expected,) = train_records()
    Trainer(config(llama_dir, uninterrupted[0], out, resume=str(out / "checkpoint-2"), **settings)).train()
    (got,) = train_records()
    assert got["step"] == 3 and got["loss"] == pytest.approx(expected["loss"], rel=1e-6)


def test_a_run_stopped_at_step_0_is_resumed_without_a_second_baseline(llama_dir, uninterrupted, tmp_path):
    # `| head` now stops a run before its first step with a checkpoint: resumed, it validated its
    # baseline again, and metrics.jsonl held two step-0 records.
    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", CHAT_ROWS[:8])
    write_jsonl(data / "valid.jsonl", CHAT_ROWS[:3])
    out = tmp_path / "run"
    # The exact-match baseline too (generated again and recorded twice).
    first = Trainer(config(llama_dir, data, out, max_steps=2, exact_match_rows=1))
    first.stop.request(signal.SIGTERM)
    with pytest.raises(TrainingStopped):
        first.train()
    assert (out / "latest").resolve().name == "checkpoint-0-emergency"
    elsewhere = tmp_path / "elsewhere"  # started from it in a new directory: that one has no baseline yet
    Trainer(config(llama_dir, data, elsewhere, max_steps=2, exact_match_rows=1,
                   resume=str(out / "checkpoint-0-emergency"))).train()
    Trainer(config(llama_dir, data, out, max_steps=2, exact_match_rows=1, resume="latest")).train()
    for run in (out, elsewhere):
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["type"] == "eval"] == [0, 2], run
        assert [r["step"] for r in records if r["type"] == "exact_match"] == [0, 2], run


def test_a_resumed_run_keeps_its_exact_match_baseline_from_step_0(llama_dir, tmp_path):
    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", CHAT_ROWS)
    write_jsonl(data / "valid.jsonl", CHAT_ROWS[:3])
    out = tmp_path / "run"
    first = Trainer(config(llama_dir, data, out, exact_match_rows=2, epochs=1))
    stop_after(first, 4)
    with pytest.raises(TrainingStopped):
        first.train()
    result = Trainer(config(llama_dir, data, out, exact_match_rows=2, epochs=1, resume="latest")).train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "exact_match"] == [0, result.steps]
    assert [r["step"] for r in records if r["type"] == "eval"][0] == 0
    assert result.exact_match_before is None and result.exact_match_after is not None


def test_sigkill_during_saves_leaves_a_loadable_checkpoint(llama_dir, uninterrupted, tmp_path):
    out = tmp_path / "run"
    for delay in (0.0, 0.13, 0.31):
        proc = cli(*long_run_args(llama_dir, uninterrupted[0], out), *(["--resume", "latest"] if (out / "latest").exists() else []))
        wait_for(proc, "checkpoint ")
        time.sleep(delay)
        proc.kill()
        proc.communicate(timeout=60)
        for path in [p for p in out.iterdir() if p.name.startswith("checkpoint-")] + [out / "latest"]:
            checkpoint.load_checkpoint(path.resolve())  # every visible checkpoint is complete
        if (out / "training_state.json").exists():  # the run's own files follow the checkpoint
            json.loads((out / "training_state.json").read_text())
    assert (out / "latest").resolve().exists()


def test_corrupt_checkpoint_and_model_are_one_line_errors(llama_dir, uninterrupted, tmp_path):
    out = tmp_path / "run"
    Trainer(config(llama_dir, uninterrupted[0], out, max_steps=2)).train()
    adapters = out / "final" / "adapters.safetensors"
    adapters.write_bytes(adapters.read_bytes()[: adapters.stat().st_size // 2])
    snapshot = files(out)
    proc = subprocess.run([sys.executable, "-m", "mlxft.train", "--model", llama_dir, "--data", uninterrupted[0],
                           "--output-dir", out, "--resume", out / "final"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "may be truncated" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert files(out) == snapshot

    broken = tmp_path / "model"
    broken.mkdir()
    for f in Path(llama_dir).iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights_file = broken / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])
    proc = subprocess.run([sys.executable, "-m", "mlxft.train", "--model", broken, "--data", uninterrupted[0],
                           "--output-dir", tmp_path / "new"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "cannot load model" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "a", "completion": "b"}\n{"prompt": \n', "line 2: invalid JSON"),
        ('{"prompt": "a"}\n', "line 1: missing field 'completion'"),
        ('{"prompt": 3, "completion": "b"}\n', "line 1: field 'prompt' must be a string"),
        ("", "holds no rows"),
        ('{"messages": [{"role": "user", "content": "only a question"}]}\n', "no row has a supervised token"),
    ],
)
def test_bad_data_leaves_an_existing_run_byte_identical(llama_dir, uninterrupted, tmp_path, content, message):
    out = tmp_path / "run"
    Trainer(config(llama_dir, uninterrupted[0], out, max_steps=1)).train()
    snapshot = files(out)
    bad = tmp_path / "bad" / "train.jsonl"
    bad.parent.mkdir()
    bad.write_text(content)
    for extra in (["--overwrite"], ["--resume", "latest"]):
        proc = subprocess.run([sys.executable, "-m", "mlxft.train", "--model", llama_dir, "--data", bad.parent,
                               "--output-dir", out, *extra], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
        assert files(out) == snapshot


def test_a_second_signal_exits_at_once():
    code = (
        "import os, signal, time\n"
        "from mlxft.signals import StopRequests\n"
        "with StopRequests() as stop:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.2)\n"
        "    assert stop.requested and stop.name == 'SIGINT'\n"
        "    print('first signal recorded', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(5)\n"
        "    print('still running')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGINT
    assert "first signal recorded" in proc.stdout and "still running" not in proc.stdout
    # Each is answered at once on stderr: a save can take seconds, and a silent wait was taken
    # for a hang and answered with the second signal, which loses the unsaved work.
    assert "SIGINT: stopping; a run saves what it has trained first (SIGINT again exits at once, unsaved)" in proc.stderr
    assert "SIGINT again: exiting at once; what was trained since the last checkpoint is not saved" in proc.stderr


def test_what_killed_saves_left_is_removed_and_nothing_else(tmp_path):
    tiny_checkpoint(tmp_path, "checkpoint-2")
    leftovers = [".checkpoint-4.k2j3h_x1.tmp", ".checkpoint-5-emergency.abc.tmp", ".final.q1w2.tmp", ".tokenizer.a8s7d6",
                 ".latest.4242.tmp", ".training_state.json.zx9.tmp.json", ".metrics.jsonl.u7.tmp.jsonl", ".adapters.safetensors.p0o9.tmp.safetensors"]
    for name in leftovers:
        (tmp_path / name).mkdir() if name.startswith((".checkpoint", ".final", ".tokenizer")) else (tmp_path / name).write_text("x")
    (tmp_path / ".checkpoint-4.k2j3h_x1.tmp" / "adapters.safetensors").write_text("half written")
    keep = [".final.m3n4.old", ".notes.tmp", "notes.txt"]  # an old checkpoint moved aside; the user's own
    for name in keep:
        (tmp_path / name).mkdir() if name.endswith(".old") else (tmp_path / name).write_text("mine")
    before = files(tmp_path / "checkpoint-2")
    assert sorted(p.name for p in checkpoint.remove_partial_saves(tmp_path)) == sorted(leftovers)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep + ["checkpoint-2", "latest"])
    assert files(tmp_path / "checkpoint-2") == before


def test_pruning_hides_a_checkpoint_before_deleting_it(tmp_path, monkeypatch):
    for step in (2, 4):
        tiny_checkpoint(tmp_path, f"checkpoint-{step}", step=step)
    seen = []

    def killed_while_deleting(path, ignore_errors=False):  # what a SIGKILL mid-rmtree leaves
        seen.append(Path(path).name)
        (Path(path) / "adapters.safetensors").unlink()

    monkeypatch.setattr(shutil, "rmtree", killed_while_deleting)
    checkpoint.prune_checkpoints(tmp_path, keep=1, run_id="run-a", step=4)
    monkeypatch.undo()
    assert seen == [f".checkpoint-2.{os.getpid()}.deleted.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["checkpoint-4", "latest"]
    assert [p.name for p in checkpoint.remove_partial_saves(tmp_path)] == seen


def test_sigkill_while_re_saving_the_checkpoint_latest_names_leaves_latest_complete(tmp_path):
    # latest -> checkpoint-3-emergency, which is saved again (a resumed run stopped again inside
    # the same window; likewise final after a resume). SIGKILL between the swap's two renames.
    tiny_checkpoint(tmp_path, "checkpoint-3-emergency", step=3)
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from test_resume import tiny_checkpoint
        run = Path({str(tmp_path)!r})
        real = os.replace
        def replace(src, dst):
            if Path(dst) == run / "checkpoint-3-emergency":  # the new one into place, the old one aside
                os.kill(os.getpid(), signal.SIGKILL)
            return real(src, dst)
        os.replace = replace
        tiny_checkpoint(run, "checkpoint-3-emergency", step=3)
    """)
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
    hidden = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".old"))
    assert len(hidden) == 2 and not (tmp_path / "checkpoint-3-emergency").exists()  # the held copy and the moved one
    assert checkpoint.load_checkpoint(checkpoint.resolve_checkpoint("latest", tmp_path))["state"]["step"] == 3
    # What the next run does first: the checkpoint is back under its name, latest names it, nothing is hidden.
    assert checkpoint.recover_swaps(tmp_path) == ["checkpoint-3-emergency"]
    checkpoint.remove_partial_saves(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3-emergency", "latest"]
    assert checkpoint.resolve_checkpoint("latest", tmp_path) == (tmp_path / "checkpoint-3-emergency").resolve()
    assert checkpoint.load_checkpoint(tmp_path / "checkpoint-3-emergency")["state"]["step"] == 3


def test_a_kill_after_the_swap_leaves_latest_pointed_at_the_new_checkpoint_by_the_next_run(tmp_path):
    tiny_checkpoint(tmp_path, "final", step=3)
    held = checkpoint._hold_latest(tmp_path, tmp_path / "final")  # what save_checkpoint does, up to the kill:
    (tmp_path / "elsewhere").mkdir()
    new = tiny_checkpoint(tmp_path / "elsewhere", "final", step=4)
    checkpoint.replace_directory(new, tmp_path / "final")  # the new one is in place, latest still names the copy
    assert (tmp_path / "latest").resolve() == held.resolve()
    assert checkpoint.recover_swaps(tmp_path) == []
    assert checkpoint.resolve_checkpoint("latest", tmp_path) == (tmp_path / "final").resolve()
    assert checkpoint.load_checkpoint(tmp_path / "final")["state"]["step"] == 4
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".old")]


def test_a_kill_between_the_final_checkpoint_and_the_run_files_leaves_a_run_that_resumes(llama_dir, uninterrupted,
                                                                                        tmp_path, monkeypatch):
    class Killed(BaseException):
        pass

    def killed(self, progress):
        raise Killed

    out = tmp_path / "run"
    monkeypatch.setattr(Trainer, "_write_run_files", killed)
    with pytest.raises(Killed):
        Trainer(config(llama_dir, uninterrupted[0], out, max_steps=2, save_every=0)).train()
    monkeypatch.undo()
    assert not (out / "adapters.safetensors").exists()
    assert checkpoint.resolve_checkpoint("latest", out) == (out / "final").resolve()
    result = Trainer(config(llama_dir, uninterrupted[0], out, max_steps=2, save_every=0, resume="latest")).train()
    assert result.steps == 2 and (out / "adapters.safetensors").is_file() and (out / "training_state.json").is_file()


def test_a_checkpoint_of_another_dtype_leaves_the_loss_scaler_as_it_starts():
    on, off = LossScaler(enabled=True), LossScaler(enabled=False)
    on.load({"enabled": False, "scale": 1.0, "good_steps": 0})  # a float32 checkpoint, resumed in float16
    off.load({"enabled": True, "scale": 32768.0, "good_steps": 7})  # a float16 checkpoint, resumed in bf16/fp32
    assert (on.scale, on.array.item()) == (2.0**15, 2.0**15)
    assert (off.scale, off.array.item(), off.good_steps) == (1.0, 1.0, 0)
    same = LossScaler(enabled=True)
    same.load({"enabled": True, "scale": 512.0, "good_steps": 3})
    assert (same.scale, same.good_steps) == (512.0, 3)


@pytest.mark.parametrize("name", ["trainer_state.json", "config.yaml"])
def test_a_checkpoint_file_that_is_not_utf8_is_a_one_line_error(tmp_path, name):
    path = tiny_checkpoint(tmp_path)
    (path / name).write_bytes(b"\xff\xfe{}")
    with pytest.raises(UserError, match=f"checkpoint {path} is unreadable"):
        checkpoint.load_checkpoint(path)


def _hold_in_another_process(run_dir):
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from mlxft import runlock; runlock.acquire(sys.argv[1]); "
                               "print('held', flush=True); sys.stdin.read()", str(run_dir)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def _free_for_another_process(run_dir) -> bool:
    code = "import sys; from mlxft import runlock; runlock.acquire(sys.argv[1])"
    return subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True).returncode == 0


def test_a_directory_in_use_refuses_before_a_model_passed_in_changes(llama_dir, uninterrupted, tmp_path):
    from mlx_lm import load
    from mlx_lm.tuner.lora import LoRALinear

    out = tmp_path / "run"
    out.mkdir()
    model, tokenizer = load(str(llama_dir))
    holder = _hold_in_another_process(out)
    try:
        with pytest.raises(UserError, match=f"in use by another run \\(pid {holder.pid}\\)"):
            Trainer(config(llama_dir, uninterrupted[0], out, max_steps=1), model, tokenizer)
        assert not any(isinstance(m, LoRALinear) for _, m in model.named_modules())
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    Trainer(config(llama_dir, uninterrupted[0], out, max_steps=1), model, tokenizer).train()  # the retry works


def test_a_refused_trainer_lets_the_directory_go_at_once(llama_dir, uninterrupted, tmp_path, monkeypatch):
    out = tmp_path / "run"
    Trainer(config(llama_dir, uninterrupted[0], out, max_steps=2)).train()
    kept = []  # a notebook keeps the failed call's traceback, and with it the half-built Trainer
    try:
        Trainer(config(llama_dir, uninterrupted[0], out, max_steps=1, resume="latest"))
    except UserError as err:
        kept.append(err)
    assert "past this run's 1 steps" in str(kept[-1]) and _free_for_another_process(out)

    def interrupted(self):  # Ctrl-C while the run describes itself, the directory set up
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "_describe", interrupted)
    try:
        Trainer(config(llama_dir, uninterrupted[0], out, max_steps=3, resume="latest"))
    except KeyboardInterrupt as err:
        kept.append(err)
    monkeypatch.undo()
    assert len(kept) == 2 and _free_for_another_process(out)
    trainer = Trainer(config(llama_dir, uninterrupted[0], out, max_steps=3, resume="latest"))
    assert not _free_for_another_process(out)  # built, not yet trained: the directory is this process's
    trainer.train()
    assert _free_for_another_process(out)


def test_a_lock_file_of_another_user_is_opened_read_only(tmp_path, monkeypatch):
    from mlxft import runlock

    real_open = os.open

    def others_file(path, flags, *mode):  # what a 0644 file of another user gives (root is never refused)
        if flags & os.O_RDWR:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *mode)

    (tmp_path / runlock.LOCK_FILE).write_text("")
    monkeypatch.setattr(os, "open", others_file)
    lock = runlock.acquire(tmp_path)
    monkeypatch.undo()
    assert lock is not None and not _free_for_another_process(tmp_path)
    lock.release()
    assert _free_for_another_process(tmp_path)


def test_resume_latest_after_a_kill_mid_swap_finds_the_checkpoint_put_back(llama_dir, uninterrupted, tmp_path):
    out = tmp_path / "run"
    Trainer(config(llama_dir, uninterrupted[0], out, max_steps=2)).train()
    before = files(out / "final")
    checkpoint._hold_latest(out, out / "final")  # re-saving final, killed between the swap's two renames:
    aside = Path(tempfile.mkdtemp(prefix=".final.", suffix=".old", dir=out))
    os.replace(out / "final", aside / "final")  # latest names the held copy, final is hidden
    trainer = Trainer(config(llama_dir, uninterrupted[0], out, max_steps=3, resume="latest"))
    assert checkpoint.resolve_checkpoint("latest", out) == (out / "final").resolve()
    assert files(out / "final") == before and not [p for p in out.iterdir() if p.name.endswith(".old")]
    assert trainer.train().steps == 3


def test_resume_by_name_after_a_kill_mid_swap_takes_the_settings_of_the_checkpoint_moved_aside(
        llama_dir, uninterrupted, tmp_path, capsys):
    from mlxft import train

    out = tmp_path / "run"
    Trainer(config(llama_dir, uninterrupted[0], out, max_steps=2)).train()
    before = files(out / "final")
    aside = Path(tempfile.mkdtemp(prefix=".final.", suffix=".old", dir=out))
    os.replace(out / "final", aside / "final")  # re-saving final, killed before the new one arrived
    # No --model, --data or --output-dir: the settings and the directory are the checkpoint's.
    assert train.main(["--resume", str(out / "final"), "--max-steps", "3"]) == 0
    printed = capsys.readouterr().out
    assert f"resumed from {(out / 'final').resolve()} at step 2" in printed and "done: 3 steps" in printed
    assert not [p for p in out.iterdir() if p.name.endswith(".old")]
    # Into another directory, which this run does not hold: the message says how to put it back.
    Trainer(config(llama_dir, uninterrupted[0], out, max_steps=2, overwrite=True)).train()
    before = files(out / "final")
    aside = Path(tempfile.mkdtemp(prefix=".final.", suffix=".old", dir=out))
    os.replace(out / "final", aside / "final")
    elsewhere = config(llama_dir, uninterrupted[0], tmp_path / "other", max_steps=3, resume=str(out / "final"))
    with pytest.raises(UserError, match=f"moved final aside in {out.resolve()}; resume with --output-dir "):
        Trainer(elsewhere)
    assert files(aside / "final") == before


def test_a_finished_run_is_not_resumed_at_its_last_step_but_a_checkpoint_there_finishes_it(
        llama_dir, uninterrupted, tmp_path, capsys):
    from mlxft import train

    out = tmp_path / "run"
    Trainer(config(llama_dir, uninterrupted[0], out, max_steps=2, exact_match_rows=1)).train()
    before = files(out)
    # It scored the finished run and recorded it a second time, and printed "train loss nan".
    with pytest.raises(UserError, match="--resume latest: the run finished at step 2, its last; raise --max-steps"):
        Trainer(config(llama_dir, uninterrupted[0], out, max_steps=2, exact_match_rows=1, resume="latest"))
    assert files(out) == before
    # A periodic checkpoint at the run's last step (as a kill before `final` leaves) still has
    # the run's end to do, and trains no step to show a loss of.
    Trainer(config(llama_dir, uninterrupted[0], out, max_steps=3, overwrite=True)).train()
    capsys.readouterr()
    assert train.main(["--resume", str(out / "checkpoint-2"), "--max-steps", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"done: 2 steps -> {out}"


def test_recovery_leaves_directories_that_are_not_a_swaps_alone(tmp_path):
    tiny_checkpoint(tmp_path, "final", step=3)
    mine = [".final.notes123.old", ".final.v1.old", ".checkpoint-2.abcdefgh.old"]
    for name in mine:
        (tmp_path / name).mkdir()
    (tmp_path / ".final.notes123.old" / "notes.txt").write_text("mine")
    (tmp_path / ".final.v1.old" / "adapters.safetensors").write_text("mine")  # not mkdtemp's name
    (tmp_path / ".checkpoint-2.abcdefgh.old" / "checkpoint-2").mkdir()
    (tmp_path / ".checkpoint-2.abcdefgh.old" / "checkpoint-2" / "notes.txt").write_text("mine")
    assert checkpoint.recover_swaps(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == sorted(mine)


def test_a_directory_without_write_access_says_so_and_a_dead_holders_pid_is_not_named(tmp_path, monkeypatch):
    from mlxft import runlock

    real_open = os.open

    def no_write_access(path, flags, *mode):
        if flags & (os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *mode)

    monkeypatch.setattr(os, "open", no_write_access)
    with pytest.raises(UserError, match=f"cannot update {tmp_path}: Permission denied"):
        runlock.acquire(tmp_path)  # no lock file to open read-only: the directory's own error
    monkeypatch.undo()
    holder = _hold_in_another_process(tmp_path)
    try:
        (tmp_path / runlock.LOCK_FILE).write_text(f"{holder.pid}\n")
        with pytest.raises(UserError, match=f"in use by another run \\(pid {holder.pid}\\);"):
            runlock.acquire(tmp_path)
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        (tmp_path / runlock.LOCK_FILE).write_text(dead.stdout)  # what a holder that could not write leaves
        with pytest.raises(UserError, match="in use by another run; wait for it"):
            runlock.acquire(tmp_path)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def test_a_run_that_finished_here_while_this_one_loaded_is_not_overwritten(llama_dir, uninterrupted, tmp_path,
                                                                           monkeypatch):
    # Two commands into one new --output-dir: both passed the check before either locked it,
    # and the second one to lock truncated the first one's metrics.
    from mlxft import models

    out = tmp_path / "run"
    first = config(llama_dir, uninterrupted[0], out, max_steps=1)
    real_load = models.load

    def load_while_another_run_trains(*args, **kwargs):
        monkeypatch.setattr(models, "load", real_load)
        Trainer(first).train()
        return real_load(*args, **kwargs)

    monkeypatch.setattr(models, "load", load_while_another_run_trains)
    with pytest.raises(UserError, match="already holds a run; choose another --output-dir"):
        Trainer(config(llama_dir, uninterrupted[0], out, max_steps=1))
    assert (out / checkpoint.METRICS_FILE).read_text().strip()  # the first run's records stay
    assert (out / "final").is_dir()


@pytest.mark.parametrize("inside", ["", "sub"])
def test_an_output_dir_that_is_or_is_inside_the_resumed_checkpoint_is_refused(llama_dir, uninterrupted, tmp_path,
                                                                            inside):
    # With --overwrite the run cleared the checkpoint it was reading, then wrote over its adapter.
    data = uninterrupted[0]
    Trainer(config(llama_dir, data, tmp_path / "a", max_steps=1)).train()
    source = tmp_path / "a" / "final"
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    with pytest.raises(UserError, match=f"--output-dir .* {'is inside' if inside else 'is'} the checkpoint .* "
                                        "being resumed"):
        Trainer(config(llama_dir, data, source / inside, resume=str(source), max_steps=2, overwrite=True))
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before


def test_damaged_optimizer_window_and_state_files_are_one_line_errors(llama_dir, uninterrupted, tmp_path):
    # Each of these was a KeyError, TypeError or MLX traceback, or (an empty optimizer file) a
    # resume with fresh moments that no longer equalled the uninterrupted run.
    data = uninterrupted[0]
    out = tmp_path / "run"
    first = Trainer(config(llama_dir, data, out))
    stop_after(first, 1)  # inside a window: the checkpoint holds one
    with pytest.raises(TrainingStopped) as stopped:
        first.train()
    ckpt = stopped.value.checkpoint
    window, optimizer = mx.load(str(ckpt / checkpoint.WINDOW_FILE)), mx.load(str(ckpt / checkpoint.OPTIMIZER_FILE))
    state = json.loads((ckpt / checkpoint.TRAINER_STATE).read_text())
    name = next(k for k in window if not k.startswith("mlxft."))
    renamed = {(k + ".x" if k == name else k): v for k, v in window.items()}
    moment = next(k for k, v in optimizer.items() if v.ndim)
    damages = [
        (checkpoint.WINDOW_FILE, renamed, f"has no gradient of '{name}'"),
        (checkpoint.WINDOW_FILE, {k: v for k, v in window.items() if k != "mlxft.tokens"}, "has no scalar 'mlxft.tokens'"),
        (checkpoint.OPTIMIZER_FILE, {"step": optimizer["step"]}, "has no '"),
        (checkpoint.OPTIMIZER_FILE, {**optimizer, moment: optimizer[moment][..., :1]}, f"'{moment}' has shape"),
        (checkpoint.TRAINER_STATE, {**state, "unlogged": "junk"}, "has no valid 'unlogged'"),
        (checkpoint.TRAINER_STATE, {**state, "last_val_step": "3"}, "has no valid 'last_val_step'"),
    ]
    originals = {f: (ckpt / f).read_bytes() for f in (checkpoint.WINDOW_FILE, checkpoint.OPTIMIZER_FILE,
                                                      checkpoint.TRAINER_STATE)}
    for file, content, message in damages:
        if file.endswith(".json"):
            (ckpt / file).write_text(json.dumps(content))
        else:
            mx.save_safetensors(str(ckpt / file), content)
        with pytest.raises(UserError, match=f"{file}:? {re.escape(message)}") as refused:
            Trainer(config(llama_dir, data, out, resume="latest"))
        assert "\n" not in str(refused.value)
        (ckpt / file).write_bytes(originals[file])
    Trainer(config(llama_dir, data, out, resume="latest")).train()  # the checkpoint put right resumes


def test_a_run_refused_for_its_output_dir_or_rank_leaves_a_model_passed_in_as_it_was(llama_dir, uninterrupted,
                                                                                     tmp_path):
    # The model had its LoRA layers already when mkdir failed, so the retry was refused too; a
    # rank past the widths was refused after the model was frozen.
    from mlx_lm import load
    from mlx_lm.tuner.lora import LoRALinear

    model, tokenizer = load(str(llama_dir))
    trainable = len(tree_flatten(model.trainable_parameters()))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match=f"cannot create --output-dir .*: {tmp_path / 'afile'} is not a directory"):
        Trainer(config(llama_dir, uninterrupted[0], tmp_path / "afile" / "run", max_steps=1), model, tokenizer)
    too_wide = config(llama_dir, uninterrupted[0], tmp_path / "run", max_steps=1)
    too_wide.adapter.rank = 10_000
    with pytest.raises(UserError, match="rank"):
        Trainer(too_wide, model, tokenizer)
    assert not any(isinstance(m, LoRALinear) for _, m in model.named_modules())
    assert len(tree_flatten(model.trainable_parameters())) == trainable
    Trainer(config(llama_dir, uninterrupted[0], tmp_path / "run", max_steps=1), model, tokenizer).train()


def test_train_called_again_after_a_stop_trains_on_to_the_uninterrupted_result(llama_dir, uninterrupted, tmp_path):
    # The stop request that ended the first call had stayed: every later call stopped at once,
    # and its first signal, taken for a second, exited the process unsaved.
    data, expected, expected_steps = uninterrupted
    trainer = Trainer(config(llama_dir, data, tmp_path / "run"))
    stop_after(trainer, 4)
    with pytest.raises(TrainingStopped):
        trainer.train()
    assert not trainer.stop.requested
    trainer._micro_step = type(trainer)._micro_step.__get__(trainer)  # no more stops
    trainer.train()
    assert trainer.optimizer.state["step"].item() == expected_steps
    got = weights(trainer.model)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_an_output_dir_that_cannot_hold_the_latest_link_is_refused_before_training(llama_dir, uninterrupted, tmp_path,
                                                                                  monkeypatch):
    # On exFAT every checkpoint failed, the first one after all the training it was to keep.
    def no_links(*args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    trainer = Trainer(config(llama_dir, uninterrupted[0], tmp_path / "run"))
    monkeypatch.setattr(os, "symlink", no_links)
    with pytest.raises(UserError, match="cannot hold the symbolic link 'latest'.*exFAT and FAT drives cannot"):
        trainer.train()
    assert trainer.step_count == 0 and not list((tmp_path / "run").glob("checkpoint-*"))


@pytest.mark.parametrize("number, advice", [(errno.ENOSPC, "free disk space"), (errno.EROFS, "make it writable"),
                                            (errno.ENOSYS, "choose another --output-dir")])
def test_a_failed_write_is_answered_by_its_cause(number, advice):
    assert checkpoint.write_advice(OSError(number, os.strerror(number))).startswith(advice)


def test_a_signal_during_the_exact_match_after_training_says_the_run_is_saved(llama_dir, uninterrupted, tmp_path,
                                                                              monkeypatch):
    # Outside the stop handlers, SIGTERM had killed the process silently (and SIGINT raised
    # KeyboardInterrupt) after the run was saved, with no word of what was kept or lost.
    from mlxft import generation

    real, calls = generation.exact_match, []

    def signalled_after_training(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the first is the baseline before training
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(generation, "exact_match", signalled_after_training)
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match="during the exact-match after training, whose score is not recorded; "
                                              "the trained run is complete in") as stopped:
        Trainer(config(llama_dir, uninterrupted[0], out, max_steps=2, exact_match_rows=1)).train()
    assert stopped.value.exit_code == 128 + signal.SIGTERM and stopped.value.checkpoint == out / "final"
    assert (out / "latest").resolve() == (out / "final").resolve()


def test_a_second_trainer_built_on_one_directory_does_not_replace_the_run_the_first_saved(llama_dir, uninterrupted,
                                                                                          tmp_path):
    # Built before either trained, both passed the directory check (the process shares the
    # lock); trained in turn, the second replaced the first's checkpoints and interleaved metrics.
    out = tmp_path / "run"
    first = Trainer(config(llama_dir, uninterrupted[0], out, max_steps=2))
    second = Trainer(config(llama_dir, uninterrupted[0], out, max_steps=3))
    first.train()
    saved = files(out)
    with pytest.raises(UserError, match="now holds another run, saved there after this Trainer was built"):
        second.train()
    assert files(out) == saved
