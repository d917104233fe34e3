"""Choosing what trains: LoRA / DoRA layers from mlx-lm, or unfrozen weights for full fine-tuning.

Targets are module names inside a transformer layer (``self_attn.q_proj``) or the shorthands
``default``, ``all``, ``attn`` and ``mlp``. ``attn`` is the token mixer of each layer, which
for LFM2 means the attention projections and the short-convolution in/out projections (for
hybrids such as Granite-4.0-H, the Mamba mixers' too); ``mlp`` is the feed-forward, a
mixture of experts' stacked expert projections (mlx-lm's ``SwitchLinear``) and router
included, as mlx-lm adapts them. ``default`` is both, which covers every linear layer of the
Llama and LFM2 families. For full fine-tuning ``layers`` trains every weight of the selected
layers, norms included: what mlx-lm's full fine-tuning trains.

A run resumed from a checkpoint adapts the modules the checkpoint names, not what its
shorthand resolves to today: a later release that widens ``default`` cannot break a resume.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxft.config import WHOLE_LAYERS, AdapterConfig
from mlxft.errors import UserError

_LINEAR_TYPES = (nn.Linear, nn.QuantizedLinear)
_MIXER_WORDS = ("attn", "attention", "conv", "mixer", "mamba")
_FEED_FORWARD_WORDS = ("mlp", "feed_forward", "ffn", "moe")
# A feed-forward's projections by name, where its block does not say (Nemotron-H calls every
# block, Mamba, attention, MLP or experts, a ``mixer``).
_FEED_FORWARD_LEAVES = ("up_proj", "down_proj", "gate_proj", "fc1", "fc2", "w1", "w2", "w3")
_ATTENTION_WORDS = ("attn", "attention")


def _expert_types() -> tuple[type, ...]:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    return SwitchLinear, QuantizedSwitchLinear


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a mixture of experts' stacked projection (mlx-lm's SwitchLinear)."""
    return isinstance(module, _expert_types())


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
            if isinstance(module, _LINEAR_TYPES) or is_experts(module) or hasattr(module, "to_lora"):
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
            if not (isinstance(module, _LINEAR_TYPES) or is_experts(module)):
                continue
            out_dims, packed = module.weight.shape[-2:]  # an expert stack's are [experts, out, in]
            in_dims = packed * 32 // module.bits if hasattr(module, "bits") else packed
            if widest is None or min(in_dims, out_dims) > widest[0]:
                widest = (min(in_dims, out_dims), name, in_dims, out_dims)
    if widest is not None and rank > widest[0]:
        width, name, in_dims, out_dims = widest
        raise UserError(f"config field adapter.rank: {rank} is more than the widest adapted layer's {width} "
                        f"({name}: {in_dims} -> {out_dims}), where no layer gains from it; use --rank {width} or less")


def _block_says(name: str, words: tuple[str, ...]) -> bool:
    """Whether the module's block (its name's first word) contains one of ``words``."""
    return any(word in name.split(".")[0] for word in words)


def _is_mixer(name: str) -> bool:
    """Attention, convolution or state-space mixing: the shorthand ``attn``."""
    return _block_says(name, _MIXER_WORDS) and not _is_feed_forward(name)


def _is_feed_forward(name: str) -> bool:
    """An MLP or a mixture of experts, shared experts and router included: the shorthand ``mlp``.
    Named so by any module on the path (``switch_mlp``), or by its projection's own name
    outside attention (``shared_experts.up_proj``)."""
    *path, leaf = name.split(".")
    if any(word in part for part in path for word in _FEED_FORWARD_WORDS):
        return True
    return leaf in _FEED_FORWARD_LEAVES and not any(word in part for part in path for word in _ATTENTION_WORDS)


def resolve_targets(targets: list[str], available: list[str]) -> list[str]:
    """Expand shorthands and check explicit names against the layers' linear modules."""
    chosen: set[str] = set()
    for target in targets:
        if target == "all":
            chosen.update(available)
        elif target == "default":
            # By the block's name alone, as before attn and mlp looked further: default stays what
            # it was, and an unfamiliar layout gets every linear layer, whatever its leaves are named.
            familiar = {n for n in available if _block_says(n, _MIXER_WORDS + _FEED_FORWARD_WORDS)}
            chosen.update(familiar or available)
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


def check(model: nn.Module, config: AdapterConfig, resolved: list[str] | None = None) -> list[str]:
    """The LoRA/DoRA targets ``config`` names in ``model`` (``resolved``: the module names a
    checkpoint recorded, which a resumed run keeps), once they and the rank are known to fit,
    changing nothing (a refused run leaves a model passed in as it was)."""
    layers = selected_layers(model, config.num_layers)
    targets = _recorded(resolved, linear_names(layers)) if resolved is not None else \
        resolve_targets(config.targets, linear_names(layers))
    _check_rank(layers, targets, config.rank)
    if config.finetune == "dora":
        experts = sorted({name for layer in layers for name, module in layer.named_modules()
                          if name in targets and is_experts(module)})
        if experts:
            raise UserError(f"config field adapter.targets: DoRA cannot adapt a mixture of experts' stacked projections "
                            f"({', '.join(experts)}; mlx-lm has no DoRA layer for them); pass --targets attn or the "
                            "modules outside the experts, or use --finetune lora")
    return targets


def _recorded(resolved: list[str], available: list[str]) -> list[str]:
    missing = [name for name in resolved if name not in available]
    if missing:
        raise UserError(f"cannot resume: the checkpoint trains {missing[0]}, which this model's layers do not have; "
                        "pass the model the checkpoint was trained on")
    return sorted(resolved)


def apply(model: nn.Module, config: AdapterConfig, seed: int, resolved: list[str] | None = None) -> list[str]:
    """Make the requested part of ``model`` trainable; return the targeted module names.

    The model comes in frozen. LoRA/DoRA layers are seeded so a run's initial adapters
    depend only on ``seed``. ``resolved`` (module names, as this returns them) replaces
    resolving ``config.targets``: a resumed run adapts what its checkpoint recorded.
    """
    from mlx_lm.tuner.utils import linear_to_lora_layers

    layers = selected_layers(model, config.num_layers)
    if config.finetune == "full":
        return _unfreeze(model, layers, config, resolved)
    targets = check(model, config, resolved)
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


def _experts_lora_in_input_dtype(self, x, indices, sorted_indices=False):
    # As _lora_in_input_dtype, for mlx-lm's LoRASwitchLinear: each token's chosen experts' adapters.
    y = self.linear(x, indices, sorted_indices=sorted_indices)
    z = mx.gather_mm(self.dropout(x), self.lora_a.astype(x.dtype).swapaxes(-1, -2), rhs_indices=indices,
                     sorted_indices=sorted_indices)
    z = mx.gather_mm(z, self.lora_b.astype(x.dtype).swapaxes(-1, -2), rhs_indices=indices,
                     sorted_indices=sorted_indices)
    return y + (self.scale * z).astype(x.dtype)


def computes_in_input_dtype(module: nn.Module) -> bool:
    """Whether :func:`compute_lora_in_input_dtype` gave ``module`` its arithmetic."""
    return type(module).__call__ in (_lora_in_input_dtype, _experts_lora_in_input_dtype)


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
    from mlx_lm.tuner.lora import LoRALinear, LoRASwitchLinear

    modules = dict(model.named_modules())
    for name, _ in tree_flatten(model.trainable_parameters()):
        owner, _, leaf = name.rpartition(".")
        module = modules.get(owner)
        if (leaf not in ("lora_a", "lora_b") or not isinstance(module, (LoRALinear, LoRASwitchLinear))
                or not computes_in_input_dtype(module)):
            return False
    return True


def compute_lora_in_input_dtype(model: nn.Module) -> None:
    """Make every mlx-lm ``LoRALinear`` and ``LoRASwitchLinear`` of ``model`` compute in its input's dtype.

    Each layer instance gets a subclass overriding ``__call__`` (parameter names unchanged;
    other models sharing the class are unaffected). A float32 model computes exactly as before.
    """
    from mlx_lm.tuner.lora import LoRALinear, LoRASwitchLinear

    for _, module in model.named_modules():
        cls = type(module)
        for base, call in ((LoRALinear, _lora_in_input_dtype), (LoRASwitchLinear, _experts_lora_in_input_dtype)):
            if isinstance(module, base) and cls.__call__ is base.__call__:
                module.__class__ = type(cls.__name__, (cls,), {"__call__": call})


def _unfreeze(model: nn.Module, layers: list[nn.Module], config: AdapterConfig,
              resolved: list[str] | None = None) -> list[str]:
    from mlxft.models import is_quantized

    if is_quantized(model):
        raise UserError("full fine-tuning needs an unquantized base; drop --quantize or use --finetune lora")
    if config.targets == ["default"] and config.num_layers == -1:
        model.unfreeze()
        return ["*"]
    if config.targets == [WHOLE_LAYERS]:
        for layer in layers:
            layer.unfreeze()
        return [WHOLE_LAYERS]
    if resolved is not None:
        targets = _recorded(resolved, linear_names(layers))
    else:
        targets = resolve_targets(["all"] if config.targets == ["default"] else config.targets, linear_names(layers))
    for layer in layers:
        for name, module in layer.named_modules():
            if name in targets:
                module.unfreeze()
    return targets


def lora_scale(config: AdapterConfig) -> float:
    return config.alpha / config.rank
