"""The training run: set up model, data and optimizer, then a short loop that delegates.

``Trainer(config).train()`` is the whole run; ``fine_tune(config)`` is the same in one call.
The loop walks epochs of seeded batches in windows of ``grad_accum_steps`` micro-batches
(the last window of an epoch may be shorter and is applied, not dropped), and hands
evaluation, reporting and saving to their own functions.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx

from mlxft import _blas, builtin, checkpoint, data, generation, lora, models
from mlxft.config import RunConfig, validate
from mlxft.errors import UserError
from mlxft.loss import loss_fn
from mlxft.optim import build_optimizer
from mlxft.report import Reporter
from mlxft.step import build_step


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    train_loss: float | None
    val_loss: float | None
    skipped_steps: int
    exact_match_before: float | None = None
    exact_match_after: float | None = None


def check_output_dir(run_dir: Path, overwrite: bool) -> None:
    """Refuse to mix two runs in one directory unless asked to."""
    holds_run = any((run_dir / name).exists() for name in (checkpoint.STATE_FILE, checkpoint.ADAPTER_FILE))
    if holds_run and not overwrite:
        raise UserError(f"output directory {run_dir} already holds a run; choose another --output-dir or pass --overwrite")
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"output path {run_dir} is a file; choose a directory for --output-dir")


class Trainer:
    """One training run from a resolved :class:`RunConfig`.

    ``model`` and ``tokenizer`` may be passed in (already loaded, frozen) to skip loading.
    """

    def __init__(self, config: RunConfig, model=None, tokenizer=None, reporter: Reporter | None = None):
        validate(config)
        self.config = config
        t = config.train
        self.run_dir = Path(t.output_dir)
        check_output_dir(self.run_dir, t.overwrite)
        self.train_file, self.valid_file = data.resolve_files(
            builtin.resolve(config.data.data), config.data.train_file, config.data.valid_file)

        if model is None:
            model, tokenizer, _, _ = models.load(
                builtin.resolve(config.model.model), config.model.dtype, config.model.quantize,
                config.model.quantize_group_size, config.model.revision,
            )
        self.model, self.tokenizer = model, tokenizer
        self.targets = lora.apply(model, config.adapter, t.seed)

        load = partial(data.load_dataset, tokenizer=tokenizer, max_seq_length=config.data.max_seq_length,
                       completion_only=config.data.completion_only, prompt_format=config.data.prompt_format)
        self.train_set = load(self.train_file)
        self.valid_set = load(self.valid_file) if self.valid_file else None

        batches_per_epoch = math.ceil(len(self.train_set) / t.batch_size)
        self.steps_per_epoch = math.ceil(batches_per_epoch / t.grad_accum_steps)
        self.total_steps = t.max_steps or t.epochs * self.steps_per_epoch
        self.optimizer = build_optimizer(config.optim, self.total_steps)
        self.step = build_step(model, self.optimizer, partial(loss_fn, label_smoothing=config.optim.label_smoothing),
                               config.optim.max_grad_norm)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / checkpoint.METRICS_FILE).write_text("")
        self.reporter = reporter or Reporter(self.run_dir, self.total_steps)
        self.step_count = 0
        self.epoch = 0
        self.skipped_steps = 0
        self.best_val_loss: float | None = None
        self.last_val_loss: float | None = None
        self._describe()

    def _describe(self) -> None:
        trainable, total = models.count_parameters(self.model)
        device = mx.default_device()
        kind = "CPU" if device == mx.cpu else ("Metal" if mx.metal.is_available() else "GPU")
        info = self.reporter.info
        if _blas.uses_reference_blas():
            info(f"warning: {_blas.HINT}")
        info(f"device: {kind} | model: {self.config.model.model} ({models.family(self.model)}) | "
             f"{self.config.adapter.finetune} on {', '.join(self.targets)}")
        info(f"trainable parameters: {trainable:,} / {total:,} ({100 * trainable / max(total, 1):.3f}%)")
        info(f"data: {len(self.train_set)} train rows ({self.train_set.kind}, {self.train_set.supervised_tokens:,} supervised tokens)"
             + (f", {len(self.valid_set)} valid rows" if self.valid_set else ", no validation set")
             + f" | {self.total_steps} steps")

    def batch(self, dataset: data.Dataset, indices) -> data.Batch:
        rows = [dataset.examples[i] for i in indices]
        return data.make_batch(rows, self.config.train.batch_size, self.config.data.length_bucket)

    def train(self) -> TrainResult:
        t = self.config.train
        if self.valid_set is not None and self.step_count == 0:
            self._evaluate()  # the baseline the validation curve starts from
        before = self._exact_match("before training") if t.exact_match_rows else None
        while self.step_count < self.total_steps:
            batches = data.epoch_batches(self.train_set.lengths, t.batch_size, t.seed, self.epoch)
            for start in range(0, len(batches), t.grad_accum_steps):
                if self.step_count >= self.total_steps:
                    break
                self._optimizer_step(batches[start : start + t.grad_accum_steps])
                self._after_step()
            self.epoch += 1
        if self.valid_set is not None and (not t.eval_every or self.step_count % t.eval_every):
            self._evaluate()
        if not t.save_every or self.step_count % t.save_every:
            self.save()
        result = TrainResult(self.run_dir, self.step_count, self.reporter.last_train_loss, self.last_val_loss, self.skipped_steps)
        if before is not None:
            after = self._exact_match("after training")
            self._show_answers(before, after)
            result.exact_match_before, result.exact_match_after = before[0], after[0]
        return result

    def _exact_match(self, when: str):
        """Exact-match of greedy answers on the first validation rows (the training rows if none)."""
        source = self.valid_file or self.train_file
        pairs = generation.qa_pairs(source, self.config.train.exact_match_rows)
        score, answers = generation.exact_match(self.model, self.tokenizer, pairs, self.config.data.prompt_format)
        self.reporter.exact_match(self.step_count, score, len(answers), when)
        return score, answers

    def _show_answers(self, before, after, count: int = 3) -> None:
        for old, new in list(zip(before[1], after[1]))[:count]:
            self.reporter.info(f"Q: {old.prompt}\n  reference: {old.reference}\n  before: {old.generated!r}\n  after:  {new.generated!r}")

    def _optimizer_step(self, window) -> None:
        state = None
        loss_sum = tokens = real = 0
        for i, indices in enumerate(window):
            batch = self.batch(self.train_set, indices)
            real += batch.real_tokens
            result, state = self.step(batch.arrays(), state, update=i == len(window) - 1)
            mx.eval(self.step.state, result.loss_sum, result.tokens, state)
        self.step_count += 1
        if not bool(result.applied.item()):
            self.skipped_steps += 1
            self.reporter.info(f"step {self.step_count}: gradient norm is not finite; update skipped")
        self.reporter.step(self.step_count, result.loss_sum.item(), int(result.tokens.item()), real)

    def _after_step(self) -> None:
        t, k = self.config.train, self.step_count
        if k % t.log_every == 0 or k == self.total_steps:
            self.reporter.train(k, self.epoch + 1, self.learning_rate, self.skipped_steps)
        if self.valid_set is not None and t.eval_every and k % t.eval_every == 0:
            self._evaluate()
        if t.save_every and k % t.save_every == 0:
            tic = time.perf_counter()
            self.save()
            self.reporter.pause_clock(time.perf_counter() - tic)

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.learning_rate.item())

    def evaluate(self, dataset: data.Dataset | None = None) -> tuple[float, int]:
        """Token-weighted mean loss over a dataset (the validation set by default)."""
        dataset = dataset or self.valid_set
        t = self.config.train
        self.model.eval()
        loss_sum, tokens = mx.array(0.0), mx.array(0.0)
        for i, indices in enumerate(data.epoch_batches(dataset.lengths, t.batch_size, 0, 0, shuffle=False)):
            if t.max_eval_batches and i >= t.max_eval_batches:
                break
            loss, ntokens = loss_fn(self.model, *self.batch(dataset, indices).arrays())
            loss_sum, tokens = loss_sum + loss * ntokens, tokens + ntokens
            mx.eval(loss_sum, tokens)
        self.model.train()
        return loss_sum.item() / max(tokens.item(), 1), int(tokens.item())

    def _evaluate(self) -> None:
        tic = time.perf_counter()
        loss, tokens = self.evaluate()
        self.last_val_loss = loss
        if self.best_val_loss is None or loss < self.best_val_loss:
            self.best_val_loss = loss
        self.reporter.eval(self.step_count, loss, tokens)
        self.reporter.pause_clock(time.perf_counter() - tic)

    def adapter_metadata(self) -> dict[str, str]:
        a = self.config.adapter
        layers = len(lora.selected_layers(self.model, a.num_layers))
        return checkpoint.adapter_metadata(a.finetune, a.rank, a.alpha, a.dropout, self.targets, layers,
                                           models.family(self.model))

    def training_state(self) -> dict:
        c = self.config
        return {
            "step": self.step_count,
            "epoch": self.epoch,
            "total_steps": self.total_steps,
            "best_val_loss": self.best_val_loss,
            "learning_rate": self.learning_rate,
            "batch_size": c.train.batch_size,
            "grad_accum_steps": c.train.grad_accum_steps,
            "max_seq_length": c.data.max_seq_length,
            "train_modules": {"finetune": c.adapter.finetune, "targets": self.targets},
            "task": self.train_set.kind,
            "model": c.model.model,
            "dataset": str(self.train_file),
            "seed": c.train.seed,
            "skipped_steps": self.skipped_steps,
        }

    def save(self) -> None:
        checkpoint.save_run(self.run_dir, self.model, self.adapter_metadata(), self.config.to_dict(), self.training_state())
        self.reporter.info(f"saved {self.run_dir} at step {self.step_count}")


def fine_tune(config: RunConfig, model=None, tokenizer=None) -> TrainResult:
    """Run a whole training job from a config; the Python API's one call."""
    return Trainer(config, model, tokenizer).train()
