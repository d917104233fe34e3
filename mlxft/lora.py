"""Choosing what trains: LoRA / DoRA layers from mlx-lm, or unfrozen weights for full fine-tuning.

Targets are module names inside a transformer layer (``self_attn.q_proj``) or the shorthands
``default``, ``all``, ``attn`` and ``mlp``. ``attn`` is the token mixer of each layer, which
for LFM2 means the attention projections and the short-convolution in/out projections;
``mlp`` is the feed-forward. ``default`` is both, which covers every linear layer of the
Llama and LFM2 families. For full fine-tuning ``layers`` trains every weight of the selected
layers, norms included: what mlx-lm's full fine-tuning trains.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxft.config import WHOLE_LAYERS, AdapterConfig
from mlxft.errors import UserError

_LINEAR_TYPES = (nn.Linear, nn.QuantizedLinear)
_MIXER_WORDS = ("attn", "attention", "conv", "mixer")
_FEED_FORWARD_WORDS = ("mlp", "feed_forward", "ffn")


def selected_layers(model: nn.Module, num_layers: int) -> list[nn.Module]:
    layers = list(model.layers)
    if num_layers > len(layers):
        raise UserError(f"config field adapter.num_layers: {num_layers} exceeds the model's {len(layers)} layers")
    return layers if num_layers == -1 else layers[-num_layers:]


def linear_names(layers: list[nn.Module]) -> list[str]:
    """Names (inside a layer) of every linear module in any of ``layers``, sorted."""
    names = set()
    for layer in layers:
        for name, module in layer.named_modules():
            if isinstance(module, _LINEAR_TYPES) or hasattr(module, "to_lora"):
                names.add(name)
    return sorted(names)


def _check_rank(layers: list[nn.Module], targets: list[str], rank: int) -> None:
    """Refuse a rank above every adapted layer's width, min(in, out): no layer's update gains
    from it (and a huge one overflowed MLX's arrays into a crash). Narrower layers beside wider
    ones (an MoE's router, 1 or 8 outputs wide) take a rank above their own width as PEFT does."""
    widest = None
    for layer in layers:
        modules = dict(layer.named_modules())
        for name in targets:
            module = modules.get(name)
            if not isinstance(module, _LINEAR_TYPES):
                continue
            out_dims, packed = module.weight.shape
            in_dims = packed * 32 // module.bits if isinstance(module, nn.QuantizedLinear) else packed
            if widest is None or min(in_dims, out_dims) > widest[0]:
                widest = (min(in_dims, out_dims), name, in_dims, out_dims)
    if widest is not None and rank > widest[0]:
        width, name, in_dims, out_dims = widest
        raise UserError(f"config field adapter.rank: {rank} is more than the widest adapted layer's {width} "
                        f"({name}: {in_dims} -> {out_dims}), where no layer gains from it; use --rank {width} or less")


def _is_mixer(name: str) -> bool:
    return any(word in name.split(".")[0] for word in _MIXER_WORDS)


def _is_feed_forward(name: str) -> bool:
    return any(word in name.split(".")[0] for word in _FEED_FORWARD_WORDS)


def resolve_targets(targets: list[str], available: list[str]) -> list[str]:
    """Expand shorthands and check explicit names against the layers' linear modules."""
    chosen: set[str] = set()
    for target in targets:
        if target == "all":
            chosen.update(available)
        elif target == "default":
            familiar = {n for n in available if _is_mixer(n) or _is_feed_forward(n)}
            chosen.update(familiar or available)  # an unfamiliar layout: every linear layer, whatever else is named
        elif target == "attn":
            chosen.update(n for n in available if _is_mixer(n))
        elif target == "mlp":
            chosen.update(n for n in available if _is_feed_forward(n))
        elif target in available:
            chosen.add(target)
        else:
            raise UserError(
                f"config field adapter.targets: '{target}' is not a linear module of the model's layers "
                f"(available: {', '.join(available)}, or default/all/attn/mlp, or {WHOLE_LAYERS} with --finetune full)"
            )
    if not chosen:
        raise UserError(f"config field adapter.targets: {', '.join(targets)} selects no module of this model")
    return sorted(chosen)


def check(model: nn.Module, config: AdapterConfig) -> list[str]:
    """The LoRA/DoRA targets ``config`` names in ``model``, once they and the rank are known
    to fit, changing nothing (a refused run leaves a model passed in as it was)."""
    layers = selected_layers(model, config.num_layers)
    targets = resolve_targets(config.targets, linear_names(layers))
    _check_rank(layers, targets, config.rank)
    return targets


def apply(model: nn.Module, config: AdapterConfig, seed: int) -> list[str]:
    """Make the requested part of ``model`` trainable; return the targeted module names.

    The model comes in frozen. LoRA/DoRA layers are seeded so a run's initial adapters
    depend only on ``seed``.
    """
    from mlx_lm.tuner.utils import linear_to_lora_layers

    layers = selected_layers(model, config.num_layers)
    if config.finetune == "full":
        return _unfreeze(model, layers, config)
    targets = check(model, config)
    mx.random.seed(seed)
    try:
        linear_to_lora_layers(
            model,
            len(layers),
            {"rank": config.rank, "scale": config.alpha / config.rank, "dropout": config.dropout, "keys": targets},
            use_dora=config.finetune == "dora",
        )
    except ValueError as err:
        raise UserError(f"config field adapter.finetune: {err}") from err
    compute_lora_in_input_dtype(model)
    return targets


def _lora_in_input_dtype(self, x):
    from mlxft import normed

    source = normed.norm_input(x)
    if source is not None and plain_lora(self):
        return normed.lora_of_normed(self, x, source)
    # mlx-lm's LoRALinear multiplies a bf16/fp16 ``x`` by float32 adapters, which promotes
    # ``x`` to float32 and keeps that copy alive for the backward pass of every adapted
    # layer. Casting the (small) adapters to the input's dtype instead keeps activations in
    # the compute dtype; the parameters, their gradients and the optimizer state stay float32.
    y = self.linear(x)
    z = (self.dropout(x) @ self.lora_a.astype(x.dtype)) @ self.lora_b.astype(x.dtype)
    return y + (self.scale * z).astype(x.dtype)


def computes_in_input_dtype(module: nn.Module) -> bool:
    """Whether :func:`compute_lora_in_input_dtype` gave ``module`` its arithmetic."""
    return type(module).__call__ is _lora_in_input_dtype


def plain_lora(module: nn.Module) -> bool:
    """Whether ``module`` is mlx-lm's LoRA layer (as mlxft computes it) over a frozen linear or
    quantized linear, without an active dropout, training nothing but ``lora_a`` and ``lora_b``:
    what the functions with their own backward pass (:func:`mlxft.fastmath.swiglu_lora`,
    :func:`mlxft.normed.lora_of_normed`) can take, the rest being constants to them."""
    from mlx_lm.tuner.lora import LoRALinear

    return (isinstance(module, LoRALinear) and computes_in_input_dtype(module)
            and type(module.linear) in (nn.Linear, nn.QuantizedLinear)
            and (module.dropout._p_1 == 1 or not module.dropout.training)
            and {name for name, _ in tree_flatten(module.trainable_parameters())} <= {"lora_a", "lora_b"})


def only_adapters_cast_per_call(model: nn.Module) -> bool:
    """Whether every trainable parameter of ``model`` is the ``lora_a`` or ``lora_b`` of a LoRA
    layer that casts it to its input's dtype at each call (:func:`compute_lora_in_input_dtype`):
    then handing the layers the adapters already in that dtype computes the same thing."""
    from mlx_lm.tuner.lora import LoRALinear

    modules = dict(model.named_modules())
    for name, _ in tree_flatten(model.trainable_parameters()):
        owner, _, leaf = name.rpartition(".")
        module = modules.get(owner)
        if leaf not in ("lora_a", "lora_b") or not isinstance(module, LoRALinear) or not computes_in_input_dtype(module):
            return False
    return True


def compute_lora_in_input_dtype(model: nn.Module) -> None:
    """Make every mlx-lm ``LoRALinear`` of ``model`` compute in its input's dtype.

    Each layer instance gets a subclass overriding ``__call__`` (parameter names unchanged;
    other models sharing the class are unaffected). A float32 model computes exactly as before.
    """
    from mlx_lm.tuner.lora import LoRALinear

    for _, module in model.named_modules():
        cls = type(module)
        if isinstance(module, LoRALinear) and cls.__call__ is LoRALinear.__call__:
            module.__class__ = type(cls.__name__, (cls,), {"__call__": _lora_in_input_dtype})


def _unfreeze(model: nn.Module, layers: list[nn.Module], config: AdapterConfig) -> list[str]:
    if any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules()):
        raise UserError("full fine-tuning needs an unquantized base; drop --quantize or use --finetune lora")
    if config.targets == ["default"] and config.num_layers == -1:
        model.unfreeze()
        return ["*"]
    if config.targets == [WHOLE_LAYERS]:
        for layer in layers:
            layer.unfreeze()
        return [WHOLE_LAYERS]
    targets = config.targets
    if targets == ["default"]:
        targets = ["all"]
    targets = resolve_targets(targets, linear_names(layers))
    for layer in layers:
        for name, module in layer.named_modules():
            if name in targets:
                module.unfreeze()
    return targets


def lora_scale(config: AdapterConfig) -> float:
    return config.alpha / config.rank
