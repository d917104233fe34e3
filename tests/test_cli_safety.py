"""Command lines that must not replace work they were not asked to, and that fail in one line."""

import os
import shutil
import subprocess
import sys

import pytest

from mlxft.train import main as train_main

from conftest import write_jsonl  # noqa: F401  (tests/ on sys.path, as the suite's own files)


def _common(llama_dir, chat_data):
    return ["--model", str(llama_dir), "--data", str(chat_data), "--max-steps", "1", "--no-memory-estimate"]


def _train(llama_dir, chat_data, out, *extra):
    assert train_main(_common(llama_dir, chat_data) + ["--output-dir", str(out), *extra]) == 0
    return out


def test_default_job_does_not_overwrite_a_directory_the_user_names(tmp_path, monkeypatch, capsys):
    """`python -m mlxft.train --output-dir runs/mine` runs the default job, whose YAML says
    overwrite: true; that must not replace the run already in runs/mine."""
    import mlxft.builtin

    monkeypatch.setenv("MLXFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(mlxft.builtin, "model_dir", lambda: pytest.fail("went on to replace the existing run"))
    run = tmp_path / "mine"
    (run / "checkpoint-200").mkdir(parents=True)
    (run / "training_state.json").write_text('{"step": 200}\n')
    assert train_main(["--output-dir", str(run), "--max-steps", "1"]) == 2
    out, err = capsys.readouterr()
    assert "running the default job" in out
    assert "already holds a run" in err and err.count("\n") == 1
    assert (run / "training_state.json").read_text() == '{"step": 200}\n' and (run / "checkpoint-200").is_dir()


def test_default_job_still_reruns_into_its_own_directory(tmp_path, monkeypatch):
    import mlxft.trainer

    seen = []

    class Ran(Exception):
        pass

    def fake_fine_tune(config):
        seen.append(config.train)
        raise Ran

    monkeypatch.setattr(mlxft.trainer, "fine_tune", fake_fine_tune)
    for argv, overwrite in (([], True), (["--epochs", "1"], True), (["--output-dir", "x"], False),
                            (["--output-dir", "x", "--overwrite"], True)):
        with pytest.raises(Ran):
            train_main(argv)
        assert seen[-1].overwrite is overwrite, argv


def test_a_saved_config_reused_with_config_does_not_replace_another_run(llama_dir, chat_data, tmp_path, capsys):
    other = _train(llama_dir, chat_data, tmp_path / "other")
    first = _train(llama_dir, chat_data, tmp_path / "first", "--overwrite")
    before = {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()}
    capsys.readouterr()
    assert train_main(["--config", str(first / "config.yaml"), "--output-dir", str(other)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()} == before


def test_a_resumed_runs_config_starts_a_new_run(llama_dir, chat_data, tmp_path):
    run = _train(llama_dir, chat_data, tmp_path / "run")
    assert train_main(_common(llama_dir, chat_data)[:-3] + ["--max-steps", "2", "--no-memory-estimate",
                                                           "--output-dir", str(run), "--resume", "latest"]) == 0
    assert train_main(["--config", str(run / "config.yaml"), "--output-dir", str(tmp_path / "new")]) == 0


def _small_disk():  # files past 40 KB fail with EFBIG, as a full disk fails with ENOSPC
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))


@pytest.mark.skipif(not sys.platform.startswith(("linux", "darwin")), reason="RLIMIT_FSIZE")
def test_a_full_disk_is_a_one_line_error(llama_dir, chat_data, tmp_path):
    run = _train(llama_dir, chat_data, tmp_path / "run")
    commands = {
        "train": ["mlxft.train", *_common(llama_dir, chat_data), "--output-dir", str(tmp_path / "run2")],
        "export": ["mlxft.export", "--adapter", str(run), "--format", "peft", "--out", str(tmp_path / "peft")],
        "fuse": ["mlxft.fuse", "--adapter", str(run), "--out", str(tmp_path / "fused")],
    }
    for name, args in commands.items():
        proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300,
                              preexec_fn=_small_disk)
        assert proc.returncode == 2, (name, proc.stderr[-1500:])
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, (name, proc.stderr[-1500:])
    assert not (tmp_path / "peft").exists() and not (tmp_path / "fused").exists()


def test_an_output_dir_that_cannot_be_created_is_a_one_line_error(llama_dir, chat_data, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert train_main(_common(llama_dir, chat_data) + ["--output-dir", str(tmp_path / "file" / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot create --output-dir") and err.count("\n") == 1


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write anywhere")
def test_an_output_dir_without_permission_is_a_one_line_error(llama_dir, chat_data, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        assert train_main(_common(llama_dir, chat_data) + ["--output-dir", str(locked / "run")]) == 2
    finally:
        locked.chmod(0o755)
    err = capsys.readouterr().err
    assert "Permission denied" in err and err.count("\n") == 1


def test_a_second_run_into_a_directory_in_use_is_refused(llama_dir, chat_data, tmp_path, capsys):
    """Both used to exit 0, the second silently replacing the first one's work."""
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from mlxft import runlock; runlock.acquire(sys.argv[1]); "
                               "print('held', flush=True); sys.stdin.read()", str(run)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        for extra in ([], ["--overwrite"]):
            assert train_main(_common(llama_dir, chat_data) + ["--output-dir", str(run), *extra]) == 2
            err = capsys.readouterr().err
            assert f"is in use by another run (pid {holder.pid}); wait for it" in err and err.count("\n") == 1
        assert [p.name for p in run.iterdir()] == [".mlxft.lock"]
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    _train(llama_dir, chat_data, run)  # the lock went with the process that held it


def test_an_output_dir_that_cannot_be_updated_at_resume_is_a_one_line_error(llama_dir, chat_data, tmp_path,
                                                                           monkeypatch, capsys):
    run = _train(llama_dir, chat_data, tmp_path / "run", "--max-steps", "2", "--save-every", "1")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "symlink", read_only)  # resuming an older checkpoint points latest back at it
    assert train_main(_common(llama_dir, chat_data)[:-3] + ["--max-steps", "2", "--no-memory-estimate", "--output-dir",
                                                           str(run), "--resume", str(run / "checkpoint-1")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: cannot update {run}: Read-only file system; make it writable or choose another --output-dir\n"
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_tilde_paths_in_a_config_file_mean_the_home_directory(llama_dir, chat_data, tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    shutil.copytree(chat_data, home / "data")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  model: {llama_dir}\ndata:\n  data: ~/data\n"
                      "train:\n  output_dir: ~/runs/x\n  max_steps: 1\n  memory_estimate: false\n")
    assert train_main(["--config", str(config)]) == 0
    assert (home / "runs" / "x" / "adapters.safetensors").is_file()
    assert not (cwd / "~").exists()


@pytest.mark.parametrize("text", ["- a list\n", "model: [4]\n", "data: [4]\n", "model:\n  quantize: four\n"])
def test_a_damaged_run_config_is_not_a_traceback(llama_dir, chat_data, tmp_path, capsys, text):
    from mlxft.generate import main as generate_main

    run = _train(llama_dir, chat_data, tmp_path / "run")
    (run / "config.yaml").write_text(text)
    capsys.readouterr()
    code = generate_main(["--adapter", str(run), "--prompt", "hi", "--max-tokens", "1"])
    err = capsys.readouterr().err
    assert code == 0 or (code == 2 and err.startswith("error: ") and err.count("\n") == 1), err


def test_generate_into_a_closed_pipe_stops_quietly(llama_dir, chat_data, tmp_path):
    run = _train(llama_dir, chat_data, tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "mlxft.generate", "--adapter", str(run), "--prompt", "hi",
                             "--max-tokens", "200"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()  # as `| head -c 1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0 and "Traceback" not in err, err


@pytest.mark.parametrize("module, args", [
    ("train", ["--no-such-flag"]),
    ("evaluate", ["--adapter", "r1"]),  # no --data
    ("generate", ["--adapter", "r1"]),  # no --prompt
    ("fuse", ["--adapter", "r1"]),  # no --out
    ("convert", ["model.gguf"]),  # no OUT_DIR
    ("export", ["--adapter", "r1", "--format", "gguf", "--out", "o"]),
])
def test_every_cli_reports_a_bad_flag_in_one_line(module, args, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit:
        importlib.import_module(f"mlxft.{module}").main(args)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: ") and err.endswith(f"(python -m mlxft.{module} --help lists the options)\n")


def test_running_out_of_host_memory_or_losing_stdout_is_one_line(capsys):
    import subprocess
    import sys

    import numpy as np

    from mlxft.errors import run_cli

    @run_cli
    def huge(argv):  # what a --batch-size of a billion rows met in NumPy
        np.zeros((2**40, 2**20), dtype=np.int32)

    assert huge([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: out of memory (") and "lower --batch-size" in err and err.count("\n") == 1
    # `python -m mlxft.train ... | head -2` printed a BrokenPipeError traceback.
    script = ("import sys\nfrom mlxft.errors import run_cli\n@run_cli\ndef main(argv):\n"
              "    for i in range(10**6): print('step', i)\nsys.exit(main([]))")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    assert proc.stderr.read().decode() == "error: standard output was closed; stopping\n" and proc.wait() == 1


@pytest.mark.parametrize("temp", ["nan", "inf", "-1"])
def test_generate_refuses_a_temperature_it_cannot_sample_with(temp, capsys):
    # nan passed the `< 0` check and sampled token 0 over and over.
    from mlxft.generate import main as generate_main

    assert generate_main(["--model", "no-such-model", "--prompt", "hi", "--temp", temp]) == 2
    assert capsys.readouterr().err == "error: --temp must be a finite number >= 0 and --top-p in [0, 1]\n"


@pytest.mark.parametrize("joint, printed", [(True, False), (False, True)])
def test_a_rank_other_than_0_says_why_it_stopped_unless_all_stopped_together(monkeypatch, capsys, joint, printed):
    # Rank 0 speaks for a stop every rank made together; an out-of-memory stop on rank 1 alone
    # had gone unprinted, while rank 0 said "see its output".
    import mlxft.trainer
    from mlxft.train import main as train_main

    def stopped(config):
        raise mlxft.trainer.TrainingStopped("out of memory at step 3", 1, None, joint=joint)

    monkeypatch.setattr(mlxft.trainer, "fine_tune", stopped)
    monkeypatch.setenv("MLX_RANK", "1")
    assert train_main(["--model", "m", "--data", "d"]) == 1
    assert ("out of memory at step 3" in capsys.readouterr().err) is printed


def test_a_checkpoint_copied_into_another_directory_does_not_take_it_over(llama_dir, chat_data, tmp_path, capsys):
    # Resuming counted as continuing the run whenever the checkpoint sat in the output
    # directory, so a checkpoint copied into a user's directory, or into another run's,
    # replaced their files (config.yaml, tokenizer, final/, latest) without --overwrite.
    first = _train(llama_dir, chat_data, tmp_path / "first", "--max-steps", "2", "--save-every", "1")
    other = _train(llama_dir, chat_data, tmp_path / "other")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my settings\n")
    (mine / "tokenizer.json").write_text("my tokenizer\n")
    before = (other / "final" / "adapters.safetensors").read_bytes()
    for directory in (mine, other):
        shutil.copytree(first / "checkpoint-1", directory / "from-first")
        capsys.readouterr()
        assert train_main(["--resume", str(directory / "from-first"), "--max-steps", "2"]) == 2
        assert "pass --overwrite" in capsys.readouterr().err
    assert (mine / "config.yaml").read_text() == "my settings\n"
    assert (mine / "tokenizer.json").read_text() == "my tokenizer\n"
    assert (other / "final" / "adapters.safetensors").read_bytes() == before
    # Its own checkpoint continues the run in its directory, as before.
    assert train_main(["--resume", str(first / "checkpoint-1"), "--max-steps", "3"]) == 0
    # With --overwrite the other run's checkpoints go, but not the copy this run resumes from.
    shutil.copytree(first / "checkpoint-1", other / "checkpoint-7")
    assert train_main(["--resume", str(other / "checkpoint-7"), "--max-steps", "2", "--overwrite"]) == 0
    assert (other / "checkpoint-7").is_dir() and (other / "final" / "adapters.safetensors").read_bytes() != before


def test_empty_paths_are_refused_not_taken_for_none(llama_dir, chat_data, tmp_path, monkeypatch, capsys):
    # `--config "$UNSET"` ran the default job (replacing runs/default); `--resume ""` trained
    # from scratch; both exited 0.
    monkeypatch.chdir(tmp_path)
    for flags, message in ((["--config", ""], "--config is empty; name a YAML file"),
                           (["--resume", " ", *_common(llama_dir, chat_data)], "--resume is empty; name a path"),
                           (["--output-dir", "", *_common(llama_dir, chat_data)], "--output-dir is empty")):
        capsys.readouterr()
        assert train_main(flags) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # no default job, no run started


def test_resume_finds_a_home_relative_run_and_takes_its_settings_beside_file_flags(llama_dir, chat_data, tmp_path,
                                                                                   monkeypatch, capsys):
    # --output-dir=~/run (bash leaves the ~) with --resume latest looked for ./~/run/latest;
    # --resume CHECKPOINT --valid-file F fell back to bare defaults ("no model given").
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    run = _train(llama_dir, chat_data, "~/run", "--max-steps", "2", "--save-every", "1")
    assert run == "~/run" and (tmp_path / "home" / "run" / "latest").exists()
    assert train_main(["--output-dir", "~/run", "--resume", "latest", "--max-steps", "3"]) == 0
    valid = tmp_path / "valid.jsonl"
    shutil.copy(chat_data / "valid.jsonl", valid)
    capsys.readouterr()
    assert train_main(["--resume", str(tmp_path / "home" / "run" / "checkpoint-1"), "--valid-file", str(valid),
                       "--max-steps", "3"]) == 0
    assert "resuming with the checkpoint's settings" in capsys.readouterr().out


def test_sizes_past_what_mlx_indexes_and_unreadable_yaml_are_one_line_errors(llama_dir, chat_data, tmp_path, capsys):
    # A batch of 2**31-1 rows was an OverflowError traceback (a bucket that large, a segfault)
    # after the output directory existed; a 5,000-digit number or YAML nested thousands deep
    # was a ValueError or RecursionError traceback.
    out = tmp_path / "run"
    for flags in (["--batch-size", str(2**31 - 1)], ["--length-bucket", str(2**31 - 1)]):
        capsys.readouterr()
        assert train_main(_common(llama_dir, chat_data) + ["--output-dir", str(out), *flags]) == 2
        assert "exceed 2**31 tokens a micro-batch" in capsys.readouterr().err and not out.exists()
    for name, text in (("digits", "train:\n  seed: " + "9" * 5000 + "\n"),
                       ("deep", "train:\n  seed: " + "[" * 3000 + "]" * 3000 + "\n")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        capsys.readouterr()
        assert train_main(["--config", str(path), *_common(llama_dir, chat_data)]) == 2
        err = capsys.readouterr().err
        assert f"{path}: YAML this reader cannot take" in err and "Traceback" not in err


def test_the_default_job_reruns_into_its_own_directory_however_it_is_spelled(tmp_path, monkeypatch, capsys):
    import mlxft.builtin
    from mlxft.errors import UserError

    def reached():
        raise UserError("reached the model")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(mlxft.builtin, "model_dir", reached)
    (tmp_path / "runs" / "default").mkdir(parents=True)
    (tmp_path / "runs" / "default" / "training_state.json").write_text("{}")  # an earlier default run
    assert train_main(["--output-dir", str(tmp_path / "runs" / "default")]) == 2
    assert "reached the model" in capsys.readouterr().err  # past the output directory's check


def test_the_default_job_restates_no_default():
    # A value restated in the job counts as given: --init-adapter then refused a starting
    # adapter of another rank than the restated default's.
    import yaml

    from mlxft.config import RunConfig
    from mlxft.train import DEFAULT_JOB

    defaults = RunConfig()
    for section, values in yaml.safe_load(DEFAULT_JOB.read_text()).items():
        for name, value in values.items():
            assert value != getattr(getattr(defaults, section), name), f"{section}.{name}"
