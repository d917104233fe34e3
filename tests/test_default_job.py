"""The built-in default job: real SmolLM2 offline, the capitals task, before/after metrics."""

import json
import os
import subprocess
import sys

import pytest

from mlxft import builtin
from mlxft.gguf import find_smollm2_gguf

needs_smollm2 = pytest.mark.skipif(find_smollm2_gguf() is None, reason=f"default model not installed: {builtin.SMOLLM2_INSTALL}")


def test_capitals_split_is_fixed_and_disjoint(tmp_path, monkeypatch):
    train, valid = builtin.capitals_rows()
    assert (train, valid) == builtin.capitals_rows()
    assert len(valid) == builtin.VALID_ROWS and len(train) == len(builtin.CAPITALS) - builtin.VALID_ROWS
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in valid}
    monkeypatch.setenv("MLXFT_CACHE", str(tmp_path))
    directory = builtin.data_dir()
    assert [json.loads(line) for line in (directory / "valid.jsonl").read_text().splitlines()] == valid
    assert builtin.resolve("some/dir") == "some/dir"
    with pytest.raises(builtin.UserError, match="unknown built-in"):
        builtin.resolve("builtin:nothing")


def test_a_killed_conversion_is_cleaned_up_and_a_concurrent_one_is_taken(tmp_path, monkeypatch):
    import mlxft.gguf

    monkeypatch.setenv("MLXFT_CACHE", str(tmp_path))
    directory = builtin.cache_dir() / "models" / "SmolLM2-135M-Instruct"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = directory.with_name(f".{directory.name}.tmp-{dead.stdout.strip()}-0123abcd")
    running = directory.with_name(f".{directory.name}.tmp-{os.getpid()}-4567abcd")  # this process: alive
    for path in (killed, running):
        (path / "weights").mkdir(parents=True)
    assert builtin.remove_killed_conversions(directory) == [killed]
    assert not killed.exists() and running.exists()

    # Two default jobs converting at once: the one that loses the rename takes the other's model.
    def converted_by_another_job(gguf, out, **kwargs):
        (out / "config.json").parent.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise builtin.UserError(f"{out}: directory is not empty; pass --overwrite")

    monkeypatch.setattr(mlxft.gguf, "find_smollm2_gguf", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(mlxft.gguf, "convert_gguf", converted_by_another_job)
    assert builtin.model_dir() == directory


@pytest.mark.slow
@needs_smollm2
def test_default_job_reduced(tmp_path):
    """`python -m mlxft.train` with no model or data: a few steps of the real default job."""
    out = tmp_path / "run"
    env = {**os.environ, "MLXFT_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        # One validation batch of the three: each costs 1.5 s on a 2-core CPU and tells no more.
        [sys.executable, "-m", "mlxft.train", "--max-steps", "2", "--exact-match-rows", "3", "--max-eval-batches", "1",
         "--output-dir", str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "running the default job" in proc.stdout
    assert "exact-match before training" in proc.stdout and "exact-match after training" in proc.stdout
    assert "before:" in proc.stdout and "after:" in proc.stdout
    assert {"adapters.safetensors", "adapter_config.json", "config.yaml", "training_state.json", "metrics.jsonl"} <= {
        p.name for p in out.iterdir()
    }
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    matches = [r for r in records if r["type"] == "exact_match"]
    assert [r["step"] for r in matches] == [0, 2] and all(r["rows"] == 3 and r["rows_from"] == "validation" for r in matches)
    assert "of 3 held-out rows" in proc.stdout
    evals = [r for r in records if r["type"] == "eval"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 2 and evals[0]["val_tokens"] < 112  # of the 24 rows' 112
    # The converted model was cached for the next run.
    assert (tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct" / "config.json").is_file()
