"""Fusing adapters into a model and writing it as a Hugging Face model directory.

:func:`fuse_adapters` merges every LoRA / DoRA layer into the linear layer it wraps (mlx-lm's
own ``fuse``), so the result is a plain model with the same outputs. :func:`save_hf_model`
writes ``config.json``, ``model*.safetensors`` shards with an index, the tokenizer files and
``generation_config.json`` in the layout both ``mlx_lm.load`` and ``transformers`` read:
tensor names are the same in both for the families mlx-lm ports, and the few weights mlx-lm
keeps in another layout (LFM2's short-convolution kernel) are put back into PyTorch's.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten


DEFAULT_SHARD_BYTES = 5 << 30
# transformers class per model_type, for config.json's "architectures" when the base lacks it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "lfm2": "Lfm2ForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                 "olmo2": "Olmo2ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM"}
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def fuse_adapters(model: nn.Module, dequantize: bool = False) -> int:
    """Merge every adapter layer into its base layer in place; return how many were fused.

    A quantized base layer is re-quantized after the merge unless ``dequantize`` (mlx-lm's
    behaviour), which loses most of a small update: pass ``dequantize`` for an exact result.
    """
    fused = [(name, module.fuse(dequantize=dequantize)) for name, module in model.named_modules()
             if hasattr(module, "fuse") and "lora_a" in module]
    if fused:
        model.update_modules(tree_unflatten(fused))
    return len(fused)


def dequantize(model: nn.Module, config: dict) -> None:
    """Replace quantized layers by float ones and drop the quantization entries of the config."""
    from mlx_lm.utils import dequantize_model

    dequantize_model(model)
    config.pop("quantization", None)
    config.pop("quantization_config", None)


def _stored_tensors(model_path: Path):
    """(name, header entry) of every tensor in a model directory's safetensors files, read
    from the headers only (8-byte length, then JSON), so nothing is loaded."""
    for path in sorted(Path(model_path).glob("*.safetensors")):
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error):
            continue
        if isinstance(header, dict):
            yield from ((name, entry) for name, entry in header.items()
                        if name != "__metadata__" and isinstance(entry, dict))


def stored_dtype(model_path: Path) -> str | None:
    """The float dtype most of a model directory's safetensors tensors are stored in."""
    counts = Counter(_SAFETENSORS_DTYPES[entry["dtype"]] for _, entry in _stored_tensors(model_path)
                     if entry.get("dtype") in _SAFETENSORS_DTYPES)
    return counts.most_common(1)[0][0] if counts else None


def tensors_unlike_base(model: nn.Module, model_path: Path) -> list[str]:
    """The tensors :func:`hf_weights` writes under names the base's own files do not use, or
    in another shape than a float tensor of that name there.

    mlx-lm's loader renames or lays out some families' tensors its own way, and this module
    turns back only LFM2's layout: a mixture of experts stays stacked (``switch_mlp``) where the
    base stores each expert apart, and a Mamba-style convolution kernel stays (channels,
    kernel, 1). transformers would refuse or start those at random; putting them back is not
    done, since for some families (Qwen3.5) mlx-lm takes PyTorch's layout as the sign of an
    unconverted checkpoint and converts its other weights again. Empty when the base stores no
    safetensors to compare with.
    """
    stored = {name: entry for name, entry in _stored_tensors(model_path)}
    if not stored:
        return []

    def unlike(name: str, value: mx.array) -> bool:
        entry = stored.get(name)
        if entry is None:
            return True
        # A quantized base's packed weights have another shape; only float tensors compare.
        return entry.get("dtype") in _SAFETENSORS_DTYPES and list(entry.get("shape", value.shape)) != list(value.shape)

    return sorted(name for name, value in hf_weights(model).items() if unlike(name, value))


def hf_weights(model: nn.Module, dtype: mx.Dtype | None = None) -> dict[str, mx.array]:
    """The model's parameters under transformers' names and layouts, floats cast to ``dtype``."""
    weights = dict(tree_flatten(model.parameters()))
    if dtype is not None:
        from mlxft.models import cast_weights

        weights = cast_weights(model, weights, dtype)
    if getattr(model, "model_type", "") == "lfm2":
        # mlx-lm keeps the depthwise conv kernel as (channels, kernel, 1); PyTorch's Conv1d
        # weight is (channels, 1, kernel). mlx-lm's loader transposes it back on load.
        weights = {k: v.transpose(0, 2, 1) if k.endswith("conv.conv.weight") and v.ndim == 3 else v
                   for k, v in weights.items()}
    return weights


def hf_config(model: nn.Module, config: dict, weights: dict[str, mx.array], dtype_name: str | None) -> dict:
    """The base's config.json with what the written weights imply: tying, dtype, architecture."""
    config = {k: v for k, v in config.items() if k != "_name_or_path"}
    model_type = config.get("model_type", getattr(model, "model_type", ""))
    if "architectures" not in config and model_type in ARCHITECTURES:
        config["architectures"] = [ARCHITECTURES[model_type]]
    # mlx-lm drops a tied head on load; without one, transformers must tie it back. A head of
    # another name (InternLM2's `output`) is known by what mlx-lm's model computes.
    declared = getattr(getattr(model, "args", None), "tie_word_embeddings", None)
    for key in ("tie_embedding", "tie_word_embeddings"):  # LFM2's own key overrides the other in transformers
        if not isinstance(declared, bool):
            declared = config.get(key)
    tied = not any(k.startswith("lm_head.") for k in weights) and (declared if isinstance(declared, bool) else True)
    config["tie_word_embeddings"] = tied
    if "tie_embedding" in config:  # LFM2's own key, which transformers lets override the other
        config["tie_embedding"] = tied
    if dtype_name:  # transformers 4.56 and later write and read "dtype"; earlier ones "torch_dtype"
        config["torch_dtype"] = dtype_name
        if "dtype" in config:
            config["dtype"] = dtype_name
    if "quantization" in config:  # still quantized: mlx-lm's loader reads either key
        config["quantization_config"] = config["quantization"]
    return dict(sorted(config.items()))


def make_shards(weights: dict[str, mx.array], max_bytes: int) -> list[dict[str, mx.array]]:
    """Split tensors into shards of at most ``max_bytes`` (a larger tensor gets its own)."""
    shards: list[dict[str, mx.array]] = []
    size = 0
    for name in sorted(weights):
        value = weights[name]
        if not shards or (size + value.nbytes > max_bytes and shards[-1]):
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    return shards


def write_model_files(out: Path, weights: dict[str, mx.array], config: dict, max_shard_bytes: int) -> list[str]:
    """The safetensors shards, their index and config.json; return the shard names."""
    shards = make_shards(weights, max_shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map = {}
    for name, shard in zip(names, shards):
        mx.save_safetensors(str(out / name), shard, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return names


def save_hf_model(model: nn.Module, config: dict, tokenizer, out, *, dtype: str | None = None,
                  source_dir: Path | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                  overwrite: bool = False) -> Path:
    """Write ``model`` as a Hugging Face model directory that mlx-lm and transformers load.

    ``config`` is the base's config.json (as :func:`mlxft.models.load` returns it); ``dtype``
    (float32 / bfloat16 / float16) casts the float tensors; ``source_dir`` is the base's
    directory, whose generation_config.json is copied. The directory is written under a
    temporary name and renamed into place; a non-empty ``out`` needs ``overwrite``.
    """
    from mlxft.gguf import _check_destination, _write_atomically

    out = Path(out)
    _check_destination(out, overwrite)
    target = getattr(mx, dtype) if dtype else None
    weights = hf_weights(model, target)
    config = hf_config(model, config, weights, dtype)

    def write(tmp: Path) -> None:
        write_model_files(tmp, weights, config, max_shard_bytes)
        tokenizer.save_pretrained(str(tmp))
        if source_dir is not None and (Path(source_dir) / "generation_config.json").is_file():
            shutil.copy2(Path(source_dir) / "generation_config.json", tmp / "generation_config.json")

    _write_atomically(out, overwrite, write)
    return out
