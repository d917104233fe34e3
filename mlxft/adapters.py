"""Adapter directories in and out, whoever wrote them: mlxft runs, mlx-lm runs, PEFT adapters.

:func:`load_adapter_dir` recognises the three layouts and returns the tensors under mlx-lm's
names and orientation (``lora_a`` (in, r), ``lora_b`` (r, out), DoRA magnitude ``m``) with an
:class:`AdapterSpec` that describes them. :func:`attach` builds the matching LoRA / DoRA layers
with mlx-lm (through :mod:`mlxft.lora`) and loads the tensors all or nothing, so a model either
carries the whole adapter or is left as it was. :func:`start_from` is the same for a training
run that continues from an adapter. :func:`write_peft` and :func:`write_mlx` write an adapter
back out in PEFT's or mlx-lm's layout.

PEFT stores ``base_model.model.<module>.lora_A.weight`` (r, in) and ``lora_B.weight`` (out, r);
mlx-lm stores ``<module>.lora_a`` (in, r) and ``lora_b`` (r, out): the conversion is a transpose
of each, and the scale is ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA). mlxft records
``alpha`` with ``scale = alpha / rank`` always, so an rsLoRA import gets ``alpha = scale * rank``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import yaml
from mlx.utils import tree_flatten, tree_unflatten

from mlxft import builtin, checkpoint, lora, models
from mlxft.config import AdapterConfig
from mlxft.errors import UserError, first_line

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
# LoraConfig fields that leave the adapter plain LoRA, rsLoRA or DoRA (read, checked below, or
# only about how PEFT trained it). Any other field set is a variant mlxft does not implement
# (aLoRA, QALoRA, layer replication, LoRA biases, trainable tokens, newer ones): refused, not
# loaded as plain LoRA.
_PEFT_PLAIN_FIELDS = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
                      "inference_mode", "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout",
                      "fan_in_fan_out", "bias", "use_rslora", "use_dora", "init_lora_weights", "layers_to_transform",
                      "layers_pattern", "rank_pattern", "alpha_pattern", "modules_to_save", "target_parameters",
                      "megatron_config", "megatron_core", "loftq_config", "eva_config", "corda_config",
                      "lora_ga_config", "qalora_group_size", "runtime_config", "ensure_weight_tying"}
# Initialisations that change the base's weights too: the adapter fits that changed base.
_PEFT_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
_PEFT_CONVERTIBLE_INITS = ("pissa", "olora", "corda", "lora_ga")  # PEFT rewrites these as LoRA of the unchanged base
FINE_TUNE_TYPES = ("lora", "dora", "full")
# Files a tokenizer is saved as; copied along so an exported adapter stays self-contained.
TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "chat_template*",
                      "vocab.json", "vocab.txt", "merges.txt")

# model.layers.<i>.<module inside the layer>.<lora_a | lora_b | m>
_LAYER_TENSOR = re.compile(r"(^|\.)layers\.\d+\.")
_ADAPTER_TENSOR = re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?P<module>.+)\.(?P<leaf>lora_a|lora_b|m)$")


@dataclass
class AdapterSpec:
    """What an adapter directory holds, independent of the layout it was stored in."""

    fine_tune_type: str  # lora | dora | full
    rank: int
    scale: float  # the update is scale * (x @ lora_a) @ lora_b
    dropout: float
    # Module names inside a layer; for full fine-tuning ["*"] = the whole model and ["layers"] =
    # every weight of the last num_layers layers.
    targets: list[str]
    num_layers: int | None  # the last N layers (-1 = all); None = decided from the model (PEFT)
    layers: list[int] = field(default_factory=list)  # layer indices that hold tensors
    model_type: str = ""
    base_model: str = ""
    base_revision: str = ""  # the hub revision of a hub base_model the adapter was trained on
    base_weights: str = ""  # models.weights_fingerprint of the base an mlxft run loaded
    source: str = ""  # mlxft | mlx-lm | peft
    path: Path = Path(".")
    run_config: dict | None = None  # an mlxft run's config.yaml, when there is one (an export's header: RUN_SETTINGS)
    task: str | None = None  # what an exported run trained on (chat, completion, text), as the header says
    base_quantization: dict | None = None  # bits, group_size, dtype: how an mlxft run quantized a float base
    # Modules inside the span may hold no tensors (a PEFT adapter's layers_to_transform, per
    # layer target lists); they get a fresh adapter that changes nothing. Elsewhere a missing
    # tensor means a damaged file.
    partial: bool = False

    @property
    def alpha(self) -> float:
        return self.scale * self.rank

    @property
    def first_layer(self) -> int:
        return min(self.layers) if self.layers else 0


# ---------------------------------------------------------------------------------------
# Reading


def adapter_directory(path) -> Path:
    """The directory an ``--adapter`` argument names: itself, or the one holding the weights file it names."""
    path = Path(path).expanduser()
    return path.parent if path.is_file() and path.name in (checkpoint.ADAPTER_FILE, PEFT_WEIGHTS) else path


def load_adapter_dir(path) -> tuple[dict[str, mx.array], AdapterSpec]:
    """The tensors of an adapter directory (mlx-lm names and orientation) and its spec.

    ``path`` is an mlxft run or checkpoint directory, an mlx-lm ``--adapter-path`` directory,
    or a PEFT adapter directory (or the weights file inside any of them).
    """
    path = adapter_directory(path)
    if not path.exists():
        raise UserError(f"adapter directory {path} does not exist; check the path given to --adapter or --init-adapter")
    if not path.is_dir():
        raise UserError(f"adapter path {path} is a file; pass the directory that holds it")
    if (path / PEFT_WEIGHTS).is_file():
        weights, spec = _read_peft(path)
    elif (path / checkpoint.ADAPTER_FILE).is_file():
        weights, metadata = checkpoint.load_adapter_weights(path / checkpoint.ADAPTER_FILE)
        if metadata.get("format", "").startswith("mlxft-adapter"):
            spec = _mlxft_spec(path, metadata)
        else:
            spec = _mlx_lm_spec(path, _read_json(path / checkpoint.ADAPTER_CONFIG, "mlx-lm adapter config"))
    elif (path / "adapter_model.bin").is_file():
        raise UserError(f"{path} holds a PEFT adapter as adapter_model.bin (pickle); save it with "
                        "save_pretrained(..., safe_serialization=True) to get adapter_model.safetensors")
    else:
        raise UserError(f"{path} holds no adapter: expected {checkpoint.ADAPTER_FILE} (mlxft or mlx-lm run) "
                        f"or {PEFT_WEIGHTS} (PEFT)")
    if not weights:
        raise UserError(f"{path}: the adapter file holds no tensors")
    if spec.targets == [lora.WHOLE_LAYERS] and any(_LAYER_TENSOR.search(name) is None for name in weights):
        spec.targets = ["*"]  # tensors outside the layers: a whole model's (mlxft's, exported to mlx-lm's layout)
    if spec.fine_tune_type != "full":
        spec.layers = _check_lora_tensors(weights, spec, path)
    run_config = path / checkpoint.CONFIG_FILE
    if run_config.is_file() and spec.source == "mlxft":  # the run's own settings, over an export's
        try:
            saved = yaml.safe_load(run_config.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError, yaml.YAMLError):  # ValueError: not UTF-8
            saved = None
        # Only used for defaults (quantization); the adapter itself is fine without it.
        spec.run_config = saved if isinstance(saved, dict) and saved else None
        if not spec.base_revision:  # runs written before the header recorded it
            spec.base_revision = str(run_section(spec, "model").get("revision") or "")
    return weights, spec


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise UserError(f"{path.parent}: no {path.name} ({what}); the adapter directory is incomplete")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: not a readable JSON file ({err})") from err
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


def _number(config: dict, key: str, where: Path, kind=float, default=None):
    value = config.get(key, default)
    if value is None:
        raise UserError(f"{where}: missing '{key}'")
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)  # JSON's NaN
            or (kind is int and value != int(value))):
        raise UserError(f"{where}: '{key}' must be {'an integer' if kind is int else 'a finite number'}, got {value!r}")
    return kind(value)


def _dropout(config: dict, key: str, where: Path) -> float:
    dropout = 0.0 if config.get(key) is None else _number(config, key, where)
    if not 0 <= dropout < 1:
        raise UserError(f"{where}: '{key}' must be in [0, 1), got {dropout}")
    return dropout


def _fine_tune_type(value, where: Path) -> str:
    if value not in FINE_TUNE_TYPES:
        raise UserError(f"{where}: fine_tune_type {value!r} is not one of {', '.join(FINE_TUNE_TYPES)}")
    return value


def _mlxft_spec(path: Path, meta: dict[str, str]) -> AdapterSpec:
    where = path / checkpoint.ADAPTER_FILE
    try:
        targets = json.loads(meta["target_modules"])
        spec = AdapterSpec(
            fine_tune_type=_fine_tune_type(meta["fine_tune_type"], where), rank=int(meta["rank"]),
            scale=float(meta["scale"]), dropout=float(meta["dropout"]), targets=list(targets),
            num_layers=int(meta["num_layers"]), model_type=meta.get("model_type", ""),
            base_model=meta.get("base_model", ""), base_revision=meta.get("base_revision", ""), source="mlxft",
            base_weights=meta.get("base_weights", ""), path=path,
            base_quantization=_base_quantization(meta.get("base_quantization"), where),
            partial=_partial(path, meta))
        if RUN_SETTINGS in meta:
            settings = json.loads(meta[RUN_SETTINGS])
            if not isinstance(settings, dict):
                raise ValueError(f"{RUN_SETTINGS} is not a mapping")
            spec.task = settings.get("task") if isinstance(settings.get("task"), str) else None
            spec.run_config = {section: settings[section] for section in ("data", "model") if section in settings}
    except KeyError as err:
        raise UserError(f"{where}: the header lacks the LoRA entry {err}; the file is damaged") from err
    except (ValueError, TypeError) as err:
        raise UserError(f"{where}: unreadable LoRA header entry ({err})") from err
    # float() reads "nan" and "inf": a fused model of NaNs, written with exit 0.
    for key, ok, what in (("rank", spec.rank >= 1, ">= 1"), ("scale", math.isfinite(spec.scale), "a finite number"),
                          ("dropout", 0 <= spec.dropout < 1, "in [0, 1)"),
                          ("num_layers", spec.num_layers == -1 or spec.num_layers >= 1, "-1 (all) or >= 1")):
        if not ok:
            raise UserError(f"{where}: the LoRA header's {key} must be {what}, got {meta[key]!r}; the file is damaged")
    config = _read_optional_json(path / checkpoint.ADAPTER_CONFIG)
    _check_config_agrees(path, config, spec)
    if not spec.base_model:  # runs written before the header recorded it
        spec.base_model = config.get("base_model", "")
    return spec


def _check_config_agrees(path: Path, config: dict, spec: AdapterSpec) -> None:
    """mlx-lm builds the layers from adapter_config.json and mlxft from the safetensors header:
    an edited copy of one would make the two load different adapters from the same directory."""
    params = config.get("lora_parameters") if isinstance(config.get("lora_parameters"), dict) else {}
    keys = params.get("keys", [])
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise UserError(f"{path / checkpoint.ADAPTER_CONFIG}: lora_parameters.keys must be a list of module names, "
                        f"got {keys!r}; put back the list {checkpoint.ADAPTER_FILE}'s header gives, {spec.targets!r}")
    recorded = (("fine_tune_type", config, spec.fine_tune_type), ("num_layers", config, spec.num_layers),
                ("rank", params, spec.rank), ("scale", params, spec.scale), ("dropout", params, spec.dropout),
                ("keys", params, spec.targets))
    for key, where, header in recorded:
        if key in where and where[key] != header and not (key == "keys" and sorted(where[key] or []) == sorted(header)):
            field = key if where is config else f"lora_parameters.{key}"
            raise UserError(f"{path / checkpoint.ADAPTER_CONFIG}: {field} is {where[key]!r} but "
                            f"{checkpoint.ADAPTER_FILE}'s header says {header!r}; mlx-lm reads the first and mlxft the "
                            "second: edit one to match the other")


def _partial(path: Path, meta: dict[str, str]) -> bool:
    """Whether an mlxft adapter may lack tensors inside its span: one exported from PEFT says
    so. Exports written before the header said either way may be such; a run's or a
    checkpoint's own adapter (config.yaml beside it) never is."""
    if "partial" in meta:
        return meta["partial"] == "true"
    return not any((path / name).is_file() for name in (checkpoint.CONFIG_FILE, checkpoint.TRAINER_STATE))


def _base_quantization(value, where: Path) -> dict | None:
    """The ``base_quantization`` an mlxft adapter records (a JSON object, or its text in a
    safetensors header), checked; None where there is none."""
    if value is None:
        return None
    try:
        recorded = json.loads(value) if isinstance(value, str) else value
        bits, group_size, dtype = recorded["bits"], recorded["group_size"], recorded["dtype"]
    except (ValueError, TypeError, KeyError) as err:
        raise UserError(f"{where}: base_quantization must be an object with bits, group_size and dtype "
                        f"({first_line(err)}); fix or remove it") from err
    if bits not in (2, 3, 4, 5, 6, 8) or group_size not in (32, 64, 128) or dtype not in ("auto", *models.DTYPES):
        raise UserError(f"{where}: base_quantization {recorded} is not bits 2-8, group_size 32, 64 or 128 and a "
                        "dtype mlxft knows; fix or remove it")
    return {"bits": bits, "group_size": group_size, "dtype": dtype}


def run_section(spec: AdapterSpec | None, section: str) -> dict:
    """A section of the run's config.yaml (``model``, ``data``), empty when there is none."""
    value = (spec.run_config or {}).get(section) if spec is not None else None
    if value is None:
        return {}
    if not isinstance(value, dict):  # an edited file
        raise UserError(f"{spec.path / checkpoint.CONFIG_FILE}: section {section} is {value!r}, not a mapping of "
                        "fields; fix the file or remove it")
    return value


def base_quantization(spec: AdapterSpec | None) -> dict | None:
    """How the run behind ``spec`` quantized a float base on load (QLoRA): what the adapter
    records, else (runs from before it did) its config.yaml's model section; None for a run on
    the base as it is."""
    if spec is None:
        return None
    if spec.base_quantization or not spec.run_config:
        return spec.base_quantization
    section = run_section(spec, "model")
    try:
        bits, group_size = int(section.get("quantize") or 0), int(section.get("quantize_group_size") or 64)
    except (AttributeError, TypeError, ValueError) as err:
        raise UserError(f"{spec.path / checkpoint.CONFIG_FILE}: model.quantize and model.quantize_group_size "
                        f"must be integers ({first_line(err)}); fix the file or remove it") from err
    if not bits:
        return None
    recorded = section.get("quantize_dtype") or section.get("dtype")
    return {"bits": bits, "group_size": group_size, "dtype": recorded if recorded in ("auto", *models.DTYPES) else "auto"}


def _read_optional_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _mlx_lm_spec(path: Path, config: dict) -> AdapterSpec:
    """mlx-lm's adapter_config.json: fine_tune_type, num_layers, lora_parameters {rank, scale, ...}.

    mlx-lm itself only reads ``scale``; a config with ``alpha`` alone is accepted here
    (scale = alpha / rank) since that is what the writer meant.
    """
    where = path / checkpoint.ADAPTER_CONFIG
    fine_tune_type = _fine_tune_type(config.get("fine_tune_type", "lora"), where)
    num_layers = _number(config, "num_layers", where, int)
    params = config.get("lora_parameters")
    if fine_tune_type == "full":
        params = params if isinstance(params, dict) else {}
        # Meaningless to a full fine-tune, but read as any LoRA run's are (a string was a traceback).
        rank = _number(params, "rank", where, int) or 1 if params.get("rank") is not None else 1
        scale = _number(params, "scale", where) or 1.0 if params.get("scale") is not None else 1.0
        # mlx-lm's full fine-tuning trains whole layers; mlxft's export names the modules it trained.
        keys = params.get("keys")
        targets = [str(k) for k in keys] if isinstance(keys, list) and keys else [lora.WHOLE_LAYERS]
    else:
        if not isinstance(params, dict):
            raise UserError(f"{where}: missing 'lora_parameters' (rank, scale, dropout)")
        rank = _number(params, "rank", where, int)
        if rank < 1:
            raise UserError(f"{where}: rank must be >= 1, got {rank}")
        if "scale" in params:
            scale = _number(params, "scale", where)
        elif "alpha" in params or "alpha" in config:
            scale = _number(params if "alpha" in params else config, "alpha", where) / rank
        else:
            raise UserError(f"{where}: lora_parameters has no 'scale' (mlx-lm) or 'alpha'")
    return AdapterSpec(
        fine_tune_type=fine_tune_type, rank=rank, scale=scale,
        dropout=_dropout(params, "dropout", where), targets=targets if fine_tune_type == "full" else [],
        num_layers=num_layers, model_type=_text(config, "model_type", where),
        base_model=_text(config, "base_model", where) or _text(config, "model", where),
        base_revision=_text(config, "base_revision", where), base_weights=_text(config, "base_weights", where),
        source="mlx-lm", path=path,
        base_quantization=_base_quantization(config.get("base_quantization"), where))


def _text(config: dict, key: str, where: Path) -> str:
    """A string field of an adapter config, "" where missing or null: a number or list there
    would be taken as a model name or revision."""
    value = config.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise UserError(f"{where}: field {key!r} must be a string, got {json.dumps(value)}; fix or remove it")
    return value


def _read_peft(path: Path) -> tuple[dict[str, mx.array], AdapterSpec]:
    where = path / PEFT_CONFIG
    config = _read_json(where, "PEFT adapter config")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise UserError(f"{where}: peft_type {peft_type!r} is not supported; only LORA adapters (LoRA, rsLoRA, DoRA) are")
    for key, refusal in (("rank_pattern", "per-module ranks"), ("alpha_pattern", "per-module alphas"),
                         ("modules_to_save", "fully trained extra modules"), ("target_parameters", "parameter targets")):
        if config.get(key):
            raise UserError(f"{where}: '{key}' is set ({refusal}); mlxft adapters have one rank and alpha and train no extra modules")
    variant = next((key for key in sorted(config) if key not in _PEFT_PLAIN_FIELDS and config[key]), None)
    if variant:
        raise UserError(f"{where}: '{variant}' is set, a LoRA variant mlxft does not implement; only plain LoRA, "
                        "rsLoRA and DoRA adapters can be loaded")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_PEFT_BASE_CHANGING_INITS):
        fix = ("save it with save_pretrained(..., path_initial_model_for_weight_conversion=...) to get a LoRA of "
               "the unchanged base" if init.lower().startswith(_PEFT_CONVERTIBLE_INITS)
               else "PEFT cannot convert it to a LoRA of the unchanged base")
        raise UserError(f"{where}: init_lora_weights {init!r} changed the base's weights as well, and the adapter "
                        f"fits only that changed base; {fix}")
    if config.get("bias", "none") != "none":
        raise UserError(f"{where}: bias={config['bias']!r} trains biases; only bias='none' adapters can be loaded")
    if config.get("fan_in_fan_out"):
        raise UserError(f"{where}: fan_in_fan_out is for GPT-2 style Conv1D layers, which mlx-lm models do not have")
    rank = _number(config, "r", where, int)
    if rank < 1:
        raise UserError(f"{where}: r must be >= 1, got {rank}")
    alpha = _number(config, "lora_alpha", where, default=8)  # PEFT's LoraConfig default, not r
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    raw, _ = checkpoint.load_adapter_weights(path / PEFT_WEIGHTS)
    weights = {}
    for name, value in raw.items():
        mlx_name, tensor = peft_to_mlx_tensor(name, value, path / PEFT_WEIGHTS)
        weights[mlx_name] = tensor
    use_dora = bool(config.get("use_dora"))
    has_magnitude = any(k.endswith(".m") for k in weights)
    if use_dora != has_magnitude:
        raise UserError(f"{where}: use_dora is {use_dora} but the weights {'lack' if use_dora else 'hold'} "
                        "lora_magnitude_vector tensors; the directory is inconsistent")
    spec = AdapterSpec(
        fine_tune_type="dora" if use_dora else "lora", rank=rank, scale=scale,
        dropout=_dropout(config, "lora_dropout", where), targets=[], num_layers=None,
        base_model=_text(config, "base_model_name_or_path", where), base_revision=_text(config, "revision", where),
        source="peft", path=path, partial=True)
    return weights, spec


def peft_to_mlx_tensor(name: str, value: mx.array, where) -> tuple[str, mx.array]:
    """One PEFT tensor under its mlx-lm name and orientation."""
    if not name.startswith(PEFT_PREFIX):
        raise UserError(f"{where}: tensor {name} does not start with '{PEFT_PREFIX}'; not a PEFT LoRA file")
    module = name[len(PEFT_PREFIX):]
    if "lora_embedding_" in module:
        raise UserError(f"{where}: tensor {name} adapts an embedding; only linear layers can be loaded")
    for suffix, leaf in ((".lora_A.weight", "lora_a"), (".lora_B.weight", "lora_b")):
        if module.endswith(suffix):
            if value.ndim != 2:
                raise UserError(f"{where}: tensor {name} has {value.ndim} dimensions; LoRA of linear layers has 2")
            return module[: -len(suffix)] + "." + leaf, value.T
    for suffix in (".lora_magnitude_vector", ".lora_magnitude_vector.weight"):
        if module.endswith(suffix):
            return module[: -len(suffix)] + ".m", value
    raise UserError(f"{where}: tensor {name} is not a LoRA tensor (lora_A, lora_B or lora_magnitude_vector)")


def _check_lora_tensors(weights: dict[str, mx.array], spec: AdapterSpec, path: Path) -> list[int]:
    """Check every tensor is a LoRA tensor of a module inside a layer with the spec's rank;
    fill the spec's targets from the tensors (mlx-lm configs may omit them); return the layers."""
    modules, layers = set(), set()
    for name, value in weights.items():
        match = _ADAPTER_TENSOR.match(name)
        if match is None:
            raise UserError(f"{path}: tensor {name} is not a LoRA tensor of a module inside the transformer layers "
                            "(expected model.layers.N.<module>.lora_a / lora_b / m)")
        leaf = match["leaf"]
        if spec.fine_tune_type == "lora" and leaf == "m":
            raise UserError(f"{path}: tensor {name} is a DoRA magnitude but the adapter says fine_tune_type lora")
        # A linear layer's adapters are [in, rank] and [rank, out]; a mixture of experts' stacked
        # projection (mlx-lm's LoRASwitchLinear) has one pair an expert: [experts, rank, in], [experts, out, rank].
        rank_dim = {(2, "lora_a"): -1, (2, "lora_b"): 0, (3, "lora_a"): 1, (3, "lora_b"): 2}.get((value.ndim, leaf))
        if leaf != "m" and (rank_dim is None or value.shape[rank_dim] != spec.rank):
            raise UserError(f"{path}: tensor {name} has shape {tuple(value.shape)}, which does not have rank {spec.rank} "
                            "(a linear layer's lora_a and lora_b are [in, rank] and [rank, out], stacked experts' "
                            "[experts, rank, in] and [experts, out, rank])")
        modules.add(match["module"])
        layers.add(int(match["layer"]))
    if not spec.targets:
        spec.targets = sorted(modules)
    elif set(spec.targets) != modules and spec.targets != ["*"]:
        extra = sorted(modules - set(spec.targets))
        if extra:
            raise UserError(f"{path}: tensors for module {extra[0]}, which the adapter's target list does not name")
    return sorted(layers)


# ---------------------------------------------------------------------------------------
# Attaching to a model


def _check_family(model: nn.Module, spec: AdapterSpec) -> None:
    if spec.model_type and spec.model_type != models.family(model):
        raise UserError(f"{spec.path}: the adapter was trained on a {spec.model_type} model but the base is "
                        f"{models.family(model)}; pass the matching --model")


def resolve_num_layers(model: nn.Module, spec: AdapterSpec) -> int:
    """How many of the last layers the adapter spans, for ``lora.apply``."""
    return _span(len(model.layers), spec)


def _span(total: int, spec: AdapterSpec) -> int:
    if spec.num_layers is None:  # PEFT: from the first layer that holds a tensor
        return total - spec.first_layer
    if spec.num_layers > total and spec.source == "mlx-lm":
        return -1  # mlx-lm's default is 16 layers, which on a smaller model means all of them
    if spec.num_layers > total:
        raise UserError(f"{spec.path}: the adapter spans {spec.num_layers} layers but the base has {total}; "
                        "the adapter is for another model")
    if spec.layers and spec.num_layers != -1 and spec.first_layer < total - spec.num_layers:
        raise UserError(f"{spec.path}: the adapter has tensors for layer {spec.first_layer}, outside the last "
                        f"{spec.num_layers} of the base's {total} layers; the adapter is for another model")
    return spec.num_layers


def adapter_config(model: nn.Module, spec: AdapterSpec):
    """The :class:`mlxft.config.AdapterConfig` that rebuilds the adapter's layers on ``model``."""
    require_adapter(spec, "rebuilding adapter layers")
    return AdapterConfig(finetune=spec.fine_tune_type, targets=list(spec.targets), num_layers=resolve_num_layers(model, spec),
                         rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout)


def _check_targets(model: nn.Module, spec: AdapterSpec, num_layers: int) -> None:
    layers = lora.selected_layers(model, num_layers)
    available = lora.linear_names(layers)
    missing = [t for t in spec.targets if t not in available]
    if not missing:
        return
    per_expert = [t for t in missing if re.search(r"(^|\.)experts\.\d+\.", t)]
    stacked = sorted({name for layer in layers for name, module in layer.named_modules() if lora.is_experts(module)})
    if per_expert and stacked:
        raise UserError(f"{spec.path}: the adapter adapts each expert as a module of its own ({per_expert[0]}), as PEFT "
                        f"does on a transformers model, but mlx-lm stacks each layer's experts ({stacked[0]}) and such "
                        "adapters do not load onto them; merge it into the model with PEFT and use the merged model")
    raise UserError(f"{spec.path}: the adapter targets {missing[0]}, which the base's layers do not have "
                    f"(they have {', '.join(available)}); the adapter is for another model")


def attach(model: nn.Module, spec: AdapterSpec, weights: dict[str, mx.array]) -> nn.Module:
    """Put the adapter on ``model``: LoRA / DoRA layers with its weights, or its full weights.

    All or nothing: every name and shape is checked before anything is loaded. The model is
    frozen first, so afterwards exactly the adapter's tensors are trainable.
    """
    _check_family(model, spec)
    source = str(spec.path)
    if spec.fine_tune_type == "full":
        load_full_weights(model, weights, source)
        return model
    config = adapter_config(model, spec)
    _check_targets(model, spec, config.num_layers)
    model.freeze()
    _apply_or_restore(model, config, 0, weights, source, spec.scale, spec.partial)
    return model


def _apply_or_restore(model: nn.Module, config, seed: int, weights: dict[str, mx.array], source: str,
                      scale: float | None = None, partial: bool = False) -> list[str]:
    """``lora.apply`` then load ``weights``; if they do not fit (a shape, a missing tensor),
    put the original layers back before raising, so a refused adapter leaves no trace.

    With ``partial`` (PEFT's ``layers_to_transform`` may pick any layers, where mlx-lm's layout
    is the last N, and its layers may adapt different modules), a module inside the span that
    holds no tensor keeps its fresh initialisation, which changes nothing: ``lora_b`` starts
    at zero, and DoRA's magnitude at the weight's norm."""
    layers = lora.selected_layers(model, config.num_layers)
    originals = [(layer, list(layer.named_modules())) for layer in layers]
    targets = lora.apply(model, config, seed)
    try:
        if scale is not None:
            set_scale(model, scale)  # exactly the stored scale, not alpha / rank recomputed
        held = {(match["layer"], match["module"]) for match in map(_ADAPTER_TENSOR.match, weights) if match}
        fresh = {name: value for name, value in checkpoint.trainable_weights(model).items()
                 if partial and (match := _ADAPTER_TENSOR.match(name)) and (match["layer"], match["module"]) not in held}
        checkpoint.apply_adapter_weights(model, {**fresh, **weights}, source)
    except UserError:
        for layer, modules in originals:
            replaced = [(name, module) for name, module in modules if name in targets]
            if replaced:
                layer.update_modules(tree_unflatten(replaced))
        raise
    return targets


def load_full_weights(model: nn.Module, weights: dict[str, mx.array], source: str) -> None:
    """Replace the model's weights by a full fine-tune's, after checking every name and shape."""
    if models.is_quantized(model):
        raise UserError(f"{source}: a full fine-tune replaces the base's weights; load the base unquantized "
                        "(it is quantized here)")
    params = dict(tree_flatten(model.parameters()))
    for name, value in weights.items():
        if name not in params:
            raise UserError(f"{source}: tensor {name} is not a parameter of the base; the weights are for another model")
        if tuple(value.shape) != tuple(params[name].shape):
            raise UserError(f"{source}: tensor {name} has shape {tuple(value.shape)} but the base has "
                            f"{tuple(params[name].shape)}; the weights are for another model")
    model.load_weights([(k, v.astype(params[k].dtype)) for k, v in weights.items()], strict=False)


def set_scale(model: nn.Module, scale: float) -> None:
    for _, module in model.named_modules():
        if "lora_a" in module and hasattr(module, "scale"):
            module.scale = scale


def start_from(model: nn.Module, config, path, seed: int = 0, base: tuple[Path, str] | None = None) -> list[str]:
    """Make ``model`` trainable as ``config`` (an AdapterConfig) asks, starting from the adapter in ``path``.

    For a training run that continues from an earlier adapter (mlxft, mlx-lm or PEFT): call
    instead of ``lora.apply``. The adapter must have the run's layout (fine-tune type, rank,
    targets, layers) and scale; the first difference is named. Returns the targeted modules.
    ``base``: the loaded base's directory and name (``--model``), to warn where that name held
    other weights when the adapter was trained.
    """
    weights, spec = load_adapter_dir(path)
    _check_family(model, spec)
    if base is not None:
        _warn_other_base_weights(spec, base[0], base[1])
    if spec.fine_tune_type != config.finetune:
        raise UserError(f"{spec.path}: the adapter is {spec.fine_tune_type} but the run trains {config.finetune}; "
                        f"pass --finetune {spec.fine_tune_type}")
    if config.finetune == "full":
        if spec.targets == [lora.WHOLE_LAYERS]:
            if config.targets != [lora.WHOLE_LAYERS]:
                raise UserError(f"{spec.path}: the adapter trained whole layers, norms included (mlx-lm's full "
                                f"fine-tuning); pass --targets {lora.WHOLE_LAYERS}")
            _check_span(model, spec, config)
        model.freeze()  # lora.apply's starting point (mlx_lm.load leaves every weight trainable)
        targets = lora.apply(model, config, seed)
        try:
            checkpoint.apply_adapter_weights(model, weights, str(spec.path))
        except UserError:
            model.freeze()  # as it came: a refused adapter leaves no trace
            raise
        return targets
    if spec.rank != config.rank:
        raise UserError(f"{spec.path}: the adapter has rank {spec.rank} but the run uses {config.rank}; pass --rank {spec.rank}")
    # Compare before changing the model, so a refusal leaves it untouched.
    targets = lora.resolve_targets(config.targets, lora.linear_names(lora.selected_layers(model, config.num_layers)))
    if sorted(spec.targets) != sorted(targets):
        raise UserError(f"{spec.path}: the adapter targets {','.join(sorted(spec.targets))} but the run targets "
                        f"{','.join(targets)}; pass --targets {','.join(sorted(spec.targets))}")
    run_scale = config.alpha / config.rank
    if not math.isclose(spec.scale, run_scale, rel_tol=1e-6):
        # The hint's alpha in full (repr): 6 digits (:g) can miss the 1e-6 tolerance (rsLoRA r=32: 181.019...).
        raise UserError(f"{spec.path}: the adapter's scale is {spec.scale:g} (alpha {spec.alpha:g}) but the run's is "
                        f"{run_scale:g}; pass --alpha {spec.alpha!r}")
    _check_span(model, spec, config)
    # Training starts from a frozen base, as lora.apply expects: from a model fresh from
    # mlx_lm.load, whose every weight is trainable, each was taken for a tensor the adapter lacked.
    model.freeze()
    _apply_or_restore(model, config, seed, weights, str(spec.path), partial=spec.partial)
    return targets


def _check_span(model: nn.Module, spec: AdapterSpec, config) -> None:
    total = len(model.layers)
    spans = resolve_num_layers(model, spec)
    spans, trains = total if spans == -1 else spans, len(lora.selected_layers(model, config.num_layers))
    if spans != trains:
        raise UserError(f"{spec.path}: the adapter spans the last {spans} layers but the run trains {trains}; "
                        f"pass --num-layers {spans}")


def run_settings(path, model: nn.Module | None = None, base_layers: int | None = None) -> dict:
    """The ``adapter`` config section an adapter directory was trained with, to default a run's
    settings to when it starts from that adapter: finetune, targets, rank, alpha (= scale * rank),
    dropout and num_layers. How many layers an adapter spans can depend on the base (a PEFT
    adapter records layer indices; mlx-lm's 16 layers on a smaller base mean all of them): pass
    ``model``, or ``base_layers``, its layer count, where known without loading it."""
    _, spec = load_adapter_dir(path)
    settings = {"finetune": spec.fine_tune_type, "rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout,
                "targets": ["default"] if spec.targets == ["*"] else list(spec.targets)}
    total = len(model.layers) if model is not None else base_layers
    if spec.fine_tune_type == "full" and spec.targets == ["*"]:
        settings["num_layers"] = -1
    elif total is not None:
        settings["num_layers"] = _span(total, spec)
    elif spec.num_layers is not None:
        settings["num_layers"] = spec.num_layers
    return settings


def base_settings(path) -> dict:
    """The ``model`` config fields a run starting from the adapter in ``path`` defaults to: a
    QLoRA adapter's quantization (``quantize``, ``quantize_group_size``, ``quantize_dtype``), so it goes on training
    over the base it was trained on; nothing for an adapter of a float base."""
    quantized = base_quantization(load_adapter_dir(path)[1])
    if not quantized:
        return {}
    return {"quantize": quantized["bits"], "quantize_group_size": quantized["group_size"],
            "quantize_dtype": quantized["dtype"]}


# ---------------------------------------------------------------------------------------
# The base model an adapter belongs to


@dataclass
class Loaded:
    model: nn.Module
    tokenizer: object
    model_path: Path
    config: dict
    spec: AdapterSpec | None


def run_task(spec: AdapterSpec | None) -> str | None:
    """What the mlxft run behind ``spec`` trained on (``chat``, ``completion`` or ``text``), as
    its training state records it; None where nothing does."""
    if spec is None or spec.source != "mlxft":
        return None
    for name in (checkpoint.STATE_FILE, checkpoint.TRAINER_STATE):  # a run's directory, a checkpoint's
        task = (checkpoint.read_state(spec.path / name) or {}).get("task")
        if isinstance(task, str):
            return task
    return spec.task


def run_setting(spec: AdapterSpec | None, field: str, given, default, section: str = "data"):
    """A flag's value: as given, else what the mlxft run recorded in its config's ``section``
    (how it rendered and cut its rows, the dtype it computed in), else ``default``; so scoring
    a run's adapter encodes rows as that run's training did."""
    if given is not None:
        return given
    recorded = run_section(spec, section).get(field)
    if recorded is None:
        return default
    if type(recorded) is not type(default):  # an edited config.yaml
        kind = {bool: "true or false", int: "a whole number", str: "text"}.get(type(default), type(default).__name__)
        raise UserError(f"{spec.path / checkpoint.CONFIG_FILE}: field {section}.{field} is {recorded!r}, which is not "
                        f"{kind}; correct it or pass the setting as a flag")
    return recorded


def base_model_name(model: str | None, spec: AdapterSpec | None) -> str:
    """``--model`` when given, else the base the adapter directory records."""
    name = model or (spec.base_model if spec else "")
    if not name:
        where = f"{spec.path} does not record its base model; " if spec else ""
        raise UserError(f"{where}pass --model (the base model directory or hub id)")
    return builtin.resolve(name)


def base_revision(model: str | None, revision: str | None, spec: AdapterSpec | None) -> str:
    """``--revision`` when given; else, for the base the adapter records, the hub revision it
    was trained on, so the adapter goes on the weights it was trained with."""
    if revision:
        return revision
    return "" if model or spec is None else spec.base_revision


def _recorded_revision(spec: AdapterSpec, base_model: str) -> str:
    """The revision an exported adapter records: its own, unless it is recorded for another base."""
    return spec.base_revision if _same_base(spec, base_model) else ""


def _same_base(spec: AdapterSpec, base_model: str) -> bool:
    """Whether an export records the base the adapter recorded (no other base was named)."""
    return not base_model or base_model == spec.base_model


def add_model_arguments(parser, dtype_of_run: bool = False) -> None:
    """The --model / --revision / --adapter / --dtype flags of the CLIs that load through
    :func:`load_with_adapter`; with ``dtype_of_run`` --dtype defaults to the run's own."""
    parser.add_argument("--model", metavar="BASE",
                        help="base model directory or hub id (default: the base recorded in --adapter)")
    add_revision_argument(parser)
    parser.add_argument("--adapter", metavar="DIR",
                        help="run directory, checkpoint, mlx-lm or PEFT adapter directory (omit for the base alone)")
    parser.add_argument("--dtype", choices=("auto", *models.DTYPES), default=None if dtype_of_run else "auto",
                        help=("compute dtype (default: the one an mlxft run recorded, else auto; " if dtype_of_run
                              else "compute dtype (") + "auto: float32 on the CPU, bfloat16 on a GPU)")


def add_revision_argument(parser) -> None:
    parser.add_argument("--revision", metavar="REV", default="",
                        help="hub branch, tag or commit of a hub --model (default: the revision an mlxft run "
                             "recorded for its base, else the hub's default branch)")


def check_adapter_named(adapter: str | None) -> None:
    """An --adapter given empty (an unset shell variable) is an error, not the base alone."""
    if adapter is not None and not str(adapter).strip():
        raise UserError("--adapter is empty; name a run, checkpoint or adapter directory, or drop --adapter to use "
                        "the base model alone")


def load_with_adapter(model: str | None, adapter: str | None, dtype: str | None = "auto", revision: str = "") -> Loaded:
    """Load the base (as the adapter was trained: an mlxft run's quantization and hub revision
    are reused, and with ``dtype`` None its dtype), put the adapter on it, and take the
    tokenizer the run saved (else the base's)."""
    check_adapter_named(adapter)
    weights, spec = load_adapter_dir(adapter) if adapter else (None, None)
    if dtype is None:
        dtype = run_setting(spec, "dtype", None, "auto", section="model")
        if dtype not in ("auto", *models.DTYPES):
            raise UserError(f"{spec.path / checkpoint.CONFIG_FILE}: field model.dtype is {dtype!r}, not one of auto, "
                            f"{', '.join(models.DTYPES)}; correct it or pass --dtype")
    name = base_model_name(model, spec)
    quantized = base_quantization(spec) or {"bits": 0, "group_size": 64, "dtype": dtype}
    quantize, group_size, run_dtype = quantized["bits"], quantized["group_size"], quantized["dtype"]
    base, tokenizer, path, config = load_base(name, dtype, quantize, group_size, spec.path if spec else None,
                                              quantize_dtype=run_dtype, revision=base_revision(model, revision, spec),
                                              recorded_in=None if model or spec is None else spec.path)
    if spec is not None:
        _warn_other_base_weights(spec, path, model)
        attach(base, spec, weights)
    base.eval()
    return Loaded(base, tokenizer, Path(path), config, spec)


def _warn_other_base_weights(spec: AdapterSpec, path: Path, model: str | None) -> None:
    """Say so where the base an adapter recorded now holds other weights than it was trained on
    (a hub id that moved on, a directory saved over): its output would be another model's. A
    base chosen with --model is the user's choice, not a surprise."""
    if not spec.base_weights or (model and models.absolute_name(model) != spec.base_model):
        return
    if models.weights_fingerprint(path, like=spec.base_weights) not in (None, spec.base_weights):
        print(f"warning: the weights in {path} differ from those {spec.path} was trained on; its adapters go on "
              "another model (restore the original weights, or pass --model to choose the base)", file=sys.stderr)


def load_base(name: str, dtype: str = "auto", quantize: int = 0, group_size: int = 64, tokenizer_dir: Path | None = None,
              quantize_dtype: str | None = None, revision: str = "", recorded_in: Path | None = None):
    """``models.load`` for a model an adapter goes on: ``(model, tokenizer, path, config)``.

    The tokenizer is the one ``tokenizer_dir`` (a run directory) saved when it holds one: the
    tokenizer the run was trained with, which the hub's copy may have drifted from (and loading
    only one of the two saves a second). ``quantize`` (the run's QLoRA setting) applies only
    to a base that is not quantized already, and quantizes it in ``quantize_dtype`` (the run's
    dtype; training cast before quantizing), so a run trained in bfloat16 and fused in float32
    gets the quantized weights it was trained on. ``recorded_in``: the run or adapter directory
    that named this base, which an error finding or reading the base then points to (and not
    an error the base is no cause of, such as a dtype refused for it).
    """
    from mlx_lm.utils import load_model

    try:
        path = models.resolve_model_path(name, revision)
        try:
            model, config = load_model(path)
            tokenizer = run_tokenizer(Path(tokenizer_dir), config) if tokenizer_dir else None
            tokenizer = tokenizer or models.load_tokenizer(path, config)
        except models.LOAD_ERRORS as err:
            raise models.load_error(path, err) from err
    except UserError as err:
        if recorded_in is None:
            raise
        raise UserError(f"{err} (the base recorded in {recorded_in}; pass --model to use another)") from err
    if quantize and not models.is_quantized(model):
        models.cast(model, models.resolve_dtype(quantize_dtype or dtype))
        model, config = models.quantized(model, config, group_size, quantize)
    models.finish_loading(model, dtype)
    return model, tokenizer, path, config


def run_tokenizer(directory: Path, config: dict):
    """The tokenizer saved in an adapter / run directory, or None when it holds none."""
    if not (directory / "tokenizer_config.json").is_file():
        return None
    from mlx_lm.utils import load_tokenizer

    try:
        tokenizer = load_tokenizer(directory, eos_token_ids=config.get("eos_token_id"))
    # A damaged copy, or one a newer tokenizers library wrote (the Rust parser raises a bare
    # Exception for a variant it does not know): the base's own tokenizer is the same one.
    except Exception:
        return None
    return tokenizer if models.encodes_text(tokenizer) else None  # its vocabulary file lost: the base's then


# ---------------------------------------------------------------------------------------
# Writing


def peft_tensors(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm adapter tensors under PEFT's names and orientation."""
    out = {}
    for name, value in weights.items():
        stem, _, leaf = name.rpartition(".")
        key = PEFT_PREFIX + stem + {"lora_a": ".lora_A.weight", "lora_b": ".lora_B.weight",
                                    "m": ".lora_magnitude_vector"}[leaf]
        # mx.save_safetensors writes the logical row-major contents of strided views (unlike
        # numpy arrays handed to safetensors.numpy, which need np.ascontiguousarray first).
        out[key] = value.T if leaf != "m" else value
    return out


def peft_config(spec: AdapterSpec, base_model: str = "") -> dict:
    """PEFT's adapter_config.json for an adapter (plain LoRA scaling: lora_alpha = scale * r)."""
    # Omitted only where the tensors are known to cover every layer; else PEFT would adapt layers
    # that hold none.
    every_layer = (not spec.partial and spec.num_layers in (-1, len(spec.layers))
                   and spec.layers == list(range(len(spec.layers))))
    layers = None if not spec.layers or every_layer else list(spec.layers)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or spec.base_model or None,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(spec.targets),
        "use_rslora": False,
        "use_dora": spec.fine_tune_type == "dora",
        "bias": "none",
        "fan_in_fan_out": False,
        "layers_to_transform": layers,
        "layers_pattern": "layers" if layers else None,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": _recorded_revision(spec, base_model) or None,
    }


def require_no_experts(weights: dict[str, mx.array], spec: AdapterSpec) -> None:
    """PEFT adapts each expert of a transformers mixture of experts as a module of its own (or,
    in newer releases, its stacked parameters by another scheme), where mlx-lm stacks them: no
    layout PEFT loads holds the stacked adapters as they are."""
    stacked = sorted(name for name, value in weights.items() if value.ndim == 3)
    if stacked:
        raise UserError(f"{spec.path}: the adapter adapts a mixture of experts' stacked projections ({stacked[0]}), "
                        "which PEFT cannot load; fuse it instead (python -m mlxft.fuse) or export with --format mlx-lm")


def require_adapter(spec: AdapterSpec, what: str) -> None:
    if spec.fine_tune_type == "full":
        raise UserError(f"{spec.path} is a full fine-tune (whole weights, no adapter); {what} needs a LoRA or DoRA "
                        "adapter. Use python -m mlxft.fuse to write it as a model directory")


def write_peft(weights: dict[str, mx.array], spec: AdapterSpec, out: Path, base_model: str = "") -> None:
    """An adapter directory in PEFT's layout: adapter_model.safetensors and adapter_config.json."""
    require_adapter(spec, "PEFT export")
    require_no_experts(weights, spec)
    out = Path(out)
    mx.save_safetensors(str(out / PEFT_WEIGHTS), peft_tensors(weights), metadata={"format": "pt"})
    (out / PEFT_CONFIG).write_text(json.dumps(peft_config(spec, base_model), indent=2) + "\n")
    copy_tokenizer_files(spec.path, out)


def count_base_layers(base_model: str) -> int | None:
    """num_hidden_layers of a local base model directory, when it can be read."""
    if not base_model:
        return None
    try:
        config = json.loads((Path(builtin.resolve(base_model)).expanduser() / "config.json").read_text())
    except (OSError, ValueError, UserError):
        return None
    config = config.get("text_config", config)
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    return int(layers) if isinstance(layers, int) else None


def write_mlx(weights: dict[str, mx.array], spec: AdapterSpec, out: Path, base_model: str = "") -> None:
    """An adapter directory in mlxft's run layout, which mlx-lm loads as ``--adapter-path``."""
    out = Path(out)
    num_layers = spec.num_layers
    if num_layers is None:  # PEFT records layers by index; mlx-lm counts the last N
        if spec.first_layer == 0:
            num_layers = -1
        else:
            total = count_base_layers(base_model or spec.base_model)
            if total is None:
                raise UserError(f"{spec.path}: the adapter starts at layer {spec.first_layer}; pass --model (the base) "
                                "so the layer count mlx-lm needs can be read from its config.json")
            num_layers = total - spec.first_layer
    elif spec.source == "mlx-lm" and num_layers > 0:
        # mlx-lm's num_layers may exceed the base's layer count (its default, 16, on a smaller
        # model: all layers), which mlxft's own layout refuses; record it as all layers (-1).
        total = count_base_layers(base_model or spec.base_model)
        if (spec.layers and spec.first_layer == 0) or (total is not None and num_layers > total):
            num_layers = -1
    metadata = checkpoint.adapter_metadata(spec.fine_tune_type, spec.rank, spec.alpha, spec.dropout, spec.targets,
                                           num_layers, spec.model_type, base_model or spec.base_model,
                                           base_quantization(spec), _recorded_revision(spec, base_model),
                                           spec.base_weights if _same_base(spec, base_model) else "")
    metadata["scale"] = repr(float(spec.scale))  # exactly the source's (alpha / rank may round)
    metadata["partial"] = "true" if spec.partial else "false"  # for mlxft; mlx-lm fills any gap this way
    settings = exported_settings(spec)
    if settings:
        metadata[RUN_SETTINGS] = json.dumps(settings, sort_keys=True)
    mx.save_safetensors(str(out / checkpoint.ADAPTER_FILE), weights, metadata=metadata)
    (out / checkpoint.ADAPTER_CONFIG).write_text(
        json.dumps(checkpoint.mlx_lm_adapter_config(metadata), indent=2, sort_keys=True) + "\n")
    copy_tokenizer_files(spec.path, out)


RUN_SETTINGS = "run_settings"  # an export's header entry: how the run encoded its rows and computed
_EXPORTED = {"data": ("prompt_format", "max_seq_length", "completion_only"), "model": ("dtype",)}


def exported_settings(spec: AdapterSpec) -> dict:
    """What an mlxft run's evaluate and generate read from its config and state (the task, how
    rows were rendered and cut, the dtype), for an export's header: an export leaves the run's
    files behind, and scoring it would otherwise render prompt/completion rows another way."""
    if spec.source != "mlxft":
        return {}
    settings = {section: {k: run_section(spec, section)[k] for k in fields if k in run_section(spec, section)}
                for section, fields in _EXPORTED.items()}
    settings = {section: values for section, values in settings.items() if values}
    task = run_task(spec)
    return {**settings, **({"task": task} if task else {})}


def copy_tokenizer_files(source: Path, out: Path) -> list[str]:
    """Copy the tokenizer files of ``source`` (if any) into ``out``; return their names."""
    copied = []
    for pattern in TOKENIZER_PATTERNS:
        for path in sorted(Path(source).glob(pattern)):
            if path.is_file() and not (out / path.name).exists():
                shutil.copy2(path, out / path.name)
                copied.append(path.name)
    return copied
