"""Rows to ids and masks, and masks to batches."""

import itertools
import json
import re

import numpy as np
import pytest

from mlxft import RunConfig
from mlxft.data import check_file, encode_chat, encode_row, epoch_batches, load_dataset, make_batch, resolve_files
from mlxft.errors import UserError
from mlxft.trainer import Trainer

from conftest import write_jsonl

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]

# A ChatML template without Qwen3's reasoning block: every prefix renders as a prefix.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def runs(tokenizer, ids, mask):
    return [(flag, tokenizer.decode([i for i, _ in group])) for flag, group in itertools.groupby(zip(ids, mask), key=lambda t: t[1])]


def test_chat_mask_covers_exactly_assistant_turns_qwen3_template(tokenizer):
    """Qwen3's real template rewrites earlier turns, so spans are found by content."""
    ids, mask = encode_chat(tokenizer, CHAT, True, "test")
    assert runs(tokenizer, ids, mask) == [
        (False, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"),
        (True, "Hello!<|im_end|>\n"),
        (False, "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        (True, "4<|im_end|>\n"),
    ]
    full = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert tokenizer.decode(ids) == full


def test_chat_mask_incremental_template(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer._tokenizer, "chat_template", CHATML)
    ids, mask = encode_chat(tokenizer, CHAT, True, "test")
    assert runs(tokenizer, ids, mask) == [
        (False, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"),
        (True, "Hello!<|im_end|>\n"),
        (False, "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"),
        (True, "4<|im_end|>\n"),
    ]
    ids_all, mask_all = encode_chat(tokenizer, CHAT, False, "test")
    assert ids_all == ids and all(mask_all)


def supervised(tokenizer, messages):
    ids, mask = encode_chat(tokenizer, messages, True, "test")
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    return [text for flag, text in runs(tokenizer, ids, mask) if flag]


def turns(*pairs, system=None):
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": role, "content": c} for q, a in pairs for role, c in (("user", q), ("assistant", a))]


@pytest.mark.parametrize(
    "messages, answers",
    [
        # Answers that also appear in the system prompt or in the user turn before them.
        (turns(("2+2?", "4"), ("3+3?", "6"), system="Answer 4 or 6 only."), ["4<|im_end|>\n", "6<|im_end|>\n"]),
        (turns(("Say ok", "ok"), ("Say d", "d")), ["ok<|im_end|>\n", "d<|im_end|>\n"]),
        # An empty answer is trained to end its turn at once.
        (turns(("Say ok", "ok"), ("again", "")), ["ok<|im_end|>\n", "<|im_end|>\n"]),
        (turns(("a", ""), ("b", "ok")), ["<|im_end|>\n", "ok<|im_end|>\n"]),
        # Qwen3 drops the reasoning of earlier turns: the answer without it is what the chat shows.
        (turns(("2+2?", "<think>\nadd them\n</think>\n\n4"), ("3+3?", "<think>\nadd them\n</think>\n\n6")),
         ["4<|im_end|>\n", "<think>\nadd them\n</think>\n\n6<|im_end|>\n"]),
        (turns(("2+2?", "<think>\nadd them\n</think>"), ("3+3?", "6")), ["<|im_end|>\n", "6<|im_end|>\n"]),
    ],
)
def test_multi_turn_qwen3_supervises_exactly_the_answers(tokenizer, messages, answers):
    assert supervised(tokenizer, messages) == answers


@pytest.mark.parametrize("template", [None, CHATML])
def test_role_header_of_a_leading_assistant_turn_is_not_supervised(tokenizer, monkeypatch, template):
    if template:
        monkeypatch.setattr(tokenizer._tokenizer, "chat_template", template)
    messages = [{"role": "assistant", "content": "Hello! How can I help?"}, *turns(("2+2?", "4"))]
    assert supervised(tokenizer, messages) == ["Hello! How can I help?<|im_end|>\n", "4<|im_end|>\n"]


def test_a_template_that_rejects_a_chat_ending_with_a_question_still_masks_the_answers(tokenizer, monkeypatch):
    # The incremental spans render each prefix up to a question; where the template refuses
    # that, the answers are found in the whole chat's rendering instead.
    strict = "{% if messages[-1].role != 'assistant' %}{{ raise_exception('end with an answer') }}{% endif %}" + CHATML
    monkeypatch.setattr(tokenizer._tokenizer, "chat_template", strict)
    assert supervised(tokenizer, turns(("2+2?", "4"), ("3+3?", "6"))) == ["4<|im_end|>\n", "6<|im_end|>\n"]


def test_rows_end_at_line_feeds_only(tmp_path, tokenizer):
    # A carriage return between a row's tokens (JSON whitespace) split the row in two, an error
    # about a string cut short; Windows line ends stay fine.
    path = tmp_path / "cr.jsonl"
    path.write_bytes(b'{"text":\r "one"}\r\n{"text": "two"}\r\n{"text": "a\rb"}\n')
    with pytest.raises(UserError, match="cr.jsonl line 3: invalid JSON"):
        check_file(path)
    path.write_bytes(b'{"text": "a"}\r{"text": "b"}\r')  # classic Mac line ends: one line, said so
    with pytest.raises(UserError, match=r"cr.jsonl line 1: invalid JSON \(Extra data at column 15\); its lines end in "
                                        r"a carriage return alone \(classic Mac\); save the file with \\n line ends"):
        check_file(path)
    path.write_bytes(b'{"text":\r "one"}\r\n{"text": "two"}\r\n')
    assert [e.ids.size > 1 for e in load_dataset(path, tokenizer, 64).examples] == [True, True]


def test_a_message_the_template_leaves_out_is_an_error_not_a_silent_drop(tmp_path, tokenizer, monkeypatch):
    # Templates skip roles they do not know: the "developer" instruction never reached the model.
    known = ("{% for m in messages %}{% if m.role in ['user', 'assistant'] %}<|im_start|>{{ m.role }}\n"
             "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    monkeypatch.setattr(tokenizer._tokenizer, "chat_template", known)
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]},
            {"messages": [{"role": "developer", "content": "Answer in French."}, *turns(("hi", "oui"))]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(UserError, match=r"d.jsonl line 2: messages\[0\] has role 'developer', which the chat "
                                        "template leaves out of its rendering"):
        load_dataset(path, tokenizer, 64)
    assert len(load_dataset(write_jsonl(tmp_path / "ok.jsonl", rows[:1]), tokenizer, 64)) == 1
    # Llama 3.1's template writes an ipython result as a JSON string: escaped, but there.
    as_json = known.replace("{% if m.role in ['user', 'assistant'] %}", "{% if m.role == 'ipython' %}{{ m.content | tojson }}"
                            "{% elif m.role in ['user', 'assistant'] %}")
    monkeypatch.setattr(tokenizer._tokenizer, "chat_template", as_json)
    tool = [{"messages": [*turns(("weather?", "Let me look.")), {"role": "ipython", "content": '{"sky": "clear"}\nü'},
                          {"role": "assistant", "content": "Clear."}]}]
    assert len(load_dataset(write_jsonl(tmp_path / "tool.jsonl", tool), tokenizer, 64)) == 1
    # The common roles are the template's to word: a system prompt it leaves out here (Mistral's
    # writes one only before the last question) is not refused.
    monkeypatch.setattr(tokenizer._tokenizer, "chat_template", known)
    system = [{"messages": [{"role": "system", "content": "Be a pirate."}, *turns(("hi", "Arr!"))]}]
    assert len(load_dataset(write_jsonl(tmp_path / "system.jsonl", system), tokenizer, 64)) == 1


def test_end_of_turn_excludes_what_ends_the_conversation(tokenizer, monkeypatch):
    """A Phi-3.5-style template appends EOS after the last turn: earlier turns still end with <|end|>."""
    phi = ("{% for m in messages %}{{ '<|' + m.role + '|>\n' + m.content + '<|end|>\n' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
    monkeypatch.setattr(tokenizer._tokenizer, "chat_template", phi)
    assert supervised(tokenizer, turns(("Hi", "Hello there"), ("Bye", "Goodbye now"))) == [
        "Hello there<|end|>\n", "Goodbye now<|end|>\n<|im_end|>"]


def test_shapes_and_masks(tmp_path, tokenizer):
    text = load_dataset(write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}]), tokenizer, 64)
    e = text.examples[0]
    assert e.mask.all() and e.ids[-1] == tokenizer.eos_token_id and text.kind == "text"

    raw = load_dataset(write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q: hi\nA:", "completion": " yes"}]), tokenizer, 64,
                       prompt_format="raw")
    e = raw.examples[0]
    assert tokenizer.decode(e.ids[e.mask].tolist()) == " yes<|im_end|>"
    assert tokenizer.decode(e.ids[~e.mask].tolist()) == "Q: hi\nA:"

    chat = load_dataset(write_jsonl(tmp_path / "pc2.jsonl", [{"prompt": "hi", "completion": "yes"}]), tokenizer, 64)
    e = chat.examples[0]
    # Incremental rendering: what the template adds after the generation prompt counts.
    assert tokenizer.decode(e.ids[e.mask].tolist()) == "<think>\n\n</think>\n\nyes<|im_end|>\n"


def test_truncation_and_skipping_are_counted(tmp_path, tokenizer, capsys):
    rows = [
        {"prompt": "a " * 50, "completion": "b"},  # the completion falls beyond the cut: skipped
        {"prompt": "hi", "completion": "long answer " * 20},  # truncated, still supervised
        {"prompt": "hi", "completion": "ok"},
    ]
    ds = load_dataset(write_jsonl(tmp_path / "x.jsonl", rows), tokenizer, 24)
    assert (len(ds), ds.skipped, ds.truncated) == (2, 1, 2)
    assert max(len(e.ids) for e in ds.examples) == 24
    err = capsys.readouterr().err
    assert "2 of 3 rows were longer than max_seq_length=24" in err and "skipped 1 rows" in err


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "ok"}\n{"text": "broken"\n', "line 2: invalid JSON"),
        ('{"text": "ok"}\n[1, 2]\n', "line 2: expected a JSON object"),
        ('{"text": 5}\n', "line 1: field 'text' must be a string"),
        ('{"prompt": "p"}\n', "line 1: missing field 'completion'"),
        ('{"foo": 1}\n', "line 1: row has none of the fields"),
        ('{"messages": [{"role": "user"}]}\n', "line 1: messages[0] must be an object"),
        ('{"text": "a\\ud800b"}\n', "line 1: field 'text' holds an unpaired surrogate"),
        ('{"messages": [{"role": "user", "content": "\\udc00"}]}\n', "line 1: field 'messages[0].content' holds an unpaired"),
        ("\n\n", "holds no rows"),
        ('{"text": "a"}\n{"prompt": "p", "completion": "c"}\n', "rows mix shapes (text at line 1, completion at line 2)"),
        (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "line 2: not UTF-8 text"),  # a Latin-1 export
        ('{"text": "ok"}\n{"n": 1' + "0" * 5000 + "}\n", "line 2: JSON Python cannot read"),
        ("[" * 100_000 + "]" * 100_000 + "\n", "line 1: JSON Python cannot read"),
        # json keeps the last of two keys and the first shape found won: both trained the wrong thing silently.
        ('{"prompt": "Q", "completion": "no", "completion": "yes"}\n', "line 1: key 'completion' is given twice"),
        ('{"messages": [{"role": "user", "role": "assistant", "content": "x"}]}\n', "key 'role' is given twice"),
        ('{"text": "t", "prompt": "Q", "completion": "A"}\n', "line 1: row has fields of two shapes (text, prompt"),
        ("plain text, not JSONL\n", "line 1: invalid JSON (Expecting value at column 1); mlxft reads JSONL: one "),
        ('[{"text": "a"}]\n', "line 1: expected a JSON object, got an array; mlxft reads JSONL"),
        ('{"text": "a\tb"}\n', "(Invalid control character at column 12); write tabs and line breaks inside "),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "Assistant", "content": "a"}]}\n',
         "line 1: messages[1] has role 'Assistant'; chat templates know 'assistant': write that"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, tokenizer, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    for read in (lambda: load_dataset(path, tokenizer, 64), lambda: check_file(path)):  # with and without tokenizer
        with pytest.raises(UserError, match=re.escape(message)) as err:
            read()
        assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_chat_row_may_carry_other_fields(tmp_path, tokenizer):
    # Chat datasets (UltraChat) carry their first prompt, or the chat rendered as text, beside the messages.
    row = {"prompt": "hi", "text": "rendered", "messages": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "yes"}]}
    assert load_dataset(write_jsonl(tmp_path / "c.jsonl", [row]), tokenizer, 64).kind == "chat"


def test_long_text_rows_are_split_so_every_token_is_a_target_once(tmp_path, tokenizer, capsys):
    # Truncated, a 300-token document trained on its first 31 tokens and dropped the rest.
    text = " ".join(f"w{i}" for i in range(150))
    whole = load_dataset(write_jsonl(tmp_path / "w.jsonl", [{"text": text}]), tokenizer, 4096).examples[0].ids
    ds = load_dataset(write_jsonl(tmp_path / "t.jsonl", [{"text": text}, {"text": "short"}]), tokenizer, 32)
    windows = [e.ids for e in ds.examples[:-1]]
    assert all(len(w) == 32 for w in windows[:-1]) and 2 <= len(windows[-1]) <= 32 and ds.truncated == 0
    assert all(a[-1] == b[0] for a, b in zip(windows, windows[1:]))  # each starts at the one before's last token
    assert np.concatenate([windows[0]] + [w[1:] for w in windows[1:]]).tolist() == whole.tolist()
    assert sum(e.supervised for e in ds.examples[:-1]) == len(whole) - 1
    assert f"1 text rows longer than max_seq_length=32 were split into windows of that length ({len(ds)} " in (
        capsys.readouterr().err)


def _long_text(seed: int = 0, size: int = 6_000) -> str:
    rng = np.random.default_rng(seed)
    words = ["the", "cat", "sat", "über", "naïve", "42", "3.14", "don't", "東京", "  ", "\t", "—", "...", "<b>"]
    ends = [" ", " ", " ", ", ", ".\n", "\n\n", "  ", "\t"]
    text = ""
    while len(text) < size:
        text += str(rng.choice(words)) + str(rng.choice(ends))
    return text


def _counting_encodes(tokenizer, monkeypatch):
    """The lengths of the texts the tokenizer is asked to encode, with special tokens or not."""
    seen, encode = [], tokenizer._tokenizer.encode
    monkeypatch.setattr(tokenizer._tokenizer, "encode",
                        lambda text, *a, **kw: seen.append(len(text)) or encode(text, *a, **kw))
    return seen


def test_a_long_text_is_encoded_in_pieces_to_the_tokens_of_the_whole(tmp_path, tokenizer, monkeypatch):
    """A 60 MB row had the tokenizer hold about 13 GB: long texts are cut where the tokens do not change."""
    from mlxft import data

    rows = [{"text": _long_text(seed)} for seed in range(3)]
    whole = [e.ids.tolist() for e in load_dataset(write_jsonl(tmp_path / "w.jsonl", rows), tokenizer, 10**5).examples]
    monkeypatch.setattr(data, "LONG_TEXT", 700)
    monkeypatch.setattr(data, "SEAM_CONTEXT", 60)
    seen = _counting_encodes(tokenizer, monkeypatch)
    pieces = [e.ids.tolist() for e in load_dataset(write_jsonl(tmp_path / "p.jsonl", rows), tokenizer, 10**5).examples]
    assert pieces == whole
    assert max(seen) <= 700 and seen.count(max(seen)) < len(seen)  # no piece longer than LONG_TEXT


def test_a_tokenizer_that_marks_each_text_s_start_encodes_a_long_text_whole(tmp_path, tokenizer, monkeypatch):
    """As SentencePiece's prefix space does: no cut keeps the tokens, so none is made. The check
    can fail: a cut without it would change them."""
    from mlxft import data

    marker = tokenizer.encode("<|im_start|>", add_special_tokens=False)
    encode = tokenizer._tokenizer.encode
    monkeypatch.setattr(tokenizer._tokenizer, "encode",
                        lambda text, *a, **kw: (marker if text else []) + encode(text, *a, **kw))
    text = _long_text(size=3_000)
    whole = load_dataset(write_jsonl(tmp_path / "w.jsonl", [{"text": text}]), tokenizer, 10**5).examples[0].ids.tolist()
    monkeypatch.setattr(data, "LONG_TEXT", 700)
    monkeypatch.setattr(data, "SEAM_CONTEXT", 60)
    assert load_dataset(write_jsonl(tmp_path / "p.jsonl", [{"text": text}]), tokenizer, 10**5).examples[0].ids.tolist() \
        == whole
    monkeypatch.setattr(data, "_seam", lambda tokenizer, text, start: data._WORD_END.search(text, start + 600).end())
    assert load_dataset(write_jsonl(tmp_path / "c.jsonl", [{"text": text}]), tokenizer, 10**5).examples[0].ids.tolist() \
        != whole


def test_text_ending_in_eos_gets_no_second_eos(tmp_path, tokenizer):
    ds = load_dataset(write_jsonl(tmp_path / "t.jsonl", [{"text": "done.<|im_end|>"}]), tokenizer, 64)
    assert tokenizer.decode(ds.examples[0].ids.tolist()) == "done.<|im_end|>"
    # Nor a raw completion (it trained the model to predict EOS after EOS).
    ds = load_dataset(write_jsonl(tmp_path / "c.jsonl", [{"prompt": "Q?", "completion": "yes<|im_end|>"}]), tokenizer,
                      64, prompt_format="raw")
    assert tokenizer.decode(ds.examples[0].ids.tolist()) == "Q?yes<|im_end|>"


def test_empty_text_rows_are_skipped_whatever_the_tokenizer(tmp_path, tokenizer, monkeypatch, capsys):
    bos = tokenizer.encode("<|im_start|>", add_special_tokens=False)
    encode = tokenizer._tokenizer.encode
    # A tokenizer that adds a BOS trained an empty row as the document [BOS, EOS].
    monkeypatch.setattr(tokenizer._tokenizer, "encode",
                        lambda text, add_special_tokens=True, **kw: (bos if add_special_tokens else [])
                        + encode(text, add_special_tokens=False, **kw))
    ds = load_dataset(write_jsonl(tmp_path / "t.jsonl", [{"text": ""}, {"text": "  "}, {"text": "a"}]), tokenizer, 64)
    assert len(ds) == 1 and ds.skipped == 2
    assert "skipped 2 text rows with no token to predict (empty, or a single token)" in capsys.readouterr().err
    # An end-of-text alone is not empty, but one token has nothing after it to predict.
    monkeypatch.undo()
    for text in ("", "<|im_end|>"):
        with pytest.raises(UserError, match=r"no row's text has a token to predict \(each is empty or a single token\)"):
            load_dataset(write_jsonl(tmp_path / "e.jsonl", [{"text": text}]), tokenizer, 64)


def test_a_pipe_is_named_as_one(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo")  # `--train-file <(...)`: the data is read more than once
    with pytest.raises(UserError, match=r"fifo is not a regular file \(a pipe or device\); write the data to a file"):
        resolve_files("", str(tmp_path / "fifo"), "")


def test_answers_all_cut_by_the_length_limit_name_it(tmp_path, tokenizer):
    # The error blamed the data ("check completions") when --max-seq-length had cut every answer.
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [{"prompt": "word " * 40, "completion": "answer"}] * 3)
    with pytest.raises(UserError, match="no row has a supervised token within max_seq_length=16 .3 of 3 rows were "
                                        "cut.; raise --max-seq-length"):
        load_dataset(path, tokenizer, 16)


@pytest.mark.parametrize("bad", ["train", "valid"])
def test_bad_data_is_reported_before_the_model_is_loaded(tmp_path, bad):
    write_jsonl(tmp_path / "data" / "train.jsonl", [{"text": "a"}])
    write_jsonl(tmp_path / "data" / "valid.jsonl", [{"text": "a"}])
    (tmp_path / "data" / f"{bad}.jsonl").write_text('{"prompt": "p"}\n')
    config = RunConfig.from_dict({"model": {"model": str(tmp_path / "no-such-model")},
                                  "data": {"data": str(tmp_path / "data")},
                                  "train": {"output_dir": str(tmp_path / "run")}})
    with pytest.raises(UserError, match=re.escape(f"{bad}.jsonl line 1: missing field 'completion'")):
        Trainer(config)


def test_byte_order_mark_is_not_part_of_line_1(tmp_path, tokenizer):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"text": "hello"}\n')
    check_file(path)
    assert tokenizer.decode(load_dataset(path, tokenizer, 64).examples[0].ids.tolist()) == "hello<|im_end|>"


def test_nothing_supervised_is_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "n.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(UserError, match="no row has a supervised token"):
        load_dataset(path, tokenizer, 64)


def test_resolve_files(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"text": "a"}])
    assert resolve_files(str(tmp_path), "", "") == (tmp_path / "train.jsonl", None)
    write_jsonl(tmp_path / "valid.jsonl", [{"text": "a"}])
    assert resolve_files(str(tmp_path), "", "") == (tmp_path / "train.jsonl", tmp_path / "valid.jsonl")
    with pytest.raises(UserError, match="does not exist"):
        resolve_files(str(tmp_path / "missing"), "", "")
    with pytest.raises(UserError, match=r"training data .* is a directory; .*--train-file FILE"):
        resolve_files("", str(tmp_path), "")
    with pytest.raises(UserError, match=r"validation data .* is a directory; pass a JSONL file to --valid-file"):
        resolve_files(str(tmp_path), "", str(tmp_path))


def test_epoch_order_is_seeded_and_complete():
    lengths = np.random.default_rng(0).integers(5, 300, size=103)
    a = epoch_batches(lengths, 8, seed=1, epoch=0)
    assert [b.tolist() for b in a] == [b.tolist() for b in epoch_batches(lengths, 8, seed=1, epoch=0)]
    assert [b.tolist() for b in a] != [b.tolist() for b in epoch_batches(lengths, 8, seed=1, epoch=1)]
    assert [b.tolist() for b in a] != [b.tolist() for b in epoch_batches(lengths, 8, seed=2, epoch=0)]
    assert sorted(np.concatenate(a).tolist()) == list(range(103))
    # Grouping by length keeps padding low: far below a random grouping's.
    waste = sum(lengths[b].max() * len(b) - lengths[b].sum() for b in a)
    assert waste < 0.25 * lengths.sum()


def test_batches_have_bucketed_shapes():
    from mlxft.data import Example

    rows = [Example(np.arange(n, dtype=np.int32), np.r_[np.zeros(n // 2, bool), np.ones(n - n // 2, bool)]) for n in (5, 17, 9)]
    b = make_batch(rows, 4, 16)
    assert b.inputs.shape == (4, 16)  # the longest row has 16 inputs; a 4th, empty row pads the batch
    assert len(b.positions) % 16 == 0 and b.supervised == sum(int(r.mask[1:].sum()) for r in rows)
    real = b.weights > 0
    # Position (row, t) predicts token t + 1 of its row, and is supervised exactly when the mask says so.
    rows_of, t_of = np.divmod(b.positions[real], 16)
    assert [rows[r].ids[t + 1] for r, t in zip(rows_of, t_of)] == b.targets[real].tolist()
    assert all(rows[r].mask[t + 1] for r, t in zip(rows_of, t_of))
    assert b.real_tokens == 4 + 16 + 8


def test_capped_evaluation_takes_rows_of_every_length():
    lengths = np.array([500, 12, 480, 15, 510, 9, 495, 11])
    batches = epoch_batches(lengths, 2, 0, 0, shuffle=False, max_batches=2)
    assert [b.tolist() for b in batches] == [[1, 3], [2, 0]]  # the file's first four rows, sorted by length
    assert len(np.concatenate(epoch_batches(lengths, 2, 0, 0, shuffle=False))) == 8


TOOL_CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'


@pytest.mark.parametrize("content, first", [("", TOOL_CALL_TEXT), ("Let me check.", "Let me check.\n" + TOOL_CALL_TEXT)])
def test_tool_calls_of_earlier_turns_are_supervised(tokenizer, content, first):
    # Qwen3's template rewrites earlier turns, so they are found in the rendering: what it writes
    # for a turn after the content (the tool call) belongs to the answer, as in the last turn.
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": content, "tool_calls": TOOL_CALL},
                {"role": "tool", "content": "sunny"},
                {"role": "assistant", "content": "It is sunny."}]
    ids, mask = encode_chat(tokenizer, messages, True, "test")
    spans = [tokenizer.decode([i for i, _ in group])
             for flag, group in itertools.groupby(zip(ids, mask), key=lambda pair: pair[1]) if flag]
    assert spans == [first, "It is sunny.<|im_end|>\n"]


def test_a_tool_call_turn_without_content_loads_as_mlx_lm_writes_it(tokenizer, tmp_path):
    # mlx-lm's LORA.md gives tool-call turns no 'content' (OpenAI's API writes null): refused, as
    # a malformed message, until they were read as the empty answer before the call.
    rows = [{"messages": [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", **content,
                                                                            "tool_calls": TOOL_CALL}],
             "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}
            for content in ({}, {"content": None}, {"content": ""})]
    path = write_jsonl(tmp_path / "tools.jsonl", rows)
    check_file(path)
    examples = load_dataset(path, tokenizer, 256).examples
    assert len(examples) == 3 and all(np.array_equal(e.ids, examples[2].ids) for e in examples)
    assert all(np.array_equal(e.mask, examples[2].mask) for e in examples)
    # The last turn: Qwen3's template writes its empty reasoning block before the call.
    assert supervised_spans(tokenizer, examples[0].ids, examples[0].mask) == ["<think>\n\n</think>\n\n" + TOOL_CALL_TEXT]
    without_call = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "Hi"},
                                                                      {"role": "assistant"}]}])
    with pytest.raises(UserError, match=r"bad.jsonl line 1: messages\[1\] must be an object with string 'role' and "
                                        r"'content' \(a turn with 'tool_calls' may leave 'content' out\)"):
        check_file(without_call)


def supervised_spans(tokenizer, ids, mask):
    return [tokenizer.decode([i for i, _ in group])
            for flag, group in itertools.groupby(zip(ids, mask), key=lambda pair: pair[1]) if flag]


@pytest.mark.parametrize("empty_role", ["tool", "user"])
@pytest.mark.parametrize("content, first", [("", TOOL_CALL_TEXT), ("Let me check.", "Let me check.\n" + TOOL_CALL_TEXT)])
def test_an_empty_message_after_an_answer_is_not_supervised_and_leaves_its_call_supervised(tokenizer, empty_role,
                                                                                          content, first):
    # The empty answer's end-of-turn was taken as the last one before the next content, the
    # empty tool (or user) turn's: its header and wrapper were trained as the assistant's. After
    # an answer with content, the empty message (found where the content ends) cut the turn
    # there: its tool call and end-of-turn were not trained.
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": content, "tool_calls": TOOL_CALL},
                {"role": empty_role, "content": ""},
                {"role": "assistant", "content": "It is sunny."}]
    ids, mask = encode_chat(tokenizer, messages, True, "test")
    assert supervised_spans(tokenizer, ids, mask) == [first, "It is sunny.<|im_end|>\n"]


def test_reasoning_content_is_supervised_in_every_turn_the_template_shows_it(tokenizer):
    # Qwen3 writes an answer's reasoning_content before it; in chats of several turns (found by
    # content) the span started at the answer, so the reasoning was shown but never a target.
    turn = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "add them"}]
    earlier = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    inline = earlier + [turn[0], {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}]
    expected = "<think>\nadd them\n</think>\n\n4<|im_end|>\n"
    for messages, spans in ((turn, [expected]), (earlier + turn, ["2<|im_end|>\n", expected]),
                            (inline, ["2<|im_end|>\n", expected])):
        ids, mask = encode_chat(tokenizer, messages, True, "test")
        assert supervised_spans(tokenizer, ids, mask) == spans
    # A turn of reasoning and a tool call with no answer text (an agent's step), or of reasoning
    # alone: after earlier turns its reasoning was shown but not a target.
    planned = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "reasoning_content": "look it up", "tool_calls": TOOL_CALL},
               {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]
    for chat in (planned, earlier + planned):
        spans = supervised_spans(tokenizer, *encode_chat(tokenizer, chat, True, "test"))
        assert spans[-2] == "<think>\nlook it up\n</think>\n\n" + TOOL_CALL_TEXT, spans
        assert spans[-1].endswith("It is sunny.<|im_end|>\n"), spans
    thought = [turn[0], {"role": "assistant", "content": "", "reasoning_content": "add them"}]
    for chat in (thought, earlier + thought):
        spans = supervised_spans(tokenizer, *encode_chat(tokenizer, chat, True, "test"))
        assert spans[-1] == "<think>\nadd them\n</think>\n\n<|im_end|>\n", spans


def test_a_chat_rows_tools_reach_the_template_in_training_and_exact_match(tokenizer, tmp_path):
    # mlx-lm's chat rows carry "tools"; they were dropped, so the model learned tool calls
    # without ever seeing the tools' descriptions.
    from mlxft import generation

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    row = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "content": "", "tool_calls": TOOL_CALL},
                        {"role": "tool", "content": "sunny"},
                        {"role": "assistant", "content": "It is sunny."}], "tools": tools}
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [row])
    example = load_dataset(path, tokenizer, 4096).examples[0]
    text = tokenizer.decode(example.ids.tolist())
    assert "Weather for a city" in text
    assert supervised_spans(tokenizer, example.ids.tolist(), example.mask.tolist()) == [
        TOOL_CALL_TEXT, "It is sunny.<|im_end|>\n"]
    pair = generation.qa_pairs(path, 1)[0]
    assert "Weather for a city" in tokenizer.decode(generation.prompt_ids(tokenizer, pair.messages, "chat", pair.tools))
    for bad in ({"name": "x"}, ["x"]):
        write_jsonl(path, [{**row, "tools": bad}])
        with pytest.raises(UserError, match="line 1: field 'tools' must be a list of objects"):
            check_file(path)


def test_a_prompt_rows_tools_reach_the_template_as_mlx_lm_renders_them(tokenizer, tmp_path):
    # mlx-lm renders a prompt/completion row's "tools" too; mlxft dropped them without a word,
    # so a switching user trained on other text than mlx-lm's.
    from mlxft import generation

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    row = {"prompt": "Weather in Paris?", "completion": "Let me look.", "tools": tools}
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [row])
    example = load_dataset(path, tokenizer, 4096).examples[0]
    as_chat = {"messages": [{"role": "user", "content": row["prompt"]},
                            {"role": "assistant", "content": row["completion"]}], "tools": tools}
    write_jsonl(tmp_path / "chat.jsonl", [as_chat])
    chat = load_dataset(tmp_path / "chat.jsonl", tokenizer, 4096).examples[0]
    assert "Weather for a city" in tokenizer.decode(example.ids.tolist())
    assert example.ids.tolist() == chat.ids.tolist() and example.mask.tolist() == chat.mask.tolist()
    pair = generation.qa_pairs(path, 1)[0]
    assert "Weather for a city" in tokenizer.decode(generation.prompt_ids(tokenizer, pair.messages, "auto", pair.tools))
    with pytest.raises(UserError, match="line 1: field 'tools' needs the chat template, but prompts are rendered raw"):
        load_dataset(path, tokenizer, 4096, prompt_format="raw")
    write_jsonl(path, [{**row, "tools": {"name": "x"}}])
    with pytest.raises(UserError, match="line 1: field 'tools' must be a list of objects"):
        check_file(path)


def test_a_lone_surrogate_anywhere_in_a_message_is_a_one_line_error(tmp_path):
    path = tmp_path / "train.jsonl"
    call = [{"type": "function", "function": {"name": "f", "arguments": {"city": "Par\ud800is"}}}]
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "", "tool_calls": call}]}) + "\n")
    with pytest.raises(UserError, match=r"line 1: field 'messages\[1\]\.tool_calls\[0\]\.function\.arguments\.city' "
                                        "holds an unpaired surrogate"):
        check_file(path)


@pytest.mark.parametrize("content, answer", [("", "sunny"), ("ok", "ok")])
def test_an_answer_that_repeats_an_earlier_tool_turn_is_found_in_its_own_turn(tokenizer, content, answer):
    # The tool result (and an answer before its tool calls) is not followed by the end of its
    # turn, so the later answer's "sunny<|im_end|>" used to be taken for it, and the answer
    # itself was then missing from the rendering.
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": content, "tool_calls": TOOL_CALL},
                {"role": "tool", "content": "sunny"},
                {"role": "assistant", "content": answer}]
    ids, mask = encode_chat(tokenizer, messages, True, "test")
    spans = [tokenizer.decode([i for i, _ in group])
             for flag, group in itertools.groupby(zip(ids, mask), key=lambda pair: pair[1]) if flag]
    assert spans == [(content + "\n" if content else "") + TOOL_CALL_TEXT, answer + "<|im_end|>\n"]


ABS_CALL = [{"type": "function", "function": {"name": "abs", "arguments": {"x": -5}}}]
ABS_CALL_TEXT = '<tool_call>\n{"name": "abs", "arguments": {"x": -5}}\n</tool_call><|im_end|>\n'


@pytest.mark.parametrize("content", ["", "Let me compute."])
def test_a_tool_result_inside_the_calls_arguments_leaves_the_call_supervised(tokenizer, content):
    # Found by searching the rendering, the tool's "5" matched inside {"x": -5} before its own
    # turn: the call and its end of turn lost their supervision, silently.
    messages = [{"role": "user", "content": "What is |-5|?"},
                {"role": "assistant", "content": content, "tool_calls": ABS_CALL},
                {"role": "tool", "content": "5"},
                {"role": "assistant", "content": "The answer is five."}]
    ids, mask = encode_chat(tokenizer, messages, True, "test")
    assert supervised_spans(tokenizer, ids, mask) == [(content + "\n" if content else "") + ABS_CALL_TEXT,
                                                      "The answer is five.<|im_end|>\n"]


def test_a_later_turn_ending_in_a_tool_result_is_neither_refused_nor_supervised_for_it(tokenizer, tmp_path):
    # "22" followed by the end of a turn first occurs at the end of the answer "It is 22", so the
    # tool result was placed there and the answer then refused as missing from the rendering;
    # with a later user turn repeating the answer, the user's words were supervised instead.
    messages = [{"role": "user", "content": "Temperature in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": TOOL_CALL},
                {"role": "tool", "content": "22"},
                {"role": "assistant", "content": "It is 22"}]
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [{"messages": messages}])
    example = load_dataset(path, tokenizer, 4096).examples[0]
    assert supervised_spans(tokenizer, example.ids.tolist(), example.mask.tolist()) == [
        TOOL_CALL_TEXT, "It is 22<|im_end|>\n"]
    longer = messages[:2] + [{"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "ok"},
                             {"role": "user", "content": "Repeat: It is sunny"},
                             {"role": "assistant", "content": "It is sunny"}]
    ids, mask = encode_chat(tokenizer, longer, True, "test")
    assert supervised_spans(tokenizer, ids, mask) == [TOOL_CALL_TEXT, "ok<|im_end|>\n", "It is sunny<|im_end|>\n"]


def test_a_user_turn_repeating_an_earlier_answer_is_not_supervised(tokenizer):
    # Qwen3 drops an earlier answer's reasoning, so the answer as written first appeared in the
    # user turn that quotes it, and that user turn was trained as the answer.
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>r</think>a"},
                {"role": "user", "content": "<think>r</think>a"}, {"role": "assistant", "content": "22"}]
    ids, mask = encode_chat(tokenizer, messages, True, "test")
    assert supervised_spans(tokenizer, ids, mask) == ["a<|im_end|>\n", "22<|im_end|>\n"]


def test_text_that_looks_like_a_content_mark_is_left_alone(tokenizer):
    # Contents are found through marks of private-use characters in a second rendering; a
    # tool call whose arguments spell such a mark must not be taken for one.
    call = [{"type": "function", "function": {"name": "f", "arguments": {"x": "\ue0003\ue001 \ue0002\ue001"}}}]
    messages = [{"role": "user", "content": "q \ue000"}, {"role": "assistant", "content": "", "tool_calls": call},
                {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "s"}]
    ids, mask = encode_chat(tokenizer, messages, True, "test")
    assert supervised_spans(tokenizer, ids, mask) == [
        '<tool_call>\n{"name": "f", "arguments": {"x": "\ue0003\ue001 \ue0002\ue001"}}\n</tool_call><|im_end|>\n',
        "s<|im_end|>\n"]


DATED_TEMPLATE = ('{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}'
                  "<|im_start|>system\nToday Date: {{ date_string }}<|im_end|>\n"
                  "{{ strftime_now('%B %d, %Y') }}\n"  # Granite's and Mistral Small's: the clock alone
                  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_stamps_the_date_renders_one_fixed_day(llama_dir, tmp_path, monkeypatch):
    # Llama 3.x's templates write today's date: the rows' tokens, and the fingerprint a resume
    # checks, changed overnight, so a run resumed the next day was refused as on other data.
    import importlib

    import mlx.nn as nn
    from mlx_lm.utils import load_tokenizer

    from mlxft.data import TEMPLATE_DATE
    from mlxft.generation import QAPair, exact_match

    dated = load_tokenizer(llama_dir)
    monkeypatch.setattr(dated._tokenizer, "chat_template", DATED_TEMPLATE)  # shared with other loads of it
    rows = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}]
    ds = load_dataset(write_jsonl(tmp_path / "c.jsonl", rows), dated, 64)
    assert f"Today Date: {TEMPLATE_DATE}<|im_end|>\nJuly 26, 2024\n" in dated.decode(ds.examples[0].ids.tolist())
    assert supervised_spans(dated, ds.examples[0].ids.tolist(), ds.examples[0].mask.tolist()) == ["4<|im_end|>\n"]
    prompts = []  # exact-match scores the rows rendered on the same day

    def generate(model, tokenizer, ids, **kwargs):
        prompts.extend(tokenizer.decode(p) for p in ids)
        return type("Generated", (), {"texts": ["4"] * len(ids)})()

    monkeypatch.setattr(importlib.import_module("mlx_lm.generate"), "batch_generate", generate)
    assert exact_match(nn.Linear(1, 1), dated, [QAPair(rows[0]["messages"][:1], "4", chat=True)])[0] == 1.0
    assert f"Today Date: {TEMPLATE_DATE}<|im_end|>\nJuly 26, 2024\n" in prompts[0]
    import datetime

    from transformers.utils import chat_template_utils
    assert chat_template_utils.datetime is datetime.datetime  # the clock is the world's again


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A tiny Metaspace (SentencePiece-style, as Llama 2, Mistral and Phi-3 tokenize) tokenizer
    with a Phi-3-like chat template: a word opening a text gets a word-start mark (▁)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<|user|>", "<|assistant|>", "<|end|>"]
    pieces = ["<unk>", *specials, "▁", "\n", "Pa", "ris", "▁Paris", "▁yes", "yes", "?", ":"] + list("abcdefghijklmnopqrstuvwxyzQW")
    model = Tokenizer(models.Unigram([(p, -1.0 if len(p) > 2 else -2.0) for p in pieces], unk_id=0, byte_fallback=False))
    model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    model.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    model.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    hf = PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="<|end|>", unk_token="<unk>")
    hf.chat_template = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    return TokenizerWrapper(hf)


def test_a_sentencepiece_answer_is_tokenized_as_the_whole_rendering_writes_it(sentencepiece_tokenizer):
    # Encoded apart, the answer "Paris" opened a text: "▁Paris", a leading space the rendering
    # never has ("Pa", "ris" after the header's newline); the same for a raw completion.
    tok = sentencepiece_tokenizer
    chat = [{"role": "user", "content": "what is it?"}, {"role": "assistant", "content": "Paris"}]
    ids, mask = encode_chat(tok, chat, True, "test")
    assert ids == tok.encode(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)
    assert [tok.convert_ids_to_tokens(i) for i, m in zip(ids, mask) if m] == ["Pa", "ris", "<|end|>", "\n"]
    _, ids, mask = encode_row({"prompt": "Q:", "completion": "yes"}, tok, True, "raw", "test")
    assert [tok.convert_ids_to_tokens(i) for i, m in zip(ids, mask) if m] == ["yes", "<|end|>"]


def test_offsets_trimmed_of_spaces_keep_a_prompts_trailing_space_out_of_the_answer(llama_dir, monkeypatch):
    # With trim_offsets on, " Paris" reports offsets from its "P": it looked as if it started at
    # the answer, and the prompt's trailing space was trained as the answer's.
    from mlx_lm.utils import load_tokenizer
    from tokenizers import processors

    tok = load_tokenizer(llama_dir)
    monkeypatch.setattr(tok._tokenizer.backend_tokenizer, "post_processor",
                        processors.ByteLevel(trim_offsets=True, add_prefix_space=False))
    _, ids, mask = encode_row({"prompt": "Capital of France? Answer: ", "completion": "Paris"}, tok, True, "raw", "row")
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Paris<|im_end|>"
    assert tok.decode([i for i, m in zip(ids, mask) if not m]) == "Capital of France? Answer: "


def test_load_dataset_refuses_a_window_too_short_for_a_target(tmp_path, tokenizer):
    # max_seq_length 1 was a ValueError from range(); 0 said every row was empty.
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}])
    for length in (0, 1):
        with pytest.raises(UserError, match=f"max_seq_length must be an integer >= 2, got {length}"):
            load_dataset(path, tokenizer, length)
