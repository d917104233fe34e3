"""Command line: generate from a base model with an adapter, streaming the answer.

    python -m mlxft.generate --adapter RUN_DIR --prompt "What is the capital of France?"

The prompt is rendered with the chat template exactly as training renders prompts (see
:func:`mlxft.generation.prompt_ids`); ``--model`` defaults to the base the run records, and
the tokenizer is the one the run saved. ``--temp 0`` (the default) is greedy.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Iterator

from mlxft.adapters import add_model_arguments
from mlxft.config import PROMPT_FORMATS, DataConfig
from mlxft.errors import CliParser, UserError, run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="python -m mlxft.generate",
        description="Generate text from a base model with an adapter (mlxft run, mlx-lm or PEFT), streaming it.")
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True, help="the user message ('-' reads it from standard input)")
    parser.add_argument("--system", default="", help="a system message to put before the prompt")
    parser.add_argument("--prompt-format", choices=PROMPT_FORMATS, default=None,
                        help="auto: the chat template when the tokenizer has one (as training does); "
                             f"raw: the prompt text as is (default: the run's, else {DataConfig.prompt_format})")
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 (the default) or below 1e-6 = greedy")
    parser.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling threshold (0 = off)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    parser.add_argument("--verbose", action="store_true", help="print prompt and generation speed to stderr")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    return parser


def read_text(value: str, flag: str, stdin: bool = False) -> str:
    """A text flag's value, with ``stdin`` ``-`` read from standard input; either must be UTF-8
    (a tokenizer takes no lone surrogates, which is what Python makes of other bytes)."""
    if stdin and value == "-":
        if sys.stdin is None:
            raise UserError(f"{flag} -: there is no standard input to read; pass the text itself")
        raw = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8", "surrogateescape")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise UserError(f"{flag} -: standard input is not UTF-8 text (byte {raw[err.start]:#04x} at offset "
                            f"{err.start}); save it as UTF-8") from None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{flag} is not UTF-8 text; give it in UTF-8") from None
    return value


def messages_for(prompt: str, system: str = "") -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


GREEDY_BELOW = 1e-6  # temperatures under this sample greedily


def stream(model, tokenizer, prompt_ids: list[int], max_tokens: int = 256, temp: float = 0.0,
           top_p: float = 0.0) -> Iterator:
    """mlx-lm's stream_generate responses (``.text`` is the next piece of the answer)."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    # Logits over a temperature this small overflow to inf and the sampler draws from NaNs
    # (random text at 1e-38): the limit it tends to is the greedy choice.
    temp = temp if temp >= GREEDY_BELOW else 0.0
    yield from stream_generate(model, tokenizer, prompt_ids, max_tokens=max_tokens,
                               sampler=make_sampler(temp=temp, top_p=top_p))


def _context_length(model) -> int | None:
    """max_position_embeddings, from the model's own settings or, for a wrapper (Gemma 3), its text model's."""
    args = getattr(model, "args", None)
    context = getattr(args, "max_position_embeddings", None)
    text = getattr(args, "text_config", None)
    if context is None and isinstance(text, dict):
        return text.get("max_position_embeddings")
    return context if context is not None else getattr(text, "max_position_embeddings", None)


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not 0 <= args.temp < float("inf") or not 0 <= args.top_p <= 1:  # nan fails both comparisons
        raise UserError("--temp must be a finite number >= 0 and --top-p in [0, 1]")
    if not 0 <= args.seed < 2**64:  # MLX's seed is an unsigned 64-bit integer
        raise UserError(f"--seed must be 0 to 2**64-1, got {args.seed}")
    prompt, system = read_text(args.prompt, "--prompt", stdin=True), read_text(args.system, "--system")
    import mlx.core as mx

    from mlxft.adapters import load_with_adapter, run_setting, run_task
    from mlxft.generation import prompt_ids

    loaded = load_with_adapter(args.model, args.adapter, args.dtype, args.revision)
    mx.random.seed(args.seed)
    # Chat rows are rendered with the chat template whatever the run's prompt_format, which
    # shapes prompt/completion rows only, and text rows never are: a run trained on chats, or on
    # plain text, is prompted as it learned.
    given = args.prompt_format or {"chat": "chat", "text": "raw"}.get(run_task(loaded.spec))
    prompt_format = run_setting(loaded.spec, "prompt_format", given, DataConfig.prompt_format)
    ids = prompt_ids(loaded.tokenizer, messages_for(prompt, system), prompt_format)
    context = _context_length(loaded.model)
    if isinstance(context, int) and len(ids) + args.max_tokens > context:  # rope scaling may stretch it: not refused
        print(f"warning: the prompt's {len(ids)} tokens and --max-tokens {args.max_tokens} pass the model's "
              f"context of {context} tokens (max_position_embeddings); the answer may be garbled past it",
              file=sys.stderr)
    last = None
    try:
        for last in stream(loaded.model, loaded.tokenizer, ids, args.max_tokens, args.temp, args.top_p):
            print(last.text, end="", flush=True)
        print(flush=True)
    except BrokenPipeError:  # the reader stopped (`| head`): stop generating, quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 0
    if args.verbose and last is not None:
        print(f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens/s | generation: "
              f"{last.generation_tokens} tokens, {last.generation_tps:.1f} tokens/s | stop: {last.finish_reason}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
