"""What a run writes to disk, and writing it so a crash never leaves a torn file.

A run directory holds ``adapters.safetensors`` (mlx-lm tensor names; LoRA metadata in the
safetensors header), ``adapter_config.json`` (what ``mlx_lm.load(..., adapter_path=...)``
reads), ``config.yaml`` (the resolved run config), ``training_state.json`` and
``metrics.jsonl``. Every file is written under a temporary name, flushed and renamed into
place, so readers see the old file or the new one, never half of either.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import yaml
from mlx.utils import tree_flatten

from mlxft.errors import UserError, first_line

ADAPTER_FILE = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
CONFIG_FILE = "config.yaml"
STATE_FILE = "training_state.json"
METRICS_FILE = "metrics.jsonl"
FORMAT = "mlxft-adapter/1"
# What save_pretrained writes for the tokenizers mlx-lm loads (which ones depends on the tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")


# What a run writes into its directory after each checkpoint (see Trainer.save_checkpoint).
RUN_FILES = (ADAPTER_FILE, ADAPTER_CONFIG, CONFIG_FILE, STATE_FILE) + TOKENIZER_FILES


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it
    os.umask(mask)
    return mask


def _usual_mode(path, directory: bool = False) -> None:
    """Give a mkstemp / mkdtemp result (0600 / 0700) the mode a plain open or mkdir would."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def save_safetensors(path, arrays: dict[str, mx.array], metadata: dict[str, str] | None = None) -> None:
    """``mx.save_safetensors``, with a failed write raised as OSError as Python's own writes are.

    MLX reports a full disk as RuntimeError("[write] Unable to write ..."); the arrays are
    computed first, so a RuntimeError left (out of memory, say) is not mistaken for one.
    """
    mx.eval(arrays)
    try:
        mx.save_safetensors(str(path), arrays, **({"metadata": metadata} if metadata is not None else {}))
    except RuntimeError as err:
        raise OSError(first_line(err).rstrip(".")) from err


def raise_write_error(err: Exception) -> None:
    """Raise a failed write as OSError, as Python's own writes raise it: MLX reports one as
    RuntimeError("[write] Unable to write ..."), the Rust tokenizers library as a bare
    Exception ending "(os error 28)". Return for any other exception: the caller re-raises it."""
    text = str(err)
    if not isinstance(err, OSError) and (text.startswith("[write]") or re.search(r"\(os error \d+\)", text)):
        raise OSError(first_line(err).rstrip(".")) from err


def write_advice(err: OSError) -> str:
    """What to do about a failed write, from its cause: a full disk is not a read-only one. MLX's
    own writers give no cause; a full disk is the likely one there."""
    if err.errno in (None, errno.ENOSPC, errno.EDQUOT):
        return "free disk space or choose another --output-dir"
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make it writable or choose another --output-dir"
    return "choose another --output-dir"


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)`` then rename ``tmp_path`` over ``path``.

    A failure (a full disk included) removes the temporary file and leaves ``path`` as it was.
    """
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + path.suffix, dir=path.parent)
        os.close(fd)
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        _usual_mode(tmp)
        os.replace(tmp, path)
    except OSError as err:
        raise UserError(f"cannot write {path}: {err.strerror or err}; {write_advice(err)}") from err
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(path.parent)


def write_text(path: Path, text: str) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


def write_json(path: Path, data: dict) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def adapter_metadata(fine_tune_type: str, rank: int, alpha: float, dropout: float, targets: list[str],
                     num_layers: int, model_type: str, base_model: str = "",
                     base_quantization: dict | None = None, base_revision: str = "",
                     base_weights: str = "") -> dict[str, str]:
    """The safetensors header entries (strings only) that describe an adapter file.
    ``base_quantization`` (``bits``, ``group_size``, ``dtype``): how the run quantized a float
    base on load (QLoRA), which the adapter belongs to as much as to the base's weights;
    ``base_revision``: the hub revision of a hub base, so a copy of the adapter finds the
    weights it was trained on; ``base_weights``: their :func:`mlxft.models.weights_fingerprint`,
    so loading the adapter on what that name holds later can tell when it is no longer them."""
    quantization = {"base_quantization": json.dumps(base_quantization, sort_keys=True)} if base_quantization else {}
    revision = {"base_revision": base_revision} if base_revision else {}
    fingerprint = {"base_weights": base_weights} if base_weights else {}
    return {**quantization, **revision, **fingerprint,
        "format": FORMAT,
        "partial": "false",  # every tensor of the span is here (see mlxft.adapters.AdapterSpec.partial)
        "fine_tune_type": fine_tune_type,
        "rank": str(rank),
        "alpha": repr(float(alpha)),
        "scale": repr(float(alpha) / rank),
        "dropout": repr(float(dropout)),
        "target_modules": json.dumps(targets),
        "num_layers": str(num_layers),
        "model_type": model_type,
        "base_model": base_model,
    }


def trainable_weights(model: nn.Module) -> dict[str, mx.array]:
    return dict(tree_flatten(model.trainable_parameters()))


def save_adapters(path: Path, model: nn.Module, metadata: dict[str, str]) -> None:
    weights = trainable_weights(model)
    atomic_write(path, lambda tmp: save_safetensors(tmp, weights, metadata))


def mlx_lm_adapter_config(metadata: dict[str, str]) -> dict:
    """``adapter_config.json`` in the shape mlx-lm's ``load_adapters`` reads (it ignores the
    extra keys, which mlxft uses to find the base model, the LoRA alpha and how the run quantized
    the base)."""
    config = {
        "base_model": metadata.get("base_model", ""),
        "alpha": float(metadata["alpha"]),
        "fine_tune_type": metadata["fine_tune_type"],
        "num_layers": int(metadata["num_layers"]),
        "lora_parameters": {
            "rank": int(metadata["rank"]),
            "scale": float(metadata["scale"]),
            "dropout": float(metadata["dropout"]),
        },
    }
    targets = json.loads(metadata["target_modules"])
    if targets != ["*"]:
        config["lora_parameters"]["keys"] = targets
    if metadata.get("base_quantization"):
        config["base_quantization"] = json.loads(metadata["base_quantization"])
    for key in ("base_revision", "base_weights"):
        if metadata.get(key):
            config[key] = metadata[key]
    return config


def save_run(run_dir: Path, model: nn.Module, metadata: dict[str, str], config: dict, state: dict) -> None:
    """Write adapters, adapter config, resolved config and training state; the state file last.

    The state names the step its adapters belong to, so it is renamed into place only after
    the adapters it describes.
    """
    run_dir = Path(run_dir)
    save_adapters(run_dir / ADAPTER_FILE, model, metadata)
    write_json(run_dir / ADAPTER_CONFIG, mlx_lm_adapter_config(metadata))
    write_text(run_dir / CONFIG_FILE, yaml.safe_dump(config, sort_keys=False))
    write_json(run_dir / STATE_FILE, state)


def save_tokenizer(run_dir: Path, tokenizer) -> None:
    """Write the tokenizer's files (tokenizer.json, config, chat template) into the run
    directory, each renamed into place, so generation needs only the run and the base."""
    run_dir = Path(run_dir)
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        with tempfile.TemporaryDirectory(prefix=".tokenizer.", dir=run_dir) as tmp:  # may meet the full disk first
            try:
                hf.save_pretrained(tmp)
            except Exception as err:  # a full disk, as the tokenizers library reports it
                raise_write_error(err)
                raise
            written = {path.name for path in Path(tmp).iterdir()}
            for name in written:
                with open(Path(tmp) / name, "rb") as f:
                    os.fsync(f.fileno())
                os.replace(Path(tmp) / name, run_dir / name)
            for name in set(TOKENIZER_FILES) - written:  # another tokenizer's, e.g. a stale chat template
                if (run_dir / name).is_file():
                    (run_dir / name).unlink()
    except OSError as err:
        raise UserError(f"cannot write the tokenizer into {run_dir}: {err.strerror or err}") from err


def append_metrics(run_dir: Path, record: dict) -> None:
    path = Path(run_dir) / METRICS_FILE
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as err:
        raise UserError(f"cannot write {path}: {err.strerror or err}; {write_advice(err)}") from err


def load_adapter_weights(path: Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The tensors of an adapter file, in their stored dtype, and its safetensors header."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"adapter file {path} does not exist")
    try:
        weights, metadata = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as err:
        raise UserError(f"{path} is not a readable safetensors file ({first_line(err)}); it may be truncated") from err
    return weights, metadata or {}


def apply_adapter_weights(model: nn.Module, weights: dict[str, mx.array], source: str) -> None:
    """Load adapter tensors into the model's trainable parameters, all or nothing.

    Every name and shape is checked before anything changes; the first mismatch is named.
    Tensors are cast to the dtype of the parameter they replace (F32, F16, BF16 files load).
    """
    params = trainable_weights(model)
    for name, value in weights.items():
        if name not in params:
            raise UserError(f"{source}: tensor {name} has no matching trainable parameter; the adapter is for another model or layout")
        if not mx.issubdtype(value.dtype, mx.floating):  # astype would take an int or bool tensor as numbers
            raise UserError(f"{source}: tensor {name} is {str(value.dtype).rsplit('.', 1)[-1]}, not floating "
                            "point; the adapter is damaged")
        if tuple(value.shape) != tuple(params[name].shape):
            raise UserError(f"{source}: tensor {name} has shape {tuple(value.shape)} but the model expects {tuple(params[name].shape)} (another rank or model?)")
    missing = sorted(set(params) - set(weights))
    if missing:
        raise UserError(f"{source}: no tensor for parameter {missing[0]} ({len(missing)} missing); the adapter is for another layout")
    model.load_weights([(k, v.astype(params[k].dtype)) for k, v in weights.items()], strict=False)


# ---------------------------------------------------------------------------------------
# Training checkpoints: run_dir/checkpoint-<step>/ (and -emergency, final), `latest` link.

OPTIMIZER_FILE = "optimizer.safetensors"
WINDOW_FILE = "window.safetensors"
WINDOW_SUMS = ("mlxft.loss_sum", "mlxft.tokens")  # beside the gradients, by these names
TRAINER_STATE = "trainer_state.json"
LATEST = "latest"
_STEP_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_name(step: int, kind: str = "step") -> str:
    """``checkpoint-<step>`` for periodic saves, with ``-emergency`` or as ``final``."""
    if kind == "final":
        return "final"
    return f"checkpoint-{step}" + ("-emergency" if kind == "emergency" else "")


def _write_checkpoint_files(directory: Path, model, metadata, optimizer_state, window, trainer_state, config,
                            progress: Callable[[], None]) -> None:
    save_safetensors(directory / ADAPTER_FILE, trainable_weights(model), metadata)
    progress()
    (directory / ADAPTER_CONFIG).write_text(json.dumps(mlx_lm_adapter_config(metadata), indent=2))
    save_safetensors(directory / OPTIMIZER_FILE, optimizer_state)
    progress()
    if window:
        save_safetensors(directory / WINDOW_FILE, window)
        progress()
    (directory / CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))
    (directory / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
    for path in directory.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        progress()


def replace_directory(new: Path, final: Path) -> None:
    """Rename the finished directory ``new`` to ``final``, replacing any old one.

    rename() cannot replace a non-empty directory, so an old ``final`` is first moved aside
    (one rename) and deleted after the new one is in place: readers see the old or the new.
    If the swap fails half-way (an I/O error, a signal), the old one is put back.
    """
    aside = None
    if final.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
    try:
        if aside is not None:
            os.replace(final, aside / final.name)
        os.replace(new, final)
    except BaseException:
        if aside is not None and not final.exists() and (aside / final.name).exists():
            os.replace(aside / final.name, final)
        raise
    finally:
        if aside is not None and final.exists():  # else the put-back failed: keep the old one hidden, not lost
            shutil.rmtree(aside, ignore_errors=True)
    _fsync_dir(final.parent)


def save_checkpoint(run_dir: Path, name: str, model, metadata: dict, optimizer_state: dict[str, mx.array],
                    window: dict[str, mx.array] | None, trainer_state: dict, config: dict,
                    progress: Callable[[], None] = lambda: None) -> Path:
    """Write a checkpoint directory under a temporary name, rename it into place, point
    ``latest`` at it. A crash at any moment leaves every earlier checkpoint intact.
    ``progress`` is called after each file (data-parallel runs show the other ranks they are
    not waiting on a lost peer)."""
    run_dir = Path(run_dir)
    final = run_dir / name
    tmp, held = None, None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=run_dir))  # may meet the full disk first
        _usual_mode(tmp, directory=True)
        _write_checkpoint_files(tmp, model, metadata, optimizer_state, window, trainer_state, config, progress)
        held = _hold_latest(run_dir, final)
        replace_directory(tmp, final)  # re-saving a step (e.g. final after a resume) swaps
        _point_latest(run_dir, name)
    except OSError as err:
        kept = " (earlier checkpoints are intact)" if (run_dir / LATEST).exists() else ""
        raise UserError(f"cannot write checkpoint {final}: {err.strerror or err}; {write_advice(err)}{kept}") from err
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if held is not None:
            _release_latest(run_dir, held, name)
    return final


def check_links(run_dir: Path) -> None:
    """Refuse, before any training, a directory whose filesystem holds no symbolic links (exFAT,
    FAT): ``latest`` is one, and the first checkpoint failed there, after the work it was to keep."""
    probe = run_dir / f".{LATEST}.{os.getpid()}.probe"
    try:
        if probe.is_symlink():
            probe.unlink()
        os.symlink(".", probe)
    except OSError as err:
        raise UserError(f"--output-dir {run_dir} cannot hold the symbolic link '{LATEST}' that names a run's newest "
                        f"checkpoint ({err.strerror or err}; exFAT and FAT drives cannot); choose an --output-dir "
                        "on another filesystem") from err
    finally:
        if probe.is_symlink():
            probe.unlink()


def _point_latest(run_dir: Path, name: str) -> None:
    """Point ``latest`` at ``name`` in one rename."""
    link = run_dir / f".{LATEST}.{os.getpid()}.tmp"
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(name, link)
    os.replace(link, run_dir / LATEST)
    _fsync_dir(run_dir)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)  # a checkpoint's files are never rewritten in place
    except OSError:
        shutil.copy2(src, dst)


def _hold_latest(run_dir: Path, final: Path) -> Path | None:
    """When ``latest`` points at ``final``, which is about to be swapped (re-saving a step, final
    after a resume), point it at a hard-linked copy first: between moving the old ``final``
    aside and renaming the new one in, ``latest`` would otherwise point at nothing. The copy
    is hidden (``.old``: never taken for a partial save); returns it, or None."""
    if not final.is_dir() or (run_dir / LATEST).resolve() != final.resolve():
        return None
    held = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=run_dir))
    try:
        _usual_mode(held, directory=True)
        shutil.copytree(final, held, dirs_exist_ok=True, copy_function=_link_or_copy)
        _fsync_dir(held)
        _point_latest(run_dir, held.name)
    except BaseException:
        shutil.rmtree(held, ignore_errors=True)
        raise
    return held


def _release_latest(run_dir: Path, held: Path, name: str) -> None:
    """Point ``latest`` back at ``name`` if it still names the held copy (a failed swap put the
    old directory back), then delete the copy."""
    try:
        if (run_dir / LATEST).resolve() == held.resolve() and (run_dir / name).is_dir():
            _point_latest(run_dir, name)
    except OSError:
        pass
    if (run_dir / LATEST).resolve() != held.resolve():
        shutil.rmtree(held, ignore_errors=True)


def read_state(path: Path) -> dict | None:
    """The JSON object in a state file (:data:`STATE_FILE`, :data:`TRAINER_STATE`); None where
    it is missing, unreadable or not an object."""
    try:
        state = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _checkpoint_state(path: Path) -> dict | None:
    """The trainer state of an mlxft checkpoint directory; None for anything else."""
    if path.is_symlink() or not path.is_dir():
        return None
    state = read_state(path / TRAINER_STATE)
    return state if state is not None and all(k in state for k in ("step", "batch_index", "total_steps")) else None


def run_id_of(path: Path) -> str | None:
    """The run an mlxft checkpoint directory belongs to; None where it records none."""
    run_id = (_checkpoint_state(path) or {}).get("run_id")
    return run_id if isinstance(run_id, str) else None


def prune_checkpoints(run_dir: Path, keep: int, run_id: str, step: int) -> list[Path]:
    """Delete all but the newest ``keep`` periodic checkpoints of run ``run_id`` up to ``step``
    (the step just saved); final, emergency and every directory another run (or anything but
    mlxft) wrote stay. So do checkpoints past ``step``: a run resumed from an older checkpoint
    left them behind (see :func:`rewind_latest`), and counting them would delete this run's."""
    if keep <= 0:
        return []
    found = sorted((int(m.group(1)), p) for p in Path(run_dir).iterdir()
                   if (m := _STEP_CHECKPOINT.match(p.name)) and int(m.group(1)) <= step
                   and (_checkpoint_state(p) or {}).get("run_id") == run_id)
    doomed = [p for _, p in found[:-keep]]
    latest = (Path(run_dir) / LATEST).resolve()
    for path in doomed:
        if path.resolve() != latest:
            _delete_directory(path)
    return doomed


def _delete_directory(path: Path) -> None:
    """Hide ``path`` under a temporary name (one rename), then delete it: a kill during the
    deletion must not leave a visible checkpoint with half its files. What it leaves hidden,
    the next run's :func:`remove_partial_saves` deletes."""
    hidden = path.with_name(f".{path.name}.{os.getpid()}.deleted.tmp")
    try:
        os.replace(path, hidden)
    except OSError:
        hidden = path
    shutil.rmtree(hidden, ignore_errors=True)


_ANY_CHECKPOINT = re.compile(r"^(checkpoint-\d+(-emergency)?|final)$")


def remove_checkpoints(run_dir: Path, spare: Path | None = None) -> list[Path]:
    """Delete an earlier run's checkpoints and its ``latest`` link (for --overwrite), and
    nothing that is not an mlxft checkpoint, nor ``spare`` (the checkpoint a run resumes from)."""
    run_dir = Path(run_dir)
    doomed = [p for p in run_dir.iterdir() if _ANY_CHECKPOINT.match(p.name) and _checkpoint_state(p) is not None
              and (spare is None or p.resolve() != Path(spare).resolve())]
    if (run_dir / LATEST).is_symlink():  # first: it must never point at a half-deleted checkpoint
        (run_dir / LATEST).unlink()
    for path in doomed:
        _delete_directory(path)
    return doomed


# What a save killed half-way (SIGKILL, power loss) leaves: a checkpoint's temporary directory,
# a run file's temporary copy, the `latest` link's, or the tokenizer's staging directory. Never
# complete, never read, so safe to delete; an old checkpoint moved aside (``.old``)
# is recover_swaps's to put back or delete.
_PARTIAL_SAVE = re.compile(r"^\.((checkpoint-\d+(-emergency)?|final|latest|adapters\.safetensors|adapter_config\.json"
                           r"|config\.yaml|training_state\.json|metrics\.jsonl)\..+\.tmp(\.[a-z]+)?|tokenizer\.\w+)$")


def remove_partial_saves(run_dir: Path) -> list[Path]:
    """Delete what interrupted saves left in ``run_dir`` (see ``_PARTIAL_SAVE``). Best effort:
    what cannot be deleted (a read-only directory) is never read either."""
    doomed = [p for p in Path(run_dir).iterdir() if _PARTIAL_SAVE.match(p.name)] if Path(run_dir).is_dir() else []
    for path in doomed:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
    return doomed


# A checkpoint moved aside by replace_directory (``.X.<mkdtemp's 8 characters>.old/X``) or the
# hard-linked copy _hold_latest points ``latest`` at while X is swapped (``.X.*.old`` itself).
_SWAPPED = re.compile(r"^\.(checkpoint-\d+(?:-emergency)?|final)\.[a-z0-9_]{8}\.old$")
_CHECKPOINT_FILES = {ADAPTER_FILE, ADAPTER_CONFIG, OPTIMIZER_FILE, WINDOW_FILE, CONFIG_FILE, TRAINER_STATE}


def _holds_checkpoint_files(directory: Path) -> bool:
    """Whether ``directory`` holds a checkpoint's files and nothing else (perhaps not all of
    them: a copy a kill cut short), so deleting it cannot delete anything of a user's."""
    try:
        return all(p.name in _CHECKPOINT_FILES and p.is_file() and not p.is_symlink() for p in directory.iterdir())
    except OSError:  # another user's, unreadable: not this run's to delete
        return False


def _moved_aside(hidden: Path, name: str) -> Path | None:
    """``hidden/name`` where ``hidden`` holds that one directory and nothing else: a checkpoint
    replace_directory moved aside (or the empty place it left once put back: None)."""
    moved = hidden / name
    return moved if [p.name for p in hidden.iterdir()] == [name] and moved.is_dir() and not moved.is_symlink() else None


def _swapped_dirs(directory: Path) -> list[tuple[Path, str]]:
    """The hidden directories a checkpoint swap in ``directory`` made (readable ones), each with
    the name of the checkpoint it is for."""
    return [(p, _SWAPPED.match(p.name).group(1)) for p in sorted(directory.iterdir())
            if _SWAPPED.match(p.name) and p.is_dir() and not p.is_symlink() and os.access(p, os.R_OK | os.X_OK)]


def _restorable(hidden: Path, name: str) -> Path | None:
    """The checkpoint ``name`` that ``hidden`` holds, moved aside whole; None otherwise."""
    moved = _moved_aside(hidden, name)
    return moved if moved is not None and _checkpoint_state(moved) is not None else None


def moved_aside(path: Path) -> Path | None:
    """The checkpoint a kill in the middle of re-saving ``path`` left moved aside, its
    replacement never having arrived (:func:`recover_swaps` puts it back); None if there is none."""
    path = Path(path)
    if path.exists() or path.is_symlink() or not path.parent.is_dir():
        return None
    return next(filter(None, (_restorable(hidden, name) for hidden, name in _swapped_dirs(path.parent)
                              if name == path.name)), None)


def recover_swaps(run_dir: Path) -> list[str]:
    """Finish what a kill in the middle of swapping a checkpoint left: put a checkpoint that
    was moved aside back when its replacement never arrived, point ``latest`` from a held copy
    back at the checkpoint's own name, and delete the hidden copies ``latest`` no longer
    needs. A directory of such a name holding anything but a checkpoint's files is left
    alone. Returns the names put back."""
    run_dir = Path(run_dir)
    link = run_dir / LATEST

    def latest_in(hidden: Path) -> bool:
        return link.is_symlink() and link.resolve() == hidden.resolve()

    hidden = _swapped_dirs(run_dir)
    restored = []
    for aside, name in hidden:  # first: a held copy is let go only once its checkpoint is back
        moved = _restorable(aside, name)
        if moved is not None and not (run_dir / name).exists() and not (run_dir / name).is_symlink():
            os.replace(moved, run_dir / name)
            _fsync_dir(run_dir)
            restored.append(name)
    for copy, name in hidden:
        if latest_in(copy) and _checkpoint_state(run_dir / name) is not None:
            _point_latest(run_dir, name)
        moved = _moved_aside(copy, name)
        leftover = _holds_checkpoint_files(copy) or (moved is not None and _holds_checkpoint_files(moved))
        if leftover and not latest_in(copy):
            shutil.rmtree(copy, ignore_errors=True)
    return restored


def first_impostor_in(run_dir: Path, last_step: int) -> str | None:
    """The name of the first thing in ``run_dir`` that no mlxft run wrote and that a run of
    ``last_step`` steps would save over: a user's own ``final/``, a ``checkpoint-N`` up to that
    step, a ``latest`` that is no link. --overwrite removes an earlier run's checkpoints only."""
    for path in sorted(Path(run_dir).iterdir()):
        if path.name == LATEST and not path.is_symlink():
            return path.name
        named = _ANY_CHECKPOINT.match(path.name)
        if named and _checkpoint_state(path) is None and (path.name == "final" or _step_of(path.name) <= last_step):
            return path.name
    return None


def _step_of(name: str) -> int:
    return int(name.split("-")[1])


def first_output_in(run_dir: Path) -> str | None:
    """The name of the first thing in ``run_dir`` that a run writes over, if any. A
    ``metrics.jsonl`` of no training step is not: a run stopped (Ctrl-C, a crash) before its
    first step leaves one, and an error naming it would block the same command run again."""
    names = RUN_FILES + (METRICS_FILE, LATEST)
    for path in sorted(Path(run_dir).iterdir()):
        if path.name == METRICS_FILE and not _records_training(path):
            continue
        if path.name in names or _ANY_CHECKPOINT.match(path.name):
            return path.name
    return None


def _records_training(metrics: Path) -> bool:
    """Whether a metrics file holds a training step's record (or cannot be read to tell)."""
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return True
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            return True
        # Before the first step a run records only its baseline validation and exact-match.
        if not isinstance(record, dict) or record.get("type") not in ("eval", "exact_match") or record.get("step") != 0:
            return True
    return False


def rewind_latest(run_dir: Path, resumed: Path) -> Path | None:
    """Point ``latest`` at ``resumed``, a checkpoint of ``run_dir`` that a run resumes from,
    when it names another; return the one it named.

    A run resumed from an older checkpoint than ``latest`` leaves the newer ones behind, and
    drops the metrics of their steps; ``--resume latest`` after a crash before its first save
    must then come back to where it started, not to a checkpoint whose metrics are gone."""
    link = Path(run_dir) / LATEST
    named = link.resolve() if link.is_symlink() or link.exists() else None
    if named == Path(resumed).resolve():
        return None
    _point_latest(Path(run_dir), Path(resumed).name)
    return named


def resolve_checkpoint(spec: str, run_dir: Path) -> Path:
    """``latest`` (in ``run_dir``) or a checkpoint directory path."""
    path = Path(run_dir) / LATEST if spec == LATEST else Path(spec).expanduser()
    if spec == LATEST and not path.exists():
        raise UserError(f"--resume latest: {run_dir} has no checkpoint yet; pass --resume PATH or check --output-dir")
    path = path.resolve()
    if not (path / TRAINER_STATE).is_file():
        if moved_aside(path) is not None:  # a run in another directory does not recover this one's swaps
            raise UserError(f"--resume {spec}: a save cut short moved {path.name} aside in {path.parent}; resume "
                            f"with --output-dir {path.parent} once, which puts it back")
        raise UserError(f"--resume {spec}: {path} is not a checkpoint directory (no {TRAINER_STATE})")
    return path


def _read_safetensors(path: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(path))
    except (RuntimeError, ValueError, OSError) as err:
        raise UserError(f"{path} is not a readable safetensors file ({first_line(err)}); it may be truncated") from err


# What a resume reads from a checkpoint's trainer_state.json and config.yaml.
STATE_KEYS = ("step", "epoch", "batch_index", "window_real_tokens", "skipped_steps", "nonfinite_streak",
              "best_val_loss", "last_val_loss", "loss_scaler")
CONFIG_SECTIONS = ("model", "data", "adapter", "optim", "train")


_COUNT_KEYS = ("step", "epoch", "batch_index", "window_real_tokens", "skipped_steps", "nonfinite_streak")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _damaged(path: Path, what: str) -> UserError:
    return UserError(f"{path} {what}; the checkpoint is damaged: resume from an earlier one")


def check_window(window: dict[str, mx.array], trainables: dict[str, mx.array], source: Path) -> None:
    """A window file (a run stopped inside a gradient-accumulation window) must hold a gradient
    of every trainable parameter, in its shape, and the window's loss and token sums."""
    for name in WINDOW_SUMS:
        if name not in window or window[name].ndim:
            raise _damaged(source, f"has no scalar {name!r}")
    for name, param in trainables.items():
        if name not in window:
            raise _damaged(source, f"has no gradient of {name!r}")
        if window[name].shape != param.shape:
            raise _damaged(source, f"holds {name!r} in shape {tuple(window[name].shape)}, not the parameter's "
                                   f"{tuple(param.shape)}")
    extra = sorted(set(window) - set(trainables) - set(WINDOW_SUMS))
    if extra:
        raise _damaged(source, f"holds {extra[0]!r}, which is no trainable parameter of this run")


def load_checkpoint(path: Path) -> dict:
    """Everything a checkpoint holds: state, config, adapter weights, optimizer, window."""
    path = Path(path)
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
        config = yaml.safe_load((path / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as err:
        raise UserError(f"checkpoint {path} is unreadable ({first_line(err)}); resume from an earlier checkpoint") from err
    if not isinstance(state, dict):
        raise _damaged(path / TRAINER_STATE, "is not a JSON object")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise _damaged(path / TRAINER_STATE, f"has no {missing[0]!r}")
    for key in _COUNT_KEYS:
        if not _is_count(state[key]):
            raise _damaged(path / TRAINER_STATE, f"has no valid {key!r} (a count, got {state[key]!r})")
    for key in ("best_val_loss", "last_val_loss"):
        if state[key] is not None and not _is_number(state[key]):
            raise _damaged(path / TRAINER_STATE, f"has no valid {key!r} (a number or null, got {state[key]!r})")
    scaler = state["loss_scaler"]
    if not (isinstance(scaler, dict) and _is_number(scaler.get("scale")) and _is_count(scaler.get("good_steps"))):
        raise _damaged(path / TRAINER_STATE, "has no valid 'loss_scaler'")
    unlogged = state.get("unlogged")
    if unlogged is not None and not (isinstance(unlogged, dict) and _is_number(unlogged.get("loss_sum"))
                                     and _is_number(unlogged.get("tokens")) and _is_count(unlogged.get("steps"))):
        raise _damaged(path / TRAINER_STATE, f"has no valid 'unlogged' (loss_sum, tokens, steps; got {unlogged!r})")
    optional = (("last_val_step", lambda v: v is None or _is_count(v), "a count or null"),
                ("exact_match_baseline", lambda v: isinstance(v, bool), "true or false"),
                ("run_id", lambda v: v is None or isinstance(v, str), "a string"))
    for key, valid, what in optional:  # older checkpoints have none of them
        if key in state and not valid(state[key]):
            raise _damaged(path / TRAINER_STATE, f"has no valid {key!r} ({what}, got {state[key]!r})")
    if not (isinstance(config, dict) and all(isinstance(config.get(s), dict) for s in CONFIG_SECTIONS)):
        raise _damaged(path / CONFIG_FILE, f"is not a run config (sections {', '.join(CONFIG_SECTIONS)})")
    window_path = path / WINDOW_FILE
    return {
        "state": state,
        "config": config,
        "adapters": _read_safetensors(path / ADAPTER_FILE),
        "optimizer": _read_safetensors(path / OPTIMIZER_FILE),
        "window": _read_safetensors(window_path) if window_path.exists() else None,
    }


# Settings a resumed run must share with its checkpoint. Shape-defining ones can never
# differ; the rest change the run's meaning but not its tensors, so --force may override.
RESUME_FIXED = ("adapter.finetune", "adapter.targets", "adapter.rank", "adapter.num_layers", "model.quantize",
                "optim.optimizer")  # another optimizer's moments are not this one's
RESUME_FORCEABLE = ("model.model", "model.revision", "model.dtype", "model.quantize_group_size",
                    "model.quantize_dtype", "data.max_seq_length",
                    "data.pack", "adapter.alpha", "adapter.dropout", "train.seed", "train.batch_size",
                    "train.grad_accum_steps")


def check_resume(saved: dict, current: dict, saved_task: str, task: str, force: bool,
                 saved_data: str | None = None, train_data: str | None = None,
                 saved_dtype: str | None = None, dtype: str | None = None,
                 saved_weights: str | None = None, weights: str | None = None) -> list[str]:
    """Refuse a resume whose settings, training data or base weights differ from the
    checkpoint's; return the differences ``force`` let through. ``saved_data`` and
    ``train_data`` are training-set fingerprints (:attr:`mlxft.data.Dataset.fingerprint`;
    checkpoints before them have none), ``saved_dtype`` and ``dtype`` the dtypes computed in,
    which one ``model.dtype`` (auto) names differently on a CPU and a GPU, ``saved_weights``
    and ``weights`` the base model's :func:`mlxft.models.weights_fingerprint` (None where a
    model was passed in, or before they were recorded): the same ``--model`` name may hold
    other weights by now (a hub id that moved on, a directory written over)."""

    def get(config, dotted):
        section, key = dotted.split(".")
        value = config.get(section, {}).get(key)
        if dotted == "model.model" and isinstance(value, str):  # two spellings of one directory
            from mlxft.models import absolute_name

            return absolute_name(value)
        if dotted == "model.quantize_dtype":  # checkpoints before the field quantized in model.dtype
            return value or ""
        return value

    forced = []
    unquantized = not get(current, "model.quantize")  # then the group size means nothing
    pairs = [(f, get(saved, f), get(current, f)) for f in RESUME_FIXED + RESUME_FORCEABLE
             if not (unquantized and f in ("model.quantize_group_size", "model.quantize_dtype"))] + [("task", saved_task, task)]
    if saved_dtype is not None:
        pairs.append(("the compute dtype (model.dtype)", saved_dtype, dtype))
    for field_name, old, new in pairs:
        if old == new:
            continue
        if field_name in RESUME_FIXED or not force:
            hint = "" if field_name in RESUME_FIXED else " (pass --force to resume anyway)"
            raise UserError(f"cannot resume: {field_name} is {new!r} but the checkpoint was trained with {old!r}{hint}")
        forced.append(f"{field_name}: {old!r} -> {new!r}")
    if saved_data is not None and saved_data != train_data:
        if not force:
            raise UserError("cannot resume: the training data differs from the checkpoint's (another file, edited "
                            "rows, or another tokenizer or max_seq_length), so the run would not continue where it "
                            "stopped (pass --force to resume anyway)")
        forced.append("training data changed")
    if saved_weights is not None and weights is not None and saved_weights != weights:
        if not force:
            raise UserError(f"cannot resume: the weights in {get(current, 'model.model')} differ from those the "
                            "checkpoint was trained on (a newer download or another model saved there), so its "
                            "adapters would continue on another base (pass --force to resume anyway)")
        forced.append("base model weights changed")
    return forced


def drop_metrics_after(run_dir: Path, step: int) -> int:
    """Remove ``metrics.jsonl``'s records of steps after ``step``, and a line a kill cut short.

    A run killed after its last checkpoint had logged steps that the resumed run trains
    again and logs anew; kept, they would appear twice, with the discarded values first.
    Returns how many lines went."""
    path = Path(run_dir) / METRICS_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read {path} ({first_line(err)}); move it aside to resume") from err

    def kept(line: str) -> bool:
        try:
            record = json.loads(line)
        except ValueError:  # cut short by a kill
            return False
        at = record.get("step") if isinstance(record, dict) else None
        return not isinstance(at, int) or at <= step

    keep = [line if line.endswith("\n") else line + "\n" for line in lines if kept(line)]
    if keep != lines:
        write_text(path, "".join(keep))
    return len(lines) - len(keep)
