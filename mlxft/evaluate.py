"""Command line: loss and perplexity of a model (with an adapter) on a JSONL test set.

    python -m mlxft.evaluate --adapter RUN_DIR --data data_dir

Rows are encoded exactly as training encodes them (:mod:`mlxft.data`) and scored with the
training loss (:mod:`mlxft.loss`): the mean is over supervised tokens of the whole set
(token-weighted), not a mean of per-batch means, so it does not depend on the batch size.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from mlxft.adapters import add_model_arguments
from mlxft.config import MAX_COUNT, PROMPT_FORMATS, DataConfig, TrainConfig
from mlxft.errors import CliParser, UserError, run_cli


@dataclass
class Evaluation:
    loss: float
    perplexity: float
    tokens: int
    rows: int
    path: Path


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="python -m mlxft.evaluate",
        description="Token-weighted loss and perplexity of a base model, with an optional adapter, on a JSONL set.")
    add_model_arguments(parser, dtype_of_run=True)
    parser.add_argument("--data", required=True,
                        help="a JSONL file, a directory holding test.jsonl (else valid.jsonl), or builtin:capitals")
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size,
                        help=f"rows per forward pass (default {TrainConfig.batch_size})")
    # These three default to what an mlxft run recorded, so its adapter is scored on rows
    # encoded as its training encoded them; otherwise to the trainer's own defaults.
    parser.add_argument("--max-seq-length", type=int, default=None,
                        help="truncate rows to this many tokens "
                             f"(default: the run's, else {DataConfig.max_seq_length})")
    parser.add_argument("--completion-only", action=argparse.BooleanOptionalAction, default=None,
                        help="score only completions / assistant turns (default: the run's, else "
                             f"{'yes' if DataConfig.completion_only else 'no'})")
    parser.add_argument("--prompt-format", choices=PROMPT_FORMATS, default=None,
                        help="how prompt/completion rows are rendered "
                             f"(default: the run's, else {DataConfig.prompt_format})")
    parser.add_argument("--max-batches", type=int, default=0, help="stop after this many batches (0 = all)")
    parser.add_argument("--loss-chunk", type=int, default=0,
                        help="score this many tokens' logits at a time, for less memory (0 = all at once)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    return parser


def data_file(data: str) -> Path:
    """``data`` itself, or the test.jsonl (else valid.jsonl) of a directory (a built-in task's,
    ``builtin:capitals``, as a run's config records it)."""
    from mlxft import builtin

    path = Path(builtin.resolve(data)).expanduser()
    if path.is_dir():
        for name in ("test.jsonl", "valid.jsonl"):
            if (path / name).is_file():
                return path / name
        raise UserError(f"{path} holds neither test.jsonl nor valid.jsonl; pass --data FILE.jsonl")
    from mlxft.data import need_file  # imported where used, as evaluate() does: importing this module stays light

    need_file(path, "evaluation data", "check --data")
    return path


def check_counts(batch_size: int, max_seq_length: int | None, max_batches: int, loss_chunk: int) -> None:
    """Refuse counts no evaluation can use (``None``: not given), naming the flag; bounded as
    training bounds its counts, as past MAX_COUNT they fail in NumPy or MLX with a traceback."""
    for flag, value, least in (("--batch-size", batch_size, 1), ("--max-seq-length", max_seq_length, 2),
                               ("--max-batches", max_batches, 0), ("--loss-chunk", loss_chunk, 0)):
        if value is not None and not least <= value <= MAX_COUNT:
            raise UserError(f"{flag} must be {least} to {MAX_COUNT:,}{' (0 = all)' if least == 0 else ''}, "
                            f"got {value:,}")


def evaluate(model, tokenizer, path, *, batch_size: int = TrainConfig.batch_size,
             max_seq_length: int = DataConfig.max_seq_length, completion_only: bool = DataConfig.completion_only,
             prompt_format: str = DataConfig.prompt_format, max_batches: int = 0, bucket: int = 8,
             loss_chunk: int = 0) -> Evaluation:
    """Token-weighted mean loss over the rows of ``path`` (and its perplexity, exp(loss))."""
    import mlx.core as mx

    from mlxft import data, models
    from mlxft.loss import evaluation_loss, perplexity

    check_counts(batch_size, max_seq_length, max_batches, loss_chunk)
    data.renders_chat(tokenizer, prompt_format)  # a format none of the three is an error, whatever the rows
    path = Path(path)
    dataset = data.load_dataset(path, tokenizer, max_seq_length, completion_only, prompt_format)
    data.check_token_ids(dataset, models.vocab_size(model))
    was_training = model.training  # a research script's training loop keeps its dropout
    model.eval()
    loss_sum, tokens, scored = mx.array(0.0), mx.array(0.0), set()
    try:
        for indices in data.epoch_batches(dataset.lengths, batch_size, 0, 0, shuffle=False, max_batches=max_batches):
            # Padded to its own rows: --batch-size past the set's size (or a short last batch) adds
            # no all-padding rows, which cost memory and time (a huge one crashed MLX).
            batch = data.make_batch([dataset.examples[j] for j in indices], len(indices), bucket)
            loss, ntokens = evaluation_loss(model, *batch.arrays(), chunk=loss_chunk)
            loss_sum, tokens = loss_sum + loss * ntokens, tokens + ntokens
            mx.eval(loss_sum, tokens)
            # --max-batches may stop short of the whole set; a long text row's windows are one row.
            scored.update(dataset.lines[j] if dataset.lines else j for j in indices)
    finally:
        model.train(was_training)
    count = int(tokens.item())
    if count == 0:  # a loss of 0 and perplexity of 1 would read as a perfect model
        raise UserError(f"{path}: no token was scored (no row has a supervised token); "
                        "give rows with completions or assistant turns, or pass --no-completion-only")
    loss = loss_sum.item() / count
    return Evaluation(loss, perplexity(loss), count, len(scored), path)


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_counts(args.batch_size, args.max_seq_length, args.max_batches, args.loss_chunk)  # before loading the model
    path = data_file(args.data)
    from mlxft.adapters import load_with_adapter, run_setting

    loaded = load_with_adapter(args.model, args.adapter, args.dtype, args.revision)
    result = evaluate(loaded.model, loaded.tokenizer, path, batch_size=args.batch_size,
                      max_seq_length=run_setting(loaded.spec, "max_seq_length", args.max_seq_length,
                                                 DataConfig.max_seq_length),
                      completion_only=run_setting(loaded.spec, "completion_only", args.completion_only,
                                                  DataConfig.completion_only),
                      prompt_format=run_setting(loaded.spec, "prompt_format", args.prompt_format,
                                                DataConfig.prompt_format),
                      max_batches=args.max_batches, loss_chunk=args.loss_chunk)
    if args.json:
        print(json.dumps({"loss": result.loss, "perplexity": result.perplexity, "tokens": result.tokens,
                          "rows": result.rows, "data": str(result.path)}))
    else:
        print(f"data: {result.path} ({result.rows} rows)")
        print(f"loss: {result.loss:.4f}")
        print(f"perplexity: {result.perplexity:.3f}")
        print(f"tokens: {result.tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
