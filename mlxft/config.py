"""Run configuration: dataclasses with one declared default each, YAML files and CLI flags.

A config file is YAML with the sections below (``model``, ``adapter``, ``data``, ``optim``,
``train``). Every field is also a CLI flag named after it (``learning_rate`` ->
``--learning-rate``); flags override the file, the file overrides the defaults. Unknown keys
and invalid values are :class:`~mlxft.errors.UserError`\\ s naming the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import math
import numbers
import os
import reprlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from mlxft.errors import UserError, first_line

WHOLE_LAYERS = "layers"  # the target that trains every weight of the selected layers (full only)


def _opt(default: Any, help: str, choices: tuple | None = None):
    """A config field: its one default, the help text shown by --help, its allowed values."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


PROMPT_FORMATS = ("auto", "chat", "raw")  # how prompt/completion rows are rendered (data.renders_chat)


@dataclass
class ModelConfig:
    """Which model to load and how to hold it in memory."""

    model: str = _opt(
        "", "Model directory or Hugging Face repo id (any architecture mlx-lm loads), or builtin:smollm2-135m-instruct."
    )
    revision: str = _opt("", "Hub revision (branch, tag or commit) when --model is a repo id.")
    dtype: str = _opt(
        "auto",
        "Compute dtype of the frozen weights; auto = float32 on the CPU, bfloat16 on a GPU.",
        ("auto", "float32", "bfloat16", "float16"),
    )
    quantize: int = _opt(0, "Quantize the base to this many bits on load (QLoRA); 0 keeps it.", (0, 4, 8))
    quantize_group_size: int = _opt(64, "Group size for --quantize.", (32, 64, 128))
    quantize_dtype: str = _opt(
        "", "Dtype the base is cast to before --quantize computes its scales; empty = --dtype. A run continuing "
            "a QLoRA adapter takes the one the adapter was quantized in, so it trains over the same base.",
        ("", "auto", "float32", "bfloat16", "float16"),
    )
    grad_checkpoint: bool = _opt(
        False, "Recompute each layer's activations during the backward pass: less memory, one more forward "
           "pass (~1/3 more compute for full fine-tuning, ~1/2 for LoRA, whose frozen weights need no gradient)."
    )
    checkpoint_layers: int = _opt(
        0, "With --grad-checkpoint, recompute only the first N layers and keep the rest's activations: "
           "between the two in memory and speed; 0 = every layer."
    )
    checkpoint_keep_mlp: bool = _opt(
        False, "With --grad-checkpoint, keep each recomputed layer's MLP gate and up projections, the costliest "
               "activations to recompute, and recompute only the rest (attention or convolution, norms, SwiGLU): "
               "SmolLM2 chat on the CPU: 1.48 GB against 2.32 without recomputation and 1.08 with all of it. "
               "Llama and LFM2 families."
    )
    recompute_mlp: bool = _opt(
        False, "Compute each MLP's gate and up projections again in the backward pass rather than keep them, "
               "where gate, up and down are LoRA layers: about half of what a layer keeps, for two of its "
               "matmuls. The same layers' LFM2 convolutions and, off the CPU, attention keep only their input "
               "projections' outputs and compute the rest again (no matmul but the attention's). Llama and LFM2 "
               "families."
    )
    recompute_mlp_layers: int = _opt(
        0, "With --recompute-mlp, only the first N layers' MLPs, and the rest keep gate and up at their "
           "speed: between the two in memory and speed; 0 = every layer."
    )
    fit_memory: bool = _opt(
        False, "When the memory estimate passes the memory limit (--memory-limit, or MLX's), apply what the "
               "warning would advise first: --recompute-mlp where it fits and checkpointing would take more than "
               "half of the layers (with --recompute-mlp-layers N, as few as bring it under), else "
               "--grad-checkpoint --checkpoint-layers N with as few layers as bring it under; applied before "
               "the first step and saved in the run's config. Needs train.memory_estimate."
    )
    loss_chunk: int = _opt(
        0, "Score supervised positions this many at a time. With a frozen output head (LoRA, DoRA) the "
           "head's input gradient is computed in the forward pass chunk by chunk, recomputing nothing; 0 "
           "picks about 8M logits a chunk on the CPU (128 tokens of a 49k vocabulary) and 64M on a GPU. "
           "With a trained head (full fine-tuning) each chunk's logits are recomputed in the backward pass: "
           "less memory for more time (SmolLM2-135M on the CPU: 0.86 against 0.98 GB with 128, 11% slower), "
           "and 0 = all at once."
    )


@dataclass
class AdapterConfig:
    """What is trained: LoRA / DoRA adapters or the weights themselves, and where."""

    finetune: str = _opt(
        "lora", "lora or dora adapters, or full fine-tuning of the targeted weights.", ("lora", "dora", "full")
    )
    targets: list = _opt(
        ["default"],
        "Modules to train, by name inside a layer (e.g. self_attn.q_proj), or one of: default "
        "(per family; everything for full), all (every linear), attn, mlp, or for full alone layers "
        "(every weight of the trained layers, norms included, as mlx-lm's full fine-tuning). "
        "Comma-separated on the CLI.",
    )
    num_layers: int = _opt(-1, "Train only the last N transformer layers; -1 = all.")
    rank: int = _opt(8, "LoRA rank r.")
    alpha: float = _opt(16.0, "LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = _opt(0.0, "Dropout on the LoRA input.")
    init_adapter: str = _opt(
        "", "Start from this adapter directory (mlxft run or checkpoint, mlx-lm run, or PEFT adapter) "
        "instead of fresh adapters; the fields above that are left unset take its layout."
    )


@dataclass
class DataConfig:
    """Where the data is and how it becomes batches."""

    data: str = _opt("", "Directory holding train.jsonl (and valid.jsonl), a train .jsonl file, or builtin:capitals.")
    train_file: str = _opt("", "Explicit training JSONL path (overrides --data).")
    valid_file: str = _opt("", "Explicit validation JSONL path (default: valid.jsonl beside train).")
    max_seq_length: int = _opt(2048, "Longest row in tokens: longer text rows are split into windows of it, other rows truncated.")
    length_bucket: int = _opt(64, "Pad batches to a multiple of this length to bound compiled shapes.")
    pack: bool = _opt(
        False,
        "Lay each micro-batch's rows end to end in as few sequences as fit (llama/lfm2 families); every row "
        "stays an isolated document, so the loss equals the unpacked batch's with less padding computed.",
    )
    completion_only: bool = _opt(
        True, "Supervise only completions / assistant turns (SFT shapes); --no-completion-only trains on all."
    )
    prompt_format: str = _opt(
        "auto",
        "How prompt/completion rows are rendered: chat (tokenizer's template), raw (concatenated), "
        "auto (chat when the tokenizer has a template).",
        PROMPT_FORMATS,
    )


@dataclass
class OptimConfig:
    """Optimizer, learning-rate schedule and gradient hygiene."""

    optimizer: str = _opt("adamw", "Optimizer from mlx.optimizers.", ("adamw", "adam", "sgd"))
    learning_rate: float = _opt(1e-4, "Peak learning rate.")
    min_learning_rate: float = _opt(
        0.0, "Where linear and cosine schedules decay to, one step after the last (so every step trains).")
    schedule: str = _opt("cosine", "Decay after warmup.", ("constant", "linear", "cosine"))
    warmup_steps: int = _opt(0, "Linear warmup from 0 over this many optimizer steps.")
    weight_decay: float = _opt(0.0, "Decoupled weight decay (AdamW) or L2 (SGD).")
    momentum: float = _opt(0.0, "SGD momentum.")
    bias_correction: bool = _opt(
        False, "Adam(W) bias correction, as PyTorch's AdamW has it. Off, as in MLX and mlx-lm, the first "
        "few hundred updates are up to 6x larger at the same learning rate.")
    max_grad_norm: float = _opt(1.0, "Clip the global gradient norm to this; 0 disables clipping.")
    label_smoothing: float = _opt(0.0, "Label smoothing of the cross-entropy, in [0, 1).")
    max_nonfinite_steps: int = _opt(
        5, "Stop with an emergency checkpoint after this many non-finite steps in a row; 0 = never."
    )


@dataclass
class TrainConfig:
    """The loop: how long, how big, how often to evaluate, log and save."""

    output_dir: str = _opt("runs/latest", "Run directory for adapters, config, state and metrics.")
    overwrite: bool = _opt(False, "Allow writing into an output directory that holds another run.")
    epochs: int = _opt(1, "Passes over the training data (ignored when --max-steps is set).")
    max_steps: int = _opt(0, "Stop after this many optimizer steps; 0 = train by --epochs.")
    batch_size: int = _opt(4, "Rows per micro-batch, over all data-parallel ranks together.")
    grad_accum_steps: int = _opt(1, "Micro-batches per optimizer step (token-weighted).")
    seed: int = _opt(0, "Seed for data order, adapter init and dropout.")
    eval_every: int = _opt(0, "Validate every N optimizer steps (and always before the first step and at the end); 0 = those two only.")
    max_eval_batches: int = _opt(0, "Cap validation at this many batches: the file's first N x batch-size rows; 0 = the whole set.")
    exact_match_rows: int = _opt(
        0, "Before and after training, answer this many validation rows greedily and report exact-match; 0 = off."
    )
    save_every: int = _opt(0, "Save every N optimizer steps (and always at the end); 0 = end only.")
    log_every: int = _opt(10, "Report training loss every N optimizer steps.")
    keep_checkpoints: int = _opt(
        3, "Keep the newest N checkpoint-<step> directories; final and emergency ones are never deleted. 0 = keep all."
    )
    resume: str = _opt("", "Continue from a checkpoint directory, or 'latest' (the newest in --output-dir).")
    backend: str = _opt(
        "auto", "Distributed backend under mlx.launch; auto = the one the launcher set up, none = one process.",
        ("auto", "none", "ring", "mpi", "jaccl", "nccl"),
    )
    dist_timeout: float = _opt(
        600.0, "Seconds a rank may wait for its peers (start-up, or no progress) before exiting with an error."
    )
    memory_limit: float = _opt(
        0.0, "MLX's memory limit in GB (it waits on pending work, then fails, past it); 0 = MLX's default "
             "(1.5x the recommended working set on Metal)."
    )
    cache_limit: float = _opt(
        -1.0, "MLX's allocator-cache limit in GB; -1 = the run's estimated peak and a quarter where MLX's default "
              "is higher (Metal and CUDA, where it is the memory limit), else MLX's default.",
    )
    pace_memory: bool = _opt(
        True, "On the CPU and CUDA: train under a memory limit just above the paced estimate (where that is "
              "below --memory-limit), so MLX waits instead of queueing the loss's chunks far ahead of the one it "
              "computes (SmolLM2-135M chat on the CPU: 1.78 -> 1.63 GB at the same speed); raised if a step needs "
              "more, up to --memory-limit. A --memory-limit paces the same way at its own value, so the paced "
              "estimate is the one compared with it. Metal keeps its limit (unmeasured there).",
    )
    clear_cache_above: float = _opt(
        -1.0, "Return the allocator cache to the system after each step once it holds more than this many GB; "
              "-1 = never. 0 is what mlx-lm does; on CUDA it cost LFM2-1.2B 66k -> 38k tokens/s for a peak "
              "of 13.2 GB, which mlxft's cap on CUDA graphs now reaches at full speed (see benchmarks/README.md).",
    )
    memory_estimate: bool = _opt(
        True, "Before training, estimate peak memory by probing one and two layers at the batch shape "
              "(one, for checkpointed layers)."
    )
    force: bool = _opt(False, "Resume even when harmless settings differ from the checkpoint's (model name or "
                              "revision, dtype, quantization group size, sequence length, packing, alpha, dropout, "
                              "seed, batch size, accumulation, training data).")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "adapter": AdapterConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
}


@dataclass
class RunConfig:
    """Everything one training run needs; saved resolved with every checkpoint."""

    model: ModelConfig = field(default_factory=ModelConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_saved_dict(self) -> dict:
        """``to_dict`` as a run saves it (config.yaml, reusable with --config): without the flags
        that act on the command giving them, so a reused file neither replaces the run in another
        --output-dir (overwrite) nor looks for a checkpoint there (resume, force)."""
        data = self.to_dict()
        data["train"].update(overwrite=False, resume="", force=False)
        return data

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "RunConfig":
        """Build from nested ``{section: {field: value}}``; unknown keys are errors."""
        config = cls()
        apply_overrides(config, data, source)
        return config


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 80
_SHOWN.maxlist = _SHOWN.maxdict = 4
_SHOWN.maxlevel = 2


def _shown(value: Any) -> str:
    """A value as an error quotes it: short, however large (a YAML alias can nest a billion items)."""
    text = _SHOWN.repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def _coerce(value: Any, f: dataclasses.Field, where: str) -> Any:
    """Check a value's type against the field's default and convert where lossless."""
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise UserError(f"{where}: expected true or false, got {_shown(value)}")
    elif isinstance(default, int):
        # numbers.Integral takes NumPy's integers (np.int64 is no int); floats, even 2.0, stay refused.
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise UserError(f"{where}: expected an integer, got {_shown(value)}")
        value = int(value)
    elif isinstance(default, float):
        if isinstance(value, str):  # PyYAML reads 1e-4 (no dot before the e) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, numbers.Real):  # Real takes np.float32 and np.int64
            raise UserError(f"{where}: expected a number, got {_shown(value)}")
        try:
            value = float(value)
        except OverflowError:  # an integer of hundreds of digits
            raise UserError(f"{where}: {value} is too large for a number") from None
    elif isinstance(default, list):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UserError(f"{where}: expected a list of names, got {_shown(value)}")
    elif isinstance(default, str):
        if isinstance(value, os.PathLike):  # scripts pass pathlib.Path; the saved config.yaml needs a str
            value = os.fspath(value)
        if not isinstance(value, str):
            raise UserError(f"{where}: expected a string or path, got {_shown(value)}")
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise UserError(f"{where}: {_shown(value)} is not one of {', '.join(map(str, choices))}")
    return value


# mlx_lm.lora's flat config keys, and the mlxft fields that say the same.
_MLX_LM_KEYS = {
    "iters": "train.max_steps", "fine_tune_type": "adapter.finetune", "lora_parameters": "adapter.rank/alpha/dropout",
    "num_layers": "adapter.num_layers", "learning_rate": "optim.learning_rate", "batch_size": "train.batch_size",
    "adapter_path": "train.output_dir", "max_seq_length": "data.max_seq_length", "steps_per_eval": "train.eval_every",
    "steps_per_report": "train.log_every", "save_every": "train.save_every", "val_batches": "train.max_eval_batches",
    "mask_prompt": "data.completion_only", "grad_checkpoint": "model.grad_checkpoint", "seed": "train.seed",
    "resume_adapter_file": "train.resume",
}


def _mlx_lm_layout(data: dict) -> str | None:
    """The first sign that ``data`` is an mlx_lm.lora config (flat keys, ``model: path``,
    ``train: true``), described with the mlxft field it maps to; None if there is none."""
    for key in data:
        if key in _MLX_LM_KEYS:
            return f"'{key}' is {_MLX_LM_KEYS[key]}"
    for key in ("model", "data", "train", "test"):
        if key in data and isinstance(data[key], (str, bool, int, float)):
            return f"'{key}: {data[key]}' is a flat key"
    return None


def apply_overrides(config: RunConfig, data: dict, source: str) -> None:
    """Set values from a nested mapping, validating every key and type."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a mapping of sections ({', '.join(SECTIONS)})")
    mlx_lm = _mlx_lm_layout(data)
    if mlx_lm:
        raise UserError(f"{source} looks like an mlx_lm.lora config ({mlx_lm}); mlxft's config puts each field "
                        f"in a section ({', '.join(SECTIONS)}), as in examples/lora_chat.yaml and each run's config.yaml")
    for section, values in data.items():
        if section not in SECTIONS:
            raise UserError(f"{source}: unknown section '{section}' (known: {', '.join(SECTIONS)})")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise UserError(f"{source}: section '{section}' must be a mapping of fields")
        target = getattr(config, section)
        known = {f.name: f for f in fields(target)}
        for key, value in values.items():
            if key not in known:
                raise UserError(
                    f"{source}: unknown key '{section}.{key}' (known: {', '.join(sorted(known))})"
                )
            setattr(target, key, _coerce(value, known[key], f"{source}: {section}.{key}"))


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error: PyYAML
    keeps the last silently, so a second ``train:`` section would quietly replace the first."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: explicit keys override those
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # unhashable: PyYAML's own construction reports it
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice; merge the two",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(path: str | Path) -> dict:
    """Read a YAML config file, turning every read or parse problem into a one-line error."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"config file {path}: not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8") from err
    except OSError as err:
        raise UserError(f"cannot read config file {path}: {err.strerror or err}") from err
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.reader.ReaderError as err:  # a control character: marked by position, not line
        line = text.count("\n", 0, err.position) + 1
        raise UserError(f"{path} line {line}: invalid YAML ({err.reason}: character #x{err.character:04x}); "
                        "remove it") from err
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", err)
        if problem == "but found another document":  # a '---' line: which of the two would the run mean?
            raise UserError(f"{path}{line}: a second YAML document starts here; a config is one document, so keep "
                            "one of them") from err
        raise UserError(f"{path}{line}: invalid YAML ({problem})") from err
    except (ValueError, RecursionError) as err:  # a number of thousands of digits, nesting thousands deep
        raise UserError(f"{path}: YAML this reader cannot take ({first_line(err) or type(err).__name__}); "
                        "simplify the value") from err
    return {} if data is None else data  # an empty file; any other non-mapping is refused as one


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per config field, grouped by section; unset flags stay absent."""
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section, (cls.__doc__ or "").strip())
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help = f"{f.metadata['help']} (default: {default if not isinstance(default, list) else ','.join(default)})"
            # argparse formats help with %: a literal one ("11% slower") pasted the option's record in.
            kwargs: dict[str, Any] = {"dest": f"{section}.{f.name}", "default": argparse.SUPPRESS,
                                      "help": help.replace("%", "%%")}
            if isinstance(default, bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            elif isinstance(default, list):
                kwargs["type"] = str
                kwargs["metavar"] = "NAMES"
            else:
                kwargs["type"] = type(default)
                kwargs["metavar"] = f.name.upper()
                if f.metadata.get("choices"):
                    kwargs["choices"] = f.metadata["choices"]
                    kwargs["metavar"] = "{" + ",".join(map(str, f.metadata["choices"])) + "}"
            group.add_argument(flag, **kwargs)


def resolve(args: argparse.Namespace, config_path: str | None) -> RunConfig:
    """Defaults, then the YAML file, then CLI flags; then validate. With ``adapter.init_adapter``
    the adapter fields neither of them sets take the starting adapter's own layout, and the
    model's quantization a QLoRA adapter's."""
    config = RunConfig()
    from_file = load_yaml(config_path) if config_path else {}
    apply_overrides(config, from_file, str(config_path))
    overrides: dict[str, dict] = {}
    for dest, value in vars(args).items():
        if "." in dest:
            section, name = dest.split(".", 1)
            overrides.setdefault(section, {})[name] = value
    apply_overrides(config, overrides, "command line")
    given = set(from_file.get("adapter") or {}) | set(overrides.get("adapter", {}))
    inherited: dict[str, Any] = {}
    if config.adapter.init_adapter:
        from mlxft.adapters import base_settings, run_settings
        from mlxft.checkpoint import resolve_checkpoint
        from mlxft.models import config_quantized, layer_count, peek_config

        given_model = set(from_file.get("model") or {}) | set(overrides.get("model", {}))
        # Resuming, the checkpoint holds the layout (and the weights): the starting adapter may
        # have moved since, or be named relative to another directory.
        source = (resolve_checkpoint(config.train.resume, Path(config.train.output_dir).expanduser())
                  if config.train.resume else Path(config.adapter.init_adapter).expanduser())
        base_config = peek_config(config.model.model, config.model.revision)
        settings = inherited = run_settings(source, base_layers=layer_count(base_config))
        for name, value in settings.items():
            if name not in given:
                setattr(config.adapter, name, value)
        # A QLoRA adapter's base is quantized as it was, unless the base given is quantized
        # already or --quantize says otherwise.
        if not config_quantized(base_config) and "quantize" not in given_model:
            for name, value in base_settings(source).items():
                if name not in given_model:
                    setattr(config.model, name, value)
    for name in ("rank", "alpha", "dropout"):  # full fine-tuning would train on without them
        value = getattr(config.adapter, name)
        # A starting adapter's own value, and a default a saved config.yaml spells out, are not a request.
        asked = name in given and value != getattr(AdapterConfig, name) and value != inherited.get(name)
        if config.adapter.finetune == "full" and asked:
            raise UserError(f"config field adapter.{name}: applies to --finetune lora or dora; full fine-tuning "
                            "has no adapter: drop it")
    validate(config)
    return config


MAX_GB = 1e6  # a memory or cache size beyond any machine: surely a typo
# A count, length or step number past this is a typo too, and MLX takes shapes and indices as
# 32-bit integers: past it a run would fail with a traceback, after creating its directory.
MAX_COUNT = 2**31 - 1
MAX_SEED = 2**64 - 1  # MLX's seed is an unsigned 64-bit integer


def _as_assigned(value: Any, f: dataclasses.Field) -> Any:
    """What a script may assign to a field and has always been able to: a tuple for a list,
    None for an unset string, a whole float for an integer (from_dict's files are stricter)."""
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(value, tuple) and isinstance(default, list):
        return list(value)
    if value is None and isinstance(default, str):
        return ""
    if isinstance(value, float) and type(default) is int and value.is_integer():
        return int(value)
    return value


def inert_settings(config: RunConfig) -> list[str]:
    """Settings given that this run does not use, as warnings: refused, they would also stop
    runs saved before the check from resuming."""
    notes = []
    if config.optim.min_learning_rate and config.optim.schedule == "constant":
        notes.append(f"optim.min_learning_rate {config.optim.min_learning_rate:g} does nothing under the constant "
                     "schedule (linear and cosine decay to it)")
    if not config.model.quantize and config.model.quantize_group_size != ModelConfig.quantize_group_size:
        notes.append(f"model.quantize_group_size {config.model.quantize_group_size} does nothing without --quantize")
    return notes


MAX_TIMEOUT = 1e6  # seconds (11.6 days); past about 1e10 the watchdog's clock overflows


def _path_problem(value: str) -> str | None:
    """Why the OS could not take ``value`` as a path, found before any work starts (a run that
    trained for hours must not fail writing its checkpoint), or None."""
    if not value:
        return None
    if "\0" in value:
        return f"{value!r} holds a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # bytes of another encoding, passed through by the shell
        return f"{_shown(value)} is not UTF-8 text, which MLX's file writers need"
    try:
        os.stat(Path(value).expanduser())
    except OSError as err:
        if err.errno in (errno.ENAMETOOLONG, errno.ELOOP):
            return f"{_shown(value)}: {err.strerror}"
    except ValueError as err:
        return f"{_shown(value)}: {first_line(err)}"
    return None


def validate(config: RunConfig, model_given: bool = False, data_given: bool = False) -> None:
    """Reject values no run can use, naming the field and what to do. ``model_given`` and
    ``data_given``: a script passes the model or the datasets in, so the config need not name them."""

    def need(ok: bool, name: str, what: str) -> None:
        if not ok:
            raise UserError(f"config field {name}: {what}")

    # A script's `config.train.learning_rate = ...` (optim's) or `config.train = {...}`: what
    # from_dict refuses as an unknown key, not ignored or a TypeError later.
    stray = sorted(set(vars(config)) - set(SECTIONS))
    if stray:
        raise UserError(f"config: unknown section '{stray[0]}' (known: {', '.join(SECTIONS)})")
    for section, kind in SECTIONS.items():
        target = getattr(config, section)
        if not isinstance(target, kind):
            raise UserError(f"config section '{section}' is a {type(target).__name__}, not {kind.__name__}; set its "
                            f"fields (config.{section}.NAME = ...) or build the config with RunConfig.from_dict")
        known = {f.name for f in fields(target)}
        unknown = sorted(set(vars(target)) - known)
        if unknown:
            raise UserError(f"config: unknown key '{section}.{unknown[0]}' (known: {', '.join(sorted(known))})")
    for section in SECTIONS:  # values a script assigned (a Path, a NumPy number) pass as from_dict's do
        target = getattr(config, section)
        for f in fields(target):
            setattr(target, f.name, _coerce(_as_assigned(getattr(target, f.name), f), f,
                                            f"config field {section}.{f.name}"))
    a, d, o, t = config.adapter, config.data, config.optim, config.train
    for section in SECTIONS:  # inf and nan pass most range checks below, then break the run
        for name, value in vars(getattr(config, section)).items():
            finite = not isinstance(value, float) or math.isfinite(value)
            need(finite, f"{section}.{name}", f"must be a finite number, got {value}")
            if isinstance(value, int) and not isinstance(value, bool) and name != "seed":
                need(abs(value) <= MAX_COUNT, f"{section}.{name}", f"must be at most {MAX_COUNT:,}, got {value:,}")
    need(0 <= t.seed <= MAX_SEED, "train.seed", f"must be 0 to 2**64-1, got {t.seed}")
    need(model_given or bool(config.model.model), "model.model", "no model given; pass --model DIR_OR_REPO")
    need(data_given or bool(d.data or d.train_file), "data.data", "no training data given; pass --data DIR or --train-file")
    need(a.rank >= 1, "adapter.rank", f"must be >= 1, got {a.rank}")
    need(a.alpha > 0, "adapter.alpha", f"must be > 0, got {a.alpha}")
    need(0 <= a.dropout < 1, "adapter.dropout", f"must be in [0, 1), got {a.dropout}")
    need(a.num_layers == -1 or a.num_layers >= 1, "adapter.num_layers", "must be -1 (all) or >= 1")
    need(len(a.targets) >= 1, "adapter.targets", "name at least one module or 'default'")
    need(WHOLE_LAYERS not in a.targets or (a.targets == [WHOLE_LAYERS] and a.finetune == "full"), "adapter.targets",
         f"'{WHOLE_LAYERS}' (every weight of the trained layers) stands alone and needs --finetune full")
    need(not config.model.quantize_dtype or config.model.quantize, "model.quantize_dtype",
         "applies to runs that quantize the base; add --quantize or drop it")
    need(not (a.finetune == "full" and config.model.quantize), "model.quantize",
         "full fine-tuning trains the base's own weights, which a quantized base cannot; drop --quantize or "
         "use --finetune lora")
    need(d.max_seq_length >= 2, "data.max_seq_length", f"must be >= 2, got {d.max_seq_length}")
    need(config.model.checkpoint_layers >= 0, "model.checkpoint_layers", "must be >= 0 (0 = every layer)")
    need(not config.model.checkpoint_layers or config.model.grad_checkpoint, "model.checkpoint_layers",
         "applies to checkpointed runs; add --grad-checkpoint")
    need(not config.model.checkpoint_keep_mlp or config.model.grad_checkpoint, "model.checkpoint_keep_mlp",
         "applies to checkpointed runs; add --grad-checkpoint")
    need(not (config.model.recompute_mlp and config.model.checkpoint_keep_mlp), "model.recompute_mlp",
         "recomputes what --checkpoint-keep-mlp keeps; pass one of the two")
    need(config.model.recompute_mlp_layers >= 0, "model.recompute_mlp_layers", "must be >= 0 (0 = every layer)")
    need(not config.model.recompute_mlp_layers or config.model.recompute_mlp, "model.recompute_mlp_layers",
         "applies to runs that recompute MLPs; add --recompute-mlp")
    need(config.model.loss_chunk >= 0, "model.loss_chunk", "must be >= 0 (0 = no chunking)")
    need(not config.model.fit_memory or config.train.memory_estimate, "model.fit_memory",
         "fits the run by the memory estimate; drop --no-memory-estimate")
    need(d.length_bucket >= 1, "data.length_bucket", f"must be >= 1, got {d.length_bucket}")
    # A micro-batch's padded token count indexes MLX arrays: past 2**31 the first step crashes.
    row = max(d.length_bucket, math.ceil(d.max_seq_length / d.length_bucket) * d.length_bucket)
    need(t.batch_size * row <= MAX_COUNT, "train.batch_size",
         f"{t.batch_size:,} rows padded to {row:,} tokens (max_seq_length rounded up to "
         f"length_bucket) exceed 2**31 tokens a micro-batch; lower batch_size, max_seq_length or length_bucket")
    need(o.learning_rate > 0 and math.isfinite(o.learning_rate), "optim.learning_rate", "must be > 0")
    need(0 <= o.min_learning_rate <= o.learning_rate, "optim.min_learning_rate", "must be in [0, learning_rate]")
    need(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    need(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    need(o.optimizer != "adam" or o.weight_decay == 0, "optim.weight_decay", "Adam has no weight decay; use --optimizer adamw")
    need(0 <= o.momentum < 1, "optim.momentum", f"must be in [0, 1), got {o.momentum}")
    need(o.momentum == 0 or o.optimizer == "sgd", "optim.momentum", "applies to --optimizer sgd only")
    need(not o.bias_correction or o.optimizer != "sgd", "optim.bias_correction", "applies to --optimizer adamw or adam only")
    need(o.max_grad_norm >= 0, "optim.max_grad_norm", "must be >= 0 (0 disables clipping)")
    need(0 <= o.label_smoothing < 1, "optim.label_smoothing", "must be in [0, 1)")
    need(t.epochs >= 1 or t.max_steps >= 1, "train.epochs", f"must be >= 1 unless --max-steps is set, got {t.epochs}")
    need(t.epochs >= 0, "train.epochs", f"must be >= 0, got {t.epochs}")
    need(t.max_steps >= 0, "train.max_steps", "must be >= 0 (0 = train by epochs)")
    need(t.batch_size >= 1, "train.batch_size", f"must be >= 1, got {t.batch_size}")
    need(t.grad_accum_steps >= 1, "train.grad_accum_steps", f"must be >= 1, got {t.grad_accum_steps}")
    # MLX takes byte counts as size_t: past ~1.8e10 GB they no longer convert.
    need(0 <= t.memory_limit <= MAX_GB, "train.memory_limit", f"must be 0 to {MAX_GB:g} GB (0 = MLX's default)")
    need(0 <= t.cache_limit <= MAX_GB or t.cache_limit == -1, "train.cache_limit",
         f"must be 0 to {MAX_GB:g} GB, or -1 for MLX's default")
    need(0 <= t.clear_cache_above <= MAX_GB or t.clear_cache_above == -1, "train.clear_cache_above",
         f"must be 0 to {MAX_GB:g} GB, or -1 (never)")
    need(o.max_nonfinite_steps >= 0, "optim.max_nonfinite_steps", "must be >= 0")
    for name in ("eval_every", "save_every", "max_eval_batches", "exact_match_rows", "keep_checkpoints"):
        need(getattr(t, name) >= 0, f"train.{name}", "must be >= 0")
    need(t.log_every >= 1, "train.log_every", "must be >= 1")
    need(bool(t.output_dir.strip()), "train.output_dir", "must name a directory")
    need(0 < t.dist_timeout <= MAX_TIMEOUT, "train.dist_timeout", f"must be > 0 and at most {MAX_TIMEOUT:g} seconds")
    for name, value in (("model.model", config.model.model), ("data.data", d.data), ("data.train_file", d.train_file),
                        ("data.valid_file", d.valid_file), ("adapter.init_adapter", a.init_adapter),
                        ("train.resume", t.resume), ("train.output_dir", t.output_dir)):
        problem = _path_problem(value)
        need(problem is None, name, f"{problem}; choose another path")
