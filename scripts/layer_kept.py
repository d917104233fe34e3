"""What one transformer layer keeps for its backward pass, in arrays of [tokens, hidden], per variant.

    python scripts/layer_kept.py 1 256 float32                      # this CPU
    python scripts/layer_kept.py 8 512 bfloat16 mlxft,recompute     # the GPU anchors' shape

Builds one layer of each kind (Llama-3.2-1B's attention; LFM2-1.2B's convolution and attention)
from the benchmark's configurations with random weights and LoRA r8 on every linear, and reads
what the forward pass of a pending vector-Jacobian product leaves allocated
(``mlxft.memory._kept_for_backward``, the memory estimate's own probe), divided by one
``[B, T, hidden]`` array. Variants: ``mlx-lm`` (its layers as they are), ``mlxft`` (the training
step's functions), ``recompute`` (with ``--recompute-mlp``), and either of the last two with
``-blocked-attn``: attention through mlxft's blocked attention instead of MLX's fused kernel,
which separates what the fused kernel's backward pass keeps. Optional arguments: the variants
and the models, comma-separated.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlxft  # noqa: E402,F401 - optimized BLAS before MLX on Linux
import mlx.core as mx  # noqa: E402
from mlx_lm.utils import _get_classes  # noqa: E402

from bench import CONFIGS  # noqa: E402
from mlxft import fastmath, lora, memory  # noqa: E402
from mlxft.config import AdapterConfig  # noqa: E402

VARIANTS = ("mlx-lm", "mlxft", "mlxft-blocked-attn", "recompute", "recompute-blocked-attn")


def build(name: str, variant: str, dtype):
    config = dict(CONFIGS[name])
    if "layer_types" in config:  # two convolutions and an attention layer
        config["layer_types"] = config["layer_types"][:3]
        config["num_hidden_layers"] = 3
    else:
        config["num_hidden_layers"] = 1
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(dtype)
    model.freeze()
    lora.apply(model, AdapterConfig(targets=["all"]), seed=0)
    module = sys.modules[type(model).__module__]
    # mlx-lm's attention function, which fastmath.enable wraps for the whole process.
    original = getattr(module.scaled_dot_product_attention, "mlxft_original", module.scaled_dot_product_attention)
    module.scaled_dot_product_attention = original
    if variant != "mlx-lm":
        fastmath.enable(model, recompute_mlp=variant.startswith("recompute"))
    if variant.endswith("blocked-attn"):
        def blocked(q, k, v, cache, scale, mask, sinks=None):
            if isinstance(mask, str) and q.shape[2] == k.shape[2]:
                return fastmath.attention(q, k, v, scale, mask)
            return original(q, k, v, cache, scale, mask, sinks)

        blocked.mlxft_original = original
        module.scaled_dot_product_attention = blocked
    mx.eval(model.parameters())
    return model, module, original


def main() -> None:
    batch, length, dtype = int(sys.argv[1]), int(sys.argv[2]), getattr(mx, sys.argv[3])
    variants = sys.argv[4].split(",") if len(sys.argv) > 4 else VARIANTS
    names = sys.argv[5].split(",") if len(sys.argv) > 5 else ("llama-3.2-1b", "lfm2-1.2b")
    print(f"{mx.default_device()}, B={batch}, T={length}, {dtype}", flush=True)
    for name in names:
        for variant in variants:
            model, module, original = build(name, variant, dtype)
            x = mx.random.normal((batch, length, CONFIGS[name]["hidden_size"])).astype(dtype)
            kept, seen = [], set()
            for layer in model.layers:
                kind = "attention" if memory.is_attention_layer(layer) else "convolution"
                if kind not in seen:
                    seen.add(kind)
                    kept.append(f"{kind} {memory._kept_for_backward(layer, None, x) / x.nbytes:.2f}")
            print(f"{name:14} {variant:24} " + "  ".join(kept), flush=True)
            module.scaled_dot_product_attention = original


if __name__ == "__main__":
    main()
