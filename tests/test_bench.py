"""The side-by-side benchmark trains both trainers on one objective when asked to."""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxft import models
from mlxft.data import Example, make_batch
from mlxft.loss import loss_fn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench  # noqa: E402


def padded_as_mlx_lm_does(rows: list[Example]):
    """mlx-lm's batch: rows right-padded with 0 to one more than a multiple of 32, and
    (first supervised token, length) per row."""
    longest = max(len(r.ids) for r in rows)
    tokens = np.zeros((len(rows), 1 + 32 * -(-longest // 32)), np.int32)
    lengths = np.zeros((len(rows), 2), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r.ids)] = r.ids
        lengths[i] = int(np.argmax(r.mask)), len(r.ids)
    return mx.array(tokens), mx.array(lengths)


def test_mlx_lm_loss_to_the_last_token_is_mlxfts_loss(llama_dir):
    from mlx_lm.tuner.trainer import default_loss

    model = models.load(str(llama_dir), "float32")[0]
    rng = np.random.default_rng(0)
    rows = []
    for length in (9, 14, 20, 31):
        mask = np.zeros(length, bool)
        mask[length // 2:] = True
        rows.append(Example(rng.integers(3, 500, size=length).astype(np.int32), mask))
    tokens, lengths = padded_as_mlx_lm_does(rows)
    supervised = sum(r.supervised for r in rows)

    ours, our_count = loss_fn(model, *make_batch(rows, 4, 32).arrays())
    theirs, their_count = bench.mlx_lm_loss_to_the_last_token(model, tokens, lengths)
    assert their_count.item() == our_count.item() == supervised
    assert theirs.item() == pytest.approx(ours.item(), rel=1e-5)
    # As shipped, mlx-lm's loss counts one padding target per row exactly when the probe says so.
    shipped_count = default_loss(model, tokens, lengths)[1].item()
    assert shipped_count == supervised + len(rows) * bench.mlx_lm_counts_padding()


def test_repeated_pairs_alternate_and_report_the_median_pair():
    assert bench.pair_orders(3) == [("mlx-lm", "mlxft"), ("mlxft", "mlx-lm"), ("mlx-lm", "mlxft")]

    def pair(base_speed, our_speed, our_peak):
        return {"mlx-lm": {"supervised_tokens_per_sec": base_speed, "tokens_per_sec": 2 * base_speed, "peak_memory_gb": 10.0},
                "mlxft": {"supervised_tokens_per_sec": our_speed, "tokens_per_sec": 2 * our_speed, "peak_memory_gb": our_peak}}

    pairs = [pair(100, 150, 5.0), pair(100, 110, 6.0), pair(80, 100, 7.0)]  # 1.5x, 1.1x, 1.25x
    summary = bench.summarize(pairs)
    assert summary["ratios (mlxft / mlx-lm)"] == {"supervised_tokens_per_sec": 1.25, "tokens_per_sec": 1.25,
                                                  "peak_memory": 0.7}
    assert summary["results"] == [pairs[2]["mlx-lm"], pairs[2]["mlxft"]]
    assert [r["supervised_tokens_per_sec"] for r in summary["pair ratios"]] == [1.5, 1.1, 1.25]
    # An even count reports the lower middle pair, one that was measured.
    assert bench.summarize(pairs[:2])["ratios (mlxft / mlx-lm)"]["supervised_tokens_per_sec"] == 1.1
    single = bench.summarize(pairs[:1])
    assert set(single) == {"results", "ratios (mlxft / mlx-lm)"}


def test_mlxfts_side_runs_and_reports_its_estimate(llama_dir, chat_data):
    # The worker each pair runs for mlxft, on a tiny model and the test chats.
    import json
    import subprocess

    proc = subprocess.run([sys.executable, str(Path(bench.__file__)), "--model", str(llama_dir), "--data", str(chat_data),
                           "--only", "mlxft", "--batch-size", "2", "--steps", "4", "--warmup", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    assert result["trainer"] == "mlxft" and result["tokens_per_sec"] > 0
    assert set(result["estimate_gb"]) == {"weights", "training_state", "activations", "loss"}
    assert sum(result["estimate_gb"].values()) == pytest.approx(result["estimated_peak_memory_gb"])


def _small_stack():
    """Three frozen 32x32 linears with rank-8 adapters, and an input: lora_layer_cost.py's stack in small."""
    mx.random.seed(0)
    weights = [0.05 * mx.random.normal((32, 32)) for _ in range(3)]
    adapters = [(0.1 * mx.random.normal((32, 8)), 0.1 * mx.random.normal((8, 32))) for _ in range(3)]
    return weights, adapters, mx.random.normal((2, 5, 32))


def test_every_way_of_computing_an_adapter_does_the_same_work():
    # scripts/lora_layer_cost.py times these against each other: a faster way that computed
    # something else would be no finding.
    import lora_layer_cost as cost
    from mlx.utils import tree_flatten

    weights, adapters, x = _small_stack()
    value, grads = mx.value_and_grad(cost.as_mlxft, argnums=1)(weights, adapters, x)
    assert float(mx.abs(tree_flatten(grads)[1][1]).sum()) > 0
    for way in (cost.flattened, cost.in_compute_dtype, cost.with_addmm, cost.own_backward):
        other_value, other_grads = mx.value_and_grad(way, argnums=1)(weights, adapters, x)
        assert other_value.item() == pytest.approx(value.item(), rel=1e-5), way.__name__
        for (_, a), (_, b) in zip(tree_flatten(other_grads), tree_flatten(grads)):
            assert mx.allclose(a, b, rtol=1e-4, atol=1e-6).item(), way.__name__


def test_the_adapters_are_timed_against_the_frozen_stacks_forward_and_backward():
    # Asked for the input gradient alone, MLX skips the forward matmuls nothing reads, and the
    # adapters' figures would include them: the baseline must return the stack's value, the same
    # value the adapted stack gives with adapters that add nothing.
    import lora_layer_cost as cost

    weights, adapters, x = _small_stack()
    idle = [(a, mx.zeros_like(b)) for a, b in adapters]
    value, grad = cost.frozen_step()(weights, None, x)
    assert grad.shape == x.shape
    assert value.item() == pytest.approx(cost.as_mlxft(weights, idle, x).item(), rel=1e-6)


def test_the_profile_counts_busy_time_once_and_sorts_idle_gaps_by_length():
    """Overlapping kernels (concurrent in a CUDA graph) count once; each gap falls in the
    bucket of the largest bound it reaches."""
    import profile_step

    busy, gaps = profile_step.busy_and_gaps([(0, 10), (5, 12), (12, 15), (18, 20), (150, 160), (1300, 1301), (2, 4)])
    assert busy == 15 + 2 + 10 + 1
    assert gaps == {0: [3], 5: [], 20: [], 100: [130], 1000: [1140]}


def test_the_profiled_epoch_is_the_benchmarks_first_epoch_of_mixed_shapes():
    """``profile_step.py --size epoch`` steps through every chat row once, in micro-batches of
    eight, whose padded widths change from step to step as in a benchmark run."""
    rows, _ = bench.probe_sizes(1000)
    epoch = bench.probe_epoch(rows)
    assert sorted(id(r) for batch in epoch for r in batch) == sorted(id(r) for r in rows)
    assert all(len(batch) == 8 for batch in epoch)
    widths = [make_batch(batch, 8, 32).arrays()[0].shape[1] for batch in epoch]
    assert len(set(widths)) > 8 and widths != sorted(widths) and widths != sorted(widths, reverse=True)


def test_loss_memory_script_finds_the_softmax_scores_lighter():
    """scripts/loss_memory.py runs both scorers; in bfloat16 the softmax's holds less (no float32 copy)."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "loss_memory.py"
    out = subprocess.run([sys.executable, str(script), "--vocab", "8000", "--hidden", "64", "--tokens", "512",
                          "--chunk", "64"], capture_output=True, text=True, check=True).stdout
    unpaced = {line.split("  ")[0]: float(line.split("unpaced")[1].split("MB")[0]) for line in out.splitlines()[1:]}
    assert set(unpaced) == {"float32 copy (CPU)", "softmax (GPU)"}, out
    assert unpaced["softmax (GPU)"] < 0.8 * unpaced["float32 copy (CPU)"], out
