"""``python -m mlxft.train``: the command-line entry point (flags and config file only)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlxft  # noqa: F401 - preloads an optimized BLAS before MLX is imported
from mlxft import config as cfg
from mlxft.errors import run_cli


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mlxft.train",
        description="Fine-tune an mlx-lm model (LoRA, DoRA or full) on JSONL data. "
        "Flags override --config, which overrides the defaults.",
    )
    p.add_argument("--config", metavar="YAML", help="Run config file with sections model, adapter, data, optim, train.")
    p.add_argument("--debug", action="store_true", help="Show full tracebacks for errors.")
    cfg.add_arguments(p)
    return p


DEFAULT_JOB = Path(__file__).with_name("default_job.yaml")


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    config_path = args.config
    if not config_path and not hasattr(args, "model.model") and not hasattr(args, "data.data"):
        config_path = DEFAULT_JOB  # no model, data or config given: the built-in default job
        print(f"no --model/--data/--config given: running the default job ({DEFAULT_JOB.name})")
    config = cfg.resolve(args, config_path)
    from mlxft.distributed import PeerLost
    from mlxft.trainer import TrainingStopped, fine_tune

    try:
        result = fine_tune(config)
    except TrainingStopped as stop:
        print(f"error: {stop}" if stop.exit_code == 1 else str(stop), file=sys.stderr)
        return stop.exit_code
    except PeerLost as lost:
        print(f"error: {lost}", file=sys.stderr)
        return lost.exit_code
    if not result.main_process:
        return 0
    print(f"done: {result.steps} steps, train loss {result.train_loss if result.train_loss is not None else float('nan'):.4f}"
          + (f", val loss {result.val_loss:.4f}" if result.val_loss is not None else "") + f" -> {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
