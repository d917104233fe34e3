"""``python -m mlxft.train``: the command-line entry point (flags and config file only)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mlxft import config as cfg  # the package import preloads an optimized BLAS before MLX is imported
from mlxft import signals
from mlxft.errors import CliParser, UserError, print_error, run_cli


def parser() -> argparse.ArgumentParser:
    p = CliParser(
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
    signals.hold_save_requests()  # SIGUSR1 while the model loads: answered, not fatal
    args = parser().parse_args(argv)
    # Before the distributed world exists, mlx.launch's rank variable tells: only rank 0 prints.
    say = print if os.environ.get("MLX_RANK", "0") in ("", "0") else (lambda *a, **k: None)
    for flag, value in (("--config", args.config), ("--resume", getattr(args, "train.resume", None)),
                        ("--init-adapter", getattr(args, "adapter.init_adapter", None)),
                        ("--output-dir", getattr(args, "train.output_dir", None))):
        if value is not None and not str(value).strip():  # "$UNSET": not the default job, nor a fresh run
            raise UserError(f"{flag} is empty; name a {'YAML file' if flag == '--config' else 'path'}")
    config_path = args.config
    if config_path is None and hasattr(args, "train.resume") and not (hasattr(args, "model.model")
                                                                     or hasattr(args, "data.data")):
        # Continue the run with its own settings; other flags (--train-file too) override them.
        config_path = _checkpoint_config(args)
        say(f"no --model/--data/--config given: resuming with the checkpoint's settings ({config_path})")
    elif config_path is None and not any(hasattr(args, name) for name in ("model.model", "data.data",
                                                                          "data.train_file", "data.valid_file")):
        config_path = DEFAULT_JOB  # no model, data or config given: the built-in default job
        say(f"no --model/--data/--config given: running the default job ({DEFAULT_JOB.name})")
    config = cfg.resolve(args, config_path)
    if config_path == DEFAULT_JOB and not hasattr(args, "train.overwrite"):
        # The job's `overwrite: true` lets it re-run into its own runs/default; a directory the
        # user names may hold another run, which only --overwrite may replace.
        job_dir = cfg.load_yaml(DEFAULT_JOB)["train"]["output_dir"]
        config.train.overwrite = config.train.overwrite and _same_path(config.train.output_dir, job_dir)
    from mlxft.distributed import PeerLost
    from mlxft.trainer import TrainingStopped, fine_tune

    try:
        result = fine_tune(config)
    except TrainingStopped as stop:
        if say is print or not stop.joint:  # where every rank stopped together, rank 0 says so for all
            print_error(f"error: {stop}" if stop.exit_code == 1 else str(stop))
        return stop.exit_code
    except PeerLost as lost:
        print_error(f"error: {lost}")
        return lost.exit_code
    if not result.main_process:
        return 0
    # A run resumed at its last step trains none: no training loss to show.
    print(f"done: {result.steps} steps"
          + (f", train loss {result.train_loss:.4f}" if result.train_loss is not None else "")
          + (f", val loss {result.val_loss:.4f}" if result.val_loss is not None else "") + f" -> {result.run_dir}")
    return 0


def _checkpoint_config(args) -> Path:
    """The config.yaml of the checkpoint ``--resume`` names; without ``--output-dir`` the run
    continues in the directory that holds it (``latest`` is looked for in the default one)."""
    from mlxft import checkpoint

    resume = getattr(args, "train.resume")
    named = None if resume == checkpoint.LATEST else Path(resume).expanduser().resolve()
    # A kill while re-saving it left it moved aside: its run puts it back before resuming.
    aside = checkpoint.moved_aside(named) if named is not None else None
    found = named if aside is not None else checkpoint.resolve_checkpoint(
        resume, Path(getattr(args, "train.output_dir", cfg.TrainConfig.output_dir)).expanduser())
    if not hasattr(args, "train.output_dir"):
        setattr(args, "train.output_dir", str(found.parent))
    path = (aside or found) / checkpoint.CONFIG_FILE
    if not path.is_file():
        raise UserError(f"--resume {resume}: {found} has no {checkpoint.CONFIG_FILE} to take the run's settings from; "
                        "pass --config or --model and --data")
    return path


def _same_path(a, b) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


if __name__ == "__main__":
    try:
        code = main()
    finally:
        signals.ignore_save_requests()
    sys.exit(code)
