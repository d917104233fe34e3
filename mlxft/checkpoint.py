"""What a run writes to disk, and writing it so a crash never leaves a torn file.

A run directory holds ``adapters.safetensors`` (mlx-lm tensor names; LoRA metadata in the
safetensors header), ``adapter_config.json`` (what ``mlx_lm.load(..., adapter_path=...)``
reads), ``config.yaml`` (the resolved run config), ``training_state.json`` and
``metrics.jsonl``. Every file is written under a temporary name, flushed and renamed into
place, so readers see the old file or the new one, never half of either.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import yaml
from mlx.utils import tree_flatten

from mlxft.errors import UserError

ADAPTER_FILE = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
CONFIG_FILE = "config.yaml"
STATE_FILE = "training_state.json"
METRICS_FILE = "metrics.jsonl"
FORMAT = "mlxft-adapter/1"


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)`` then rename ``tmp_path`` over ``path``.

    A failure (a full disk included) removes the temporary file and leaves ``path`` as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + path.suffix, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        raise UserError(f"cannot write {path}: {err.strerror or err}; free disk space or choose another --output-dir") from err
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(path.parent)


def write_text(path: Path, text: str) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


def write_json(path: Path, data: dict) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def adapter_metadata(fine_tune_type: str, rank: int, alpha: float, dropout: float, targets: list[str],
                     num_layers: int, model_type: str) -> dict[str, str]:
    """The safetensors header entries (strings only) that describe an adapter file."""
    return {
        "format": FORMAT,
        "fine_tune_type": fine_tune_type,
        "rank": str(rank),
        "alpha": repr(float(alpha)),
        "scale": repr(float(alpha) / rank),
        "dropout": repr(float(dropout)),
        "target_modules": json.dumps(targets),
        "num_layers": str(num_layers),
        "model_type": model_type,
    }


def trainable_weights(model: nn.Module) -> dict[str, mx.array]:
    return dict(tree_flatten(model.trainable_parameters()))


def save_adapters(path: Path, model: nn.Module, metadata: dict[str, str]) -> None:
    weights = trainable_weights(model)
    atomic_write(path, lambda tmp: mx.save_safetensors(tmp, weights, metadata=metadata))


def mlx_lm_adapter_config(metadata: dict[str, str]) -> dict:
    """``adapter_config.json`` in the shape mlx-lm's ``load_adapters`` reads."""
    config = {
        "fine_tune_type": metadata["fine_tune_type"],
        "num_layers": int(metadata["num_layers"]),
        "lora_parameters": {
            "rank": int(metadata["rank"]),
            "scale": float(metadata["scale"]),
            "dropout": float(metadata["dropout"]),
        },
    }
    targets = json.loads(metadata["target_modules"])
    if targets != ["*"]:
        config["lora_parameters"]["keys"] = targets
    return config


def save_run(run_dir: Path, model: nn.Module, metadata: dict[str, str], config: dict, state: dict) -> None:
    """Write adapters, adapter config, resolved config and training state; the state file last.

    The state names the step its adapters belong to, so it is renamed into place only after
    the adapters it describes.
    """
    run_dir = Path(run_dir)
    save_adapters(run_dir / ADAPTER_FILE, model, metadata)
    write_json(run_dir / ADAPTER_CONFIG, mlx_lm_adapter_config(metadata))
    write_text(run_dir / CONFIG_FILE, yaml.safe_dump(config, sort_keys=False))
    write_json(run_dir / STATE_FILE, state)


def append_metrics(run_dir: Path, record: dict) -> None:
    with open(Path(run_dir) / METRICS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def load_adapter_weights(path: Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The tensors of an adapter file, in their stored dtype, and its safetensors header."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"adapter file {path} does not exist")
    try:
        weights, metadata = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as err:
        raise UserError(f"{path} is not a readable safetensors file ({str(err).splitlines()[0]}); it may be truncated") from err
    return weights, metadata or {}


def apply_adapter_weights(model: nn.Module, weights: dict[str, mx.array], source: str) -> None:
    """Load adapter tensors into the model's trainable parameters, all or nothing.

    Every name and shape is checked before anything changes; the first mismatch is named.
    Tensors are cast to the dtype of the parameter they replace (F32, F16, BF16 files load).
    """
    params = trainable_weights(model)
    for name, value in weights.items():
        if name not in params:
            raise UserError(f"{source}: tensor {name} has no matching trainable parameter; the adapter is for another model or layout")
        if tuple(value.shape) != tuple(params[name].shape):
            raise UserError(f"{source}: tensor {name} has shape {tuple(value.shape)} but the model expects {tuple(params[name].shape)} (another rank or model?)")
    missing = sorted(set(params) - set(weights))
    if missing:
        raise UserError(f"{source}: no tensor for parameter {missing[0]} ({len(missing)} missing); the adapter is for another layout")
    model.load_weights([(k, v.astype(params[k].dtype)) for k, v in weights.items()], strict=False)
