"""Greedy generation for evaluation: exact-match of answers on held-out rows.

Prompts are rendered the way training renders them (the chat template with a generation
prompt, or the raw prompt), so the metric measures what the loss trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from mlxft.data import read_jsonl, render_on_template_day, renders_chat, without_reasoning
from mlxft.errors import UserError, first_line


@dataclass
class Answer:
    prompt: str
    reference: str
    generated: str

    @property
    def correct(self) -> bool:
        return normalize(self.generated) == normalize(self.reference)


def normalize(text: str) -> str:
    """The answer as compared: without a leading reasoning block (Qwen3's template trains an
    empty one before every final answer, so a model that learned its targets writes it),
    case, spacing or a final period."""
    return " ".join(without_reasoning(text).strip().rstrip(".").split()).casefold()


class QAPair(NamedTuple):
    messages: list[dict]  # the prompt: what comes before the answer
    reference: str
    chat: bool = False  # from a chat row, which training renders with the chat template whatever --prompt-format says
    tools: list | None = None  # the row's function schemas, which its template shows the model


def prompt_ids(tokenizer, messages: list[dict], prompt_format: str = "auto", tools: list | None = None,
               template_day: bool = False) -> list[int]:
    """The prompt's token ids; ``template_day``: a date the template writes is the one training
    renders (:func:`mlxft.data.render_on_template_day`), not the template's own (today's)."""
    if renders_chat(tokenizer, prompt_format):
        if not getattr(tokenizer, "chat_template", None):  # as training checks (data.encode_chat)
            raise UserError("--prompt-format chat needs a tokenizer with a chat template; this model's tokenizer "
                            "has none; use --prompt-format raw")
        extra = {"tools": tools} if tools else {}
        try:
            if template_day:
                text = render_on_template_day(tokenizer, messages, add_generation_prompt=True, **extra)
            else:
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        except Exception as err:  # jinja raises its own exception types for template errors
            raise UserError(f"the chat template rejected the prompt's messages ({first_line(err)}); "
                            "leave out --system if the template takes none, or use --prompt-format raw") from err
        return list(tokenizer.encode(text, add_special_tokens=False))
    if len(messages) > 1:  # the raw format has no place for them: a system message would go unread
        raise UserError("--system needs the chat template, but the prompt is rendered raw (--prompt-format raw, the "
                        "run's recorded format, or a tokenizer without a template); drop --system or use "
                        "--prompt-format chat")
    ids = list(tokenizer.encode(messages[-1]["content"], add_special_tokens=True)) if messages else []
    if not ids:
        raise UserError("the prompt is empty and the raw format adds nothing to it; give a prompt to continue")
    return ids


def qa_pairs(path, limit: int) -> list[QAPair]:
    """Prompt and reference answer from prompt/completion or chat rows. A row with nothing
    to prompt with (an empty prompt, a chat that opens with the answer) is passed over."""
    pairs = []
    for _, row in read_jsonl(path):
        if "messages" in row:
            msgs = row["messages"]
            last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=None)
            if not last:
                continue
            pairs.append(QAPair(msgs[:last], msgs[last]["content"], chat=True, tools=row.get("tools")))
        elif "prompt" in row and "completion" in row and row["prompt"].strip():
            pairs.append(QAPair([{"role": "user", "content": row["prompt"]}], row["completion"], tools=row.get("tools")))
        if len(pairs) >= limit:
            break
    return pairs


# Prompts decoded at once. Each holds its own KV cache, which mlx-lm grows 256 positions at a
# time: the default job's 24 capitals (SmolLM2-135M, float32) peaked at 1.05-1.13 GB decoded 32
# at a time, over training's 0.94, and at 0.85 GB 8 at a time; its two exact-match passes took
# about 5 s longer (a 4-step run: 34.8 against 29.9 s).
GENERATION_BATCH = 8


def exact_match(model, tokenizer, pairs, prompt_format: str = "auto", max_tokens: int = 32) -> tuple[float, list[Answer]]:
    """Share of pairs whose greedy answer equals the reference (case, spacing, final period aside).

    The prompts are decoded together (mlx-lm's batch generator, left-padded and masked): each
    token then reads the weights once for the whole batch, not once per prompt, which on a
    bandwidth-bound device is most of the cost (SmolLM2-135M on the CPU, 24 capitals: 7.6 s
    against 31 s one prompt at a time, the same 24 answers)."""
    from mlx_lm.generate import batch_generate

    renders_chat(tokenizer, prompt_format)  # a format none of the three is an error, whatever the rows
    if not pairs:
        return 0.0, []
    # Scored as training renders the rows, on the same day.
    prompts = [prompt_ids(tokenizer, pair.messages, "chat" if pair.chat else prompt_format, pair.tools, True)
               for pair in pairs]
    was_training = model.training
    model.eval()
    try:
        texts = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens,
                               completion_batch_size=GENERATION_BATCH, prefill_batch_size=GENERATION_BATCH).texts
    finally:
        model.train(was_training)
    answers = [Answer(pair.messages[-1]["content"], pair.reference, text.strip()) for pair, text in zip(pairs, texts)]
    score = sum(a.correct for a in answers) / len(answers)
    return score, answers
