"""Memory: the pre-run estimate against the measured peak, limits, and out-of-memory advice."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import yaml

from conftest import KEPT_TOKENS, LFM2_CONFIG, LLAMA_CONFIG, write_model
from mlxft import RunConfig, _gpu, fastmath, generation, lora, memory, models
from mlxft.config import AdapterConfig
from mlxft.data import Dataset, Example
from mlxft.trainer import Trainer, TrainingStopped

SIZES = {"hidden_size": 256, "intermediate_size": 512, "block_dim": 256, "block_ff_dim": 512,
         "num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "conv"], "vocab_size": 32000}


@pytest.fixture(scope="module", params=["llama", "lfm2"])
def wider_model(request, tmp_path_factory) -> Path:
    """Big enough that activations, not fixed overheads, make up a good part of the peak."""
    config = {**(LLAMA_CONFIG if request.param == "llama" else LFM2_CONFIG), **SIZES}
    return write_model(tmp_path_factory.mktemp(request.param), config)


@pytest.fixture(scope="module")
def wider_llama(tmp_path_factory) -> Path:
    """For what does not depend on the family (the advice's arithmetic, pacing, which layers
    the backward pass reaches): one family is enough."""
    return write_model(tmp_path_factory.mktemp("llama"), {**LLAMA_CONFIG, **SIZES})


def random_rows(n: int, longest: int, seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        length = int(rng.integers(longest // 2, longest + 1))
        mask = np.ones(length, bool)
        mask[: length // 3] = False
        rows.append(Example(rng.integers(3, KEPT_TOKENS, size=length).astype(np.int32), mask))
    return rows


def trainer(model_dir, tmp_path, batch_size=8, longest=256, rows_file=None, **train):
    config = RunConfig.from_dict({
        "model": {"model": str(model_dir), "dtype": "float32", "grad_checkpoint": train.pop("grad_checkpoint", False),
                  "checkpoint_layers": train.pop("checkpoint_layers", 0),
                  "checkpoint_keep_mlp": train.pop("checkpoint_keep_mlp", False),
                  "recompute_mlp": train.pop("recompute_mlp", False),
                  "recompute_mlp_layers": train.pop("recompute_mlp_layers", 0),
                  "fit_memory": train.pop("fit_memory", False),
                  "loss_chunk": train.pop("loss_chunk", 0)},
        "data": {"data": "in-memory", "length_bucket": 32, "pack": train.pop("pack", False)},
        "adapter": {"rank": 8, "num_layers": train.pop("num_layers", -1), "targets": train.pop("targets", ["default"]),
                    "finetune": train.pop("finetune", "lora")},
        "train": {"output_dir": str(tmp_path / "run"), "batch_size": batch_size, "max_steps": 3, "log_every": 1, **train},
    })
    rows = random_rows(3 * batch_size, longest)
    if rows_file is not None:  # a file for exact-match to read its rows from
        rows_file.write_text("")
    path = rows_file or Path("rows")
    return Trainer(config, datasets=(Dataset(path, rows, "completion"), None))


def train_records(run: Trainer) -> list[dict]:
    """The training-step records a finished run wrote to metrics.jsonl."""
    records = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["type"] == "train"]


def measured_peak(run: Trainer) -> float:
    """The largest per-step peak a finished run reported, in bytes."""
    return max(r["peak_memory_gb"] for r in train_records(run)) * memory.GB


# Checkpointed layers' estimates are checked by a partly checkpointed run below. Each family
# once and each batch layout once: Llama padded, LFM2 packed.
def test_estimate_is_within_a_quarter_of_the_measured_peak(wider_model, tmp_path, request):
    gc.collect()  # earlier tests' arrays would count in the process-wide peak
    mx.clear_cache()
    already_allocated = mx.get_active_memory()
    run = trainer(wider_model, tmp_path, pack=request.node.callspec.params["wider_model"] == "lfm2")
    run.train()
    measured = measured_peak(run) - already_allocated
    # What the probes measure carries weight in what is compared.
    assert run.estimate.activations + run.estimate.loss > 0.5 * measured
    assert 0.75 <= run.estimate.total / measured <= 1.25, (run.estimate.describe(), measured / memory.GB)


def test_full_fine_tuning_estimate_prices_the_optimizer_update(wider_model, tmp_path):
    # One short row: the update (new weights and moments beside the old) outweighs the backward
    # pass. Priced as the backward pass alone, the estimate came to 0.6-0.7x the measured peak.
    gc.collect()
    mx.clear_cache()
    already_allocated = mx.get_active_memory()
    run = trainer(wider_model, tmp_path, batch_size=1, longest=64, finetune="full", pace_memory=False)
    assert run.estimate.update > run.estimate.activations + run.estimate.loss
    run.train()
    measured = measured_peak(run) - already_allocated
    assert 0.75 <= run.estimate.total / measured <= 1.25, (run.estimate.describe(), measured / memory.GB)


def test_loss_chunk_is_advised_only_where_it_would_split_a_trained_heads_loss(llama_dir, tmp_path):
    # Full fine-tuning trains the head, whose loss scores the micro-batch at once unless chunked;
    # a micro-batch of fewer supervised positions than a chunk would be scored as before.
    settings = {"finetune": "full", "memory_estimate": False}
    short = trainer(llama_dir, tmp_path / "short", batch_size=2, longest=64, **settings)
    assert "--loss-chunk" not in short._advice(memory.GB)
    long = trainer(llama_dir, tmp_path / "long", batch_size=8, longest=512, **settings)
    assert long._largest_micro_batch()[2] > memory.LOSS_CHUNK_HINT
    assert "--loss-chunk 1024" in long._advice(memory.GB)
    chunked = trainer(llama_dir, tmp_path / "chunked", batch_size=8, longest=512, loss_chunk=2048, **settings)
    adapters = trainer(llama_dir, tmp_path / "adapters", batch_size=8, longest=512, memory_estimate=False)
    assert "--loss-chunk" not in chunked._advice(memory.GB) + adapters._advice(memory.GB)  # frozen heads chunk anyway


def test_checkpointing_lowers_the_estimated_activations(wider_model, tmp_path):
    plain = trainer(wider_model, tmp_path / "a").estimate
    checkpointed = trainer(wider_model, tmp_path / "b", grad_checkpoint=True).estimate
    assert checkpointed.activations < plain.activations
    # The loss's peak moves by about a chunk of logits (39 MB here) with how far MLX's CPU
    # backend has queued the next chunks when the probe reads it.
    assert checkpointed.weights == plain.weights and checkpointed.loss == pytest.approx(plain.loss, rel=0.15)
    # The first two of four layers recomputed: the estimate lies between, and so does the peak.
    gc.collect()  # the runs above, and earlier tests', would count in the process-wide peak
    mx.clear_cache()
    already_allocated = mx.get_active_memory()
    partial = trainer(wider_model, tmp_path / "c", grad_checkpoint=True, checkpoint_layers=2)
    assert checkpointed.activations < partial.estimate.activations < plain.activations
    partial.train()
    measured = measured_peak(partial) - already_allocated
    assert 0.75 <= partial.estimate.total / measured <= 1.25, (partial.estimate.describe(), measured / memory.GB)


def test_untrained_layers_after_a_trained_one_keep_their_activations(tmp_path_factory, tmp_path):
    # LFM2 under attention-only --targets: its convolutions hold no adapters, but those after the
    # first attention layer lie on the backward path and keep their activations all the same.
    # The estimate took them for forward-only, and came to 0.58x the measured peak.
    model_dir = write_model(tmp_path_factory.mktemp("lfm2-attention-first"),
                            {**LFM2_CONFIG, **SIZES, "num_hidden_layers": 12, "layer_types": ["full_attention"] + ["conv"] * 11})
    run = trainer(model_dir, tmp_path, targets=["self_attn.q_proj", "self_attn.v_proj"], pace_memory=False, loss_chunk=64)
    run.train()
    measured = measured_peak(run)
    assert 0.75 <= run.estimate.total / measured <= 1.25, (run.estimate.describe(), measured / memory.GB)


# Where a limit lies between two layer counts, the loss's peak must not move from probe to probe
# by as much as one layer's recomputation saving (about 21 MB here). In chunks it moves with how
# far the CPU backend has queued the next chunks; scored in one chunk and unpaced it does not.
STEADY_LOSS = {"loss_chunk": 1 << 16, "pace_memory": False}


def test_layers_before_the_trained_ones_keep_nothing(wider_llama, tmp_path):
    # --num-layers 2 of 4: the backward pass never reaches the first two layers. Paced and in
    # chunks, a busy CI machine's peak came 1.43x this estimate (the backend queued further).
    everything = trainer(wider_llama, tmp_path / "a", **STEADY_LOSS).estimate
    last_two = trainer(wider_llama, tmp_path / "b", num_layers=2, **STEADY_LOSS)
    assert last_two.estimate is not None and last_two.estimate.activations < everything.activations
    last_two.train()
    measured = measured_peak(last_two)
    assert 0.75 <= last_two.estimate.total / measured <= 1.25, (last_two.estimate.describe(), measured / memory.GB)


def test_advice_recomputes_as_few_layers_as_fit_the_limit(wider_llama, tmp_path):
    plain = trainer(wider_llama, tmp_path / "a", **STEADY_LOSS).estimate
    layers = len(plain.recompute_savings)
    assert layers == 4 and all(saving > 0 for saving in plain.recompute_savings)
    # A limit that recomputing the first two layers meets and recomputing one does not.
    fits, short = plain.total_recomputing(2), plain.total_recomputing(1)
    assert fits < short <= plain.total
    limit = (fits + short) / 2
    config = RunConfig.from_dict({"model": {"model": str(wider_llama)}})
    assert memory.advice(config, plain, limit).startswith(
        f"lower memory with --grad-checkpoint --checkpoint-layers 2 (estimated {fits / memory.GB:.2f} GB), or ")
    # The run as advised: its own estimate and its measured peak agree with the advice's figure.
    gc.collect()
    mx.clear_cache()
    advised = trainer(wider_llama, tmp_path / "b", grad_checkpoint=True, checkpoint_layers=2, **STEADY_LOSS)
    assert advised.estimate.total == pytest.approx(fits, rel=0.05), (advised.estimate.describe(), fits / memory.GB)
    advised.train()
    measured = measured_peak(advised)
    assert 0.75 <= fits / measured <= 1.25, (fits / memory.GB, measured / memory.GB)
    # From a run that already recomputes its first layer, only the count changes.
    partial = trainer(wider_llama, tmp_path / "c", grad_checkpoint=True, checkpoint_layers=1, memory_estimate=False,
                      **STEADY_LOSS)
    assert memory.advice(partial.config, plain, limit).startswith("lower memory with --checkpoint-layers 2 (")
    # Below what recomputing every layer gives, the advice says so and goes on to the other settings.
    everything = plain.total_recomputing(layers)
    text = memory.advice(config, plain, everything / 2)
    assert text.startswith(f"lower memory with --grad-checkpoint (estimated {everything / memory.GB:.2f} GB), or ")
    assert "--batch-size" in text
    # An estimate the run has outgrown (it fit the limit) gives no count, only the setting.
    assert memory.advice(config, plain, plain.total * 2).startswith("lower memory with --grad-checkpoint, or ")


def test_fit_memory_recomputes_the_layers_the_advice_names(wider_llama, tmp_path, capsys):
    plain = trainer(wider_llama, tmp_path / "a", **STEADY_LOSS).estimate
    limit = (plain.total_recomputing(2) + plain.total_recomputing(1)) / 2
    before = mx.get_memory_limit()
    try:
        run = trainer(wider_llama, tmp_path / "b", memory_limit=limit / memory.GB, fit_memory=True,
                      **STEADY_LOSS)
        assert [models.is_checkpointed(layer) for layer in run.model.layers] == [True, True, False, False]
        assert run.config.model.grad_checkpoint and run.config.model.checkpoint_layers == 2
        assert run.estimate.total <= limit
        out = capsys.readouterr().out
        assert "fit memory: recomputing the first 2 of 4 layers (--grad-checkpoint --checkpoint-layers 2)" in out
        assert "estimate exceeds the memory limit" not in out
        run.train()
    finally:
        mx.set_memory_limit(before)
        mx.set_cache_limit(before)
    assert 0.75 <= run.estimate.total / measured_peak(run) <= 1.25
    # The saved config recomputes those layers, and so fits again as it stands.
    saved = yaml.safe_load((run.run_dir / "config.yaml").read_text())["model"]
    assert (saved["grad_checkpoint"], saved["checkpoint_layers"], saved["fit_memory"]) == (True, 2, True)


def test_fit_memory_prices_again_where_the_fitted_run_still_passes_the_limit(wider_llama, tmp_path, capsys,
                                                                             monkeypatch):
    """The fitted run's own estimate comes out over the limit (the probes' noise, made larger
    here): the next layer is recomputed too, and the first stays wrapped once."""
    plain = trainer(wider_llama, tmp_path / "a", **STEADY_LOSS).estimate
    limit = (plain.total_recomputing(2) + plain.total_recomputing(1)) / 2
    estimate_memory, made = Trainer.estimate_memory, []

    def noisy(self):
        made.append(estimate_memory(self))
        noise = plain.recompute_savings[2] if len(made) == 2 else 0  # the first fitted estimate
        return dataclasses.replace(made[-1], weights=made[-1].weights + noise)

    monkeypatch.setattr(Trainer, "estimate_memory", noisy)
    before = mx.get_memory_limit()
    try:
        run = trainer(wider_llama, tmp_path / "b", memory_limit=limit / memory.GB, fit_memory=True, **STEADY_LOSS)
    finally:
        mx.set_memory_limit(before)
        mx.set_cache_limit(before)
    out = capsys.readouterr().out
    assert "fit memory: recomputing the first 2 of 4 layers (--grad-checkpoint --checkpoint-layers 2)" in out
    assert "fit memory: recomputing the first 3 of 4 layers (--grad-checkpoint --checkpoint-layers 3)" in out
    assert len(made) == 3 and run.estimate.total <= limit and run.config.model.checkpoint_layers == 3
    assert "estimate exceeds the memory limit" not in out
    first = run.model.layers[0]
    assert models.is_checkpointed(first) and not getattr(type(first).__mro__[1], models._CHECKPOINTED, False)


def test_the_estimate_prices_recomputing_the_mlps(wider_model, tmp_path):
    """What ``--recompute-mlp`` would come to, priced on a run without it: the estimate of the run
    configured that way, and within a quarter of its measured peak."""
    small = {"batch_size": 4, "longest": 128}
    plain = trainer(wider_model, tmp_path / "a", **small, **STEADY_LOSS).estimate
    assert len(plain.recompute_mlp_savings) == 4 and all(saving > 0 for saving in plain.recompute_mlp_savings)
    priced = plain.total_recomputing_mlp()
    assert plain.total_recomputing(4) < priced < plain.total
    gc.collect()
    mx.clear_cache()
    configured = trainer(wider_model, tmp_path / "b", recompute_mlp=True, **small, **STEADY_LOSS)
    assert not any(configured.estimate.recompute_mlp_savings)  # nothing more to price
    assert configured.estimate.total == pytest.approx(priced, rel=0.05), (configured.estimate.describe(), priced / memory.GB)
    configured.train()
    assert 0.75 <= priced / measured_peak(configured) <= 1.25


@pytest.mark.parametrize("settings, ranks, quantized, has, lacks, longest", [
    # Each hint is one validation takes and that changes the run.
    ({"train": {"batch_size": 2}}, 2, False, [], ["--batch-size"], None),  # 1 row cannot be split over 2 ranks
    ({"train": {"batch_size": 8}}, 2, False, ["--batch-size 4 with --grad-accum-steps 2"], [], None),
    ({"train": {"batch_size": 1}}, 1, False, [], ["--batch-size"], None),  # already one row
    ({"train": {"batch_size": 3}}, 1, False, ["--batch-size 1 with --grad-accum-steps 3 (same"], [], None),
    ({"data": {"max_seq_length": 3}}, 1, False, [], ["--max-seq-length"], None),  # 1 is refused
    ({"adapter": {"finetune": "full", "targets": ["layers"]}}, 1, False, ["--finetune lora --targets default"], [],
     None),
    ({}, 1, True, [], ["--quantize"], None),  # the model on disk is quantized already
    ({}, 1, False, ["--quantize 4", "--max-seq-length 1024"], [], None),
    ({}, 1, False, ["--max-seq-length 20,"], ["--max-seq-length 1024"], 40),  # halving 2048 cut no row of 40
])
def test_advice_names_only_settings_that_are_taken_and_change_the_run(settings, ranks, quantized, has, lacks, longest):
    config = RunConfig.from_dict({**settings, "model": {"model": "m"}, "data": {"data": "d", **settings.get("data", {})}})
    text = memory.advice(config, ranks=ranks, quantized=quantized, longest=longest)
    assert all(h in text for h in has) and not any(x in text for x in lacks), text


def test_advice_puts_mlp_recomputation_first_where_checkpointing_takes_most_layers():
    """Eight layers that each keep 1 GB (0.6 of it the MLP's gate and up); each layer's or MLP's
    backward pass holds 1 GB over what the layers keep."""
    gb = memory.GB
    estimate = memory.Estimate(weights=1 * gb, training_state=0, activations=9 * gb, loss=0,
                               recompute_savings=(int(gb),) * 8, recompute_peaks=(int(gb),) * 8, transient=int(gb),
                               recompute_mlp_savings=(int(0.6 * gb),) * 8, recompute_mlp_transient=int(gb))
    assert estimate.total_recomputing_mlp() == pytest.approx(5.2 * gb)
    config = RunConfig.from_dict({"model": {"model": "m"}})
    # Checkpointing would need 5 of the 8 layers: recomputing gate and up comes first.
    assert memory.advice(config, estimate, 5.5 * gb).startswith(
        "lower memory with --recompute-mlp (estimated 5.20 GB), or --grad-checkpoint --checkpoint-layers 5 "
        "(estimated 5.00 GB), or --batch-size")
    assert memory.prefers_mlp_recomputation(config, estimate, 5.5 * gb)
    # Seven of the eight MLPs are enough: only theirs are recomputed.
    assert memory.advice(config, estimate, 5.9 * gb).startswith(
        "lower memory with --recompute-mlp --recompute-mlp-layers 7 (estimated 5.80 GB), or --grad-checkpoint "
        "--checkpoint-layers 5 (estimated 5.00 GB), or --batch-size")
    # Three layers are enough: they come first, and the fewest MLPs (five) after them.
    assert memory.advice(config, estimate, 7.5 * gb).startswith(
        "lower memory with --grad-checkpoint --checkpoint-layers 3 (estimated 7.00 GB), or --recompute-mlp "
        "--recompute-mlp-layers 5 (estimated 7.00 GB), or --batch-size")
    # A run that recomputes the first five MLPs already is told how many more.
    partly = RunConfig.from_dict({"model": {"model": "m", "recompute_mlp": True, "recompute_mlp_layers": 5}})
    rest = dataclasses.replace(estimate, activations=6 * gb, recompute_mlp_savings=(0,) * 5 + (int(0.6 * gb),) * 3)
    assert rest.total_recomputing_mlp() == pytest.approx(5.2 * gb)
    assert "--recompute-mlp-layers 7 (estimated 5.80 GB)" in memory.advice(partly, rest, 6 * gb)
    assert "--recompute-mlp-layers 0 (estimated 5.20 GB)" in memory.advice(partly, rest, 5.3 * gb)
    # Not enough, already on, or not allowed beside --checkpoint-keep-mlp: not advised.
    assert "--recompute-mlp" not in memory.advice(config, estimate, 4.5 * gb)
    every = dataclasses.replace(estimate, activations=4.2 * gb, recompute_mlp_savings=(0,) * 8)
    assert "--recompute-mlp" not in memory.advice(RunConfig.from_dict({"model": {"model": "m", "recompute_mlp": True}}),
                                                  every, 4 * gb)
    keep = RunConfig.from_dict({"model": {"model": "m", "grad_checkpoint": True, "checkpoint_keep_mlp": True}})
    assert "--recompute-mlp" not in memory.advice(keep, estimate, 5.5 * gb)
    assert "--recompute-mlp" not in memory.advice(config, dataclasses.replace(estimate, recompute_mlp_savings=()),
                                                  5.5 * gb)


@pytest.fixture(scope="module")
def wide_mlp_llama(tmp_path_factory) -> Path:
    """Eight layers with MLPs sixteen times the hidden width, so that their gate and up are most
    of what a layer keeps (as in the real models, and more), and recomputing seven MLPs saves
    more than checkpointing four whole layers."""
    return write_model(tmp_path_factory.mktemp("llama"), {**LLAMA_CONFIG, **SIZES, "intermediate_size": 4096,
                                                          "num_hidden_layers": 8, "layer_types": ["full_attention"] * 8})


def test_fit_memory_recomputes_the_fewest_mlps_where_the_advice_puts_that_first(wide_mlp_llama, tmp_path, capsys,
                                                                               monkeypatch):
    # An eager layer's peak on the CPU moves by one buffer of the MLP's width from probe to probe
    # (whether a freed one is gone before the next is allocated): half an MLP's room, or more in
    # a full parallel suite. The fitted run gets the plain run's estimate, so both price the same figures.
    estimates, real_estimate = {}, memory.estimate

    def same_estimate_per_setting(model, *args, **kwargs):
        family = models.family(model)
        setting = tuple((models.is_checkpointed(layer), fastmath.recomputes_mlp(layer, family)) for layer in model.layers)
        if setting not in estimates:
            estimates[setting] = real_estimate(model, *args, **kwargs)
        return estimates[setting]

    monkeypatch.setattr(memory, "estimate", same_estimate_per_setting)
    small = {"batch_size": 4, "longest": 128}
    plain = trainer(wide_mlp_llama, tmp_path / "a", **small, **STEADY_LOSS).estimate
    priced = plain.total_recomputing_mlp(7)
    assert plain.total_recomputing_mlp() < priced < plain.total_recomputing_mlp(6)
    # Most of an MLP's room for the probes' noise: the fitted run estimates 7 recomputed MLPs
    # afresh, and in a full parallel suite that came 0.48 GB against a limit halfway to 6 (0.4799).
    limit = priced + 0.9 * (plain.total_recomputing_mlp(6) - priced)
    assert plain.total_recomputing(4) > limit  # checkpointing would need more than half of the layers
    before = mx.get_memory_limit()
    try:
        run = trainer(wide_mlp_llama, tmp_path / "b", memory_limit=limit / memory.GB, fit_memory=True,
                      **small, **STEADY_LOSS)
        assert run.config.model.recompute_mlp and run.config.model.recompute_mlp_layers == 7
        assert not run.config.model.grad_checkpoint
        assert not any(models.is_checkpointed(layer) for layer in run.model.layers)
        family = models.family(run.model)
        assert [fastmath.recomputes_mlp(layer, family) for layer in run.model.layers] == [True] * 7 + [False]
        # The fitted run's own estimate: what the plain run priced.
        assert run.estimate.total <= limit and run.estimate.total == pytest.approx(priced, rel=0.05)
        out = capsys.readouterr().out
        assert ("fit memory: recomputing the MLPs' gate and up projections in the first 7 of 8 layers "
                "(--recompute-mlp --recompute-mlp-layers 7)") in out
        assert "estimate exceeds the memory limit" not in out
        run.train()
    finally:
        mx.set_memory_limit(before)
        mx.set_cache_limit(before)
    assert 0.75 <= run.estimate.total / measured_peak(run) <= 1.25
    saved = yaml.safe_load((run.run_dir / "config.yaml").read_text())["model"]
    assert (saved["recompute_mlp"], saved["recompute_mlp_layers"], saved["grad_checkpoint"], saved["fit_memory"]) \
        == (True, 7, False, True)


def test_no_pacing_where_the_update_peaks_higher():
    gb = memory.GB
    estimate = memory.Estimate(weights=1 * gb, training_state=2 * gb, activations=0.5 * gb, loss=1 * gb,
                               transient=int(0.2 * gb), loss_queued_ahead=0.8 * gb, update=2 * gb)
    # The update's 2 GB outweighs the backward pass paced or not: pacing would lower nothing.
    assert estimate.total == pytest.approx(5 * gb) and estimate.pace().total == estimate.total
    assert not memory.can_pace(estimate)
    assert memory.can_pace(dataclasses.replace(estimate, update=0))
    # A limit under what the update needs would make MLX wait on every operation of it.
    assert memory.pacing_limit(dataclasses.replace(estimate, update=1.6 * gb).pace()) == pytest.approx(4.6 * gb)


@pytest.mark.skipif(memory.device_kind() == "Metal", reason="pacing is off on Metal")
def test_pacing_takes_the_queued_loss_off_the_peak(wider_llama, tmp_path, capsys):
    # About 1,200 supervised tokens over a 32k vocabulary in chunks of 256: unpaced, the CPU
    # backend allocates the chunks' logits as it queues them, well ahead of the one it computes.
    peaks, losses = [], []
    for pace in (False, True):
        gc.collect()
        mx.clear_cache()
        before, limit = mx.get_active_memory(), mx.get_memory_limit()
        run = trainer(wider_llama, tmp_path / str(pace), pace_memory=pace)
        run.train()
        assert mx.get_memory_limit() == limit  # the process gets its limit back
        if not pace:  # a run that will not pace does not probe the loss paced
            assert run.estimate.loss_queued_ahead == 0 and not run.estimate.paced
        peaks.append(measured_peak(run) - before)
        losses.append([r["loss"] for r in train_records(run)])
    queued = run.estimate.loss_queued_ahead
    assert queued > 0.1 * peaks[0], (queued, peaks)
    assert peaks[1] < peaks[0] - 0.5 * queued, (queued, peaks)
    assert losses[1] == losses[0]
    assert "memory: pacing evaluation at" in capsys.readouterr().out
    # The paced run's estimate (Estimate.pace) covers its peak.
    assert peaks[1] <= 1.05 * run.estimate.total


@pytest.mark.skipif(memory.device_kind() == "Metal", reason="pacing is off on Metal")
def test_pacing_rises_to_what_the_run_needs(wider_llama, tmp_path, capsys):
    run = trainer(wider_llama, tmp_path, pace_memory=True)
    # An estimate far under the run's need: the first paced limit cannot fit a step.
    run.estimate = dataclasses.replace(run.estimate, activations=0, weights=0, training_state=0)
    run.train()
    out = capsys.readouterr().out
    assert "(the run has needed" in out, out
    assert len(train_records(run)) == 3


def test_validation_takes_the_loss_a_chunk_at_a_time(llama_dir, tmp_path):
    peaks, losses = [], []
    for chunk in (0, 32):
        run = trainer(llama_dir, tmp_path / str(chunk), batch_size=4, longest=128, loss_chunk=chunk, memory_estimate=False)
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        losses.append(run.evaluate(run.train_set)[0])
        peaks.append(mx.get_peak_memory() - before)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert peaks[1] < 0.5 * peaks[0], peaks  # [supervised, vocab] float32 logits are most of it


def test_recomputed_layers_keep_their_inputs_and_nothing_they_recompute(wider_model, tmp_path):
    # What the estimate counts a layer for is read off the pending backward pass of a vjp,
    # not off a peak: for a recomputed layer that is its input alone, for a plain one far more.
    batch, length = 4, 128
    x = mx.random.normal((batch, length, 256))
    plain = trainer(wider_model, tmp_path / "a", memory_estimate=False).model.layers[1]
    checkpointed = trainer(wider_model, tmp_path / "b", grad_checkpoint=True, memory_estimate=False).model.layers[1]
    kept = [memory._kept_for_backward(checkpointed, None, x) for _ in range(2)]
    assert kept[0] == kept[1]
    assert x.nbytes <= kept[0] <= 1.05 * x.nbytes
    # Keeping the MLP: the input, the gate and up projections, and the attention's residual sum
    # (an output of the recomputed part, which mx.checkpoint keeps); nothing else of the attention.
    keeping_mlp = trainer(wider_model, tmp_path / "c", grad_checkpoint=True, checkpoint_keep_mlp=True,
                          memory_estimate=False).model.layers[1]
    gate = keeping_mlp.mlp.gate_proj if "mlp" in keeping_mlp else keeping_mlp.feed_forward.w1
    expected = 2 * x.nbytes + 2 * batch * length * gate.linear.weight.shape[0] * 4
    assert expected <= memory._kept_for_backward(keeping_mlp, None, x) <= 1.05 * expected
    assert memory._kept_for_backward(plain, None, x) > 1.5 * expected  # the attention's activations besides


def test_no_garbage_is_collected_while_a_probe_reads_the_counters(llama_dir, monkeypatch):
    # Arrays in reference cycles that the collector frees mid-probe would be subtracted from what
    # the probe allocated (a flaky suite: a layer's kept bytes read 0.3 of its input low). With a
    # threshold of 1 the collector would run at nearly every allocation; it must not run between
    # a probe's first and last reading of MLX's counters.
    collections = lambda: sum(s["collections"] for s in gc.get_stats())
    seen = []
    for name in ("get_active_memory", "get_peak_memory"):
        read = getattr(mx, name)
        monkeypatch.setattr(mx, name, lambda read=read: seen.append(collections()) or read())
    model = models.load(str(llama_dir), "float32")[0]
    lora.apply(model, AdapterConfig(rank=4), seed=0)
    layer = model.layers[0]
    x = mx.random.normal((1, 8, LLAMA_CONFIG["hidden_size"]))
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        memory._kept_for_backward(layer, None, x)
        memory._layer_peak(layer, None, x)
    finally:
        gc.set_threshold(*threshold)
    assert len(seen) == 4 and seen[0] == seen[1] and seen[2] == seen[3], seen
    assert gc.isenabled()


def test_what_earlier_work_left_cached_does_not_move_a_probe(llama_dir):
    # MLX hands a cached block to a smaller request and counts the whole block as active: a
    # probe that started on whatever the last test left cached read a layer's kept bytes up to
    # 12% high in CI (tests/test_normed.py failed once on it).
    model = models.load(str(llama_dir), "float32")[0]
    lora.apply(model, AdapterConfig(rank=4), seed=0)
    layer = model.layers[0]
    x = mx.random.normal((4, 64, LLAMA_CONFIG["hidden_size"]), key=mx.random.key(2))
    clean = memory._kept_for_backward(layer, None, x)
    for sizes in (range(1, 4000, 37), range(900, 40000, 411)):
        leftovers = [mx.zeros((n,)) for n in sizes]
        mx.eval(leftovers)
        del leftovers
        assert mx.get_cache_memory() > 0
        assert memory._kept_for_backward(layer, None, x) == clean


def test_limits_hold_for_the_run_alone_and_passing_one_says_what_to_lower(llama_dir, tmp_path, capsys, monkeypatch):
    # MLX's limits are the process's: a Trainer in a user's script sets its own while it
    # estimates and trains, then gives the process back what it had, however it ends.
    before = memory.Limits.now()
    run = trainer(llama_dir, tmp_path, batch_size=2, longest=64, memory_limit=0.001, cache_limit=0.0)
    assert memory.Limits.now() == before
    during = []
    train_steps = run._train
    run._train = lambda: during.append(memory.Limits.now()) or train_steps()
    run.train()
    assert during == [memory.Limits(1_000_000, 0)] and memory.Limits.now() == before
    run._train = lambda: 1 / 0
    with pytest.raises(ZeroDivisionError):
        run.train()
    assert memory.Limits.now() == before
    def failing_probe(*args, **kwargs):
        raise RuntimeError("the estimate's probe failed")

    monkeypatch.setattr(memory, "estimate", failing_probe)  # fails while the run's limits are set
    with pytest.raises(RuntimeError, match="probe failed"):
        trainer(llama_dir, tmp_path / "other", batch_size=2, longest=64, memory_limit=0.5, cache_limit=0.1)
    assert memory.Limits.now() == before
    out = capsys.readouterr().out
    assert "estimate exceeds the memory limit" in out
    assert "passed the memory limit" in out and "--grad-checkpoint" in out and "--batch-size 1" in out
    # Nothing fits 1 MB: the advice gives what recomputing every layer would come to, then the rest.
    assert "lower memory with --grad-checkpoint (estimated " in out


def test_generation_reports_its_own_peak_apart_from_training(llama_dir, tmp_path, capsys, monkeypatch):
    """Exact-match generation that peaks far above training (as a batch of KV caches can): its
    record carries that peak and the warning names its own setting, while the training steps'
    records report training's peak and raise no training warning."""
    def generating(model, tokenizer, pairs, prompt_format):
        held = mx.zeros((160, 1 << 20))  # 0.67 GB
        mx.eval(held)
        return 0.5, []

    monkeypatch.setattr(generation, "qa_pairs", lambda source, limit: [([], "x")] * limit)
    monkeypatch.setattr(generation, "exact_match", generating)
    before = mx.get_memory_limit()
    try:
        run = trainer(llama_dir, tmp_path, batch_size=2, longest=64, exact_match_rows=2, memory_limit=0.5,
                      rows_file=tmp_path / "rows.jsonl")
        run.train()
    finally:
        mx.set_memory_limit(before)
        mx.set_cache_limit(before)
    records = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    generated = [r["peak_memory_gb"] for r in records if r["type"] == "exact_match"]
    assert len(generated) == 2 and min(generated) > 0.6
    # No validation set: the rows scored are training rows, and the record and line say so.
    assert {r["rows_from"] for r in records if r["type"] == "exact_match"} == {"training"}
    assert 0 < measured_peak(run) / memory.GB < 0.4
    out = capsys.readouterr().out
    assert "warning: exact-match generation peaked at" in out and "--exact-match-rows 0 skips it (now 2)" in out
    assert "training (no validation set) rows" in out and "held-out" not in out
    assert "warning: peak memory" not in out and "estimate exceeds the memory limit" not in out


def test_out_of_memory_stops_with_advice(llama_dir, tmp_path, monkeypatch):
    run = trainer(llama_dir, tmp_path, batch_size=2, longest=64, grad_checkpoint=True)

    def exhausted(*_):
        raise RuntimeError("[metal::malloc] Unable to allocate 68719476736 bytes.")

    monkeypatch.setattr(run, "_train", exhausted)
    with pytest.raises(TrainingStopped) as stopped:
        run.train()
    message = str(stopped.value)
    assert stopped.value.exit_code == 1 and "\n" not in message
    assert "out of memory" in message and "--batch-size 1" in message and "--grad-checkpoint" not in message
    # Nothing to resume from: the advice says so rather than name a `latest` that is not there.
    assert "--resume" not in message and message.endswith("(no checkpoint was saved: the run starts again)")


def test_out_of_memory_advice_resumes_only_with_what_resume_takes(llama_dir, tmp_path, monkeypatch):
    run = trainer(llama_dir, tmp_path, batch_size=2, longest=64)
    run.train()  # its final checkpoint is what `latest` names

    def exhausted(*_):
        raise RuntimeError("[metal::malloc] Unable to allocate 68719476736 bytes.")

    monkeypatch.setattr(run, "_train", exhausted)
    with pytest.raises(TrainingStopped) as stopped:
        run.train()
    resumable, fresh = str(stopped.value).split("; or start a new run with ")
    assert f"and continue with --resume {run.run_dir / 'latest'}" in resumable
    # A resume refuses another batch or sequence length without --force, and any quantization.
    assert "(same effective batch) and --force" in resumable and re.search(r"--max-seq-length \d+ and --force", resumable)
    assert "with --grad-checkpoint, or" in resumable and "--quantize" not in resumable and fresh == "--quantize 4"


def test_device_is_named():
    assert memory.device_description().split(" ")[0] in ("CPU", "Metal", "CUDA")


def test_cuda_graph_cache_is_raised_unless_the_user_set_it():
    read = "import os, mlxft; print(os.environ['MLX_CUDA_GRAPH_CACHE_SIZE'])"
    env = {k: v for k, v in os.environ.items() if k != "MLX_CUDA_GRAPH_CACHE_SIZE"}
    default = subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, text=True, check=True)
    chosen = subprocess.run([sys.executable, "-c", read], env={**env, "MLX_CUDA_GRAPH_CACHE_SIZE": "7"},
                            capture_output=True, text=True, check=True)
    assert (default.stdout.strip(), chosen.stdout.strip()) == ("1000", "7")


def test_the_memory_line_names_the_evaluation_width(monkeypatch):
    limit = mx.get_memory_limit()
    try:
        monkeypatch.setenv(_gpu.EVAL_WIDTH_VARIABLE, "1")
        assert "evaluation width 1 (MLX_BFS_MAX_WIDTH)" in memory.configure(0, -1)
        monkeypatch.delenv(_gpu.EVAL_WIDTH_VARIABLE)
        assert "MLX's default evaluation width (MLX_BFS_MAX_WIDTH unset)" in memory.configure(0, -1)
    finally:
        mx.set_memory_limit(limit)


@pytest.mark.parametrize("working_set", [24 * 10**9, None])
def test_metal_wires_its_recommended_working_set_and_other_devices_wire_nothing(monkeypatch, working_set):
    """As mlx-lm does on a Mac: unified memory the run needs stays resident. Only Metal reports a
    recommended working set; elsewhere (or where it reports none) the wired limit is left alone."""
    wired = []
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "set_wired_limit", wired.append)
    info = {"architecture": "applegpu_g15s", "max_recommended_working_set_size": working_set}
    monkeypatch.setattr(_gpu, "device_info", lambda: {k: v for k, v in info.items() if v is not None})
    limit = mx.get_memory_limit()
    try:
        summary = memory.configure(0, -1)
    finally:
        mx.set_memory_limit(limit)
    assert wired == ([working_set] if working_set else [])
    assert ("wired limit 24.0 GB" in summary) == bool(working_set)
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    memory.configure(0, -1)
    assert len(wired) == (1 if working_set else 0)


def test_graphs_are_evaluated_one_branch_at_a_time_unless_the_user_chose_a_width(tmp_path):
    """32 independent branches, each an array of 2 MiB summed to a scalar: MLX's default order
    keeps many of them alive together, mlxft's (MLX_BFS_MAX_WIDTH=1) far fewer."""
    script = tmp_path / "branches.py"
    script.write_text("import os, mlxft\n"
                      "import mlx.core as mx\n"
                      "x = mx.random.normal((512, 1024)); mx.eval(x)\n"
                      "mx.reset_peak_memory(); base = mx.get_active_memory()\n"
                      "mx.eval(mx.stack([mx.exp(x * (i + 1) * 1e-3).sum() for i in range(32)]).sum())\n"
                      "print(os.environ['MLX_BFS_MAX_WIDTH'], (mx.get_peak_memory() - base) / 2**20)\n")
    env = {k: v for k, v in os.environ.items() if k != "MLX_BFS_MAX_WIDTH"}
    runs = [subprocess.run([sys.executable, str(script)], env={**env, **extra}, capture_output=True, text=True,
                           check=True).stdout.split() for extra in ({}, {"MLX_BFS_MAX_WIDTH": "20"})]
    (width, narrow), (kept, wide) = [(w, float(mb)) for w, mb in runs]
    assert (width, kept) == ("1", "20")
    assert narrow < 0.6 * wide, (narrow, wide)  # measured 20 against 46 MiB


@pytest.mark.parametrize("info, user, expected", [
    ({"compute_capability_major": 9, "compute_capability_minor": 0}, None, "200"),  # H100/H200: MLX caps at 1000M
    ({"compute_capability_major": 8, "compute_capability_minor": 0}, None, "200"),  # A100: 400M
    ({"compute_capability_major": 8, "compute_capability_minor": 9}, None, None),  # MLX's 100M is below ours
    ({"compute_capability_major": 12, "compute_capability_minor": 1}, None, None),  # DGX Spark: 25M
    ({"compute_capability_major": 9, "compute_capability_minor": 0}, "50", "50"),  # the user's choice stands
    ({"architecture": "applegpu_g15s", "device_name": "Apple M4"}, None, None),  # Metal sizes its own buffers
    ({"architecture": "x86_64", "device_name": "AMD EPYC"}, None, None),  # the CPU
])
def test_cuda_graphs_are_capped_only_where_mlx_allows_larger(monkeypatch, info, user, expected):
    monkeypatch.delenv(_gpu.GRAPH_MB_VARIABLE, raising=False)
    monkeypatch.delenv(_gpu.CHOSEN_VARIABLE, raising=False)
    if user is not None:
        monkeypatch.setenv(_gpu.GRAPH_MB_VARIABLE, user)
    _gpu.cap_graph_inputs(info)
    assert os.environ.get(_gpu.GRAPH_MB_VARIABLE) == expected


def test_a_device_mlx_cannot_describe_does_not_stop_the_import(monkeypatch):
    def no_device():
        raise RuntimeError("CUDA driver version is insufficient")

    monkeypatch.delenv(_gpu.GRAPH_MB_VARIABLE, raising=False)
    monkeypatch.delenv(_gpu.CHOSEN_VARIABLE, raising=False)
    monkeypatch.setattr(mx, "device_info", no_device, raising=False)
    _gpu.configure()
    assert _gpu.GRAPH_MB_VARIABLE not in os.environ


@pytest.mark.parametrize("user", [None, "300"])
@pytest.mark.parametrize("recomputing, cap", [({}, _gpu.GRAPH_MB),
                                              ({"grad_checkpoint": True}, _gpu.CHECKPOINTED_GRAPH_MB),
                                              ({"recompute_mlp": True}, _gpu.RECOMPUTED_MLP_GRAPH_MB)])
def test_recomputing_runs_lower_only_mlxfts_own_cap(monkeypatch, llama_dir, tmp_path, user, recomputing, cap):
    monkeypatch.delenv(_gpu.GRAPH_MB_VARIABLE, raising=False)
    monkeypatch.delenv(_gpu.CHOSEN_VARIABLE, raising=False)
    if user is not None:
        monkeypatch.setenv(_gpu.GRAPH_MB_VARIABLE, user)
    _gpu.cap_graph_inputs({"compute_capability_major": 9, "compute_capability_minor": 0})
    trainer(llama_dir, tmp_path, batch_size=2, longest=64, memory_estimate=False, **recomputing)
    assert os.environ[_gpu.GRAPH_MB_VARIABLE] == (user or str(cap))
    assert len({_gpu.GRAPH_MB, _gpu.CHECKPOINTED_GRAPH_MB, _gpu.RECOMPUTED_MLP_GRAPH_MB}) == 3


def test_fit_memory_needs_the_estimate():
    from mlxft.config import validate
    from mlxft.errors import UserError

    with pytest.raises(UserError, match="model.fit_memory"):
        validate(RunConfig.from_dict({"model": {"model": "m", "fit_memory": True}, "data": {"data": "d"},
                                         "train": {"memory_estimate": False}}))


def test_the_cache_limit_is_only_ever_lowered():
    before = mx.set_cache_limit(10 * 10**9)
    try:
        assert memory.bound_cache(10**9) == 10 * 10**9
        assert memory.bound_cache(2 * 10**9) is None  # already under: left as it is
        assert mx.set_cache_limit(10**9) == 10**9
    finally:
        mx.set_cache_limit(before)


def test_a_run_keeps_the_cache_under_its_estimated_peak_and_gives_the_limit_back(llama_dir, tmp_path, capsys,
                                                                              monkeypatch):
    seen = []

    def record_cache_limit(threshold_gb):
        limit = mx.set_cache_limit(0)
        mx.set_cache_limit(limit)
        seen.append(limit)

    monkeypatch.setattr(memory, "release_cache", record_cache_limit)
    before = mx.set_cache_limit(100 * 10**9)  # MLX's default on Metal and CUDA: the memory limit
    try:
        run = trainer(llama_dir, tmp_path / "auto", batch_size=2, longest=64)
        run.train()
        assert seen and set(seen) == {int(memory.CACHE_OVER_ESTIMATE * run.estimate.total)}
        assert mx.set_cache_limit(100 * 10**9) == 100 * 10**9  # the process has its own back
        assert "memory: allocator cache kept under" in capsys.readouterr().out
        seen.clear()
        run = trainer(llama_dir, tmp_path / "set", batch_size=2, longest=64, cache_limit=0.5)
        run.train()
        assert set(seen) == {500_000_000}  # --cache-limit stands
        assert "allocator cache kept under" not in capsys.readouterr().out
    finally:
        mx.set_cache_limit(before)


def test_a_trained_heads_chunked_loss_leaves_the_head_as_it_found_it(llama_dir, tmp_path):
    # The memory estimate traces the chunked loss in a compiled probe: a head updated with the
    # probe's traced parameters had no value left to evaluate in the run's first validation.
    run = trainer(llama_dir, tmp_path, batch_size=2, longest=32, finetune="full", loss_chunk=8, max_steps=1)
    head = run.model.lm_head if "lm_head" in run.model else run.model.model.embed_tokens
    mx.eval(head.parameters())
    run.train()
    assert len(train_records(run)) == 1


def test_a_model_on_its_own_logits_is_priced_for_every_position_and_told_its_loss_chunk_is_idle(
        tmp_path, monkeypatch, capsys):
    config = {k: v for k, v in LLAMA_CONFIG.items() if k != "model_type"} | {
        "model_type": "granite", "logits_scaling": 4.0, "embedding_multiplier": 12.0, "attention_multiplier": 0.25,
        "residual_multiplier": 0.22, "attention_bias": False, "mlp_bias": False}
    granite = write_model(tmp_path / "granite", config)
    split = trainer(granite, tmp_path / "split", batch_size=4, longest=64, pace_memory=False)
    assert "does nothing for this model" not in capsys.readouterr().out
    monkeypatch.setattr(models, "_logit_transforms", lambda model: [None])  # its scaling unknown: whole logits
    whole = trainer(granite, tmp_path / "whole", batch_size=4, longest=64, pace_memory=False, loss_chunk=16)
    assert models.output_head(whole.model) is None and models.output_head(split.model) is not None
    assert "model.loss_chunk 16 does nothing for this model: granite computes its logits" in capsys.readouterr().out
    # Every position's logits in the model's dtype, then the supervised rows read off them:
    # about a third more rows than the supervised ones alone, and their copy besides.
    assert whole.estimate.loss > 1.5 * split.estimate.loss, (whole.estimate, split.estimate)


def test_attention_that_takes_only_an_array_mask_is_estimated(tmp_path, capsys):
    config = {k: v for k, v in LLAMA_CONFIG.items() if k != "model_type"} | {
        "model_type": "gemma2", "head_dim": 16, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "sliding_window": 64}
    run = trainer(write_model(tmp_path / "gemma2", config), tmp_path, batch_size=2, longest=32, pace_memory=False)
    assert "no memory estimate" not in capsys.readouterr().out  # Gemma 2 had none ('str' object has no attribute)
    assert run.estimate is not None and run.estimate.activations > 0
