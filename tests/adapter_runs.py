"""Run directories for the adapter tests (fuse, export, import, generate, evaluate).

Each is made once per test session and shared between the test modules that use it. Most
are written by mlxft's own checkpoint code with random, clearly non-zero adapter weights
(much quicker than training and far from the identity, so a comparison that passes means
something); one is a real ``Trainer`` run and one a real ``mlx_lm lora`` run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxft import RunConfig, Trainer, checkpoint, lora, models
from mlxft.config import AdapterConfig

from conftest import CHAT_ROWS, IM_END, IM_START, write_jsonl

_RUNS: dict[tuple, Path] = {}
_TOKENIZERS: dict[tuple, object] = {}
# "What is 1 plus 2?" in the chat template, ready for the answer, as the test tokenizer encodes it.
PROMPT_IDS = [[IM_START, 872, 198, 3838, 374, 220, 16, 5519, 220, 17, 30, IM_END, 198, IM_START, 395, 380, 517, 198]]


def _once(key: tuple, make) -> Path:
    if key not in _RUNS or not _RUNS[key].exists():
        _RUNS[key] = make()
    return _RUNS[key]


def data_dir(root: Path) -> Path:
    def make():
        directory = root / "adapter-data"
        write_jsonl(directory / "train.jsonl", CHAT_ROWS)
        write_jsonl(directory / "valid.jsonl", CHAT_ROWS[:5])
        return directory

    return _once(("data",), make)


def trained_run(root: Path, model_dir: Path) -> Path:
    """A real mlxft training run (3 steps, with validation) on ``model_dir``."""

    def make():
        out = root / f"trained-{model_dir.name}"
        config = RunConfig.from_dict({
            "model": {"model": str(model_dir)}, "data": {"data": str(data_dir(root))},
            "adapter": {"rank": 4, "alpha": 8.0},
            "optim": {"learning_rate": 2e-2, "warmup_steps": 0},
            "train": {"output_dir": str(out), "batch_size": 4, "max_steps": 3, "log_every": 100}})
        Trainer(config).train()
        return out

    return _once(("trained", str(model_dir)), make)


def synthetic_run(root: Path, model_dir: Path, finetune: str = "lora", targets=("default",), num_layers: int = -1,
                  rank: int = 4, alpha: float = 8.0, quantize: int = 0, seed: int = 0) -> Path:
    """A run directory exactly as the trainer writes it, with random adapter weights."""
    key = ("synthetic", str(model_dir), finetune, tuple(targets), num_layers, rank, alpha, quantize, seed)

    def make():
        out = root / f"run-{model_dir.name}-{finetune}-{len(_RUNS)}"
        if quantize:
            model, tokenizer, _, _ = models.load(str(model_dir), "float32", quantize, 32)
        else:
            model, tokenizer = base_model(model_dir), tokenizer_of(model_dir)
        adapter = AdapterConfig(finetune=finetune, targets=list(targets), num_layers=num_layers, rank=rank, alpha=alpha)
        chosen = lora.apply(model, adapter, seed)
        mx.random.seed(seed + 1)
        new = {}
        for name, value in checkpoint.trainable_weights(model).items():
            if name.endswith("lora_b"):
                value = 0.05 * mx.random.normal(value.shape)
            elif name.endswith(".m") or finetune == "full":
                value = value * (1 + 0.05 * mx.random.normal(value.shape))
            new[name] = value
        model.load_weights(list(new.items()), strict=False)
        config = RunConfig.from_dict({
            "model": {"model": str(model_dir), "quantize": quantize, "quantize_group_size": 32},
            "adapter": {"finetune": finetune, "targets": list(targets), "num_layers": num_layers, "rank": rank,
                        "alpha": alpha}})
        layers = len(lora.selected_layers(model, num_layers))
        meta = checkpoint.adapter_metadata(finetune, rank, alpha, 0.0, chosen, layers, models.family(model), str(model_dir))
        out.mkdir(parents=True)
        checkpoint.save_tokenizer(out, tokenizer)
        checkpoint.save_run(out, model, meta, config.to_dict(), {"step": 0})
        return out

    return _once(key, make)


def mlx_lm_run(root: Path, model_dir: Path, full_layers: int = 0) -> Path:
    """A real ``mlx_lm lora`` run: rank 4, scale 3 (no alpha anywhere), the last 2 layers; or
    with ``full_layers`` a full fine-tune of that many last layers (whole layers, as mlx-lm trains)."""

    def make():
        out = root / f"mlx-lm-{model_dir.name}-{'full' if full_layers else 'lora'}"
        config = root / "mlx-lm-lora.yaml"
        config.write_text(json.dumps({"lora_parameters": {"rank": 4, "scale": 3.0, "dropout": 0.0}}))
        layout = ["--fine-tune-type", "full", "--num-layers", str(full_layers)] if full_layers else ["--num-layers", "2"]
        proc = subprocess.run(
            [sys.executable, "-m", "mlx_lm", "lora", "--model", str(model_dir), "--train", "--data", str(data_dir(root)),
             "--iters", "2", "--batch-size", "2", *layout, "--val-batches", "1", "--steps-per-eval", "100",
             "--learning-rate", "2e-2", "--adapter-path", str(out), "-c", str(config)],
            capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return out

    return _once(("mlx-lm", str(model_dir), full_layers), make)


def tokenizer_of(model_dir: Path):
    key = ("tokenizer", str(model_dir))
    if key not in _TOKENIZERS:
        from mlx_lm.utils import load_tokenizer

        _TOKENIZERS[key] = load_tokenizer(Path(model_dir))
    return _TOKENIZERS[key]


def base_model(model_dir: Path):
    """The frozen float32 base as ``models.load`` gives it, without the tokenizer (which takes
    a second to load and which these tests do not need)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    model.set_dtype(mx.float32)
    model.freeze()
    return model


def adapted(run: Path, model_dir: Path | None = None):
    """The base (the one the run records by default) with the run's adapter attached, as
    ``adapters.load_with_adapter`` builds it but without loading a tokenizer."""
    from mlxft import adapters

    weights, spec = adapters.load_adapter_dir(run)
    return adapters.attach(base_model(model_dir or spec.base_model), spec, weights)


def logits(model, ids=PROMPT_IDS) -> np.ndarray:
    model.eval()
    return np.array(model(mx.array(ids)).astype(mx.float32))


def max_rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())
