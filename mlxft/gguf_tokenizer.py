"""The tokenizer of a GGUF file, rebuilt as a Hugging Face ``tokenizers`` tokenizer.

llama.cpp stores the vocabulary, its merges (gpt2 BPE) or scores (llama SentencePiece), each
token's type and the pre-tokenizer's name in ``tokenizer.ggml.*`` metadata. From those,
:func:`build_tokenizer` makes a ``tokenizer.json`` equivalent and :func:`build_tokenizer_config`
the ``tokenizer_config.json`` beside it (special tokens, the chat template), for
:func:`mlxft.gguf.convert_gguf`. ``meta`` is that module's typed view of the metadata.
"""

from __future__ import annotations

import logging
from typing import Any

from mlxft.errors import UserError

DAMAGED = "the file is damaged or not a llama.cpp model"  # how mlxft.gguf's messages end too

log = logging.getLogger(__name__)

# tokenizer.ggml.token_type values (llama.cpp's llama_token_attr enum in the file format).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL = 1, 2, 3
TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 4, 5, 6

# GPT-2's pre-tokenization regex and Llama 3's (as in their Hugging Face tokenizer.json files).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre values (llama.cpp names) grouped by how Hugging Face pre-tokenizes them.
_PRE_GPT2 = {"default", "gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais"}
_PRE_STARCODER = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
_PRE_LLAMA3 = {"llama3", "llama-v3", "llama-bpe"}


def _bpe_pre_tokenization(meta):
    """Pre-tokenizer and ``ignore_merges`` flag for the GGUF's ``tokenizer.ggml.pre``."""
    from tokenizers import Regex, pre_tokenizers

    pre = meta.get_str("tokenizer.ggml.pre", "default")
    if pre in _PRE_GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    if pre in _PRE_STARCODER:
        # Single digits first, then GPT-2's regex (SmolLM2/StarCoder tokenizer.json).
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]), False
    if pre in _PRE_LLAMA3:
        # llama.cpp (like recent Llama 3 tokenizer.json files) takes a whole pre-token that is
        # in the vocabulary as one token before applying merges.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]), True
    known = sorted(_PRE_GPT2 | _PRE_STARCODER | _PRE_LLAMA3)
    raise UserError(f"{meta.path}: tokenizer pre-tokenizer {pre!r} is not supported (known: "
                    f"{', '.join(known)}); convert the original Hugging Face model instead")


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges for a SentencePiece BPE vocabulary, ordered by the merged piece's score.

    SentencePiece BPE merges the adjacent pair whose concatenation has the highest score;
    a merge list sorted that way makes Hugging Face's BPE reproduce it.
    """
    ids = {}
    for i, token in enumerate(tokens):
        if types[i] in (TOKEN_NORMAL, TOKEN_USER_DEFINED, TOKEN_UNUSED):
            ids.setdefault(token, i)
    merges = []
    for piece, piece_id in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                merges.append((-scores[piece_id], piece_id, ids[left], ids[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def _check_per_token(meta, key: str, values: list, tokens: list[str]) -> None:
    if len(values) != len(tokens):
        raise UserError(f"{meta.path}: GGUF metadata {key!r} has {len(values)} entries for {len(tokens)} tokens; "
                        f"{DAMAGED}")


def _token_id(meta, key: str, tokens: list[str], default: int | None = None) -> int | None:
    """The token id under ``key``, which must name one of ``tokens``."""
    token_id = meta.get_int(key, default)
    if token_id is not None and not 0 <= token_id < len(tokens):
        raise UserError(f"{meta.path}: GGUF metadata {key!r} is {token_id}, past the {len(tokens)} tokens; "
                        f"{DAMAGED}")
    return token_id


def build_tokenizer(meta):
    """A ``tokenizers.Tokenizer`` equivalent to the GGUF's vocabulary (gpt2 BPE or llama SPM)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    model_kind = meta.get_str("tokenizer.ggml.model", required=True)
    tokens = meta.get_list("tokenizer.ggml.tokens", required=True)
    types = meta.get_list("tokenizer.ggml.token_type", kind=int) or [TOKEN_NORMAL] * len(tokens)
    _check_per_token(meta, "tokenizer.ggml.token_type", types, tokens)

    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a repeated string keeps its first id
    if len(vocab) != len(tokens):
        log.warning("%s: %d duplicate token strings keep only their first id",
                    meta.path, len(tokens) - len(vocab))

    if model_kind == "gpt2":
        merges = meta.get_list("tokenizer.ggml.merges", required=True)
        merges = [tuple(m.split(" ", 1)) for m in merges]
        broken = next((i for i, pair in enumerate(merges) if len(pair) != 2), None)
        if broken is not None:
            raise UserError(f"{meta.path}: GGUF metadata 'tokenizer.ggml.merges' entry {broken} "
                            f"({merges[broken][0]!r}) is not two pieces apart; {DAMAGED}")
        pre_tokenizer, ignore_merges = _bpe_pre_tokenization(meta)
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
        tokenizer.pre_tokenizer = pre_tokenizer
        tokenizer.decoder = decoders.ByteLevel()
        byte_level = True
    elif model_kind == "llama":
        scores = meta.get_list("tokenizer.ggml.scores", kind=float) or [0.0] * len(tokens)
        _check_per_token(meta, "tokenizer.ggml.scores", scores, tokens)
        unk_id = _token_id(meta, "tokenizer.ggml.unknown_token_id", tokens, 0)
        tokenizer = Tokenizer(models.BPE(
            vocab=vocab, merges=_spm_merges(tokens, scores, types),
            unk_token=tokens[unk_id], byte_fallback=True, fuse_unk=True,
        ))
        # SentencePiece marks word starts with U+2581 and prefixes the text with one.
        add_space = meta.get_bool("tokenizer.ggml.add_space_prefix", True)
        steps = [normalizers.Prepend("▁")] if add_space else []
        tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
        decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_space:
            decode.append(decoders.Strip(" ", 1, 0))
        tokenizer.decoder = decoders.Sequence(decode)
        byte_level = False
    else:
        raise UserError(f"{meta.path}: tokenizer model {model_kind!r} is not supported (gpt2 or "
                        "llama only); convert the original Hugging Face model instead")

    # Control (and unknown) tokens are Hugging Face's special added tokens; user-defined are plain
    # added tokens. Both already sit in the vocabulary, so adding them keeps their ids.
    special = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types) if k in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
    added = [AddedToken(t, special=False, normalized=False)
             for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(added)

    # Checked only where added: tokenizer_config.json leaves out an id past the vocabulary.
    add_bos = meta.get_bool("tokenizer.ggml.add_bos_token", model_kind == "llama")
    add_eos = meta.get_bool("tokenizer.ggml.add_eos_token", False)
    bos_id = _token_id(meta, "tokenizer.ggml.bos_token_id", tokens) if add_bos else None
    eos_id = _token_id(meta, "tokenizer.ggml.eos_token_id", tokens) if add_eos else None
    single, pair, specials = "$A", "$A:0 $B:1", []
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        single, pair = f"{bos} {single}", f"{bos} $A:0 {bos}:1 $B:1"
        specials.append((tokens[bos_id], bos_id))
    if add_eos and eos_id is not None:
        single, pair = f"{single} {tokens[eos_id]}", f"{pair} {tokens[eos_id]}:1"
        specials.append((tokens[eos_id], eos_id))
    if specials:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=list(dict.fromkeys(specials)))
    elif byte_level:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def build_tokenizer_config(meta, config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json for transformers' generic fast tokenizer, with the chat template."""
    tokens = meta.get_list("tokenizer.ggml.tokens", required=True)
    types = meta.get_list("tokenizer.ggml.token_type", kind=int) or [TOKEN_NORMAL] * len(tokens)
    result: dict[str, Any] = {
        # The generic class loads tokenizer.json as written; a model-specific class could
        # replace our pre-tokenizer with its own defaults.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get_bool("tokenizer.ggml.add_bos_token",
                                        meta.get_str("tokenizer.ggml.model") == "llama")),
        "add_eos_token": bool(meta.get_bool("tokenizer.ggml.add_eos_token", False)),
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):  # llama.cpp's key names
        token_id = meta.get_int(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            result[f"{name}_token"] = tokens[token_id]
    template = meta.get_str("tokenizer.chat_template")
    if template:
        result["chat_template"] = template
    result["added_tokens_decoder"] = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": k != TOKEN_USER_DEFINED}
        for i, (t, k) in enumerate(zip(tokens, types))
        if k in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED)
    }
    return result
