"""The training run: set up model, data and optimizer, then a short loop that delegates.

``Trainer(config).train()`` is the whole run; ``fine_tune(config)`` is the same in one call.
The loop walks epochs of seeded batches one micro-batch at a time; windows of
``grad_accum_steps`` micro-batches end in an optimizer step (the last window of an epoch may
be shorter and is applied, not dropped). Its position (epoch, micro-batch, open window) is
all a checkpoint needs to continue exactly, so a resumed run ends where an uninterrupted one
would. Evaluation, reporting and saving live in their own methods and modules.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
import uuid
import weakref
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_map_with_path, tree_unflatten

from mlxft import (_blas, _gpu, builtin, checkpoint, data, distributed, fastmath, generation, lora, memory, models,
                   normed, packing, runlock, signals)
from mlxft.config import WHOLE_LAYERS, RunConfig, inert_settings, validate
from mlxft.errors import UserError, first_line, print_error
from mlxft.gguf import check_output_apart
from mlxft.loss import cross_entropy, evaluation_loss, frozen_head, hidden_loss, loss_fn
from mlxft.optim import build_optimizer, load_state as load_optimizer_state
from mlxft.report import Reporter
from mlxft.signals import Interrupted, StopRequests
from mlxft.step import LossScaler, build_step, gradient_tree, gradient_window, optimizer_state


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    train_loss: float | None
    val_loss: float | None
    skipped_steps: int
    exact_match_before: float | None = None
    exact_match_after: float | None = None
    main_process: bool = True  # False on data-parallel ranks other than 0


@dataclass
class _QueuedStep:
    """An optimizer step queued on the device whose results are not read yet."""

    step: int
    epoch: int
    result: object  # mlxft.step.StepResult
    real_tokens: int
    learning_rate: mx.array  # the rate this step used (the optimizer's moves on with the next)
    # When the host began queueing the step. A throughput window ends where the next step's
    # queueing began, when it has: reading a step's results can come right after the next
    # step's was read (the last step; MLX's CPU backend reports them done together).
    queued_at: float = 0.0


class TrainingStopped(Exception):
    """The run stopped early: a signal or gradients that stay non-finite (after saving), or out of memory."""

    def __init__(self, message: str, exit_code: int, checkpoint: Path | None, joint: bool = False):
        super().__init__(message)
        self.exit_code = exit_code
        self.checkpoint = checkpoint
        self.joint = joint  # every data-parallel rank stopped here together (a signal, non-finite gradients)


def continues_in(run_dir: Path, resume_from: Path | None) -> bool:
    """Whether resuming from ``resume_from`` continues the run in ``run_dir`` (rather than
    starting one there from another run's checkpoint): the checkpoint lies in ``run_dir`` and
    the directory holds its run. A checkpoint copied into another run's directory, or into
    one of the user's, is not at home there: ``latest`` names a checkpoint of another run,
    or (before a run's first ``latest``) files a run writes after its checkpoint are there."""
    if resume_from is None or resume_from.parent != run_dir.resolve():
        return False
    run_id = checkpoint.run_id_of(resume_from)
    if run_id is None:  # written before checkpoints recorded their run
        return True
    latest = run_dir / checkpoint.LATEST
    if latest.is_symlink() or latest.exists():
        return checkpoint.run_id_of(latest.resolve()) in (None, run_id)
    return not any((run_dir / name).exists() for name in checkpoint.RUN_FILES)


def _finished_in(run_dir: Path, resume_from: Path, state: dict) -> bool:
    """Whether ``resume_from`` is the ``final`` checkpoint of the run in ``run_dir`` and that run
    finished: trained, validated and not stopped, its run files written after it. A run stopped
    at its end, or killed before its run files, has its end still to do."""
    if resume_from.name != checkpoint.checkpoint_name(0, "final") or state.get("finished") is not True:
        return False
    if not continues_in(run_dir, resume_from):
        return False
    written = checkpoint.read_state(run_dir / checkpoint.STATE_FILE) or {}
    return written.get("finished") is True and written.get("step") == state["step"]


def check_output_dir(run_dir: Path, overwrite: bool, resume_from: Path | None = None, main: bool = True) -> None:
    """Refuse to mix two runs in one directory, or to replace files a run did not write, unless
    asked to (resuming continues a run). Only rank 0 (``main``) looks for the files a run writes:
    another rank sharing the directory may already see the metrics.jsonl rank 0 started."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"output path {run_dir} is a file; choose a directory for --output-dir")
    if overwrite or continues_in(run_dir, resume_from) or not run_dir.exists():
        return
    if any((run_dir / name).exists() for name in (checkpoint.STATE_FILE, checkpoint.ADAPTER_FILE, checkpoint.LATEST)):
        raise UserError(f"output directory {run_dir} already holds a run; choose another --output-dir or pass --overwrite")
    clash = checkpoint.first_output_in(run_dir) if main else None
    if clash:
        raise UserError(f"output directory {run_dir} holds {clash}, which a run would overwrite; "
                        "choose another --output-dir or pass --overwrite")


def _recorded_targets(saved: dict | None, path: Path | None) -> list[str] | None:
    """The module names a checkpoint's run adapted or trained (None: no checkpoint, one from
    before they were recorded, or a whole-model or whole-layer run, which names none)."""
    modules = (saved or {}).get("state", {}).get("train_modules")
    if not isinstance(modules, dict) or "targets" not in modules:
        return None
    targets = modules["targets"]
    if not (isinstance(targets, list) and targets and all(isinstance(name, str) for name in targets)):
        raise UserError(f"{path / checkpoint.TRAINER_STATE}: train_modules.targets is not a list of module names "
                        f"(got {targets!r}); the file is damaged")
    return None if targets in (["*"], [WHOLE_LAYERS]) else targets


def _check_output_outside_checkpoint(run_dir: Path, resume_from: Path | None) -> None:
    """A run writes its adapter and state into --output-dir and clears it under --overwrite: the
    checkpoint it resumes from must not be that directory or hold it (holding one is normal)."""
    if resume_from is None:
        return
    target = run_dir.expanduser().resolve()
    if target == resume_from or resume_from in target.parents:
        relation = "is" if target == resume_from else "is inside"
        raise UserError(f"--output-dir {run_dir} {relation} the checkpoint {resume_from} being resumed, whose files "
                        f"the run would overwrite; use the run directory that holds it ({resume_from.parent}) "
                        "or another --output-dir")


def _check_creatable(run_dir: Path) -> None:
    """Refuse an --output-dir that cannot be made (a parent that is a file, one not writable)
    before the model changes; ``mkdir`` itself comes once the run is set up."""
    parent = run_dir.expanduser().absolute()
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if run_dir.exists():
        return
    if not parent.is_dir():
        raise UserError(f"cannot create --output-dir {run_dir}: {parent} is not a directory; choose a directory "
                        "you can write to")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot create --output-dir {run_dir}: {parent} is not writable; choose a directory you "
                        "can write to")


def _check_given_datasets(train_set: data.Dataset, valid_set: data.Dataset | None, vocab_size: int | None,
                          max_seq_length: int) -> None:
    """What loading a JSONL file refuses or cuts, for datasets built in Python: token ids the
    model's embedding does not have (MLX does not check an index), and rows past
    ``max_seq_length`` (which the memory estimate, its advice and the size checks rely on)."""
    for name, dataset in (("train", train_set), ("validation", valid_set)):
        if dataset is None:
            continue
        if len(dataset.lengths) != len(dataset.examples):  # batches follow lengths, steps follow examples
            raise UserError(f"the {name} dataset holds {len(dataset.examples)} examples but was built with "
                            f"{len(dataset.lengths)}; build a new Dataset after changing its examples")
        if not any(example.supervised for example in dataset.examples):
            raise UserError(f"the {name} dataset has no row with a supervised token; give rows with completions "
                            "or assistant turns")
        for number, example in enumerate(dataset.examples):
            if not example.ids.size:  # a batch row would start one token before it
                raise UserError(f"the {name} dataset's example {number} holds no tokens; leave it out")
            if example.ids.size > max_seq_length:
                raise UserError(f"the {name} dataset's example {number} holds {example.ids.size} tokens, more than "
                                f"data.max_seq_length ({max_seq_length}); cut it (data.text_windows splits a "
                                "document) or raise max_seq_length")
        data.check_token_ids(dataset, vocab_size, name)


def _check_arguments(config, model, tokenizer, datasets) -> None:
    """A research script's mistakes in calling :class:`Trainer`, as one line each."""
    if not isinstance(config, RunConfig):
        raise UserError(f"Trainer and fine_tune take a RunConfig, not {type(config).__name__}; build one with "
                        "RunConfig.from_dict({...})")
    if tokenizer is not None and model is None:  # it would be replaced by the loaded model's
        raise UserError("a tokenizer was passed without its model; pass model= as well, or neither")
    if model is not None and tokenizer is None and datasets is None:
        raise UserError("reading the data files needs the model's tokenizer: pass tokenizer= with model=, "
                        "or datasets= already tokenized")
    given = isinstance(datasets, (tuple, list)) and len(datasets) == 2 and isinstance(datasets[0], data.Dataset) \
        and (datasets[1] is None or isinstance(datasets[1], data.Dataset))
    if datasets is not None and not given:
        raise UserError("datasets= takes a pair (train, valid or None) of mlxft.data.Dataset objects")
    if model is not None and not isinstance(model, nn.Module):
        hint = ("; mlx_lm.load returns (model, tokenizer): pass them as model= and tokenizer="
                if isinstance(model, tuple) else "; to load one by name, set config.model.model instead")
        raise UserError(f"model= takes an MLX model (mlx.nn.Module), not {type(model).__name__}{hint}")
    if tokenizer is not None and not callable(getattr(tokenizer, "encode", None)):
        raise UserError(f"tokenizer= takes the model's tokenizer (with encode), not {type(tokenizer).__name__}")
    if model is not None and tokenizer is None and config.train.exact_match_rows:
        raise UserError("train.exact_match_rows: exact-match generates answers, which needs the model's tokenizer; "
                        "pass tokenizer= or set exact_match_rows to 0")


def _check_model_settings(model, config: RunConfig) -> None:
    """What the model's family or depth refuses of the config, before the model changes (a
    refused run leaves a model the caller passed in as it was)."""
    m = config.model
    if m.recompute_mlp:
        fastmath.check_mlps_to_recompute(model, config.adapter, m.recompute_mlp_layers)
    if m.grad_checkpoint:
        models.first_layers(model, m.checkpoint_layers, "model.checkpoint_layers")
        models.check_keep_mlp(model, m.checkpoint_keep_mlp)
    if config.data.pack:
        packing.check_supported(model)


def _check_unadapted(model) -> None:
    """Refuse a model that holds adapters already: new ones would wrap them (LoRA inside LoRA),
    a layout neither mlxft nor mlx-lm loads."""
    from mlx_lm.tuner.dora import DoRALinear
    from mlx_lm.tuner.lora import LoRALinear

    if any(isinstance(module, (LoRALinear, DoRALinear)) for _, module in model.named_modules()):
        raise UserError("the model holds LoRA layers already (a model an earlier run trained, or one loaded with "
                        "an adapter): load the base again, and start from that adapter with adapter.init_adapter")


def _fingerprint_like(current: str | None, recorded: str | None, model_path) -> str | None:
    """``current`` (the loaded base's fingerprint), in the scheme of the ``recorded`` one: a
    checkpoint from before the per-tensor blocks compares against the files sampled alone."""
    if current is None or not recorded or models.fingerprint_scheme(recorded) == models.fingerprint_scheme(current):
        return current
    return models.weights_fingerprint(model_path, like=recorded)


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]  # "mlx.core.bfloat16" -> "bfloat16"


def dropout_seed(seed: int, epoch: int, micro_batch: int, world: distributed.World) -> int:
    """The random seed a micro-batch's dropout draws from: a function of its position alone, so
    a resumed run draws the same noise; and of the rank, since each rank's share of the rows
    would otherwise repeat the masks of every other rank's."""
    position = [seed, epoch, micro_batch] + ([world.rank] if world.size > 1 else [])
    return int(np.random.SeedSequence(position).generate_state(1)[0])


class Trainer:
    """One training run from a resolved :class:`RunConfig`.

    ``model`` and ``tokenizer`` may be passed in (already loaded, frozen) to skip loading, and
    ``datasets`` as ``(train, valid_or_None)`` :class:`mlxft.data.Dataset` objects built in
    Python (research scripts, benchmarks) instead of JSONL files.
    """

    def __init__(self, config: RunConfig, model=None, tokenizer=None, reporter: Reporter | None = None,
                 world: distributed.World | None = None, datasets: tuple | None = None):
        self.lock: runlock.RunLock | None = None  # rank 0's hold on run_dir (see mlxft.runlock)
        try:
            self._build(config, model, tokenizer, reporter, world, datasets)
        except BaseException:  # a refused run (or Ctrl-C) leaves the directory free at once, not when collected
            self.release()
            raise

    def _build(self, config: RunConfig, model, tokenizer, reporter: Reporter | None, world: distributed.World | None,
               datasets: tuple | None) -> None:
        _check_arguments(config, model, tokenizer, datasets)
        validate(config, model_given=model is not None, data_given=datasets is not None)
        self.config = config
        t = config.train
        if model is None:  # a model given has been evaluated already
            _gpu.cap_for_recomputation(config.model.grad_checkpoint, config.model.recompute_mlp)
        self.world = world or distributed.init(t.backend, t.dist_timeout)
        self.estimate: memory.Estimate | None = None
        self.warned_over_limit = False
        self.warned_generation_over_limit = False
        self.pacing: int | None = None  # the paced limit once set; 0 = not pacing
        if t.batch_size % self.world.size:
            raise UserError(f"config field train.batch_size: {t.batch_size} rows cannot be split evenly over "
                            f"{self.world.size} ranks; use a multiple of {self.world.size}")
        self.run_dir = Path(t.output_dir).expanduser()  # as --model and --init-adapter are
        refusal = None
        if self.world.is_main and self.run_dir.is_dir():
            # Before reading `latest` or changing a model passed in: another process may be
            # training here, and a run killed while swapping a checkpoint may have hidden it.
            try:
                self._hold_run_dir(create=False)
                with self._updating_run_dir():
                    checkpoint.recover_swaps(self.run_dir)
            except UserError as err:
                refusal = err
        if self.world.any(refusal is not None):  # the other ranks read `latest` once rank 0 has put it right
            raise refusal or UserError(f"rank 0 cannot use --output-dir {self.run_dir}; see its message")
        resume_from = checkpoint.resolve_checkpoint(t.resume, self.run_dir) if t.resume else None
        self.resumed_from = resume_from  # where a run stopped before its first checkpoint continues from
        _check_output_outside_checkpoint(self.run_dir, resume_from)
        check_output_dir(self.run_dir, t.overwrite, resume_from, self.world.is_main)
        if datasets is None:
            self.train_file, self.valid_file = data.resolve_files(
                builtin.resolve(config.data.data), config.data.train_file, config.data.valid_file)
            # Recorded as absolute paths too: `--resume CHECKPOINT` takes them from its config.yaml.
            for name in ("data", "train_file", "valid_file"):
                setattr(config.data, name, models.absolute_name(getattr(config.data, name)))
            with self.world.local_work():  # reading a large file may take longer than --dist-timeout
                for path in (self.train_file, self.valid_file):
                    if path is not None:
                        data.check_file(path)
        else:
            self.train_file = datasets[0].path
            self.valid_file = datasets[1].path if datasets[1] is not None else None

        self.base_weights = None  # a model passed in is whatever the caller made it: nothing to fingerprint
        model_path = None
        if model is None:
            with self.world.local_work():  # a download or a large model may take longer than --dist-timeout
                model, tokenizer, model_path, _ = models.load(
                    builtin.resolve(config.model.model), config.model.dtype, config.model.quantize,
                    config.model.quantize_group_size, config.model.revision, config.model.quantize_dtype,
                )
                self.base_weights = models.weights_fingerprint(model_path)
            # A run writes tokenizer files and adapters where it is told, and --overwrite clears
            # it: neither may reach the model or adapter it starts from (a run inside them
            # touches none of their files).
            check_output_apart(self.run_dir, "--output-dir", {"model directory": model_path,
                                                              "starting adapter": config.adapter.init_adapter},
                               inside_is_apart=True)
            # Recorded as absolute paths: resumed, fused or evaluated from any directory.
            config.model.model = models.absolute_name(config.model.model)
        elif config.model.quantize and not models.is_quantized(model):  # its adapter would say QLoRA
            raise UserError(f"config field model.quantize is {config.model.quantize}, but the model passed in is not "
                            "quantized; quantize it first (mlx_lm.utils.quantize_model) or set model.quantize to 0")
        config.adapter.init_adapter = models.absolute_name(config.adapter.init_adapter)
        if getattr(model, models.HEAD_PROBE, None) is None:  # a model passed in, not probed at load
            models.probe_output_head(model)
        self.model, self.tokenizer = model, tokenizer

        load = partial(data.load_dataset, tokenizer=tokenizer, max_seq_length=config.data.max_seq_length,
                       completion_only=config.data.completion_only, prompt_format=config.data.prompt_format,
                       warn=self.world.is_main)
        if datasets is None:
            with self.world.local_work():  # so may tokenizing a large dataset
                self.train_set = load(self.train_file)
                self.valid_set = load(self.valid_file) if self.valid_file else None
                for dataset in (self.train_set, self.valid_set):
                    if dataset is not None:
                        data.check_token_ids(dataset, models.vocab_size(model))
        else:
            self.train_set, self.valid_set = datasets
            _check_given_datasets(self.train_set, self.valid_set, models.vocab_size(model), config.data.max_seq_length)
        scored = self.valid_set if self.valid_set is not None else self.train_set  # what exact-match reads
        if t.exact_match_rows and (scored.path is None or not Path(scored.path).is_file()):  # a dataset built in Python
            raise UserError(f"train.exact_match_rows: exact-match reads prompts and answers from the dataset's JSONL "
                            f"file (Dataset.path), and {scored.path} is none; set exact_match_rows to 0")
        if t.exact_match_rows and scored.kind == "text":
            raise UserError(f"train.exact_match_rows: {scored.path} holds text rows, which have no prompt and answer "
                            "to score; set --exact-match-rows 0")

        batches_per_epoch = math.ceil(len(self.train_set) / t.batch_size)
        self.steps_per_epoch = math.ceil(batches_per_epoch / t.grad_accum_steps)
        self.total_steps = t.max_steps or t.epochs * self.steps_per_epoch
        saved, forced = None, []
        if resume_from:
            with self.world.local_work():
                saved = checkpoint.load_checkpoint(resume_from)
            forced = checkpoint.check_resume(saved["config"], config.to_dict(), saved["state"].get("task"),
                                             self.train_set.kind, t.force, saved["state"].get("train_data"),
                                             self.train_set.fingerprint, saved["state"].get("compute_dtype"),
                                             _dtype_name(models.compute_dtype(model)),
                                             saved["state"].get("base_weights"),
                                             _fingerprint_like(self.base_weights, saved["state"].get("base_weights"),
                                                               model_path))
            if saved["state"]["step"] > self.total_steps:  # it would train nothing and save over `final`
                raise UserError(f"--resume {t.resume}: the checkpoint is at step {saved['state']['step']}, past this "
                                f"run's {self.total_steps} steps; raise --max-steps or --epochs to train further")
            if saved["state"]["step"] == self.total_steps and _finished_in(self.run_dir, resume_from, saved["state"]):
                # Nothing to train: it would only score and record the finished run a second time.
                raise UserError(f"--resume {t.resume}: the run finished at step {self.total_steps}, its last; raise "
                                "--max-steps or --epochs to train further")
        replacing = t.overwrite and self.world.is_main and self.run_dir.is_dir() and not continues_in(self.run_dir,
                                                                                                        resume_from)
        impostor = checkpoint.first_impostor_in(self.run_dir, self.total_steps) if replacing else None
        if impostor:  # --overwrite removes an earlier run's checkpoints only; the save would replace this
            raise UserError(f"output directory {self.run_dir} holds {impostor}, which no mlxft run wrote and which "
                            "this run would replace; move it away or choose another --output-dir")

        # The model changes only once the data (and the checkpoint resumed) have passed their
        # checks: a refused run leaves a model the caller passed in as it was.
        _check_unadapted(model)
        _check_model_settings(model, config)
        recorded = _recorded_targets(saved, resume_from)  # what the checkpoint adapts, however "default" reads now
        if config.adapter.finetune != "full":
            lora.check(model, config.adapter, recorded)
        if self.world.is_main:
            _check_creatable(self.run_dir)
        model.freeze()  # mlx_lm.load's is not: unfrozen, "LoRA" would train every weight
        # Resuming, the checkpoint's weights replace the starting adapter's (its layout is checked).
        if config.adapter.init_adapter and saved is None:
            from mlxft.adapters import start_from

            base = (model_path, config.model.model) if model_path is not None and self.world.is_main else None
            self.targets = start_from(model, config.adapter, config.adapter.init_adapter, t.seed, base)
        else:
            self.targets = lora.apply(model, config.adapter, t.seed, recorded)
        if config.data.pack:
            packing.enable(model)
        fastmath.enable(model, config.model.recompute_mlp, config.model.recompute_mlp_layers)
        normed.enable(model)
        if config.model.grad_checkpoint:
            models.checkpoint_layers(model, config.model.checkpoint_layers, config.model.checkpoint_keep_mlp)
        self.world.heartbeat()

        self.optimizer = build_optimizer(config.optim, self.total_steps)
        self.scaler = LossScaler(enabled=models.compute_dtype(model) == mx.float16)
        # Position in the data and the open accumulation window: what exact resume needs.
        self.step_count = self.epoch = self.batch_index = 0
        self.window = None
        self.window_real_tokens = 0
        self.window_queued_at: float | None = None  # when the open accumulation window's first micro-batch was queued
        self.pending: list[_QueuedStep] = []  # optimizer steps queued but not read yet
        self.last_done: _QueuedStep | None = None  # the last optimizer step read
        self.in_flight = None  # the last queued micro-batch's output, waited for after the next is queued
        self.skipped_steps = self.nonfinite_streak = 0
        self.best_val_loss: float | None = None
        self.last_val_loss: float | None = None
        self.last_val_step: int | None = None  # the step of the last validation that ran to its end
        self.exact_match_baseline = False  # whether this run's metrics.jsonl holds its before-training exact-match
        self.finished = False  # every step trained and validated, no stop: what `final` and the run files say
        self.stop = StopRequests()
        self.saved_step: int | None = None  # the step of this process's last checkpoint
        # Marks this run's checkpoints, so pruning never deletes another run's (or a user's) directories.
        self.run_id = uuid.uuid4().hex
        self.tokenizer_saved = False
        if saved is not None:
            self._restore(resume_from, saved)
            if not continues_in(self.run_dir, resume_from) and self.step_count == 0 and self.batch_index == 0:
                self.last_val_step = None  # a new directory's metrics.jsonl holds no baseline yet
                self.exact_match_baseline = False
        self.step = build_step(model, self.optimizer, partial(loss_fn, label_smoothing=config.optim.label_smoothing,
                                                                  chunk=config.model.loss_chunk, training=True),
                               config.optim.max_grad_norm, reduce=self.world.all_sum if self.world.size > 1 else None)
        self.layout = self.step.layout
        if self.window is not None:  # restored per parameter; the step may hold it as one vector
            grads, loss_sum, tokens = self.window
            self.window = (gradient_window(grads, self.layout), loss_sum, tokens)
        dropped, left = 0, None  # metrics.jsonl records of steps this resumed run trains again; what latest named
        if self.world.is_main:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as err:  # permissions, a read-only disk, a parent that is a file
                raise UserError(f"cannot create --output-dir {self.run_dir}: {err.strerror or err}; choose "
                                "a directory you can write to") from err
            self._hold_run_dir()  # a directory this run created, unless another process just did
            # Another run may have started and finished here while this one loaded its model:
            # the check above saw a directory that no longer looks as it did.
            check_output_dir(self.run_dir, t.overwrite, resume_from)
            with self._updating_run_dir():
                checkpoint.remove_partial_saves(self.run_dir)  # a killed run's; this run's saves start clean
                if continues_in(self.run_dir, resume_from):
                    left = checkpoint.rewind_latest(self.run_dir, resume_from)  # before its steps' metrics go
                    dropped = checkpoint.drop_metrics_after(self.run_dir, self.step_count)
                else:  # a new run here, though it may start from another run's checkpoint
                    if t.overwrite:  # the old run's checkpoints and `latest` would pass for this run's
                        checkpoint.remove_checkpoints(self.run_dir, spare=resume_from)
                    checkpoint.write_text(self.run_dir / checkpoint.METRICS_FILE, "")
        self.reporter = reporter or Reporter(self.run_dir, self.total_steps, enabled=self.world.is_main)
        self.reporter.on_stream_lost = self._output_lost
        if saved is not None:
            self.reporter.restore_unlogged(saved["state"].get("unlogged"))
        # The run's limits hold while it estimates and trains, and no longer (see memory.Limits).
        with self._run_limits():
            self._describe()
        if resume_from:
            self.reporter.info(f"resumed from {resume_from} at step {self.step_count} (epoch {self.epoch + 1}, "
                               f"micro-batch {self.batch_index})" + (f"; forced: {'; '.join(forced)}" if forced else ""))
        if left is not None:
            self.reporter.info(f"{checkpoint.LATEST} now names {resume_from.name} (it named {left.name}, which stays "
                               "on disk unless this run saves a checkpoint of that name)")
        if dropped:
            self.reporter.info(f"{checkpoint.METRICS_FILE}: removed {dropped} records of steps after {self.step_count}, "
                               "which this run trains again")

    def _describe(self) -> None:
        trainable, total = models.count_parameters(self.model)
        info = self.reporter.info
        if _blas.uses_reference_blas():
            info(f"warning: {_blas.hint()}")
        info(f"device: {memory.device_description()} | model: {self.config.model.model} ({models.family(self.model)}) | "
             f"{self.config.adapter.finetune} on {', '.join(self.targets)}")
        info(f"trainable parameters: {trainable:,} / {total:,} ({100 * trainable / max(total, 1):.3f}%)")
        info(f"data: {len(self.train_set)} train rows ({self.train_set.kind}, {self.train_set.supervised_tokens:,} supervised tokens)"
             + (f", {len(self.valid_set)} valid rows" if self.valid_set else ", no validation set")
             + f" | {self.total_steps} steps"
             + (f" | {self.world.size} data-parallel ranks" if self.world.size > 1 else ""))
        info(f"memory: {self.memory_settings}")
        notes = inert_settings(self.config)
        if self.config.model.loss_chunk and models.output_head(self.model) is None:
            notes.append(f"model.loss_chunk {self.config.model.loss_chunk} does nothing for this model: "
                         f"{models.family(self.model)} computes its logits at every position itself")
        for note in notes:
            info(f"warning: {note}")
        if self.config.train.memory_estimate:
            try:
                self.estimate = self.estimate_memory()
            except (AttributeError, TypeError, ValueError) as err:  # an architecture the probes do not fit
                info(f"no memory estimate for this model ({type(err).__name__}: {first_line(err)})"
                     + ("; --fit-memory, which fits the run by it, does nothing" if self.config.model.fit_memory else ""))
                return
            limit = mx.get_memory_limit()
            info(f"estimated peak memory: {self.estimate.describe()}")
            if self.estimate.total > limit and self.config.model.fit_memory:
                self._fit_memory(limit)
            if self.estimate.total > limit:
                info(f"warning: the estimate exceeds the memory limit of {limit / memory.GB:.2f} GB; "
                     + self._advice(limit))

    def _fit_memory(self, limit: float) -> None:
        """Recompute the MLPs' gate and up projections in, or else the whole of, the fewest first
        layers that bring the estimate under ``limit`` (every layer when none does), as the advice
        would put first, and as the run's config then says (``--fit-memory``)."""
        m, layers = self.config.model, len(self.estimate.recompute_savings)
        mlps = memory.prefers_mlp_recomputation(self.config, self.estimate, limit)
        fewest = memory.mlp_layers_to_fit if mlps else memory.layers_to_fit
        first = fewest(self.config, self.estimate, limit)
        # The fewest layers can price within the probes' noise of the limit: where the fitted
        # run's own estimate still passes it, that estimate prices the next ones.
        while first is not None:
            count = 0 if first >= layers else first
            if mlps:
                if not fastmath.recompute_mlps(self.model, count):
                    return
                m.recompute_mlp, m.recompute_mlp_layers = True, count
                what = (f"the MLPs' gate and up projections in the first {first} of {layers} layers "
                        f"(--recompute-mlp --recompute-mlp-layers {count})")
            else:
                models.checkpoint_layers(self.model, count)
                m.grad_checkpoint, m.checkpoint_layers = True, count
                what = f"the first {first} of {layers} layers (--grad-checkpoint --checkpoint-layers {count})"
            self.estimate = self.estimate_memory()
            self.reporter.info(f"fit memory: recomputing {what}; estimated peak memory: {self.estimate.describe()}")
            if self.estimate.total <= limit or not count:
                return
            first = fewest(self.config, self.estimate, limit)

    def _largest_micro_batch(self) -> tuple[int, int, int]:
        """Rows, padded length and (padded) supervised positions of the largest micro-batch a
        rank can get: its longest row's, and its rows with the most supervised tokens."""
        c, examples = self.config, self.train_set.examples
        per_rank = self._rows(self.train_set)
        length = data.round_up(max(len(e.ids) for e in examples) - 1, c.data.length_bucket)
        supervised = sorted((int(e.mask[1:].sum()) for e in examples), reverse=True)[:per_rank]
        return per_rank, length, data.padded_supervised_count(sum(supervised), per_rank * length,
                                                              c.data.length_bucket)

    def estimate_memory(self) -> memory.Estimate:
        """Peak memory of this run's largest micro-batch (see :func:`mlxft.memory.estimate`)."""
        c = self.config
        per_rank, length, padded = self._largest_micro_batch()
        targets = mx.zeros((padded,), mx.int32)
        weights = mx.ones(targets.shape)

        def loss_of_hidden(hidden):
            if models.output_head(self.model) is None:
                # The model's own logits: every position's, in its dtype, then the supervised rows read off them.
                whole = mx.zeros((per_rank * length, self.model.args.vocab_size), models.compute_dtype(self.model))
                logits = (whole + hidden.sum().astype(whole.dtype))[:hidden.shape[0]]
                return cross_entropy(logits, targets, weights, c.optim.label_smoothing)[0]
            return hidden_loss(self.model, hidden, targets, weights, c.optim.label_smoothing, c.model.loss_chunk,
                               training=True)[0]

        # A --memory-limit paces as well (MLX waits for queued work past any limit), so the
        # paced estimate is what has to fit under one.
        may_pace = c.train.pace_memory and memory.may_pace_here()
        with self.world.local_work():  # its probes compile and run steps on this rank alone
            estimate = memory.estimate(self.model, per_rank, length, targets.size, self.optimizer.state,
                                       c.train.grad_accum_steps > 1, c.data.pack, loss_of_hidden, may_pace)
        mx.reset_peak_memory()
        if memory.can_pace(estimate):  # never where may_pace is false: no paced probe, no queue
            estimate = estimate.pace()
        return estimate

    def batch(self, dataset: data.Dataset, indices) -> data.Batch:
        """This rank's share of the global batch ``indices``, padded to its fixed row count."""
        rows = [dataset.examples[i] for i in self.world.shard(indices)]
        return data.make_batch(rows, self._rows(dataset), self.config.data.length_bucket, pack=self.config.data.pack)

    def _rows(self, dataset: data.Dataset) -> int:
        """The rows of each of this rank's micro-batches of ``dataset``: its share of the batch
        size, or of the whole dataset where that is smaller (a small validation set), which all
        padding rows would only slow down (64 rows for 4 took 10 times as long)."""
        per_rank = self.config.train.batch_size // self.world.size
        return max(1, min(per_rank, -(-len(dataset.examples) // self.world.size)))

    @contextlib.contextmanager
    def _run_limits(self):
        """MLX's limits set as the run asks (``--memory-limit``, ``--cache-limit``) for the
        block, and those it had put back after it, however it ends."""
        before = memory.Limits.now()
        self.memory_settings = memory.configure(self.config.train.memory_limit, self.config.train.cache_limit)
        self.memory_limit = mx.get_memory_limit()  # the run's own; pacing lowers MLX's below it
        try:
            yield
        finally:
            self.pacing = None
            before.restore()

    def train(self) -> TrainResult:
        """Train to the last step; raises :class:`TrainingStopped` after an emergency save. The
        model is left in the mode (training or evaluation) it was in, and the output directory
        free for another process."""
        was_training = self.model.training
        self._hold_run_dir()
        self.model.train()  # mlx_lm.load leaves a model in evaluation mode, with its dropouts off
        try:
            if self.world.is_main:
                checkpoint.check_links(self.run_dir)
                self._check_run_dir_still_ours()
            with self._run_limits():
                return self._train_reporting_failures()
        finally:
            self.model.train(was_training)
            self.release()
            # The request that stopped this call is spent: another train() trains on, and its
            # first signal asks for a save again instead of exiting at once.
            self.stop = StopRequests()

    def _check_run_dir_still_ours(self) -> None:
        """Refuse to train into a directory where another Trainer of this process (which shares
        the lock) has saved a run since this one was built: the two had interleaved their
        metrics and the second replaced the first's checkpoints."""
        latest = self.run_dir / checkpoint.LATEST
        other = checkpoint.run_id_of(latest.resolve()) if latest.is_symlink() else None
        if other is not None and other != self.run_id:
            raise UserError(f"output directory {self.run_dir} now holds another run, saved there after this Trainer "
                            "was built; build it again (with overwrite to replace that run) or choose another "
                            "output_dir")

    def _hold_run_dir(self, create: bool = True) -> None:
        """Rank 0 locks the output directory against other processes (see :mod:`mlxft.runlock`)."""
        if self.world.is_main and self.lock is None:
            self.lock = runlock.acquire(self.run_dir, create)
            if self.lock is not None:  # a Trainer dropped without training lets the directory go
                weakref.finalize(self, self.lock.release)

    @contextlib.contextmanager
    def _updating_run_dir(self):
        """An OSError while changing the output directory (a read-only or full disk) as one line."""
        try:
            yield
        except OSError as err:
            raise UserError(f"cannot update {self.run_dir}: {err.strerror or err}; {checkpoint.write_advice(err)}") from err

    def release(self) -> None:
        """Let other processes train into the output directory; :meth:`train` takes it again."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _train_reporting_failures(self) -> TrainResult:
        try:
            return self._train()
        except RuntimeError as err:
            if memory.is_out_of_memory(err):
                latest = self.run_dir / checkpoint.LATEST
                resume = latest if latest.exists() else self.resumed_from
                advice = self._advice(self.memory_limit, resume=resume)
                if resume is None:
                    advice += " (no checkpoint was saved: the run starts again)"
                raise TrainingStopped(f"out of memory at step {self.step_count + 1} ({first_line(err)}); {advice}",
                                      1, None) from err
            if self.world.size == 1:
                raise
            raise distributed.PeerLost(f"rank {self.world.rank}: {first_line(err)}; another rank failed "
                                       "or became unreachable (see its output)") from err

    def _train(self) -> TrainResult:
        t = self.config.train
        if self.pacing is None:
            self._pace_memory(first=True)
        self._bound_cache()
        # A resumed run's weights are partly trained: its baselines are the step-0 records it has.
        fresh = self.step_count == 0 and self.batch_index == 0
        if self.valid_set is not None and fresh and self.last_val_step is None:
            self._evaluate()  # the baseline the validation curve starts from (once: a run stopped at step 0 has it)
        before = None
        if t.exact_match_rows and fresh and not self.exact_match_baseline:  # once, as the validation baseline
            before = self._exact_match("before training")
            self.exact_match_baseline = True
        self.reporter.start_clock()  # the first logged window times training, not what came before it
        self._compile_first_step()
        with self.stop:
            with self.stop.taking_saves():  # the loop only: the final save holds the last step anyway
                self._train_steps()
            self._drain()
            # Unless the last step's own validation ran: not where a stop cut it short, nor in a
            # resumed run whose checkpoint was saved at the last step before it.
            if self.valid_set is not None and self.last_val_step != self.step_count:
                self._evaluate()
            stopped = self.world.any(self.stop.requested)  # agreed first: no rank waits in it while rank 0 saves
            self.finished = not stopped  # resuming its `final` would have nothing left to do (_finished_in)
            path = self.save_checkpoint("final", run_files=True)
            if stopped or self.stop.requested:
                self.stop.signum = self.stop.signum or signal.SIGTERM  # a peer's request
                raise TrainingStopped(f"stopped by {self.stop.name} after the last step ({self.step_count}); saved {path}",
                                      128 + self.stop.signum, path, joint=True)
        result = TrainResult(self.run_dir, self.step_count, self.reporter.last_train_loss, self.last_val_loss,
                             self.skipped_steps, main_process=self.world.is_main)
        if t.exact_match_rows:
            try:  # the run is saved: a stop request here only gives up the score, with a message and its code
                with self.stop, self.stop.interrupting():
                    after = self._exact_match("after training")
            except Interrupted:
                raise TrainingStopped(f"stopped by {self.stop.name} during the exact-match after training, whose "
                                      f"score is not recorded; the trained run is complete in {path}",
                                      128 + self.stop.signum, path) from None
            result.exact_match_after = after[0]
            if before is not None:
                self._show_answers(before, after)
                result.exact_match_before = before[0]
        return result

    def _train_steps(self) -> None:
        """The optimizer steps left, micro-batch by micro-batch; a stop request ends them with an
        emergency checkpoint (:class:`TrainingStopped`), a save request takes a checkpoint on the way."""
        t = self.config.train
        self._say_how_to_save()
        while self.step_count < self.total_steps:
            batches = data.epoch_batches(self.train_set.lengths, t.batch_size, t.seed, self.epoch)
            while self.batch_index < len(batches) and self.step_count < self.total_steps:
                # Every rank stops at the same micro-batch. With several ranks only between
                # windows: an open window holds each rank's own partial gradients.
                if self.window is None or self.world.size == 1:
                    stop, save = self.world.any_each(self.stop.requested,
                                                     self.stop.save_requested and self._between_steps())
                    if stop:
                        self._stop_with_checkpoint()
                    if save:
                        self._save_on_request()
                self._micro_step(batches)
            if self.batch_index >= len(batches):
                self.epoch, self.batch_index = self.epoch + 1, 0

    def _stop_with_checkpoint(self) -> None:
        """Save an emergency checkpoint where a stop request found the loop, and raise :class:`TrainingStopped`."""
        self._drain()
        if self.reporter.unlogged_steps and self.last_done is not None:
            # The resumed run starts after them: their window is logged now or never.
            self._log_step(self.last_done, force=True)
        self.stop.signum = self.stop.signum or signal.SIGTERM  # a peer's request
        path = self.save_checkpoint("emergency")
        raise TrainingStopped(f"stopped by {self.stop.name} at step {self.step_count}; saved {path}; "
                              f"continue with --resume {self.run_dir / checkpoint.LATEST}",
                              128 + self.stop.signum, path, joint=True)

    def _between_steps(self) -> bool:
        """Whether the next micro-batch opens an optimizer step after at least one has run: where
        a requested checkpoint is taken, so it holds whole steps and no partial window."""
        return self.window is None and self.step_count > 0

    def _say_how_to_save(self) -> None:
        if signals.SAVE_SIGNAL is not None and self.stop.handles_signals and self.world.is_main:
            self.reporter.info(f"pid {os.getpid()}: kill -USR1 {os.getpid()} saves a checkpoint after the current "
                               "step and trains on; Ctrl-C saves one and stops")

    def _save_on_request(self) -> None:
        """A checkpoint asked for by SIGUSR1 (or :meth:`request_checkpoint`), after the step just run."""
        self.stop.save_requested = False
        self._drain()
        if self.saved_step == self.step_count:  # the queued step's own save_every, or a request just before
            self.reporter.info(f"checkpoint at step {self.step_count} is saved already")
            return
        tic = time.perf_counter()
        self.save_checkpoint("step", run_files=True)
        self.reporter.pause_clock(time.perf_counter() - tic)

    def request_checkpoint(self) -> None:
        """Ask a training run (from another thread, or a callback) for a checkpoint after the
        current optimizer step, as ``kill -USR1`` does; training goes on."""
        self.stop.request_save()

    def _output_lost(self, err: BaseException) -> None:
        """The progress stream went away (``| head``, a closed terminal): stop at the next
        micro-batch with a checkpoint, as SIGPIPE would stop a program that had not saved, rather
        than train on unwatched. Once every step is done there is nothing left to stop."""
        if self.step_count < self.total_steps and not self.stop.requested:
            self.stop.request(signal.SIGPIPE, "a closed standard output")
            print_error(f"warning: the progress output failed ({first_line(err)}); stopping at the next step "
                        "with a checkpoint")

    def _compile_first_step(self) -> None:
        """With several ranks, build the first micro-batch's kernels as local work. The first
        step would build them on its way to the gradient sum, where a peer waits on this rank
        with its watchdog running: a slow compile (a fresh kernel cache, a busy machine) would
        count against --dist-timeout as if this rank were lost."""
        if self.world.size == 1 or self.step_count >= self.total_steps:
            return
        t = self.config.train
        batches = data.epoch_batches(self.train_set.lengths, t.batch_size, t.seed, self.epoch)
        if self.batch_index >= len(batches):
            return
        with self.world.local_work():
            self.step.compile_kernels(self.batch(self.train_set, batches[self.batch_index]).arrays(),
                                      self.scaler.array)

    def _micro_step(self, batches) -> None:
        """Queue one micro-batch; the last of its window (or of the epoch) applies the update.

        The device runs a step while the host builds the next (the step is host-bound on small
        models and short rows): a micro-batch is queued before the previous one's results are
        read. An optimizer step that evaluates, saves, ends the run or sets the next step's
        loss scale is finished before anything else is queued (see :meth:`_may_run_ahead`).
        """
        accum, i = self.config.train.grad_accum_steps, self.batch_index
        update = (i + 1) % accum == 0 or i == len(batches) - 1
        self.window_queued_at = self.window_queued_at or time.perf_counter()
        batch = self.batch(self.train_set, batches[i])
        # Dropout noise is a function of the position alone, so a resumed run draws the same.
        mx.random.seed(dropout_seed(self.config.train.seed, self.epoch, i, self.world))
        result, self.window = self.step(batch.arrays(), self.window, update, self.scaler.array)
        mx.async_eval(self.step.state, result.loss_sum, result.tokens, self.window)
        if self.in_flight is not None:
            mx.eval(self.in_flight)  # at most two micro-batches queued
        self.in_flight = result.tokens
        self.world.heartbeat()
        self.batch_index += 1
        self.window_real_tokens += batch.real_tokens
        ready, self.pending = self.pending, []
        if update:
            self.step_count += 1
            done = _QueuedStep(self.step_count, self.epoch, result, self.window_real_tokens,
                               self.optimizer.state["learning_rate"], self.window_queued_at)
            self.window_real_tokens, self.window_queued_at = 0, None
            (self.pending if self._may_run_ahead(self.step_count) else ready).append(done)
        self._finish(ready)

    def _may_run_ahead(self, step: int) -> bool:
        """Whether the next micro-batch may be queued before optimizer step ``step`` is read."""
        return not (self.scaler.enabled or self._evaluates_after(step) or self._saves_after(step)
                    or step >= self.total_steps)

    def _evaluates_after(self, step: int) -> bool:
        t = self.config.train
        return self.valid_set is not None and bool(t.eval_every) and step % t.eval_every == 0

    def _saves_after(self, step: int) -> bool:
        t = self.config.train
        return bool(t.save_every) and step % t.save_every == 0 and step < self.total_steps

    def _drain(self) -> None:
        """Finish every queued optimizer step (before saving or leaving the loop)."""
        steps, self.pending = self.pending, []
        self._finish(steps)

    def _finish(self, steps: list[_QueuedStep]) -> None:
        for n, done in enumerate(steps):
            self._account(done)
            limit = self.config.optim.max_nonfinite_steps
            if limit and self.nonfinite_streak >= limit:
                streak = self.nonfinite_streak
                stopped = [done, *steps[n + 1:], *self.pending]  # queued behind it: the checkpoint holds them
                for k, step in enumerate(stopped):
                    if k:
                        self._account(step)
                    # The resumed run starts after them, so they are logged now or never; the
                    # last closes the log's window whatever the cadence. Each one's time ends
                    # where the next began to be queued (else a queued step's rate spanned only
                    # the moment between two log lines).
                    last = k == len(stopped) - 1
                    self._log_step(step, None if last else stopped[k + 1].queued_at, force=last)
                self.pending = []
                if self.world.size > 1 and self.window is not None:
                    # The next window's first micro-batch was queued before this step was read,
                    # and each rank holds its own share of it: the checkpoint holds their sum,
                    # as a one-process run's would (on resume rank 0 alone restores it).
                    self.window = self.world.all_sum(self.window)
                    mx.eval(self.window)  # on every rank now: rank 0 alone evaluates it when it saves
                    self.window_real_tokens = int(self.world.all_sum(mx.array(self.window_real_tokens)).item())
                path = self.save_checkpoint("emergency")
                floor = " at the loss scale's floor of 1" if self.scaler.enabled else ""
                raise TrainingStopped(
                    f"gradients were not finite for {streak} steps in a row{floor} (step {done.step}); saved {path}. "
                    "Lower --learning-rate, set --max-grad-norm, or check the data, then --resume "
                    f"{self.run_dir / checkpoint.LATEST}", 1, path, joint=True)
            later = steps[n + 1:] + self.pending
            self._after_step(done, later[0].queued_at if later else self.window_queued_at)

    def _account(self, done: _QueuedStep) -> None:
        """Read one optimizer step's results: loss, tokens, whether it applied."""
        result = done.result
        applied = bool(result.applied.item())
        empty = int(result.tokens.item()) == 0  # skipped for want of data, not for overflow
        # The scale this step ran at: a float16 step is read before the next is queued.
        ran_at = self.scaler.scale
        if not empty:
            self.scaler.update(applied)
        real_tokens = done.real_tokens
        if self.world.size > 1:  # loss and supervised tokens come back global from the step
            real_tokens = int(self.world.all_sum(mx.array(real_tokens)).item())
        self.reporter.step(done.step, result.loss_sum.item(), int(result.tokens.item()), real_tokens)
        memory.release_cache(self.config.train.clear_cache_above)
        self._pace_memory()
        self._check_memory_limit()
        if empty:
            self.skipped_steps += 1
            self.reporter.info(f"step {done.step}: no supervised token in this step's rows; update skipped")
        elif not applied:
            self.skipped_steps += 1
            # An overflow above the scale's floor is the scaler's business (it halves the
            # scale); only steps that fail at the floor count towards --max-nonfinite-steps.
            self.nonfinite_streak += ran_at <= 1.0
            self.reporter.info(f"step {done.step}: gradient norm is not finite; update skipped"
                               + (f" (loss scale now {self.scaler.scale:g})" if self.scaler.enabled else ""))
        else:
            self.nonfinite_streak = 0

    def _pace_memory(self, first: bool = False) -> None:
        """Pace evaluation from the first step (``first``: see :func:`mlxft.memory.pacing_limit`),
        and raise the limit whenever the run has needed more than it: a step that cannot fit
        waits on every operation, so it passes the limit by more than the one allocation a
        paced step may."""
        pacing = (self.estimate is not None and self.estimate.paced) if first else self.pacing
        if not pacing:
            return
        peak = mx.get_peak_memory()
        if first:
            limit = memory.pacing_limit(self.estimate)
        elif peak > 1.05 * self.pacing:
            limit = int(1.05 * peak)
        else:
            return
        if limit >= self.memory_limit:
            if self.pacing:
                mx.set_memory_limit(self.memory_limit)
            self.pacing = 0
            return
        self.pacing = limit
        mx.set_memory_limit(limit)
        self.reporter.info(f"memory: pacing evaluation at {limit / memory.GB:.2f} GB"
                           + ("" if first else f" (the run has needed {peak / memory.GB:.2f} GB)")
                           + "; --no-pace-memory turns it off")

    def _bound_cache(self) -> None:
        """Keep MLX's allocator cache under a quarter more than the run's estimated peak (the
        estimate's tolerance, so the largest step's buffers fit) where ``--cache-limit`` is unset
        and MLX's own limit is higher (see :func:`mlxft.memory.bound_cache`)."""
        if self.config.train.cache_limit != -1 or self.estimate is None:
            return
        limit = int(memory.CACHE_OVER_ESTIMATE * self.estimate.total)
        if memory.bound_cache(limit) is not None:  # the limit it replaced comes back with the run's (_run_limits)
            self.reporter.info(f"memory: allocator cache kept under {limit / memory.GB:.2f} GB (the estimated peak "
                               "and a quarter); --cache-limit sets another")

    def _advice(self, limit: float, resume: Path | None = None) -> str:
        # A trained head's loss, unless chunked, scores the micro-batch's positions at once.
        trained_head = models.output_head(self.model) is not None and frozen_head(self.model) is None
        scored_at_once = self._largest_micro_batch()[2] if trained_head and not self.config.model.loss_chunk else 0
        return memory.advice(self.config, self.estimate, limit, ranks=self.world.size,
                             quantized=models.is_quantized(self.model), longest=int(max(self.train_set.lengths)),
                             resume=None if resume is None else str(resume), scored_at_once=scored_at_once)

    def _check_memory_limit(self) -> None:
        peak, limit = mx.get_peak_memory(), self.memory_limit
        # Under a limit MLX waits for queued work once past it, so a peak a little over is expected.
        if peak > 1.1 * limit and not self.warned_over_limit:
            self.warned_over_limit = True
            self.reporter.info(f"warning: peak memory {peak / memory.GB:.2f} GB passed the memory limit of "
                               f"{limit / memory.GB:.2f} GB, so MLX waits for memory and may swap; "
                               + self._advice(limit))

    def _exact_match(self, when: str):
        """Exact-match of greedy answers on the first validation rows (the training rows if none)."""
        source = self.valid_file or self.train_file
        pairs = generation.qa_pairs(source, self.config.train.exact_match_rows)
        # Generation has a peak of its own (a batch of KV caches), which the training steps'
        # records and the memory warning must not take for training's: measured apart.
        mx.reset_peak_memory()
        with self.world.local_work():  # every rank generates; it takes as long as it takes
            score, answers = generation.exact_match(self.model, self.tokenizer, pairs, self.config.data.prompt_format)
        peak = mx.get_peak_memory()
        mx.reset_peak_memory()
        self.reporter.exact_match(self.step_count, score, len(answers), when, peak / memory.GB,
                                  held_out=self.valid_file is not None)
        if peak > 1.1 * self.memory_limit and not self.warned_generation_over_limit:
            self.warned_generation_over_limit = True
            self.reporter.info(f"warning: exact-match generation peaked at {peak / memory.GB:.2f} GB, past the "
                               f"memory limit of {self.memory_limit / memory.GB:.2f} GB; --exact-match-rows 0 "
                               f"skips it (now {self.config.train.exact_match_rows})")
        return score, answers

    def _show_answers(self, before, after, count: int = 3) -> None:
        for old, new in list(zip(before[1], after[1]))[:count]:
            self.reporter.info(f"Q: {old.prompt}\n  reference: {old.reference}\n  before: {old.generated!r}\n  after:  {new.generated!r}")

    def _log_step(self, done: _QueuedStep, next_queued_at: float | None = None, force: bool = False) -> None:
        k = done.step
        if force or k % self.config.train.log_every == 0 or k == self.total_steps:
            self.reporter.train(k, done.epoch + 1, float(done.learning_rate.item()), self.skipped_steps, next_queued_at)

    def _after_step(self, done: _QueuedStep, next_queued_at: float | None = None) -> None:
        k = done.step
        self.last_done = done
        self._log_step(done, next_queued_at)
        if self._evaluates_after(k):
            self._evaluate()
        if self._saves_after(k):
            tic = time.perf_counter()
            self.save_checkpoint("step", run_files=True)
            self.reporter.pause_clock(time.perf_counter() - tic)

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.learning_rate.item())

    def evaluate(self, dataset: data.Dataset | None = None) -> tuple[float, int]:
        """Token-weighted mean loss over a dataset (the validation set by default)."""
        dataset = dataset if dataset is not None else self.valid_set
        if dataset is None:
            raise UserError("evaluate: this run has no validation set; pass a dataset")
        if not isinstance(dataset, data.Dataset):
            raise UserError(f"evaluate takes an mlxft.data.Dataset, not {type(dataset).__name__}")
        if dataset is not self.valid_set and dataset is not self.train_set:  # those were checked once
            # A loss over no token, ids past the vocabulary, rows past max_seq_length.
            _check_given_datasets(None, dataset, models.vocab_size(self.model), self.config.data.max_seq_length)
        t = self.config.train
        was_training = self.model.training
        self.model.eval()
        loss_sum, tokens = mx.array(0.0), mx.array(0.0)
        # Up to the sum, each rank works on its own share: however long a batch takes (the first
        # builds the loss's kernels), it is no sign of a lost peer.
        with self.world.local_work():
            for indices in data.epoch_batches(dataset.lengths, t.batch_size, 0, 0, shuffle=False,
                                              max_batches=t.max_eval_batches):
                loss, ntokens = evaluation_loss(self.model, *self.batch(dataset, indices).arrays(),
                                                chunk=self.config.model.loss_chunk)
                loss_sum, tokens = loss_sum + loss * ntokens, tokens + ntokens
                mx.eval(loss_sum, tokens)
        loss_sum, tokens = self.world.all_sum((loss_sum, tokens))
        self.model.train(was_training)
        return loss_sum.item() / max(tokens.item(), 1), int(tokens.item())

    def _evaluate(self) -> None:
        tic = time.perf_counter()
        # A stop request cuts the last validation short: only the save is left, which matters more.
        # Not with several ranks, which sum their losses at the end and so must finish together.
        try:
            with self.stop.interrupting(self.step_count >= self.total_steps and self.world.size == 1):
                loss, tokens = self.evaluate()
        except Interrupted:
            self.model.train()
            self.reporter.info(f"{self.stop.name}: skipped the rest of the final validation to save the run")
            return
        self.last_val_loss, self.last_val_step = loss, self.step_count
        if self.best_val_loss is None or loss < self.best_val_loss:
            self.best_val_loss = loss
        self.reporter.eval(self.step_count, loss, tokens)
        self.reporter.pause_clock(time.perf_counter() - tic)

    def adapter_metadata(self) -> dict[str, str]:
        a = self.config.adapter
        layers = len(lora.selected_layers(self.model, a.num_layers))
        m = self.config.model
        # The dtype it was quantized in, resolved: "auto" would resolve on the machine loading it.
        dtype = m.quantize_dtype or next(name for name, d in models.DTYPES.items() if d == models.resolve_dtype(m.dtype))
        quantized = {"bits": m.quantize, "group_size": m.quantize_group_size, "dtype": dtype} if m.quantize else None
        return checkpoint.adapter_metadata(a.finetune, a.rank, a.alpha, a.dropout, self.targets, layers,
                                           models.family(self.model), m.model, quantized, m.revision,
                                           self.base_weights or "")

    def training_state(self) -> dict:
        c = self.config
        return {
            "step": self.step_count,
            "epoch": self.epoch,
            "total_steps": self.total_steps,
            "finished": self.finished,
            "best_val_loss": self.best_val_loss,
            "learning_rate": self.learning_rate,
            "batch_size": c.train.batch_size,
            "grad_accum_steps": c.train.grad_accum_steps,
            "max_seq_length": c.data.max_seq_length,
            "train_modules": {"finetune": c.adapter.finetune, "targets": self.targets},
            "task": self.train_set.kind,
            "model": c.model.model,
            "dataset": models.absolute_name(str(self.train_file)),  # as config.yaml records it
            "train_data": self.train_set.fingerprint,
            "seed": c.train.seed,
            "skipped_steps": self.skipped_steps,
        }

    def resume_state(self) -> dict:
        """The training state plus the exact position: what a checkpoint's JSON holds."""
        return {
            **self.training_state(),
            "batch_index": self.batch_index,
            "window_real_tokens": self.window_real_tokens,
            "nonfinite_streak": self.nonfinite_streak,
            "last_val_loss": self.last_val_loss,
            "last_val_step": self.last_val_step,
            "exact_match_baseline": self.exact_match_baseline,
            "unlogged": self.reporter.unlogged(),
            "loss_scaler": self.scaler.state(),
            "run_id": self.run_id,
            # model.dtype "auto" is float32 on a CPU and bfloat16 on a GPU: what it resolved to
            "compute_dtype": _dtype_name(models.compute_dtype(self.model)),
            "base_weights": self.base_weights,  # models.weights_fingerprint of the directory loaded
        }

    def save_checkpoint(self, kind: str, run_files: bool = False) -> Path:
        """A resumable checkpoint (``step``, ``emergency`` or ``final``) in the run directory;
        with ``run_files``, the run directory's own files (:meth:`save`) after it, in the same wait.

        Only rank 0 writes; every rank calls this at the same point and returns the path. A
        step checkpoint is followed by pruning the older ones. A peer lost during the save is
        reported (raised) once rank 0 has finished writing."""
        name = checkpoint.checkpoint_name(self.step_count, kind)
        self.saved_step = self.step_count

        def write(progress):
            moments = dict(tree_flatten(optimizer_state(self.optimizer, self.layout)))
            window = None
            if self.window is not None:
                grads, loss_sum, tokens = self.window
                window = {**dict(tree_flatten(gradient_tree(grads, self.layout))),
                          **dict(zip(checkpoint.WINDOW_SUMS, (loss_sum, tokens)))}
            path = checkpoint.save_checkpoint(self.run_dir, name, self.model, self.adapter_metadata(), moments, window,
                                              self.resume_state(), self.config.to_saved_dict(), progress)
            self.reporter.info(f"checkpoint {path}")
            if run_files:  # after the checkpoint: a kill between them leaves a run that resumes
                progress()
                self._write_run_files(progress)
            if kind == "step":
                progress()
                checkpoint.prune_checkpoints(self.run_dir, self.config.train.keep_checkpoints, self.run_id,
                                             self.step_count)

        self.world.main_rank_work(write)
        return self.run_dir / name

    def _restore(self, path: Path, saved: dict) -> None:
        """Put a checkpoint's weights, optimizer, random state and position (``saved``, read
        from ``path`` and checked against this run) in place."""
        state = saved["state"]
        checkpoint.apply_adapter_weights(self.model, saved["adapters"], str(path / checkpoint.ADAPTER_FILE))
        self.optimizer.init(self.model.trainable_parameters())
        load_optimizer_state(self.optimizer, dict(saved["optimizer"]), str(path / checkpoint.OPTIMIZER_FILE))
        if saved["window"] is not None:  # only a one-process run stops inside a window
            window = dict(saved["window"])
            checkpoint.check_window(window, dict(tree_flatten(self.model.trainable_parameters())),
                                    path / checkpoint.WINDOW_FILE)
            loss_sum, tokens = (window.pop(name) for name in checkpoint.WINDOW_SUMS)
            # Rebuild the gradient tree on the parameters' own structure (it has empty containers).
            grads = tree_map_with_path(lambda name, _: window[name], self.model.trainable_parameters())
            self.window = (grads, loss_sum, tokens)
            if self.world.rank > 0:  # resumed on several ranks: the step sums the ranks' windows, so one holds it
                self.window = tree_map(mx.zeros_like, self.window)
        self.step_count, self.epoch, self.batch_index = state["step"], state["epoch"], state["batch_index"]
        self.window_real_tokens = state["window_real_tokens"] if self.world.rank == 0 else 0  # summed over ranks too
        self.skipped_steps, self.nonfinite_streak = state["skipped_steps"], state["nonfinite_streak"]
        self.best_val_loss, self.last_val_loss = state["best_val_loss"], state["last_val_loss"]
        # Checkpoints from before it was recorded: a validation at the cadence is taken as run.
        cadence = state["step"] if self._evaluates_after(state["step"]) else None
        self.last_val_step = state.get("last_val_step", cadence)
        self.exact_match_baseline = state.get("exact_match_baseline", False)  # older checkpoints: run it again
        self.scaler.load(state["loss_scaler"])
        self.run_id = state.get("run_id") or self.run_id  # older checkpoints have none: theirs are never pruned

    def save(self) -> None:
        """The run directory's adapters, configs, state and tokenizer (rank 0; every rank calls this)."""
        self.world.main_rank_work(self._write_run_files)

    def _write_run_files(self, progress) -> None:
        if self.tokenizer is not None and not self.tokenizer_saved:  # files already there may be another model's
            checkpoint.save_tokenizer(self.run_dir, self.tokenizer)
            self.tokenizer_saved = True
            progress()
        checkpoint.save_run(self.run_dir, self.model, self.adapter_metadata(), self.config.to_saved_dict(),
                            self.training_state())
        self.reporter.info(f"saved {self.run_dir} at step {self.step_count}")


def fine_tune(config: RunConfig, model=None, tokenizer=None) -> TrainResult:
    """Run a whole training job from a config; the Python API's one call."""
    trainer = Trainer(config, model, tokenizer)
    try:
        return trainer.train()
    finally:
        trainer.world.close()
