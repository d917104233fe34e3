"""Command line: write an adapter in another library's layout.

    python -m mlxft.export --adapter RUN_DIR --format peft --out DIR
    python -m mlxft.export --adapter PEFT_DIR --format mlx-lm --out DIR

``peft`` writes adapter_model.safetensors (PEFT's tensor names, (r, in) / (out, r) orientation)
and adapter_config.json, which ``peft.PeftModel.from_pretrained`` loads onto the transformers
model. ``mlx-lm`` writes mlxft's run layout (adapters.safetensors with LoRA metadata, and
adapter_config.json) that mlx-lm loads with ``--adapter-path`` and mlxft trains from.
Any of the three layouts can be the input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlxft.errors import CliParser, UserError, run_cli

FORMATS = ("peft", "mlx-lm")


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="python -m mlxft.export",
        description="Convert an adapter directory (mlxft run, mlx-lm or PEFT) into PEFT's or mlx-lm's layout.")
    parser.add_argument("--adapter", required=True, metavar="DIR",
                        help="run directory, checkpoint, mlx-lm adapter directory or PEFT adapter directory")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="peft: adapter_model.safetensors + adapter_config.json for transformers + peft; "
                             "mlx-lm: adapters.safetensors + adapter_config.json for mlx-lm and mlxft")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write (must not exist or be empty)")
    parser.add_argument("--model", metavar="BASE",
                        help="base model to record in the output (default: the one the adapter records); for "
                             "--format mlx-lm from a PEFT adapter on a subset of layers, its config.json gives "
                             "the layer count")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists and is not empty")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    return parser


def export(adapter, fmt: str, out, *, model: str = "", overwrite: bool = False, say=print) -> Path:
    """Convert the adapter directory ``adapter`` into ``fmt`` under ``out``; return ``out``.
    ``say`` gets the note for an adapter trained on a base mlxft quantized on load (QLoRA),
    which neither mlx-lm nor PEFT does for it."""
    from mlxft import adapters, models
    from mlxft.gguf import _check_destination, _write_atomically, check_output_apart

    adapters.check_adapter_named(adapter)
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if model and not model.startswith("builtin:"):
        models.check_model_name(model)  # recorded in the output, which would name a base no one can load
    model = models.absolute_name(model or "")  # recorded: it must name the base from any directory
    out = Path(out).expanduser()
    weights, spec = adapters.load_adapter_dir(adapter)
    base_type = (models.peek_config(model) or {}).get("model_type")
    if base_type and spec.model_type and base_type != spec.model_type:
        raise UserError(f"--model {model} is a {base_type} model, but {spec.path} was trained on a {spec.model_type} "
                        "model; pass the adapter's base")
    # The base is read for mlx-lm's layer count; --overwrite must not delete it either.
    check_output_apart(out, "--out", {"adapter directory": spec.path,
                                      "base model": model or spec.base_model})
    _check_destination(out, overwrite)
    write = adapters.write_peft if fmt == "peft" else adapters.write_mlx
    if fmt == "peft":
        adapters.require_adapter(spec, "PEFT export")  # refuse before creating anything
        adapters.require_no_experts(weights, spec)
    _write_atomically(out, overwrite, lambda tmp: write(weights, spec, tmp, model or ""))
    quantized = adapters.base_quantization(spec)
    if quantized:
        say(_quantized_base_note(quantized, fmt, model or spec.base_model or "BASE", out))
    return out


def _quantized_base_note(quantized: dict, fmt: str, base: str, out: Path) -> str:
    bits, group, dtype = quantized["bits"], quantized["group_size"], quantized["dtype"]
    trained = f"note: this adapter was trained on {base} quantized on load to {bits} bits (group size {group}, {dtype})"
    if fmt == "peft":
        return f"{trained}; transformers loads the base as it is, so PEFT's outputs differ from the trained model's"
    return (f"{trained}. mlxft's generate, evaluate and fuse do the same from {out}; mlx-lm loads --model as it is, "
            f"so give it a copy quantized the same way: python -m mlx_lm convert --hf-path {base} --mlx-path "
            f"BASE-{bits}bit -q --q-bits {bits} --q-group-size {group} --dtype {dtype}")


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = export(args.adapter, args.format, args.out, model=args.model or "", overwrite=args.overwrite)
    print(f"wrote {out} ({args.format})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
