"""JSONL datasets: rows to token ids and supervision masks, and masks to padded batches.

Three row shapes are read: ``{"text"}`` (every token supervised), ``{"prompt", "completion"}``
and ``{"messages": [...]}`` (chat template). For the SFT shapes only completion / assistant
tokens are supervised unless ``completion_only`` is off. Rows are tokenized once; an epoch
is a seeded permutation grouped by length, so batches carry little padding and the data
order depends on nothing but the seed and the epoch number.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mlxft.config import PROMPT_FORMATS
from mlxft.errors import UserError, first_line

# Batches are sorted by length inside windows of this many batches: little padding,
# while the order still mixes the whole dataset every epoch.
LENGTH_GROUP_BATCHES = 16


@dataclass
class Example:
    """One tokenized row. ``mask[j]`` is True when token j is a supervised target."""

    ids: np.ndarray
    mask: np.ndarray

    def __post_init__(self):
        # Examples also come from research scripts (Trainer(datasets=...)): lists, int masks.
        ids, mask = np.asarray(self.ids), np.asarray(self.mask)
        if ids.ndim != 1 or mask.shape != ids.shape:
            raise UserError(f"Example: ids and mask must be 1-D and of one length (got shapes {ids.shape} and "
                            f"{mask.shape}); give mask[j] = whether token j is a supervised target")
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise UserError(f"Example: ids must be integer token ids, got {ids.dtype}")
        if ids.size and (ids.min() < np.iinfo(np.int32).min or ids.max() > np.iinfo(np.int32).max):
            # int32 would wrap 2**32 + 7 to 7, a valid id
            raise UserError(f"Example: token id {ids.max() if ids.max() > 0 else ids.min()} is outside the range of "
                            "token ids; tokenize with the model's tokenizer")
        if mask.size and not (mask.dtype == bool or np.issubdtype(mask.dtype, np.integer)):
            raise UserError(f"Example: mask must be booleans (or 0/1), got {mask.dtype}")
        self.ids, self.mask = ids.astype(np.int32, copy=False), mask.astype(bool, copy=False)

    @property
    def supervised(self) -> int:
        return int(self.mask[1:].sum())


@dataclass
class Dataset:
    path: Path
    examples: list[Example]
    kind: str
    truncated: int = 0
    skipped: int = 0
    lines: list[int] | None = None
    """The file line each example comes from (a long text row's windows share one); None for
    examples built in Python."""
    lengths: np.ndarray = field(init=False)

    def __post_init__(self):
        if isinstance(self.examples, tuple):
            self.examples = list(self.examples)
        if not isinstance(self.examples, list):
            raise UserError(f"Dataset: examples must be a list of mlxft.data.Example, not a "
                            f"{type(self.examples).__name__}")
        bad = next((e for e in self.examples if not isinstance(e, Example)), None)
        if bad is not None:
            raise UserError(f"Dataset: examples must be a list of mlxft.data.Example, got {type(bad).__name__}; "
                            "build each as Example(ids, mask)")
        self.lengths = np.array([len(e.ids) for e in self.examples], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def supervised_tokens(self) -> int:
        return sum(e.supervised for e in self.examples)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of every row's token ids and supervision mask, in order: it changes when the
        file, its rows, the tokenizer or the truncation length do, and with it the batches an
        epoch holds (which is what a resumed run must agree on)."""
        digest = hashlib.sha256()
        for e in self.examples:
            ids = np.ascontiguousarray(e.ids, np.int32)
            digest.update(len(ids).to_bytes(8, "little") + ids.tobytes() + np.packbits(e.mask).tobytes())
        return digest.hexdigest()[:32]


def resolve_files(data: str, train_file: str, valid_file: str) -> tuple[Path, Path | None]:
    """The training file and the validation file (None when there is none)."""
    if train_file:
        train = Path(train_file).expanduser()
    else:
        base = Path(data).expanduser()
        train = base / "train.jsonl" if base.is_dir() else base
    need_file(train, "training data", "pass --data DIR (with train.jsonl) or --train-file FILE")
    if valid_file:
        valid = Path(valid_file).expanduser()
        need_file(valid, "validation data", "pass a JSONL file to --valid-file")
        return train, valid
    valid = train.parent / "valid.jsonl"
    return train, valid if valid.is_file() and valid != train else None


def need_file(path: Path, what: str, advice: str) -> None:
    """Refuse ``path`` unless it is a regular file, saying what it is instead."""
    if path.is_file():
        return
    if path.is_dir():
        found = "is a directory"
    elif path.exists():  # a pipe (<(...)) or a device: the data is read more than once
        found, advice = "is not a regular file (a pipe or device)", "write the data to a file and pass that"
    else:
        found = "does not exist"
    raise UserError(f"{what} {path} {found}; {advice}")


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are all different (json keeps the last of two silently)."""
    row = dict(pairs)
    if len(row) < len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return row


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false",
               type(None): "null"}
_JSONL = "mlxft reads JSONL: one object per line, with text, prompt/completion or messages"


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line; malformed lines are errors."""
    rows = []
    try:
        # A BOM (Windows editors) is not part of line 1. Lines end at "\n" only, as JSONL's do: a
        # carriage return alone is inside a row (where JSON refuses it in a string), not a new line.
        with open(path, encoding="utf-8-sig", newline="\n") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line, object_pairs_hook=_unique_keys)
                except json.JSONDecodeError as err:
                    if "\r" in line.rstrip("\r\n") and err.msg.startswith("Extra data"):
                        advice = "its lines end in a carriage return alone (classic Mac); save the file with \\n line ends"
                    elif "control character" in err.msg:
                        advice = "write tabs and line breaks inside strings as \\t and \\n"
                    elif not rows and not line.lstrip().startswith("{"):  # a .txt or a JSON array, not JSONL
                        advice = _JSONL
                    else:
                        advice = "fix or remove the line"
                    what = err.msg.removesuffix(" at")  # "Invalid control character at"
                    raise UserError(f"{path} line {number}: invalid JSON ({what} at column {err.colno}); "
                                    f"{advice}") from err
                except _DuplicateKey as err:
                    raise UserError(f"{path} line {number}: key {str(err)!r} is given twice in one object; "
                                    "keep one") from err
                except (ValueError, RecursionError) as err:  # an integer past Python's digit limit, nesting past its depth
                    raise UserError(f"{path} line {number}: JSON Python cannot read ({first_line(err)}); "
                                    "fix or remove the line") from err
                if not isinstance(row, dict):
                    raise UserError(f"{path} line {number}: expected a JSON object, got "
                                    f"{_JSON_TYPES.get(type(row), type(row).__name__)}; {_JSONL}")
                rows.append((number, row))
    except UnicodeDecodeError as err:
        raise UserError(f"{path}{_undecodable_line(path)}: not UTF-8 text ({err.reason}); save the file as UTF-8") from err
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from err
    if not rows:
        raise UserError(f"{path} holds no rows; add JSONL rows with text, prompt/completion or messages")
    return rows


def _undecodable_line(path: Path) -> str:
    """`` line N`` for the first line of ``path`` that is not UTF-8 (the text reader decodes in
    blocks, so its error does not say), or "" where none is found alone."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return f" line {number}"
    return ""


def row_kind(row: dict, where: str) -> str:
    """The row's shape. ``messages`` decides (chat datasets often carry a rendered ``text`` or
    their first ``prompt`` as well); a row with both ``text`` and a prompt or completion is
    ambiguous and refused."""
    if "messages" in row:
        return "chat"
    if "text" in row and ("prompt" in row or "completion" in row):
        both = [key for key in ("text", "prompt", "completion") if key in row]
        raise UserError(f"{where}: row has fields of two shapes ({', '.join(both)}); keep text, or prompt and "
                        "completion")
    if "prompt" in row or "completion" in row:
        return "completion"
    if "text" in row:
        return "text"
    raise UserError(f"{where}: row has none of the fields text, prompt/completion, messages (keys: {', '.join(row) or 'none'})")


def _need_str(row: dict, key: str, where: str) -> str:
    if key not in row:
        raise UserError(f"{where}: missing field '{key}'")
    if not isinstance(row[key], str):
        raise UserError(f"{where}: field '{key}' must be a string, got {type(row[key]).__name__}")
    _need_text(row[key], key, where)
    return row[key]


def _need_text(value: str, name: str, where: str) -> None:
    # JSON may spell a lone surrogate ("\ud800"), which no tokenizer can encode.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UserError(f"{where}: field '{name}' holds an unpaired surrogate ({value[err.start]!r} at "
                        f"character {err.start}); fix the \\u escape or remove it") from err


_COMMON_ROLES = ("system", "user", "assistant", "tool")


def check_row(row: dict, where: str) -> str:
    """The row's shape, once its fields have the types that shape needs (no tokenizer needed)."""
    kind = row_kind(row, where)
    if kind == "text":
        _need_str(row, "text", where)
    elif kind == "completion":
        _need_str(row, "prompt", where)
        _need_str(row, "completion", where)
    else:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{where}: field 'messages' must be a non-empty list")
        for i, m in enumerate(messages):
            if isinstance(m, dict) and m.get("content") is None and m.get("tool_calls"):
                # mlx-lm's and OpenAI's tool-call turns carry no text (no 'content', or null):
                # as the empty answer before the call that chat templates render for them.
                m["content"] = ""
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise UserError(f"{where}: messages[{i}] must be an object with string 'role' and 'content' (a turn "
                                "with 'tool_calls' may leave 'content' out); give each message both")
            _need_all_text(m, f"messages[{i}]", where)  # tool calls and the like reach the template too
            role = m["role"]
            if role != role.strip().lower() and role.strip().lower() in _COMMON_ROLES:  # "Assistant" is not supervised
                raise UserError(f"{where}: messages[{i}] has role {role!r}; chat templates know "
                                f"{role.strip().lower()!r}: write that")
    tools = row.get("tools")
    if kind != "text" and tools is not None:  # function schemas, which a chat or prompt row's template shows
        if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
            raise UserError(f"{where}: field 'tools' must be a list of objects (function schemas)")
        _need_all_text(tools, "tools", where)
    return kind


def _need_all_text(value, name: str, where: str) -> None:
    """:func:`_need_text` for every string nested in ``value`` (keys included)."""
    if isinstance(value, str):
        _need_text(value, name, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            _need_text(str(key), f"{name} key", where)
            _need_all_text(item, f"{name}.{key}", where)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _need_all_text(item, f"{name}[{i}]", where)


def check_file(path: Path) -> None:
    """Every row of ``path`` well-formed and of one shape: what can be checked before the model
    (and its tokenizer) is loaded, so a bad file fails in a moment rather than after minutes."""
    kinds: dict[str, int] = {}
    for number, row in read_jsonl(path):
        kinds.setdefault(check_row(row, f"{path} line {number}"), number)
    _one_shape(path, kinds)


def _one_shape(path: Path, kinds: dict[str, int]) -> str:
    """The one shape of a file's rows; ``kinds`` maps each shape met to its first line."""
    if len(kinds) > 1:
        first = ", ".join(f"{kind} at line {number}" for kind, number in sorted(kinds.items(), key=lambda k: k[1]))
        raise UserError(f"{path}: rows mix shapes ({first}); use one shape per file")
    return next(iter(kinds))


def _encode(tokenizer, text: str, special: bool = False) -> list[int]:
    try:  # transformers warns of "indexing errors" past the model's length; mlxft cuts or splits first
        return list(tokenizer.encode(text, add_special_tokens=special, verbose=False))
    except TypeError:  # a tokenizer without transformers' keyword
        return list(tokenizer.encode(text, add_special_tokens=special))


# Texts longer than this many characters are encoded in pieces: a fast tokenizer holds a few
# hundred bytes a token while it encodes (a 10 MB row peaked at 3.2 GB, a 60 MB row near 13;
# in pieces 0.75 and 2.4).
LONG_TEXT = 1_000_000
# Characters each side of a cut that must encode alike whole and apart (see _seam).
SEAM_CONTEXT = 2_000
_WORD_END = re.compile(r"\S(?=\s)")


def _encode_text(tokenizer, text: str) -> list[int]:
    """A text row's tokens, special tokens included, as encoding it whole gives them, encoded
    in pieces of at most :data:`LONG_TEXT` characters where it is longer. Pieces are cut only
    where the tokens do not change (:func:`_seam`); a tokenizer that adds tokens after a text,
    or a text with no such cut left, is encoded whole from there."""
    if len(text) <= LONG_TEXT:
        return _encode(tokenizer, text, special=True)
    added, head = _encode(tokenizer, "", special=True), text[:SEAM_CONTEXT]
    if _encode(tokenizer, head, special=True) != added + _encode(tokenizer, head):
        return _encode(tokenizer, text, special=True)
    ids, start = added, 0
    while len(text) - start > LONG_TEXT:
        cut = _seam(tokenizer, text, start)
        if cut is None:
            break
        ids += _encode(tokenizer, text[start:cut])
        start = cut
    return ids + _encode(tokenizer, text[start:])


def _seam(tokenizer, text: str, start: int) -> int | None:
    """A place to end the piece of ``text`` that begins at ``start``: the last word end within
    :data:`LONG_TEXT` characters where the text around it (:data:`SEAM_CONTEXT` characters each
    side) encodes to the same tokens whole as its two sides do apart. A few word ends are tried
    (a tokenizer that marks the start of every text, as SentencePiece's prefix space does, fails
    them all); None when none passes."""
    end = start + LONG_TEXT
    for _ in range(8):
        ends = list(_WORD_END.finditer(text, max(start + SEAM_CONTEXT, end - 10 * SEAM_CONTEXT), end))
        if not ends:
            return None
        cut = ends[-1].end()
        left, right = text[cut - SEAM_CONTEXT:cut], text[cut:cut + SEAM_CONTEXT]
        if _encode(tokenizer, left + right) == _encode(tokenizer, left) + _encode(tokenizer, right):
            return cut
        end = cut - 1
    return None


def _eos(tokenizer) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the tokenizer defines no EOS token; add eos_token to tokenizer_config.json")
    return int(eos)


def _whole_text_tokens(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]] | None:
    """``text`` tokenized at once, each token supervised where it starts inside a span of
    characters; None where the tokenizer gives no offsets or a span's edge is not where one
    token ends and the next starts (a token across it; offsets trimmed of a token's spaces).

    Tokenized piece by piece, a SentencePiece tokenizer (Llama 2, Mistral, Phi-3) starts each
    piece as a text: the answer "Paris" after its header became "▁Paris" (" Paris"), which the
    whole rendering writes "Pa", "ris". Where every edge falls between tokens, the pieces of
    a byte-level BPE tokenizer (Qwen, Llama 3, LFM2) are the same tokens either way."""
    hf = getattr(tokenizer, "_tokenizer", None)
    hf = hf if callable(getattr(hf, "convert_ids_to_tokens", None)) else tokenizer  # mlx-lm's wrapper, or HF's own
    if not getattr(hf, "is_fast", False):
        return None
    encoded = hf(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids, offsets = list(encoded["input_ids"]), encoded.get("offset_mapping")
    if offsets is None or len(offsets) != len(ids):
        return None
    starts, ends = {start for start, _ in offsets}, {end for _, end in offsets}
    edges = {edge for span in spans for edge in span if 0 < edge < len(text)}
    if any(edge not in starts or edge not in ends for edge in edges) or any(
            start < edge < end for start, end in offsets for edge in edges):
        return None
    return ids, [any(s <= start < e for s, e in spans) for start, _ in offsets]


def _from_segments(tokenizer, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Tokenize text pieces together where the tokenizer can say which piece each token came
    from (:func:`_whole_text_tokens`), else separately, and tag each."""
    text, spans, at = "", [], 0
    for piece, supervised in segments:
        if supervised and piece:
            spans.append((at, at + len(piece)))
        text, at = text + piece, at + len(piece)
    whole = _whole_text_tokens(tokenizer, text, spans)
    if whole is not None:
        return whole
    ids: list[int] = []
    mask: list[bool] = []
    for text, supervised in segments:
        if text:
            piece = _encode(tokenizer, text)
            ids += piece
            mask += [supervised] * len(piece)
    return ids, mask


# The day templates that stamp one render in training and evaluation: by the clock a row's
# tokens, and the training-set fingerprint a resume checks, would change at midnight. It is the
# date Llama 3.x's template itself falls back to without a clock.
TEMPLATE_DAY = datetime.datetime(2024, 7, 26)
TEMPLATE_DATE = f"{TEMPLATE_DAY:%d %b %Y}"


@contextlib.contextmanager
def _template_clock():
    """transformers' clock, which templates read through ``strftime_now`` (Granite, Mistral
    Small), held at :data:`TEMPLATE_DAY`; left alone where that module has no such clock."""
    try:
        from transformers.utils import chat_template_utils as module
    except ImportError:
        module = None
    clock = getattr(module, "datetime", None)
    if not (isinstance(clock, type) and issubclass(clock, datetime.datetime)):
        yield
        return

    class Held(clock):
        @classmethod
        def now(cls, tz=None):
            return TEMPLATE_DAY.replace(tzinfo=tz)

    module.datetime = Held
    try:
        yield
    finally:
        module.datetime = clock


def render_on_template_day(tokenizer, messages, **kwargs) -> str:
    """``tokenizer.apply_chat_template`` as text, a date the template writes being
    :data:`TEMPLATE_DATE`: as ``date_string`` (Llama 3.x) or by the clock (:func:`_template_clock`)."""
    with _template_clock():
        return tokenizer.apply_chat_template(messages, tokenize=False, date_string=TEMPLATE_DATE, **kwargs)


def _render(tokenizer, messages, generation_prompt: bool, tools: list | None = None) -> str:
    """The chat as the template writes it; ``tools`` (a row's function schemas, as mlx-lm's chat
    rows give them) go to the template, which lists them where the model will see them."""
    extra = {"tools": tools} if tools else {}
    return render_on_template_day(tokenizer, messages, add_generation_prompt=generation_prompt, **extra)


def _incremental_spans(tokenizer, messages: list, full: str, tools: list | None = None) -> list[tuple[int, int]] | None:
    """Assistant spans when every prefix of the chat renders as a prefix of the whole.

    A turn runs from the end of the prefix rendered with a generation prompt to the end of
    the rendering that includes it, so role headers never count and whatever the template
    puts around the content (end-of-turn token, reasoning block) does.
    """
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:  # no prompt to end a role header; the content search leaves the header out
            return None
        try:
            prompt = _render(tokenizer, messages[:i], True, tools)
            upto = _render(tokenizer, messages[: i + 1], False, tools)
        except Exception:  # a template that rejects a prefix (one that must end the chat with an answer)
            return None
        if not (upto.startswith(prompt) and full.startswith(upto)) or (spans and len(prompt) < spans[-1][1]):
            return None
        spans.append((len(prompt), len(upto)))
    return spans


def _end_of_turn(tokenizer) -> str:
    """The text a template puts after an assistant turn's content (see :func:`_probe_end_of_turn`)."""
    return _probe_end_of_turn(tokenizer, getattr(tokenizer, "chat_template", None))


# Once per tokenizer and template, not per row: the probe renders two chats and encodes
# a dozen strings (4 ms with Qwen3's), and every multi-turn row that rewrites earlier turns asks.
@functools.lru_cache(maxsize=4)
def _probe_end_of_turn(tokenizer, template) -> str:
    """The text a template puts after an assistant turn's content, from a two-turn probe.

    It is what follows the first answer both when the chat ends there and when it goes on:
    the end of a conversation may add more (Phi-3.5 appends EOS), and the next turn's header
    is not part of it. Cut back to whole tokens, because "<|end|>\n<|endoftext|>" and
    "<|end|>\n<|user|>" also share "<|".
    """
    answer = "\x00probe\x00"
    one = [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]
    two = one + [{"role": "user", "content": "r"}, {"role": "assistant", "content": "s"}]
    try:
        renders = [_render(tokenizer, chat, False) for chat in (one, two)]
    except Exception:  # a template that rejects the probe: no end-of-turn text to look for
        return ""
    tails = [text[text.index(answer) + len(answer):] for text in renders if answer in text]
    if len(tails) < 2:
        return ""
    tokens = [_encode(tokenizer, tail) for tail in tails]

    def whole_tokens(text: str) -> bool:
        ids = _encode(tokenizer, text)
        return all(t[: len(ids)] == ids for t in tokens)

    eot = os.path.commonprefix(tails)
    while eot and not whole_tokens(eot):
        eot = eot[:-1]
    return eot


@functools.lru_cache(maxsize=4)
def _probe_assistant_header(tokenizer, template) -> str:
    """What the generation prompt adds: the header that opens an assistant turn."""
    chat = [{"role": "user", "content": "q"}]
    try:
        prompt, plain = _render(tokenizer, chat, True), _render(tokenizer, chat, False)
    except Exception:  # a template that rejects the probe: no header, content spans as before
        return ""
    return prompt[len(plain):] if prompt.startswith(plain) else ""


def _assistant_header(tokenizer) -> str:
    return _probe_assistant_header(tokenizer, getattr(tokenizer, "chat_template", None))


# A leading reasoning block, which templates such as Qwen3's drop from earlier turns.
_REASONING = re.compile(r"^\s*<think>.*?</think>", re.S)


def without_reasoning(text: str) -> str:
    """``text`` without a leading ``<think>...</think>`` block."""
    return _REASONING.sub("", text, count=1)


def _find(full: str, content: str, cursor: int, end_of_turn: str, repeated: bool = False) -> tuple[int, int] | None:
    """Where ``content`` is rendered at or after ``cursor``: as given, trimmed (Llama 3 trims)
    or without its reasoning block (nothing left: an empty answer at ``cursor``). A match
    followed by the end-of-turn text comes first, so a short answer such as "d" is not taken
    from inside "<|im_end|>" or a role header. ``repeated``: a later message says the same,
    and that match may be the later message's where this one's content is not what closes its
    turn (a tool result, an answer before its tool calls); then a match a turn earlier wins."""
    for text in dict.fromkeys((content, content.strip(), without_reasoning(content).strip())):
        if not text:
            return cursor, cursor
        at = full.find(text + end_of_turn, cursor) if end_of_turn else -1
        plain = full.find(text, cursor)
        if at >= 0 and repeated and full.find(end_of_turn, plain + len(text), at) >= 0:
            at = plain
        at = at if at >= 0 else plain
        if at >= 0:
            return at, at + len(text)
    return None


# Private-use characters, which no chat template writes, around a message's index: a mark
# stands for a content in a rendering of the chat's structure.
_MARK = re.compile("\ue000[0-9]+[ra]?\ue001")
_THINK_PARTS = re.compile(r"^(\s*<think>)(.*?)(</think>)(.*)$", re.S)


def _mark(text: str, key: str, cores: dict[str, str]) -> str:
    """``text`` with its core (the text inside its outer whitespace) replaced by a mark, so a
    template that trims renders the mark where it would have rendered the core."""
    core = text.strip()
    if not core:
        return text
    mark = f"\ue000{key}\ue001"
    cores[mark] = core
    return text[: len(text) - len(text.lstrip())] + mark + text[len(text.rstrip()):]


def _marked_content(content: str, index: int, cores: dict[str, str]) -> str:
    """A content with marks for its answer and its leading reasoning block's text, keeping the
    ``<think>`` tags a template looks for."""
    parts = _THINK_PARTS.match(content)
    if parts is None:
        return _mark(content, str(index), cores)
    head, reasoning, close, answer = parts.groups()
    return head + _mark(reasoning, f"{index}r", cores) + close + _mark(answer, f"{index}a", cores)


def _marked_spans(tokenizer, messages: list, full: str, where: str, tools: list | None) -> list[tuple[int, int]] | None:
    """Assistant spans found on a rendering with every content replaced by a unique mark.

    A content search on the chat itself can match a short content inside template text: a
    tool's "5" inside the tool call's arguments {"x": -5} before it, a later turn's equal
    answer. Marks match only where their content was rendered. The spans carry over when the
    marks, replaced by the contents, give the chat's own rendering to the character (the
    template copied every content as it is, or trimmed); else None.
    """
    if "\ue000" in full or "\ue001" in full:
        return None
    cores: dict[str, str] = {}
    marked = [dict(m, content=_marked_content(m["content"], i, cores)) for i, m in enumerate(messages)]
    try:
        skeleton = _render(tokenizer, marked, False, tools)
    except Exception:  # a template that rejects the marked chat: search the contents themselves
        return None
    marks = _MARK.findall(skeleton)
    if len(set(marks)) != len(marks) or any(mark not in cores for mark in marks):
        return None
    if _MARK.sub(lambda found: cores[found.group()], skeleton) != full:
        return None
    shifts = []  # each mark's place in the skeleton, and how far the contents up to its end move the text
    moved = 0
    for found in _MARK.finditer(skeleton):
        moved += len(cores[found.group()]) - len(found.group())
        shifts.append((found.start(), found.end(), moved))

    def real(at: int) -> int | None:
        """A skeleton offset in the chat's rendering; None inside a mark."""
        shift = 0
        for start, end, total in shifts:
            if at <= start:
                break
            if at < end:
                return None
            shift = total
        return at + shift

    try:
        spans = [(real(start), real(end)) for start, end in _content_spans(tokenizer, marked, skeleton, where)]
    except UserError:  # a content the template left out: the search on the chat itself says so
        return None
    return None if any(None in span for span in spans) else spans


def _content_spans(tokenizer, messages: list, full: str, where: str) -> list[tuple[int, int]]:
    """Assistant spans for templates that rewrite earlier turns (e.g. dropping reasoning).

    Every message's content is found in order, each after the one before, so an answer is
    never matched inside the system prompt or the user turn before it; a message the
    template leaves out (a dropped system prompt) is skipped. A span is the answer and the
    end-of-turn text after it; an empty answer supervises only its end-of-turn, the last one
    before the next message's content. The chat's last message keeps whatever the template
    closes the conversation with, as the incremental spans do.
    """
    end_of_turn = _end_of_turn(tokenizer)
    found, cursor = [], 0
    for i, m in enumerate(messages):
        repeated = any(later["content"].strip() == m["content"].strip() for later in messages[i + 1:])
        at = _find(full, m["content"], cursor, end_of_turn, repeated) if m["content"].strip() else (cursor, cursor)
        if at is None and m["role"] == "assistant":
            raise UserError(f"{where}: an assistant turn's content does not appear in the chat template's rendering")
        found.append(at)
        cursor = at[1] if at else cursor
    header = _assistant_header(tokenizer)
    spans: list[tuple[int, int]] = []
    for i, (m, at) in enumerate(zip(messages, found)):
        if m["role"] != "assistant":
            continue
        start, end = at
        # An empty message is placed where the content before it ended, which is no bound.
        limit = next((s for s, e in filter(None, found[i + 1:]) if s > start and e > s), len(full))
        own = full.find(header, start, limit) if header and start == end else -1  # this turn's header
        if start == end:
            # This turn's own end-of-turn: the first after its header. Empty messages after it
            # (a tool that returned "", an empty user turn) render their turns before ``limit``.
            if end_of_turn:
                close = full.find(end_of_turn, own + len(header), limit) if own >= 0 else full.rfind(end_of_turn, start, limit)
            else:
                close = -1
            if close < 0:
                continue
            start = end = close
            # What the template wrote for the turn besides its content (tool calls) counts too;
            # an empty reasoning block alone does not.
            h = own if own >= 0 else (full.rfind(header, at[0], close) if header else -1)
            if h >= 0:
                body = full[h + len(header):close]
                kept = without_reasoning(body)
                if kept.strip():
                    start = close - len(kept.lstrip())
        # The reasoning the template wrote before an answer (or before tool calls alone) is learned too.
        start = _with_reasoning_before(full, header, start, spans[-1][1] if spans else 0)
        if start != end and end_of_turn and not full.startswith(end_of_turn, end):
            close = full.find(end_of_turn, end, limit)  # tool calls after the content, then its end-of-turn
            if close >= 0:
                end = close
        if end_of_turn and full.startswith(end_of_turn, end):
            end += len(end_of_turn)
        if i == len(messages) - 1:
            end = len(full)
        if start >= (spans[-1][1] if spans else 0) and end > start:
            spans.append((start, end))
    return spans


def _with_reasoning_before(full: str, header: str, start: int, floor: int) -> int:
    """Where an answer's span starts when the template wrote a non-empty reasoning block
    (Qwen3's ``reasoning_content``) between the turn's header and the content: at the block,
    which the model is to learn as the incremental spans teach it; else at ``start``."""
    h = full.rfind(header, floor, start) if header else -1
    if h < 0:
        return start
    body = full[h + len(header):start]
    block = _REASONING.match(body)
    if block is None or body[block.end():].strip() or not block.group(0).strip()[len("<think>"):-len("</think>")].strip():
        return start
    return h + len(header) + (len(body) - len(body.lstrip()))


def _check_rendered(messages: list, full: str, where: str) -> None:
    """Refuse a message of a role templates commonly leave out ("developer", "human"): the
    model would train without it. The common roles are not checked, as templates render them
    by design in other words: Mistral's writes a system prompt only before the last question,
    Llama 3.1's drops an answer's text beside its tool calls. A tool result may be written as
    a JSON string (Llama 3.1's ``| tojson``) and content trimmed."""
    for i, m in enumerate(messages):
        content = m["content"].strip()
        if m["role"] in _COMMON_ROLES or not content:
            continue
        forms = (content, json.dumps(content, ensure_ascii=False)[1:-1], json.dumps(content)[1:-1])
        if not any(form in full for form in forms):
            raise UserError(f"{where}: messages[{i}] has role {m['role']!r}, which the chat template leaves out of "
                            f"its rendering; use a role it renders (such as {', '.join(_COMMON_ROLES)})")


def encode_chat(tokenizer, messages: list, completion_only: bool, where: str,
                tools: list | None = None) -> tuple[list[int], list[bool]]:
    """Render with the chat template; supervise every assistant turn, its end-of-turn included.
    ``messages`` (and ``tools``) are well-formed (:func:`check_row`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{where}: chat rows need a tokenizer with a chat template; this model's tokenizer has none")
    try:
        full = _render(tokenizer, messages, False, tools)
    except Exception as err:  # jinja raises its own exception types for template errors
        raise UserError(f"{where}: the chat template rejected these messages ({first_line(err)})") from err
    _check_rendered(messages, full, where)
    spans = _incremental_spans(tokenizer, messages, full, tools)
    if spans is None:
        spans = _marked_spans(tokenizer, messages, full, where, tools)
    if spans is None:
        spans = _content_spans(tokenizer, messages, full, where)
    segments: list[tuple[str, bool]] = []
    done = 0
    for start, end in spans:
        segments += [(full[done:start], False), (full[start:end], True)]
        done = end
    segments.append((full[done:], False))
    ids, mask = _from_segments(tokenizer, segments)
    if not completion_only:
        mask = [True] * len(ids)
    return ids, mask


def renders_chat(tokenizer, prompt_format: str) -> bool:
    """Whether a prompt (and its completion) is rendered with the tokenizer's chat template;
    any other format than these three is an error, not raw text."""
    if prompt_format not in PROMPT_FORMATS:
        raise UserError(f"prompt_format {prompt_format!r} is not one of {', '.join(PROMPT_FORMATS)}")
    return prompt_format == "chat" or (prompt_format == "auto" and bool(getattr(tokenizer, "chat_template", None)))


def encode_row(row: dict, tokenizer, completion_only: bool, prompt_format: str, where: str) -> tuple[str, list[int], list[bool]]:
    kind = check_row(row, where)
    if kind == "text":
        if not row["text"].strip():  # no document (with a BOS it would train an empty one)
            return kind, [], []
        ids = _encode_text(tokenizer, row["text"])
        if ids[-1:] != [_eos(tokenizer)]:  # a document that already ends in EOS keeps one
            ids.append(_eos(tokenizer))
        return kind, ids, [True] * len(ids)
    if kind == "chat":
        return (kind, *encode_chat(tokenizer, row["messages"], completion_only, where, row.get("tools")))
    prompt, completion = row["prompt"], row["completion"]
    if renders_chat(tokenizer, prompt_format):
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        # As mlx-lm renders such a row: with its tools (they had been dropped unread).
        return (kind, *encode_chat(tokenizer, messages, completion_only, where, row.get("tools")))
    if row.get("tools"):
        raise UserError(f"{where}: field 'tools' needs the chat template, but prompts are rendered raw (--prompt-format "
                        "raw, or a tokenizer without a template); drop 'tools' or use --prompt-format chat")
    # What the tokenizer adds around a text (a BOS), then prompt and completion as one text.
    added = _encode(tokenizer, "", special=True)
    if _encode(tokenizer, prompt, special=True) == added + _encode(tokenizer, prompt):
        ids, mask = _from_segments(tokenizer, [(prompt, False), (completion, True)])
        ids, mask = added + ids, [False] * len(added) + mask
    else:  # a tokenizer that adds tokens after a text too: the prompt as inference encodes it
        head, tail = _encode(tokenizer, prompt, special=True), _encode(tokenizer, completion)
        ids, mask = head + tail, [False] * len(head) + [True] * len(tail)
    if ids[-1:] != [_eos(tokenizer)]:  # a completion that already ends in EOS keeps one, as text rows do
        ids, mask = ids + [_eos(tokenizer)], mask + [True]
    if not completion_only:
        mask = [True] * len(ids)
    return kind, ids, mask


def check_token_ids(dataset: Dataset, vocab_size: int | None, name: str = "") -> None:
    """Refuse token ids the model's embedding does not have: MLX does not check an index, so
    they would train on whatever memory lies past the table. From a file they come from a
    tokenizer with more tokens than the model (its added or special tokens); ``name`` names a
    dataset built in Python."""
    for number, example in enumerate(dataset.examples):
        ids = np.asarray(example.ids)
        outside = (ids < 0) | (ids >= vocab_size) if vocab_size else ids < 0
        if not outside.any():
            continue
        token = int(ids[outside][0])
        if dataset.lines is not None:
            raise UserError(f"{dataset.path}: line {dataset.lines[number]} tokenizes to id {token}, outside the "
                            f"model's vocabulary of {vocab_size}: the tokenizer holds tokens the model's embedding "
                            "does not; use the model's own tokenizer, or a model with an embedding row for each token")
        raise UserError(f"the {name} dataset's example {number} holds token id {token}, outside the model's "
                        f"vocabulary of {vocab_size or 'ids from 0'}; tokenize with the model's tokenizer")


def text_windows(ids: list[int], max_seq_length: int) -> list[list[int]]:
    """A long document as consecutive windows of ``max_seq_length`` tokens, each starting at
    the last token of the one before: every token after the first is a target exactly once."""
    step = max_seq_length - 1
    return [ids[start : start + max_seq_length] for start in range(0, len(ids) - 1, step)]


def load_dataset(path: Path, tokenizer, max_seq_length: int, completion_only: bool = True, prompt_format: str = "auto",
                 warn: bool = True) -> Dataset:
    """Tokenize every row once; split long text rows into windows, truncate other long rows and
    skip rows with nothing supervised, saying so on stderr unless not ``warn`` (a data-parallel
    run's other ranks)."""
    if not isinstance(max_seq_length, int) or max_seq_length < 2:  # a window must hold a token and its target
        raise UserError(f"max_seq_length must be an integer >= 2, got {max_seq_length!r}")
    examples: list[Example] = []
    lines: list[int] = []
    kinds: dict[str, int] = {}
    truncated = skipped = split = 0
    for number, row in read_jsonl(path):
        where = f"{path} line {number}"
        kind, ids, mask = encode_row(row, tokenizer, completion_only, prompt_format, where)
        kinds.setdefault(kind, number)
        pieces = [(ids, mask)]
        if len(ids) > max_seq_length and kind == "text":  # pretraining text: nothing dropped
            pieces = [(window, [True] * len(window)) for window in text_windows(ids, max_seq_length)]
            split += 1
        elif len(ids) > max_seq_length:
            pieces = [(ids[:max_seq_length], mask[:max_seq_length])]
            truncated += 1
        for ids, mask in pieces:
            example = Example(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool))
            if example.supervised == 0:
                skipped += 1
                continue
            examples.append(example)
            lines.append(number)
    kind = _one_shape(path, kinds)
    # A text row's first token is only context: one token (an end-of-text alone) teaches nothing.
    nothing = "text rows with no token to predict (empty, or a single token)" if kind == "text" \
        else "rows with no supervised token"
    if not examples:
        if truncated:  # the limit cut the answers off, not the data
            raise UserError(f"{path}: no row has a supervised token within max_seq_length={max_seq_length} "
                            f"({truncated} of {skipped} rows were cut); raise --max-seq-length")
        if kind == "text":
            raise UserError(f"{path}: no row's text has a token to predict (each is empty or a single token); "
                            "add text")
        raise UserError(f"{path}: no row has a supervised token (all {skipped} rows skipped); check completions / assistant turns")
    if split and warn:
        print(f"note: {path}: {split} text rows longer than max_seq_length={max_seq_length} were split into "
              f"windows of that length ({len(examples)} examples in all)", file=sys.stderr)
    if truncated and warn:
        print(f"warning: {path}: {truncated} of {len(examples) + skipped} rows were longer than "
              f"max_seq_length={max_seq_length} and were truncated", file=sys.stderr)
    if skipped and warn:
        print(f"warning: {path}: skipped {skipped} {nothing}", file=sys.stderr)
    return Dataset(path, examples, kind, truncated, skipped, lines)


def epoch_batches(lengths: np.ndarray, batch_size: int, seed: int, epoch: int, shuffle: bool = True,
                  max_batches: int = 0) -> list[np.ndarray]:
    """The batches of one epoch as index arrays; the last one may be short.

    With ``shuffle=False`` (evaluation) rows are simply taken in length order; ``max_batches``
    (> 0) keeps the first ``max_batches * batch_size`` rows in file order, so a capped
    evaluation scores rows of every length rather than only the shortest ones.
    Shuffled from (seed, epoch) alone, then sorted by length inside windows of
    ``LENGTH_GROUP_BATCHES`` batches so rows of similar length share a batch.
    """
    n = len(lengths)
    if not shuffle:  # evaluation: length-sorted for the least padding
        rows = np.arange(min(n, max_batches * batch_size) if max_batches else n)
        order = rows[np.argsort(lengths[rows], kind="stable")]
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n)
    window = batch_size * LENGTH_GROUP_BATCHES
    grouped = []
    for i in range(0, n, window):
        chunk = order[i : i + window]
        grouped.append(chunk[np.argsort(-lengths[chunk], kind="stable")])
    order = np.concatenate(grouped)
    batches = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def round_up(n: int, multiple: int) -> int:
    return max(multiple, math.ceil(n / multiple) * multiple)


def padded_supervised_count(supervised: int, batch_tokens: int, bucket: int) -> int:
    """How many supervised positions a batch of ``batch_tokens`` inputs carries, padding included.

    Padded to a quarter of the batch's token grid: at most four compiled shapes per width (a
    bucket-sized grid gave dozens), for head work on at most ``batch_tokens / 4`` more rows."""
    return round_up(supervised, max(bucket, round_up(batch_tokens // 4, bucket)))


@dataclass
class Batch:
    """A padded micro-batch in the layout the loss takes.

    ``positions`` index the flattened ``[B * T]`` inputs whose next token is supervised;
    ``targets`` and ``weights`` belong to those positions. The sequence length is padded to
    the bucket and the supervised count to :func:`padded_supervised_count` (weight 0), so the
    compiled step sees a bounded set of shapes. A packed batch
    also carries each token's position inside its document and its document (segment) id,
    both ``[B, T]`` (see :mod:`mlxft.packing`).
    """

    inputs: np.ndarray
    positions: np.ndarray
    targets: np.ndarray
    weights: np.ndarray
    real_tokens: int
    doc_positions: np.ndarray | None = None
    segments: np.ndarray | None = None

    @property
    def supervised(self) -> int:
        return int(self.weights.sum())

    def arrays(self):
        import mlx.core as mx

        arrays = [self.inputs, self.positions, self.targets, self.weights]
        if self.doc_positions is not None:
            arrays += [self.doc_positions, self.segments]
        return tuple(mx.array(a) for a in arrays)


def make_batch(examples: list[Example], batch_size: int, bucket: int, pack: bool = False) -> Batch:
    """Pad ``examples`` (at most ``batch_size``) to ``[batch_size, T]`` with T a bucket multiple.

    With ``pack`` the rows are laid end to end in as few sequences of width T as they fit
    (when that saves any), each remaining an isolated document. No examples (a data-parallel
    rank's share of a short last batch) gives an all-padding batch."""
    lengths = [len(e.ids) - 1 for e in examples]
    width = round_up(max(lengths, default=1), bucket)
    layout = None
    if pack and len(examples) > 1:
        from mlxft.packing import pack_layout

        layout = pack_layout(lengths, width)
        if len(layout[0]) == len(examples):  # one row per sequence: nothing to gain
            layout = None
    bins = layout[0] if layout else [[i] for i in range(len(examples))]
    inputs = np.zeros((len(bins) if layout else batch_size, width), dtype=np.int32)
    positions, targets = [], []
    for row, members in enumerate(bins):
        start = 0
        for i in members:
            e, n = examples[i], lengths[i]
            inputs[row, start:start + n] = e.ids[:-1]
            supervised = np.nonzero(e.mask[1:])[0]
            positions.append(row * width + start + supervised)
            targets.append(e.ids[1:][supervised])
            start += n
    positions = np.concatenate(positions or [np.zeros(0)]).astype(np.int32)
    targets = np.concatenate(targets or [np.zeros(0)]).astype(np.int32)
    pad = padded_supervised_count(len(positions), inputs.size, bucket) - len(positions)
    weights = np.concatenate([np.ones(len(positions), np.float32), np.zeros(pad, np.float32)])
    positions = np.concatenate([positions, np.zeros(pad, np.int32)])
    targets = np.concatenate([targets, np.zeros(pad, np.int32)])
    batch = Batch(inputs, positions, targets, weights, sum(lengths))
    if layout:
        batch.doc_positions, batch.segments = layout[1], layout[2]
    return batch
