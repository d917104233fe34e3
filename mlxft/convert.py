"""Command line: convert a Llama-family GGUF file into an mlx-lm model directory.

    python -m mlxft.convert MODEL.gguf OUT_DIR [--dequantize] [--dtype float32] [--overwrite]

The work is done by :func:`mlxft.gguf.convert_gguf`; this module only parses arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys

from mlxft.errors import CliParser, run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="python -m mlxft.convert",
        description=(
            "Convert a Llama-family GGUF (llama.cpp format) into an mlx-lm model directory "
            "(config.json, model.safetensors, tokenizer.json, tokenizer_config.json) that "
            "mlx_lm.load and mlxft can use. Q4_0/Q4_1/Q8_0 tensors stay quantized unless "
            "--dequantize is given."
        ),
    )
    parser.add_argument("gguf", metavar="MODEL.gguf", help="the GGUF file to convert")
    parser.add_argument("out_dir", metavar="OUT_DIR",
                        help="directory to create (must not exist or be empty)")
    parser.add_argument("--dequantize", action="store_true",
                        help="write plain (unquantized) weights, e.g. for full fine-tuning")
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                        help="float type of the written tensors, quantization scales included "
                             "(default: the GGUF's own, float16 for quantized files; use float32 "
                             "on MLX's CPU backend, where float16 is many times slower)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT_DIR if it exists and is not empty")
    parser.add_argument("--debug", action="store_true",
                        help="show full tracebacks for errors")
    return parser


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from mlxft.gguf import convert_gguf  # imports MLX: keep --help fast

    out = convert_gguf(args.gguf, args.out_dir, dequantize=args.dequantize,
                       overwrite=args.overwrite, dtype=args.dtype)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
