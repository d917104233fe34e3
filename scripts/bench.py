"""mlxft against mlx-lm's own trainer, side by side in one invocation on the same work.

    python scripts/bench.py --model builtin:smollm2-135m-instruct --workload chat
    python scripts/bench.py --model config:lfm2-1.2b --dtype bfloat16 --workload chat --fixed-length 512
    python scripts/bench.py --data builtin:capitals --batch-size 4 --steps 60 --warmup 10 --lr 2e-4

Each trainer runs in its own fresh process (same interpreter, MLX build, BLAS, flags and MLX
environment settings, including the CUDA graph limits mlxft sets on import; a
shared process would count the first trainer's cached compiled graphs and weights against
the second), and gets the same model, the same tokenized rows, LoRA rank 8 on every
linear of every layer, the same batch size, seed, optimizer (Adam) and number of optimizer
steps. mlx-lm runs `mlx_lm.tuner.trainer.train` with its compiled step and `default_loss`;
mlxft runs its `Trainer`. Reported per trainer: supervised tokens/s and real (non-padding)
tokens/s over the wall-clock time of the steps after warm-up (batching included for both), peak memory (`mx.get_peak_memory`), the last training
loss, and the losses of the trained adapters on the training rows and on the validation rows
under one common loss (mlxft's). Workloads: ``chat`` (completion-only SFT, variable lengths,
~45% prompt) and ``text`` (pretraining: every token supervised) on random tokens, or a real
data directory (``--data``), where validation loss measures what was learnt. Writes JSON to
benchmarks/.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlxft  # noqa: F401,E402 - optimized BLAS before MLX on Linux
import mlx.core as mx  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402

from mlxft import builtin, lora, models  # noqa: E402
from mlxft.config import AdapterConfig, RunConfig  # noqa: E402
from mlxft.data import Dataset, Example, epoch_batches, make_batch  # noqa: E402
from mlxft.loss import loss_fn  # noqa: E402

# MLX settings both trainers' processes inherit (mlxft sets them on import where unset).
ENVIRONMENT = ("MLX_MAX_MB_PER_BUFFER", "MLX_MAX_OPS_PER_BUFFER", "MLX_CUDA_GRAPH_CACHE_SIZE", "MLX_BFS_MAX_WIDTH")

# Hub configurations of the anchor models (random weights; no download).
CONFIGS = {
    "lfm2-1.2b": {
        "model_type": "lfm2", "vocab_size": 65536, "hidden_size": 2048, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 128000, "norm_eps": 1e-5,
        "conv_bias": False, "conv_L_cache": 3, "block_dim": 2048, "block_ff_dim": 12288, "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True, "rope_theta": 1000000.0,
        "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv",
                        "full_attention", "conv", "full_attention", "conv", "full_attention", "conv",
                        "full_attention", "conv"],
    },
    "llama-3.2-1b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 16,
        "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    },
}


def load_model(name: str, dtype: str):
    if name.startswith("config:"):
        from mlx_lm.utils import _get_classes

        config = CONFIGS[name.split(":", 1)[1]]
        model_class, args_class = _get_classes(config)
        mx.random.seed(0)
        model = model_class(args_class.from_dict(config))
        model.set_dtype(models.resolve_dtype(dtype))
        mx.eval(model.parameters())
        model.freeze()
        return model, config["vocab_size"]
    model, tokenizer, _, _ = models.load(builtin.resolve(name), dtype)
    return model, model.args.vocab_size


def synthetic_rows(n: int, vocab: int, workload: str, max_len: int, fixed: int, seed: int) -> list[Example]:
    """Token rows with a prompt/completion split (chat) or fully supervised (text)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        length = fixed or int(rng.integers(max_len // 4, max_len + 1))
        ids = rng.integers(3, min(vocab, 32000), size=length).astype(np.int32)
        mask = np.ones(length, bool)
        if workload == "chat":
            mask[: int(length * (0.45 if not fixed else 0.5))] = False
        rows.append(Example(ids, mask))
    return rows


def dataset_rows(data: str, model: str) -> tuple[list[Example], list[Example]]:
    """A data directory's train and valid rows, tokenized with the model's tokenizer as mlxft's
    trainer would, each cut after its last supervised token (nothing after it enters a loss).
    mlx-lm's batches mark supervision by where it starts, so a row with an unsupervised gap
    inside (a multi-turn chat) has no equal there and is refused."""
    from mlx_lm.utils import load_tokenizer

    from mlxft.data import load_dataset, resolve_files

    tokenizer = load_tokenizer(Path(builtin.resolve(model)))
    split = []
    for path in resolve_files(builtin.resolve(data), "", ""):
        if path is None:
            sys.exit(f"{data}: the benchmark needs a valid.jsonl beside train.jsonl")
        rows = []
        for number, row in enumerate(load_dataset(path, tokenizer, 10**6).examples, 1):
            end = int(np.flatnonzero(row.mask)[-1]) + 1
            start = int(np.argmax(row.mask))
            if not row.mask[start:end].all():
                sys.exit(f"{path}: row {number} has unsupervised tokens between supervised ones, which mlx-lm's "
                         f"trainer cannot express; use prompt/completion rows or single-turn chats")
            rows.append(Example(row.ids[:end], row.mask[:end]))
        split.append(rows)
    return split[0], split[1]


def probe_sizes(vocab: int) -> tuple[list[Example], dict[str, list[Example]]]:
    """The probe scripts' rows: the benchmark's 128 chat rows, longest first, and three
    micro-batches of 8 from them by length (``longest``, ``middle``: about 2,800 tokens, ``shortest``)."""
    rows = sorted(synthetic_rows(128, vocab, "chat", 512, 0, 0), key=lambda r: -len(r.ids))
    return rows, {"longest": rows[0:8], "middle": rows[60:68], "shortest": rows[120:128]}


def probe_epoch(rows: list[Example], batch_size: int = 8) -> list[list[Example]]:
    """The micro-batches of ``rows`` that a benchmark run trains in its first epoch, in its order."""
    lengths = np.array([len(r.ids) for r in rows])
    return [[rows[i] for i in idx] for idx in epoch_batches(lengths, batch_size, 0, 0)]


def probe_trainer(name: str, model, rows: list[Example], grad_checkpoint: bool, loss_chunk: int, batch_size: int,
                  targets: tuple[str, ...] = ("all",), **model_options):
    """mlxft's Trainer on in-memory chat rows, as the probe scripts build it (LoRA r8 on
    ``targets``, every linear by default, Adam at a constant 1e-4, no clipping, no memory
    estimate): its ``step`` is the compiled step they time and measure. ``model_options``: more
    fields of the model config (``checkpoint_layers``, ``checkpoint_keep_mlp``)."""
    from mlxft.trainer import Trainer

    config = RunConfig.from_dict({
        "model": {"model": name, "grad_checkpoint": grad_checkpoint, "loss_chunk": loss_chunk, **model_options},
        "data": {"data": "in-memory", "length_bucket": 32, "max_seq_length": 513},
        "adapter": {"targets": list(targets), "rank": 8, "alpha": 16.0},
        "optim": {"optimizer": "adam", "learning_rate": 1e-4, "schedule": "constant", "max_grad_norm": 0.0},
        "train": {"output_dir": tempfile.mkdtemp(), "batch_size": batch_size, "max_steps": 10,
                  "memory_estimate": False},
    })
    return Trainer(config, model, tokenizer=None, datasets=(Dataset(Path("rows"), rows, "completion"), None))


def common_val_loss(model, rows: list[Example], batch_size: int) -> float:
    model.eval()
    total, count = 0.0, 0
    lengths = np.array([len(r.ids) for r in rows])
    for idx in epoch_batches(lengths, batch_size, 0, 0, shuffle=False):
        loss, n = loss_fn(model, *make_batch([rows[i] for i in idx], batch_size, 32).arrays())
        total, count = total + loss.item() * n.item(), count + n.item()
    return total / count


@functools.cache  # known before mlx-lm compiles a loss that asks
def mlx_lm_counts_padding() -> bool:
    """Whether mlx-lm's ``default_loss`` reaches one position past each row's last token, the
    first padding column, training every row to predict the padding id 0 after its end and
    counting one target more (as 0.32 does)."""
    from mlx_lm.tuner.trainer import default_loss

    def uniform(inputs):
        return mx.zeros((*inputs.shape, 2))

    # One row of two real tokens (one target), padded to four.
    _, targets = default_loss(uniform, mx.zeros((1, 4), mx.int32), mx.array([[1, 2]]))
    return targets.item() == 2


def mlx_lm_loss_to_the_last_token(model, batch, lengths):
    """mlx-lm's ``default_loss`` with its mask ending at each row's last token."""
    from mlx_lm.tuner.trainer import default_loss

    return default_loss(model, batch, lengths - mx.array([0, int(mlx_lm_counts_padding())]))


def run_mlx_lm(args, rows, val_rows):
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.trainer import TrainingArgs, default_loss, train

    model, _ = load_model(args.model, args.dtype)
    lora.apply(model, AdapterConfig(targets=["all"], rank=args.rank, alpha=2.0 * args.rank), seed=args.seed)
    np.random.seed(args.seed)  # mlx-lm shuffles its batches with numpy's global generator
    # mlx-lm's batches: (tokens, offset) with the offset marking where supervision starts.
    dataset = [(r.ids.tolist(), int(np.argmax(r.mask[1:])) + 1 if not r.mask[1:].all() else 0) for r in rows]
    reports = []

    class Capture(TrainingCallback):
        def on_train_loss_report(self, info):  # wall-clock, as mlxft's windows are (batching included)
            reports.append(dict(info, wall=time.perf_counter()))

    mx.reset_peak_memory()
    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArgs(batch_size=args.batch_size, iters=args.steps, steps_per_report=args.warmup,
                             steps_per_eval=10**9, steps_per_save=10**9, max_seq_length=args.max_len + 1,
                             adapter_file=str(Path(tmp) / "adapters.safetensors"))
        counts_padding = mlx_lm_counts_padding()
        loss = mlx_lm_loss_to_the_last_token if args.mlx_lm_loss == "fixed" else default_loss
        tic = time.perf_counter()
        train(model, optim.Adam(learning_rate=args.lr), dataset, None, args=targs, loss=loss, training_callback=Capture())
        wall = time.perf_counter() - tic
    peak = mx.get_peak_memory() / 1e9
    start = next(r for r in reports if r["iteration"] == args.warmup)
    last = reports[-1]
    supervised_per_sec = (last["trained_tokens"] - start["trained_tokens"]) / (last["wall"] - start["wall"])
    supervised = sum(r.supervised for r in rows)
    if args.mlx_lm_loss == "as-shipped" and counts_padding:  # a padding target in every row
        supervised_per_sec *= supervised / (supervised + len(rows))
    real_per_supervised = sum(len(r.ids) - 1 for r in rows) / supervised
    result = {"trainer": "mlx-lm", "supervised_tokens_per_sec": supervised_per_sec,
              "tokens_per_sec": supervised_per_sec * real_per_supervised, "peak_memory_gb": peak,
              "train_loss": last["train_loss"], "train_set_loss": common_val_loss(model, rows, args.batch_size),
              "val_loss": common_val_loss(model, val_rows, args.batch_size),
              "wall_s": wall, "graph_mb": os.environ.get("MLX_MAX_MB_PER_BUFFER")}
    del model
    return result


def run_mlxft(args, rows, val_rows):
    from mlxft import _gpu
    from mlxft.trainer import Trainer

    _gpu.cap_for_recomputation(args.grad_checkpoint, args.recompute_mlp)  # as the trainer does, before this model's first evaluation
    model, _ = load_model(args.model, args.dtype)
    if args.lora_float32:  # measure the lever: mlx-lm's float32 LoRA arithmetic
        lora.compute_lora_in_input_dtype = lambda model: None
    with tempfile.TemporaryDirectory() as tmp:
        config = RunConfig.from_dict({
            "model": {"model": args.model, "grad_checkpoint": args.grad_checkpoint,
                      "checkpoint_layers": args.checkpoint_layers, "checkpoint_keep_mlp": args.checkpoint_keep_mlp,
                      "recompute_mlp": args.recompute_mlp, "recompute_mlp_layers": args.recompute_mlp_layers,
                      "fit_memory": args.fit_memory, "loss_chunk": args.loss_chunk},
            "data": {"data": "in-memory", "length_bucket": 32, "max_seq_length": args.max_len + 1, "pack": args.pack},
            "adapter": {"targets": ["all"], "rank": args.rank, "alpha": 2.0 * args.rank},
            "optim": {"optimizer": "adam", "learning_rate": args.lr, "schedule": "constant", "max_grad_norm": 0.0},
            "train": {"output_dir": tmp, "batch_size": args.batch_size, "max_steps": args.steps,
                      "log_every": args.log_every or args.warmup, "backend": args.backend, "seed": args.seed,
                      "clear_cache_above": args.clear_cache_above, "memory_limit": args.memory_limit,
                      "cache_limit": args.cache_limit, "pace_memory": args.pace_memory},
        })
        train_set = Dataset(Path("bench-train"), rows, "completion" if args.workload == "chat" else "text")
        trainer = Trainer(config, model, tokenizer=None, datasets=(train_set, None))
        mx.reset_peak_memory()
        tic = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - tic
        peak = mx.get_peak_memory() / 1e9
        if not trainer.world.is_main:  # data-parallel: rank 0 reports
            trainer.world.close()
            return None
        trainer.world.close()
        records = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["type"] == "train" and r["step"] > args.warmup]
    seconds = sum(r["seconds"] for r in timed)
    last = timed[-1]
    result = {"trainer": "mlxft", "supervised_tokens_per_sec": sum(r["supervised_tokens_per_sec"] * r["seconds"] for r in timed) / seconds,
              "tokens_per_sec": sum(r["tokens_per_sec"] * r["seconds"] for r in timed) / seconds, "peak_memory_gb": peak, "train_loss": last["loss"],
              "train_set_loss": common_val_loss(trainer.model, rows, args.batch_size),
              "val_loss": common_val_loss(trainer.model, val_rows, args.batch_size), "wall_s": wall,
              "estimated_peak_memory_gb": trainer.estimate.total / 1e9,
              "estimate_gb": {k: getattr(trainer.estimate, k) / 1e9 for k in ("weights", "training_state", "activations", "loss")},
              # Inside activations: the most a layer's backward pass holds over what the layers keep.
              "estimate_transient_gb": trainer.estimate.transient / 1e9,
              "graph_mb": os.environ.get("MLX_MAX_MB_PER_BUFFER"),  # the trainer may lower mlxft's own cap
              # What the run recomputed, as --fit-memory may have chosen it.
              "recomputation": {k: getattr(trainer.config.model, k) for k in
                                ("grad_checkpoint", "checkpoint_layers", "recompute_mlp", "recompute_mlp_layers")}}
    del trainer, model
    return result


def pair_orders(repeats: int) -> list[tuple[str, str]]:
    """The order of the two trainers in each of ``repeats`` pairs: alternated, so that neither
    always runs first on a GPU whose clocks and neighbours change within a session."""
    return [("mlx-lm", "mlxft") if i % 2 == 0 else ("mlxft", "mlx-lm") for i in range(repeats)]


def pair_ratios(pair: dict) -> dict:
    base, ours = pair["mlx-lm"], pair["mlxft"]
    return {key: ours[field] / base[field] for key, field in (
        ("supervised_tokens_per_sec", "supervised_tokens_per_sec"), ("tokens_per_sec", "tokens_per_sec"),
        ("peak_memory", "peak_memory_gb"))}


def summarize(pairs: list[dict]) -> dict:
    """The median pair by throughput ratio (its results and ratios stand for the run), and with
    several pairs every pair's ratios and results. The median of an even count is the lower
    middle pair, so the figure shown is always one that was measured."""
    ratios = [pair_ratios(p) for p in pairs]
    ranked = sorted(range(len(pairs)), key=lambda i: ratios[i]["supervised_tokens_per_sec"])
    middle = ranked[(len(pairs) - 1) // 2]
    summary = {"results": [pairs[middle]["mlx-lm"], pairs[middle]["mlxft"]], "ratios (mlxft / mlx-lm)": ratios[middle]}
    if len(pairs) > 1:
        summary.update({"pair ratios": ratios, "pairs": [[p["mlx-lm"], p["mlxft"]] for p in pairs]})
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m-instruct", help="model dir, builtin:..., or config:lfm2-1.2b / config:llama-3.2-1b")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workload", choices=("chat", "text"), default="chat")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-len", type=int, default=256, help="longest row (variable lengths down to a quarter)")
    p.add_argument("--fixed-length", type=int, default=0, help="every row this long (the GPU anchors use 512)")
    p.add_argument("--data", default="", help="a data directory (train.jsonl, valid.jsonl) or builtin:capitals instead of "
                   "random rows; needs a model with a tokenizer (--workload, --rows and the lengths then do not apply)")
    p.add_argument("--mlx-lm-loss", choices=("as-shipped", "fixed"), default="as-shipped",
                   help="mlx-lm's default_loss as shipped (it also trains each row to predict padding after its "
                        "last token), or with that mask ending at the last token, the objective mlxft trains")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps excluded from the throughput figures (both trainers report every this many steps)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="both trainers' adapter init and batch order (the rows stay the same)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--grad-checkpoint", action="store_true", help="mlxft recomputes layer activations")
    p.add_argument("--checkpoint-layers", type=int, default=0, help="with --grad-checkpoint, only the first N layers")
    p.add_argument("--checkpoint-keep-mlp", action="store_true", help="with --grad-checkpoint, keep the MLP's gate and up projections")
    p.add_argument("--recompute-mlp", action="store_true", help="mlxft recomputes each MLP's gate and up projections")
    p.add_argument("--recompute-mlp-layers", type=int, default=0, help="with --recompute-mlp, only the first N layers' MLPs")
    p.add_argument("--fit-memory", action="store_true",
                   help="mlxft recomputes as little as brings its estimate under --memory-limit")
    p.add_argument("--pack", action="store_true", help="mlxft packs each micro-batch's rows (same rows, same loss)")
    p.add_argument("--lora-float32", action="store_true", help="mlxft computes LoRA in float32 as mlx-lm does")
    p.add_argument("--loss-chunk", type=int, default=0, help="mlxft scores supervised positions in recomputed chunks")
    p.add_argument("--clear-cache-above", type=float, default=-1.0, help="mlxft's train.clear_cache_above (GB)")
    p.add_argument("--memory-limit", type=float, default=0.0, help="mlxft's train.memory_limit (GB; MLX waits for queued work above it)")
    p.add_argument("--pace-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="mlxft's train.pace_memory (see mlxft.memory.pacing_limit)")
    p.add_argument("--cache-limit", type=float, default=-1.0, help="mlxft's train.cache_limit (GB)")
    p.add_argument("--log-every", type=int, default=0, help="mlxft's log interval (default: --warmup; must divide it)")
    p.add_argument("--only", choices=("both", "mlxft", "mlx-lm"), default="both")
    p.add_argument("--backend", default="none", help="mlxft's distributed backend (auto under mlx.launch)")
    p.add_argument("--repeats", type=int, default=1,
                   help="pairs of runs, the trainers' order alternating; the pair with the median throughput ratio is reported")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not 0 < args.warmup < args.steps or (args.log_every and args.warmup % args.log_every) or args.repeats < 1:
        p.error("need 0 < --warmup < --steps, --log-every dividing --warmup, and --repeats of at least 1")
    if args.fixed_length:
        args.max_len = args.fixed_length
    if args.data:
        if args.model.startswith("config:") or args.fixed_length:
            p.error("--data needs a model with a tokenizer, and takes the rows' own lengths")
        rows, val_rows = dataset_rows(args.data, args.model)
        args.max_len = max(len(r.ids) for r in rows)
    else:
        vocab = CONFIGS[args.model.split(":", 1)[1]]["vocab_size"] if args.model.startswith("config:") else 49152
        rows = synthetic_rows(args.rows, vocab, args.workload, args.max_len, args.fixed_length, seed=0)
        val_rows = synthetic_rows(16, vocab, args.workload, args.max_len, args.fixed_length, seed=1)
    if args.only != "both":
        result = (run_mlxft if args.only == "mlxft" else run_mlx_lm)(args, rows, val_rows)
        if result is not None:  # None: a data-parallel rank other than 0
            print("RESULT " + json.dumps(result))
        return
    pairs = []
    for order in pair_orders(args.repeats):
        pair = {}
        for only in order:
            argv = [a for a in sys.argv[1:]] + ["--only", only]
            proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                sys.exit(f"{only} run failed:\n{proc.stderr[-3000:]}")
            pair[only] = json.loads(lines[-1][len("RESULT "):])
            print(f"pair {len(pairs) + 1} {lines[-1]}", flush=True)  # kept if a later pair does not finish
        pairs.append(pair)
    summary = {
        "args": vars(args), "device": str(mx.default_device()), "machine": platform.machine(),
        "mlx": mx.__version__, "environment": {k: os.environ.get(k) for k in ENVIRONMENT}, **summarize(pairs),
    }
    results = summary["results"]
    work = Path(args.data.split(":")[-1]).name if args.data else args.workload
    out = Path(args.out or f"benchmarks/bench-{args.model.split(':')[-1].replace('/', '_')}-{work}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'trainer':8} {'sup tok/s':>10} {'tok/s':>10} {'peak GB':>8} {'train loss':>10} {'val loss':>9}")
    for r in results:
        print(f"{r['trainer']:8} {r['supervised_tokens_per_sec']:10.0f} {r['tokens_per_sec']:10.0f} "
              f"{r['peak_memory_gb']:8.2f} {r['train_loss']:10.4f} {r['val_loss']:9.4f}")
    ratios = summary["ratios (mlxft / mlx-lm)"]
    if len(pairs) > 1:
        each = ", ".join(f"{r['supervised_tokens_per_sec']:.2f}x" for r in summary["pair ratios"])
        print(f"throughput ratio of each pair (mlx-lm first in the 1st, 3rd, ...): {each}; the median pair is shown")
    print(f"mlxft / mlx-lm: throughput {ratios['supervised_tokens_per_sec']:.2f}x, peak memory {ratios['peak_memory']:.2f}x -> {out}")


if __name__ == "__main__":
    main()
