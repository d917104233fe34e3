"""Command line: loss and perplexity of a model (with an adapter) on a JSONL test set.

    python -m mlxft.evaluate --adapter RUN_DIR --data data_dir

Rows are encoded exactly as training encodes them (:mod:`mlxft.data`) and scored with the
training loss (:mod:`mlxft.loss`): the mean is over supervised tokens of the whole set
(token-weighted), not a mean of per-batch means, so it does not depend on the batch size.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from mlxft.adapters import add_model_arguments
from mlxft.errors import UserError, run_cli


@dataclass
class Evaluation:
    loss: float
    perplexity: float
    tokens: int
    rows: int
    path: Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mlxft.evaluate",
        description="Token-weighted loss and perplexity of a base model, with an optional adapter, on a JSONL set.")
    add_model_arguments(parser)
    parser.add_argument("--data", required=True,
                        help="a JSONL file, or a directory holding test.jsonl (else valid.jsonl)")
    parser.add_argument("--batch-size", type=int, default=4, help="rows per forward pass (default 4)")
    # These three default to what an mlxft run recorded, so its adapter is scored on rows
    # encoded as its training encoded them; otherwise to the trainer's own defaults.
    parser.add_argument("--max-seq-length", type=int, default=None,
                        help="truncate rows to this many tokens (default: the run's, else 2048)")
    parser.add_argument("--completion-only", action=argparse.BooleanOptionalAction, default=None,
                        help="score only completions / assistant turns (default: the run's, else yes)")
    parser.add_argument("--prompt-format", choices=("auto", "chat", "raw"), default=None,
                        help="how prompt/completion rows are rendered (default: the run's, else auto)")
    parser.add_argument("--max-batches", type=int, default=0, help="stop after this many batches (0 = all)")
    parser.add_argument("--loss-chunk", type=int, default=0,
                        help="score this many tokens' logits at a time, for less memory (0 = all at once)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    return parser


def data_file(data: str) -> Path:
    """``data`` itself, or the test.jsonl (else valid.jsonl) of a directory."""
    path = Path(data).expanduser()
    if path.is_dir():
        for name in ("test.jsonl", "valid.jsonl"):
            if (path / name).is_file():
                return path / name
        raise UserError(f"{path} holds neither test.jsonl nor valid.jsonl; pass --data FILE.jsonl")
    if not path.is_file():
        raise UserError(f"evaluation data {path} does not exist; check --data")
    return path


def evaluate(model, tokenizer, path, *, batch_size: int = 4, max_seq_length: int = 2048, completion_only: bool = True,
             prompt_format: str = "auto", max_batches: int = 0, bucket: int = 8, loss_chunk: int = 0) -> Evaluation:
    """Token-weighted mean loss over the rows of ``path`` (and its perplexity, exp(loss))."""
    import mlx.core as mx

    from mlxft import data
    from mlxft.loss import evaluation_loss

    if batch_size < 1 or max_seq_length < 2 or max_batches < 0 or loss_chunk < 0:
        raise UserError("--batch-size must be >= 1, --max-seq-length >= 2, --max-batches >= 0 and --loss-chunk >= 0 "
                        "(0 = all)")
    path = Path(path)
    dataset = data.load_dataset(path, tokenizer, max_seq_length, completion_only, prompt_format)
    model.eval()
    loss_sum, tokens = mx.array(0.0), mx.array(0.0)
    for indices in data.epoch_batches(dataset.lengths, batch_size, 0, 0, shuffle=False, max_batches=max_batches):
        batch = data.make_batch([dataset.examples[j] for j in indices], batch_size, bucket)
        loss, ntokens = evaluation_loss(model, *batch.arrays(), chunk=loss_chunk)
        loss_sum, tokens = loss_sum + loss * ntokens, tokens + ntokens
        mx.eval(loss_sum, tokens)
    count = int(tokens.item())
    if count == 0:  # a loss of 0 and perplexity of 1 would read as a perfect model
        raise UserError(f"{path}: no token was scored (no row has a supervised token); "
                        "give rows with completions or assistant turns, or pass --no-completion-only")
    loss = loss_sum.item() / count
    return Evaluation(loss, math.exp(min(loss, 700.0)), count, len(dataset), path)


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    path = data_file(args.data)
    from mlxft.adapters import load_with_adapter, run_setting

    loaded = load_with_adapter(args.model, args.adapter, args.dtype)
    result = evaluate(loaded.model, loaded.tokenizer, path, batch_size=args.batch_size,
                      max_seq_length=run_setting(loaded.spec, "max_seq_length", args.max_seq_length, 2048),
                      completion_only=run_setting(loaded.spec, "completion_only", args.completion_only, True),
                      prompt_format=run_setting(loaded.spec, "prompt_format", args.prompt_format, "auto"),
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
