"""LoRA projections that read the same input (attention's q, k and v; an MLP's gate and up),
computed as one.

A LoRA step runs every adapted projection as a frozen matmul plus two rank-r products in the
forward pass, and five more products in the backward pass: each is a kernel of its own, and on a
GPU the host spends about as long queueing a chat step's kernels as the device spends running
them. Sibling projections that read one input share the work here: their frozen weights are one
array (each member's weight becomes a view of it, so memory is unchanged), their adapters' A
matrices one product, and one function with its own backward pass gives every member its output
and gradients. For q, k and v that is 5 products forward and 9 backward in place of 9 and 15.

mlx-lm's model code is left as it is: the first member called with an input computes the whole
group and hands the others their outputs when they are called with that same input (the same
array object), as attention and the MLP do. A member called with anything else, with an active
dropout, or after its base weight was replaced computes on its own, as before.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

# Sibling names, inside one parent module, that mlx-lm's families call with the same input.
_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
_MARKER = "_mlxft_shared_input"
_ARRAY_KEYS = ("weight", "scales", "biases", "bias")


def input_gradient(linear: nn.Module, cotangent: mx.array) -> mx.array:
    """The gradient of a frozen ``linear(x)`` with respect to ``x``: no activation needed.
    (Through ``mx.vjp`` the compiled step also kept the forward product, a [tokens, out] array.)"""
    if isinstance(linear, nn.QuantizedLinear):
        return mx.quantized_matmul(cotangent, linear["weight"], scales=linear["scales"], biases=linear.get("biases"),
                                   transpose=False, group_size=linear.group_size, bits=linear.bits, mode=linear.mode)
    return cotangent @ linear["weight"]


def plain_lora(module: nn.Module) -> bool:
    """Whether ``module`` is mlx-lm's LoRA layer (as mlxft computes it) over a frozen linear or
    quantized linear, without an active dropout, training nothing but ``lora_a`` and ``lora_b``
    (a fused function takes the rest as constants)."""
    from mlx_lm.tuner.lora import LoRALinear

    from mlxft.lora import computes_in_input_dtype

    return (isinstance(module, LoRALinear) and (computes_in_input_dtype(module) or _group_of(module) is not None)
            and type(module.linear) in (nn.Linear, nn.QuantizedLinear)
            and not _dropout_active(module)
            and {name for name, _ in tree_flatten(module.trainable_parameters())} <= {"lora_a", "lora_b"})


def _dropout_active(module: nn.Module) -> bool:
    return module.dropout._p_1 < 1 and module.dropout.training


def _group_of(module: nn.Module) -> SharedInput | None:
    return module.__dict__.get("_mlxft_group")


class SharedInput:
    """One group of sibling LoRA projections whose frozen weights are one array."""

    def __init__(self, members: list[nn.Module]):
        self.members = members
        linears = [m.linear for m in members]
        self.widths = [linear["weight"].shape[0] for linear in linears]
        self.base = copy.copy(linears[0])  # the fused frozen projection, outside the model's tree
        for key in _ARRAY_KEYS:
            if key in linears[0]:
                self.base[key] = mx.concatenate([linear[key] for linear in linears], axis=0)
        mx.eval(self.base.parameters())
        for linear, (start, end) in zip(linears, _bounds(self.widths)):
            for key in self.base:
                linear[key] = self.base[key][start:end]
            # From here on, anything that sets one of its arrays (load_weights, update, set_dtype)
            # makes the fused copy stale; MLX's own tracing swaps arrays without this call.
            linear.__dict__["_mlxft_group"] = self
            linear.__class__ = _marking_stale(type(linear))
        mx.eval([linear.parameters() for linear in linears])
        self.stale = False
        # The last input the group computed for, and the outputs its other members have yet to take.
        self.pending: tuple[mx.array, dict[int, mx.array]] | None = None

    def applies(self) -> bool:
        """Whether the fused computation stands for each member's own (weights unchanged, no dropout)."""
        return not self.stale and not any(_dropout_active(m) for m in self.members)

    def output(self, member: nn.Module, x: mx.array) -> mx.array:
        index = next(i for i, m in enumerate(self.members) if m is member)
        if self.pending is not None and self.pending[0] is x and index in self.pending[1]:
            out = self.pending[1].pop(index)
            if not self.pending[1]:
                self.pending = None
            return out
        outputs = self(x)
        self.pending = (x, {i: out for i, out in enumerate(outputs) if i != index})
        return outputs[index]

    def __call__(self, x: mx.array) -> tuple[mx.array, ...]:
        """Every member's output for input ``x``, from one function with its own backward pass."""
        members, base, dtype = self.members, self.base, x.dtype
        n = len(members)
        scales = [m.scale for m in members]
        columns = _bounds(self.widths)
        ranks = _bounds([m.lora_a.shape[1] for m in members])

        def low_rank(x, a_list):
            return x @ mx.concatenate([a.astype(dtype) for a in a_list], axis=1)

        @mx.custom_function
        def fused(x, *lora):
            projected, low = base(x), low_rank(x, lora[:n])
            return tuple(projected[..., c0:c1] + (scale * (low[..., r0:r1] @ b.astype(dtype))).astype(dtype)
                         for (c0, c1), (r0, r1), scale, b in zip(columns, ranks, scales, lora[n:]))

        @fused.vjp
        def fused_vjp(primals, cotangents, outputs):
            x, *lora = primals
            a_list, b_list = lora[:n], lora[n:]
            cdtype = cotangents[0].dtype
            low = low_rank(x, a_list).reshape(-1, ranks[-1][1])  # as in the forward pass: kept, not recomputed
            scaled = [(scale * c.reshape(-1, c.shape[-1])).astype(cdtype) for scale, c in zip(scales, cotangents)]
            low_cotangent = mx.concatenate([s @ b.astype(cdtype).T for s, b in zip(scaled, b_list)], axis=1)
            a_cat = mx.concatenate([a.astype(cdtype) for a in a_list], axis=1)
            grad_x = input_gradient(base, mx.concatenate(cotangents, axis=-1)) + \
                (low_cotangent @ a_cat.T).reshape(x.shape)
            grad_a = x.reshape(-1, x.shape[-1]).T @ low_cotangent
            return (grad_x, *(grad_a[:, r0:r1].astype(a.dtype) for (r0, r1), a in zip(ranks, a_list)),
                    *((low[:, r0:r1].T @ s).astype(b.dtype) for (r0, r1), s, b in zip(ranks, scaled, b_list)))

        return fused(x, *(m.lora_a for m in members), *(m.lora_b for m in members))


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(start, start + size) for start, size in zip(starts, sizes)]


def _marking_stale(cls: type) -> type:
    def __setitem__(self, key, value):
        if key in _ARRAY_KEYS:
            self.__dict__["_mlxft_group"].stale = True
        super(marking, self).__setitem__(key, value)

    marking = type(cls.__name__, (cls,), {"__setitem__": __setitem__})
    return marking


def _shared_input_call(self, x):
    from mlxft.lora import _lora_in_input_dtype

    group = _group_of(self)
    if group is not None and group.applies():
        return group.output(self, x)
    return _lora_in_input_dtype(self, x)


def _fusable(members: list[nn.Module]) -> bool:
    from mlxft.lora import computes_in_input_dtype

    if len(members) < 2 or not all(plain_lora(m) and computes_in_input_dtype(m) for m in members):
        return False
    first = members[0].linear
    return all(type(m.linear) is type(first) and m.linear.keys() == first.keys()
               and m.linear["weight"].shape[1:] == first["weight"].shape[1:]
               and m.linear["weight"].dtype == first["weight"].dtype
               and all(getattr(m.linear, a, None) == getattr(first, a, None) for a in ("group_size", "bits", "mode"))
               for m in members)


def fuse(model: nn.Module) -> int:
    """Give every group of sibling LoRA projections that share an input one frozen weight and
    one function (see the module's docstring); returns how many groups there are. Idempotent."""
    count = 0
    for _, parent in model.named_modules():
        for names in _GROUPS:
            members = [parent[name] for name in names if name in parent]
            if any(_group_of(m) is not None for m in members):
                count += 1
                continue
            # Members not adapted (a narrower --targets) stay as they are; the rest still share.
            members = [m for m in members if plain_lora(m)]
            if not _fusable(members):
                continue
            group = SharedInput(members)
            for member in members:
                member.__dict__["_mlxft_group"] = group
                cls = type(member)
                member.__class__ = type(cls.__name__, (cls,), {"__call__": _shared_input_call, _MARKER: True})
            count += 1
    return count
