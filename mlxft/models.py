"""Loading models through mlx-lm, choosing their dtype, and reaching their hidden states.

mlx-lm owns the architectures; this module resolves a directory or hub id, turns loader
failures into one-line errors, and exposes the body / output-head split that lets the loss
project only supervised positions instead of materializing ``[B, T, vocab]`` logits.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from mlxft.errors import UserError, first_line

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}

# Architectures whose logits are exactly ``head(model.model(inputs))`` with head either
# ``lm_head`` or the tied embedding: no logit scaling or soft-capping after the body.
_PLAIN_HEAD_TYPES = {"llama", "lfm2", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "phi3"}


def absolute_name(name: str) -> str:
    """``name`` as an absolute path where it names a local file or directory (as typed, a
    relative one fails from another working directory, and two spellings of one model differ);
    else as is (a hub id, ``builtin:...``, nothing)."""
    path = Path(name).expanduser()
    return str(path.resolve()) if name and not name.startswith("builtin:") and path.exists() else name


def check_model_name(name: str) -> bool:
    """Refuse a --model that is neither a model directory nor a hub repo id; True where it is
    a local directory (with a config.json)."""
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(f"model directory {path} has no config.json; point --model at an mlx-lm/HF model directory")
        return True
    looks_like_repo = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not looks_like_repo:
        raise UserError(f"model directory {name} does not exist; check --model")
    return False


_FINGERPRINT_SAMPLES = 64  # blocks read across each weights file
_FINGERPRINT_BLOCK = 4096
_FINGERPRINT_PER_TENSOR = "2:"  # the prefix of fingerprints that also sample every tensor


def weights_fingerprint(path, like: str = "") -> str | None:
    """A hash telling one model directory's weights from another's without reading them all:
    each ``model*.safetensors`` file's (what mlx-lm loads) name, size, header (tensor names,
    dtypes, shapes, offsets), 64 blocks of 4 KiB spread over its data, and a block from the
    middle of every tensor. Another fine-tune of the same shape, even one that changed a
    single projection (a LoRA fused into one layer), differs in that tensor's block; a few
    ms even for a large model. None where the directory holds no such file (GGUF).

    ``like``: a recorded fingerprint, computed again in its scheme (those recorded before the
    per-tensor blocks were added carry no prefix and sampled the files only)."""
    import hashlib

    files = sorted(Path(path).glob("model*.safetensors"))
    if not files:
        return None
    per_tensor = not like or like.startswith(_FINGERPRINT_PER_TENSOR)
    digest = hashlib.sha256()
    for file in files:
        try:
            with open(file, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                digest.update(f"{file.name}\0{size}\0".encode())
                header_length = int.from_bytes(handle.read(8), "little")
                header = handle.read(min(header_length, size))
                digest.update(header)
                start = 8 + header_length
                span = max(size - start - _FINGERPRINT_BLOCK, 0)
                offsets = [start + span * sample // max(_FINGERPRINT_SAMPLES - 1, 1)
                           for sample in range(_FINGERPRINT_SAMPLES)]
                if per_tensor:
                    offsets += [start + max((begin + end - _FINGERPRINT_BLOCK) // 2, begin)
                                for begin, end in _tensor_spans(header)]
                for offset in offsets:
                    handle.seek(offset)
                    digest.update(handle.read(_FINGERPRINT_BLOCK))
        except OSError as err:
            raise UserError(f"cannot read {file}: {first_line(err)}") from err
    return (_FINGERPRINT_PER_TENSOR if per_tensor else "") + digest.hexdigest()[:32]


def fingerprint_scheme(fingerprint: str) -> str:
    """Which way :func:`weights_fingerprint` made ``fingerprint``: its prefix ("" for the first)."""
    return _FINGERPRINT_PER_TENSOR if fingerprint.startswith(_FINGERPRINT_PER_TENSOR) else ""


def _tensor_spans(header: bytes) -> list[tuple[int, int]]:
    """The data offsets of each tensor a safetensors header lists; none from a header that does
    not parse (the header's bytes are hashed all the same, and loading the file will say what
    is wrong with it)."""
    try:
        entries = json.loads(header)
        return sorted((int(entry["data_offsets"][0]), int(entry["data_offsets"][1]))
                      for name, entry in entries.items() if name != "__metadata__")
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return []


def resolve_model_path(name: str, revision: str = "") -> Path:
    """A local model directory as is, or a hub repo id downloaded (cached) via huggingface-hub."""
    path = Path(name).expanduser()
    if check_model_name(name):
        if revision:  # a local directory is whatever is checked out there
            raise UserError(f"model.revision (--revision) {revision!r} applies to a hub repo id, but {path} is a local "
                            "directory; drop --revision, or pass the repo id as --model")
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(name, revision=revision or None, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except RepositoryNotFoundError as err:
        raise UserError(f"model repo {name} was not found on the Hugging Face hub (or needs a login); check --model") from err
    except LocalEntryNotFoundError as err:
        which = f"model {name} at revision {revision}" if revision else f"model {name}"
        if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
            raise UserError(f"{which} is not in the local hub cache, and HF_HUB_OFFLINE is set; unset it to "
                            "download the model once, or pass a local model directory") from err
        raise UserError(f"{which} is not in the local hub cache and the hub cannot be reached; connect to the "
                        "internet once or pass a local model directory") from err
    except (HfHubHTTPError, OSError, ValueError) as err:
        raise UserError(f"cannot download model {name}: {first_line(err)}") from err


def peek_config(name: str, revision: str = "") -> dict | None:
    """A model's config.json without loading its weights: from a local directory, the built-in
    model's directory (converted first, as loading it would), or the hub cache for a repo id
    (never downloading); None where none is at hand."""
    if not name:
        return None
    path = Path(name).expanduser() / "config.json"
    if name.startswith("builtin:"):
        from mlxft import builtin

        try:
            path = Path(builtin.resolve(name)) / "config.json"
        except UserError:
            return None
    elif not path.parent.exists() and name.count("/") == 1:
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(name, "config.json", revision=revision or None)
        except (ValueError, OSError):  # not a valid repo id
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def layer_count(config: dict | None) -> int | None:
    """The layer count a config.json gives, or None."""
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    count = (text if isinstance(text, dict) else config).get("num_hidden_layers")
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None


def config_quantized(config: dict | None) -> bool:
    """Whether a config.json describes an mlx-lm quantized model."""
    return isinstance(config, dict) and bool(config.get("quantization") or config.get("quantization_config"))


def resolve_dtype(name: str) -> mx.Dtype:
    """``auto`` is float32 on the CPU (bf16 matmuls are slow there) and bfloat16 on a GPU."""
    if name == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    return DTYPES[name]


def _strict_config_errors() -> tuple[type[BaseException], ...]:
    """huggingface_hub's error for a config.json that transformers' validated config classes
    reject (a Granite-4.0-H whose Mamba heads do not match its width), raised while the
    tokenizer loads; not a ValueError, and absent from older releases."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


_STRICT_CONFIG_ERRORS = _strict_config_errors()

# What mlx-lm's loader raises for a directory it cannot load: a missing or unreadable file,
# bad JSON, a config.json with a field missing or of the wrong type, or one transformers rejects.
LOAD_ERRORS = (ValueError, FileNotFoundError, KeyError, json.JSONDecodeError, OSError, RuntimeError, TypeError,
               AttributeError, *_STRICT_CONFIG_ERRORS)


def load_error(path, err: BaseException) -> UserError:
    """One line for a model directory mlx-lm could not load."""
    hint = "; check its config.json" if isinstance(err, (TypeError, AttributeError, KeyError, *_STRICT_CONFIG_ERRORS)) else ""
    return UserError(f"cannot load model from {path}: {first_line(err)}{hint}")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(path: Path, config: dict):
    """mlx-lm's tokenizer wrapper for the model in ``path``, or one line saying what is missing."""
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        # transformers' own message for this is a list cut off after its first line
        raise UserError(f"model directory {path} has no tokenizer ({', '.join(TOKENIZER_FILES)}); copy the "
                        "tokenizer files of the model it came from into it")
    tokenizer = mlx_lm_load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    if not encodes_text(tokenizer):
        raise UserError(f"model directory {path}: its tokenizer encodes text to no tokens (its vocabulary file is "
                        "missing, e.g. tokenizer.json); copy the tokenizer files of the model it came from into it")
    return tokenizer


def encodes_text(tokenizer) -> bool:
    """Whether the tokenizer turns plain text into tokens. From a tokenizer_config.json alone
    transformers builds one of a few special tokens, which encodes text to nothing: a run
    trained on the chat template's tokens alone."""
    return bool(tokenizer.encode("The capital of France is Paris.", add_special_tokens=False))


def load(name: str, dtype: str = "auto", quantize: int = 0, group_size: int = 64, revision: str = "",
         quantize_dtype: str = ""):
    """Load ``(model, tokenizer, path, config)`` with mlx-lm, cast and optionally quantized
    (from the weights cast to ``quantize_dtype``, else to ``dtype``)."""
    from mlx_lm.utils import load_model

    path = resolve_model_path(name, revision)
    try:
        model, config = load_model(path)
        tokenizer = load_tokenizer(path, config)
    except LOAD_ERRORS as err:
        raise load_error(path, err) from err
    if quantize:
        if is_quantized(model):
            raise UserError(f"model {name} is already quantized; drop --quantize")
        _check_group_size(model, group_size)
        cast(model, resolve_dtype(quantize_dtype or dtype))
        model, config = quantized(model, config, group_size, quantize)
    finish_loading(model, dtype)
    return model, tokenizer, path, config


def quantized(model: nn.Module, config: dict, group_size: int, bits: int):
    """mlx-lm's ``quantize_model``, whose report of the bits per weight goes to stderr: on
    stdout it broke ``evaluate --json`` and came before ``generate``'s answer."""
    import contextlib

    from mlx_lm.utils import quantize_model

    with contextlib.redirect_stdout(sys.stderr):
        return quantize_model(model, config, group_size, bits)


def cast(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast the model's floating parameters to ``dtype``, but those its family keeps in float32
    (mlx-lm's ``cast_predicate``: Nemotron-H's ``A_log``, a mixture's routing bias), as mlx-lm's
    own conversion does: in bfloat16 that bias moved which experts a token went to."""
    if getattr(model, "cast_predicate", None) is None:  # every floating parameter: MLX's own cast
        model.set_dtype(dtype)
        return
    from mlx.utils import tree_flatten, tree_unflatten

    model.update(tree_unflatten(list(cast_weights(model, dict(tree_flatten(model.parameters())), dtype).items())))


def cast_weights(model: nn.Module, weights: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    """``weights`` (the model's, flattened) with the floating ones cast to ``dtype``, but those
    the model's ``cast_predicate`` keeps (see :func:`cast`)."""
    castable = getattr(model, "cast_predicate", lambda name: True)  # True for a name that may be cast
    return {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and castable(k) else v
            for k, v in weights.items()}


def finish_loading(model: nn.Module, dtype: str) -> None:
    """Cast a loaded (and perhaps quantized) model to ``dtype``, frozen, its output head probed."""
    cast(model, resolve_dtype(dtype))
    check_expert_dtype(model)
    # Cast (and quantized) now: left lazy, the checkpoint's own tensors stay allocated beside
    # the cast ones until the first step, whose peak they join, and every memory probe before it
    # converts its weights again (SmolLM2-135M on the CPU: 0.11 GB too much in the estimate).
    mx.eval(model.parameters())
    model.freeze()
    probe_output_head(model)


def check_expert_dtype(model: nn.Module) -> None:
    """MLX's CPU backend multiplies a mixture of experts' gathered weights in float32 only: in a
    half-precision model the first step failed in a traceback."""
    from mlx_lm.models.switch_layers import SwitchLinear

    if mx.default_device() != mx.cpu or compute_dtype(model) == mx.float32:
        return
    if any(isinstance(m, SwitchLinear) for _, m in model.named_modules()):
        raise UserError(f"this model's mixture-of-experts layers compute in float32 only on MLX's CPU backend, not "
                        f"{str(compute_dtype(model)).split('.')[-1]}; use --dtype float32 (or auto) on the CPU")


def _check_group_size(model: nn.Module, group_size: int) -> None:
    """mlx-lm leaves a layer whose input width the group size does not divide unquantized, and
    the run would record a 4-bit base of which most stayed full precision (SmolLM2-135M's 576
    at 128). Refused where that leaves over a tenth of the weights and another group size
    would quantize them all; a few small layers left (Mamba's dt_proj) are mlx-lm's choice."""
    layers = [m.weight for _, m in model.named_modules()
              if hasattr(m, "to_quantized") and isinstance(getattr(m, "weight", None), mx.array)]
    left = [w for w in layers if w.shape[-1] % group_size]
    fits = [g for g in (128, 64, 32) if all(w.shape[-1] % g == 0 for w in layers)]
    if left and fits and sum(w.size for w in left) > 0.1 * sum(w.size for w in layers):
        raise UserError(f"--quantize-group-size {group_size} does not divide this model's layer width "
                        f"{left[0].shape[-1]}, so those layers would stay unquantized; use --quantize-group-size {fits[0]}")


def is_quantized(model: nn.Module) -> bool:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
    return any(isinstance(m, quantized) for _, m in model.named_modules())


HEAD_PROBE = "_mlxft_head_split"  # what probe_output_head found (see there)


def _logit_transforms(model: nn.Module) -> list[Callable[[mx.array], mx.array] | None]:
    """What families apply to the head's output (None: nothing), in mlx-lm's own arithmetic."""
    transforms = [None]
    scaling = getattr(model, "logits_scaling", None)  # Granite
    if isinstance(scaling, (int, float)):
        transforms.append(lambda z: z / scaling)
    cap = getattr(model, "final_logit_softcapping", None)  # Gemma 2
    if isinstance(cap, (int, float)) and cap:
        transforms.append(lambda z: mx.tanh(z / cap) * cap)
    scale = getattr(getattr(model.model, "args", None), "logit_scale", None)  # Cohere
    if isinstance(scale, (int, float)):
        transforms.append(lambda z: z * scale)
    return transforms


def head_projection(model: nn.Module) -> Callable[[mx.array], mx.array] | None:
    """``lm_head``, or the tied embedding read as a linear layer: the head's own projection."""
    if "lm_head" in model:
        return model.lm_head
    embed = getattr(model.model, "embed_tokens", None)
    return embed.as_linear if embed is not None else None


def probe_output_head(model: nn.Module) -> None:
    """Find out, for a family outside the known plain ones, whether its logits are
    ``transform(head(model.model(x)))`` with an elementwise ``transform`` (or none), so the loss
    can project only supervised positions. Recorded on the model as ``(transform,)``, or as
    ``()`` where no split matched; :func:`output_head` reads it.

    Checked on a few tokens, to the bit: a body or head this split misreads, or a transform it
    does not know, leaves the model on its own whole logits, which are always right."""
    if getattr(model, "model_type", None) in _PLAIN_HEAD_TYPES or not hasattr(model, "model"):
        return
    found = ()
    was_training = model.training
    model.eval()  # no dropout: both passes must compute the same function
    try:
        head = head_projection(model)
        if head is not None:
            tokens = mx.array([[1, 2, 3, 4]])
            whole, split = model(tokens), head(model.model(tokens))
            found = next(((t,) for t in _logit_transforms(model)
                          if mx.array_equal(split if t is None else t(split), whole).item()), ())
    except Exception:  # noqa: BLE001 - a body that takes other arguments: the model's own logits then
        found = ()
    finally:
        model.train(was_training)
    object.__setattr__(model, HEAD_PROBE, found)


def _head_split(model: nn.Module) -> tuple | None:
    """``(transform,)`` for a plain split (``transform`` None where there is none), else None."""
    if not hasattr(model, "model"):
        return None
    if getattr(model, "model_type", None) in _PLAIN_HEAD_TYPES:
        return (None,)
    return getattr(model, HEAD_PROBE, None) or None


def output_head(model: nn.Module) -> Callable[[mx.array], mx.array] | None:
    """The function mapping hidden states to logits, when the architecture's split is plain.

    Called inside the traced loss so it reads the current (possibly trained) weights.
    Returns None for architectures whose logits need more than ``head(body(x))`` and an
    elementwise transform :func:`probe_output_head` found.
    """
    split = _head_split(model)
    head = head_projection(model) if split else None
    if head is None or split[0] is None:
        return head
    transform = split[0]
    return lambda hidden: transform(head(hidden))


def logits_transformed(model: nn.Module) -> bool:
    """Whether :func:`output_head` applies a transform after the head module (Granite's scaling,
    Gemma 2's soft-capping), which the frozen-head loss's linear shortcut cannot take."""
    split = _head_split(model)
    return bool(split) and split[0] is not None


def hidden_states(model: nn.Module, inputs: mx.array) -> mx.array:
    """The body's final normalized hidden states ``[B, T, D]`` (models with a plain head)."""
    return model.model(inputs)


def compute_dtype(model: nn.Module) -> mx.Dtype:
    """The floating dtype the model computes in: that of most of its floating parameters'
    elements (a family may keep a few small ones in float32, see :func:`cast`)."""
    from collections import Counter

    from mlx.utils import tree_flatten

    sizes = Counter()
    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            sizes[value.dtype] += value.size
    return sizes.most_common(1)[0][0] if sizes else mx.float32


def vocab_size(model: nn.Module) -> int | None:
    """The token embedding's rows as the model's config declares them (a wrapped model's in its
    text config); None when it declares none."""
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if size is None:
        text = getattr(args, "text_config", None)
        size = text.get("vocab_size") if isinstance(text, dict) else getattr(text, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; quantized weights count as their logical size."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import get_total_parameters

    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    return trainable, get_total_parameters(model)


def family(model: nn.Module) -> str:
    """The model_type mlx-lm reports (``llama``, ``lfm2``, ...)."""
    return str(getattr(model, "model_type", type(model).__module__.rsplit(".", 1)[-1]))


def override_call(module: nn.Module, call: Callable, marker: str) -> None:
    """Give ``module`` its own subclass whose ``__call__`` is ``call``, unless an earlier
    override named ``marker`` is already in place. Parameter names stay as they are, and
    other instances of the class (other models in the process) are unaffected."""
    cls = type(module)
    if not getattr(cls, marker, False):
        module.__class__ = type(cls.__name__, (cls,), {"__call__": call, marker: True})


def call_beneath(module: nn.Module, marker: str) -> Callable:
    """The ``__call__`` that :func:`override_call`'s ``marker`` override replaced for ``module``:
    what the override hands the calls it does not take. Overrides stack (packing's, then the
    fused convolution's), so it is found by marker, not as the class's direct base."""
    classes = type(module).__mro__
    for below, cls in zip(classes[1:], classes):
        if marker in vars(cls):
            return below.__call__
    raise TypeError(f"{type(module).__name__} has no {marker} override")


_CHECKPOINTED = "_mlxft_checkpointed"


def is_checkpointed(layer: nn.Module) -> bool:
    """Whether :func:`checkpoint_layers` made ``layer`` recompute its activations."""
    return getattr(type(layer), _CHECKPOINTED, False)


class _RecomputedRandom:
    """The random key a checkpointed layer's dropout masks come from while it runs.

    A recomputation would otherwise draw new masks from MLX's global random state, and the
    backward pass would differentiate a different function than the forward pass computed
    (LoRA dropout 0.5 on a tiny Llama: gradients off by up to 80% of their size). Set from a
    key drawn once per forward pass and captured by the recomputation, each dropout in the
    layer draws the next key of the same sequence both times."""

    key: mx.array | None = None

    @classmethod
    def next(cls) -> mx.array:
        cls.key, drawn = mx.random.split(cls.key)
        return drawn


def _keyed_dropout(self, x):
    if _RecomputedRandom.key is None or self._p_1 == 1 or not self.training:
        return nn.Dropout.__call__(self, x)
    return (mx.random.bernoulli(self._p_1, x.shape, key=_RecomputedRandom.next()) * x) * (1 / self._p_1)


def _key_dropouts(layer: nn.Module) -> bool:
    """Make ``layer``'s active dropouts draw from :class:`_RecomputedRandom` while it is recomputed;
    returns whether it has any."""
    dropouts = [m for _, m in layer.named_modules() if isinstance(m, nn.Dropout) and m._p_1 < 1]
    for dropout in dropouts:
        override_call(dropout, _keyed_dropout, "_mlxft_keyed")
    return bool(dropouts)


def _checkpoint(fn: Callable, keyed: bool) -> Callable:
    """``mx.checkpoint(fn)``; ``keyed`` (the layer has dropout, see :func:`_key_dropouts`): the
    recomputation draws the forward pass's dropout masks."""
    if not keyed:
        return mx.checkpoint(fn)

    def call(*args):
        start = mx.random.randint(0, 2**31 - 1, (2,), mx.uint32)  # a key, drawn from the global state

        def with_key(*inner_args):
            outer, _RecomputedRandom.key = _RecomputedRandom.key, start
            try:
                return fn(*inner_args)
            finally:
                _RecomputedRandom.key = outer

        return mx.checkpoint(with_key)(*args)

    return call


class LayerParts(NamedTuple):
    """The names of a layer's parts, as mlx-lm's layer ``__call__`` chains them."""

    norm: str  # before the mixer
    mixers: tuple[str, ...]  # attention or convolution: the first the layer has
    mlp_norm: str
    mlp: str
    projections: tuple[str, str, str]  # the MLP's gate, up and down


LAYER_PARTS = {
    "llama": LayerParts("input_layernorm", ("self_attn",), "post_attention_layernorm", "mlp",
                        ("gate_proj", "up_proj", "down_proj")),
    "lfm2": LayerParts("operator_norm", ("self_attn", "conv"), "ffn_norm", "feed_forward", ("w1", "w3", "w2")),
}


def first_layers(model: nn.Module, count: int, field: str) -> list:
    """The model's first ``count`` transformer layers (0: all of them), for the config ``field``
    that names the count; a count beyond the model's layers is that field's error."""
    layers = list(model.layers)
    if count > len(layers):
        raise UserError(f"config field {field}: {count} exceeds the model's {len(layers)} layers")
    return layers[:count or len(layers)]


def check_keep_mlp(model: nn.Module, keep_mlp: bool) -> None:
    if keep_mlp and family(model) not in LAYER_PARTS:
        raise UserError(f"config field model.checkpoint_keep_mlp: not supported for {family(model)} models "
                        f"(only {', '.join(LAYER_PARTS)}); drop --checkpoint-keep-mlp")


def checkpoint_layers(model: nn.Module, count: int = 0, keep_mlp: bool = False) -> None:
    """Recompute the first ``count`` transformer layers' activations (0: every layer's) in the
    backward pass, for less memory: each one's ``__call__`` runs under ``mx.checkpoint`` (see
    :func:`override_call`). With ``keep_mlp`` (Llama and LFM2 families) a layer keeps its MLP's
    gate and up projections, the two largest and costliest activations to recompute, and
    recomputes the rest: the mixer (attention or convolution), the norms and the SwiGLU."""
    from mlxft.fastmath import swiglu

    recomputed = first_layers(model, count, "model.checkpoint_layers")
    check_keep_mlp(model, keep_mlp)
    for layer in recomputed:
        plain_call, keyed = type(layer).__call__, _key_dropouts(layer)

        def checkpointed(self, *args, _call=plain_call, _keyed=keyed, **kwargs):
            def inner(params, *inner_args):
                self.update(params)
                return _call(self, *inner_args, **kwargs)

            return _checkpoint(inner, _keyed)(self.trainable_parameters(), *args)

        def keeping_mlp(self, x, mask=None, cache=None, _parts=LAYER_PARTS.get(family(model)), _keyed=keyed):
            norm_name, mixers, mlp_norm_name, mlp_name, (gate_name, up_name, down_name) = _parts
            norm, mlp_norm, mlp = self[norm_name], self[mlp_norm_name], self[mlp_name]
            mixer = self[next(name for name in mixers if name in self)]
            gate, up, down = mlp[gate_name], mlp[up_name], mlp[down_name]

            def before_down(params, x):
                # Recomputed in the backward pass, except the gate and up projections' frozen
                # matmuls, whose outputs nothing there reads: their LoRA and input gradients
                # need only the normalised input.
                self.update(params)
                h = x + mixer(norm(x), mask=mask, cache=cache)
                normed = mlp_norm(h)
                return h, gate(normed), up(normed)

            def after_gates(params, h, g, u):
                down.update(params)
                return h + down(swiglu(g, u))

            # mx.checkpoint keeps a function's outputs as well as its inputs until the backward
            # pass: the residual sum stays in the second function so that it keeps the layer's
            # output (the next layer's input, kept anyway) rather than the MLP's.
            params = self.trainable_parameters()
            params.get(mlp_name, {}).pop(down_name, None)
            h, g, u = _checkpoint(before_down, _keyed)(params, x)
            return _checkpoint(after_gates, _keyed)(down.trainable_parameters(), h, g, u)

        override_call(layer, keeping_mlp if keep_mlp else checkpointed, _CHECKPOINTED)
