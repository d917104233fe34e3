"""Command line: merge a run's adapter into its base and write a Hugging Face model directory.

    python -m mlxft.fuse --adapter RUN_DIR --out DIR [--model BASE] [--dequantize] [--dtype bfloat16]

The adapter may be an mlxft run or checkpoint, an mlx-lm adapter directory or a PEFT adapter;
``--model`` defaults to the base model the adapter directory records. A full fine-tuning run's
weights are loaded in place of the base's. Without ``--adapter`` the base is re-written as is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlxft.adapters import add_revision_argument
from mlxft.errors import CliParser, UserError, run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="python -m mlxft.fuse",
        description="Merge LoRA / DoRA adapters (or a full fine-tune's weights) into the base model and write "
                    "a model directory (config.json, safetensors shards, tokenizer) that mlx_lm.load and "
                    "transformers both load.")
    parser.add_argument("--adapter", metavar="DIR",
                        help="run directory, checkpoint, mlx-lm adapter directory or PEFT adapter directory "
                             "(omit to re-write the base as is)")
    parser.add_argument("--model", metavar="BASE",
                        help="base model directory or hub id (default: the base recorded in the adapter directory)")
    add_revision_argument(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write (must not exist or be empty)")
    parser.add_argument("--dequantize", action="store_true",
                        help="write float weights when the base is quantized (exact, and loadable by transformers); "
                             "without it quantized layers are re-quantized after the merge, which is lossy")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="float type of the written weights (default auto: the type the base is stored in); "
                             "the merge itself is computed in float32")
    parser.add_argument("--max-shard-size", type=float, default=5.0, metavar="GB",
                        help="largest safetensors shard, in GB (default 5)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists and is not empty")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    return parser


def fuse(adapter: str | None, model: str | None, out, *, dequantize: bool = False, dtype: str = "auto",
         max_shard_gb: float = 5.0, overwrite: bool = False, revision: str = "") -> Path:
    """Load base and adapter, merge, and write the model directory; return its path."""
    from mlxft import hf, models
    from mlxft.adapters import adapter_directory, check_adapter_named, load_with_adapter
    from mlxft.gguf import _check_destination, check_output_apart

    check_adapter_named(adapter)
    out = Path(out).expanduser()
    # --adapter may name the weights file in its directory: the directory is what is read.
    adapter_dir = adapter_directory(adapter) if adapter else None
    check_output_apart(out, "--out", {"adapter directory": adapter_dir, "base model": model})
    _check_destination(out, overwrite)  # before the model loads, not after the merge
    if not (0 < max_shard_gb < float("inf")):  # nan and inf fail here, not after the model has loaded
        raise UserError(f"--max-shard-size must be a number of GB > 0, got {max_shard_gb}")
    loaded = load_with_adapter(model, adapter, dtype="float32", revision=revision)  # merged in float32, cast when written
    # The base the run recorded is an input too.
    check_output_apart(out, "--out", {"base model": loaded.model_path})
    base_dtype = hf.stored_dtype(loaded.model_path)
    out_dtype = base_dtype if dtype == "auto" else dtype
    count = hf.fuse_adapters(loaded.model, dequantize=dequantize)
    quantized = models.is_quantized(loaded.model)
    if quantized and dequantize:
        hf.dequantize(loaded.model, loaded.config)
        quantized = False
    if quantized and count:
        print("note: the base is quantized; the merged layers were re-quantized, which loses precision "
              "(pass --dequantize for an exact merge)", file=sys.stderr)
    renamed = [] if quantized else hf.tensors_unlike_base(loaded.model, loaded.model_path)
    if renamed:
        print(f"note: {len(renamed)} tensors are written as mlx-lm names or lays them out, not as the base stores "
              f"them (e.g. {renamed[0]}): mlx-lm loads the result, transformers would refuse them or start them "
              "at random", file=sys.stderr)
    path = hf.save_hf_model(loaded.model, loaded.config, loaded.tokenizer, out, dtype=out_dtype,
                            source_dir=loaded.model_path, max_shard_bytes=int(max_shard_gb * (1 << 30)),
                            overwrite=overwrite)
    what = f"{count} adapter layers merged" if count else (
        "full fine-tuned weights" if loaded.spec is not None else "base re-written")
    print(f"wrote {path} ({what}; {out_dtype or 'stored'} weights"
          + ("; quantized: mlx-lm loads it, transformers does not" if quantized else "")
          + ("; mlx-lm's layout: mlx-lm loads it, transformers does not" if renamed else "") + ")")
    return path


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.adapter and not args.model:
        raise UserError("pass --adapter RUN_DIR (and optionally --model BASE), or --model alone to re-write a base")
    fuse(args.adapter, args.model, args.out, dequantize=args.dequantize, dtype=args.dtype,
         max_shard_gb=args.max_shard_size, overwrite=args.overwrite, revision=args.revision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
