"""The compiled step: exact accumulation, clipping, skipped non-finite updates, the schedule."""

import math

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mlxft import lora, models
from mlxft.config import AdapterConfig, OptimConfig
from mlxft.data import Example, make_batch
from mlxft.loss import loss_fn
from mlxft.optim import build_optimizer, learning_rate_at
from mlxft.step import build_step, gradient_tree, gradient_window, optimizer_state


def lora_model(model_dir, seed=0):
    model, _, _, _ = models.load(str(model_dir), "float32")
    lora.apply(model, AdapterConfig(rank=4), seed=seed)
    mx.random.seed(seed + 1)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.05, model.trainable_parameters()))
    return model


def uneven_rows():
    """Rows whose supervised-token counts differ a lot, so weighting matters."""
    rng = np.random.default_rng(3)
    rows = []
    for n, sup in [(30, 25), (6, 2), (18, 3), (11, 10), (25, 1), (8, 7)]:
        ids = rng.integers(0, 2000, size=n).astype(np.int32)
        mask = np.zeros(n, bool)
        mask[n - sup :] = True
        rows.append(Example(ids, mask))
    return rows


def params_after(model_dir, micro_batches, batch_size, optimizer_cls=optim.SGD, flat=None):
    model = lora_model(model_dir)
    opt = optimizer_cls(learning_rate=0.5)
    step = build_step(model, opt, loss_fn, flat=flat)
    window = None
    for i, rows in enumerate(micro_batches):
        result, window = step(make_batch(rows, batch_size, 4).arrays(), window, update=i == len(micro_batches) - 1)
        mx.eval(step.state, window)
    return dict(tree_flatten(model.trainable_parameters())), result


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per-tensor"])
def test_accumulation_equals_one_big_batch(model_dir, flat):
    rows = uneven_rows()
    big, big_result = params_after(model_dir, [rows], 6, flat=flat)
    small, small_result = params_after(model_dir, [rows[0:2], rows[2:4], rows[4:6]], 2, flat=flat)
    assert small_result.tokens.item() == big_result.tokens.item() == sum(e.supervised for e in rows)
    assert small_result.loss_sum.item() == pytest.approx(big_result.loss_sum.item(), rel=1e-5)
    start = dict(tree_flatten(lora_model(model_dir).trainable_parameters()))
    for name in big:
        moved = np.abs(np.array(big[name]) - np.array(start[name])).max()
        assert moved > 1e-4, name  # the step really updated this tensor
        np.testing.assert_allclose(np.array(small[name]), np.array(big[name]), rtol=1e-4, atol=1e-6, err_msg=name)


def test_mean_of_means_would_differ(model_dir):
    """The check above can fail: mlx-lm-style averaging of per-batch means gives other grads."""
    rows = uneven_rows()
    model = lora_model(model_dir)
    grad_fn = nn.value_and_grad(model, lambda m, *b: loss_fn(m, *b)[0])
    _, big = grad_fn(model, *make_batch(rows, 6, 4).arrays())
    parts = [grad_fn(model, *make_batch(rows[i : i + 2], 2, 4).arrays())[1] for i in (0, 2, 4)]
    mean_of_means = tree_map(lambda a, b, c: (a + b + c) / 3, *parts)
    diffs = [np.abs(np.array(a) - np.array(b)).max() for (_, a), (_, b) in zip(tree_flatten(big), tree_flatten(mean_of_means))]
    assert max(diffs) > 1e-3


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per-tensor"])
def test_clipping_caps_the_global_norm(llama_dir, flat):
    model = lora_model(llama_dir)
    before = dict(tree_flatten(model.trainable_parameters()))
    step = build_step(model, optim.SGD(learning_rate=1.0), loss_fn, max_grad_norm=1e-3, flat=flat)
    result, _ = step(make_batch(uneven_rows(), 6, 4).arrays(), None, update=True)
    mx.eval(step.state, result.grad_norm)
    after = dict(tree_flatten(model.trainable_parameters()))
    delta = math.sqrt(sum(float(((after[k] - before[k]) ** 2).sum().item()) for k in before))
    assert result.grad_norm.item() > 1e-2  # the raw gradient really was larger
    assert delta == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per-tensor"])
def test_non_finite_gradients_skip_the_update(llama_dir, flat):
    model = lora_model(llama_dir)
    opt = optim.Adam(learning_rate=1e-2)
    batch = make_batch(uneven_rows(), 6, 4).arrays()
    good = build_step(model, opt, loss_fn, flat=flat)
    result, _ = good(batch, None, update=True)
    mx.eval(good.state)
    assert result.applied.item()
    params = dict(tree_flatten(model.trainable_parameters()))
    moments = dict(tree_flatten({k: v for k, v in opt.state.items() if k not in ("step", "learning_rate")}))

    def exploding(m, *b):
        loss, n = loss_fn(m, *b)
        return loss * mx.array(float("inf")), n

    bad = build_step(model, opt, exploding, flat=flat)
    result, _ = bad(batch, None, update=True)
    mx.eval(bad.state)
    assert not result.applied.item()
    for k, v in tree_flatten(model.trainable_parameters()):
        assert mx.array_equal(v, params[k]).item(), k
    for k, v in tree_flatten({k: v for k, v in opt.state.items() if k not in ("step", "learning_rate")}):
        assert mx.array_equal(v, moments[k]).item(), k


def test_flat_update_equals_per_tensor_update(llama_dir):
    """Adapters laid end to end (one clip, guard and AdamW update) train exactly as per tensor,
    checkpoint the same per-parameter optimizer state, and adopt a per-tensor one on resume."""
    rows = uneven_rows()
    runs = {}
    for flat in (True, False):
        model = lora_model(llama_dir)
        opt = optim.AdamW(learning_rate=1e-2, weight_decay=0.1)
        step = build_step(model, opt, loss_fn, max_grad_norm=0.5, flat=flat)
        assert (step.layout is not None) == flat
        window = None
        for i, part in enumerate([rows[0:2], rows[2:4], rows[4:6], rows[0:3]]):
            result, window = step(make_batch(part, 3, 4).arrays(), window, update=i % 2 == 1)
            mx.eval(step.state, window)
        runs[flat] = (model, dict(tree_flatten(optimizer_state(opt, step.layout))), result)
    (flat_model, flat_state, flat_result), (model, state, result) = runs[True], runs[False]
    assert flat_result.grad_norm.item() == pytest.approx(result.grad_norm.item(), rel=1e-5)
    params = dict(tree_flatten(model.trainable_parameters()))
    # Adam divides by the root of tiny second moments, so the last bits of a near-zero gradient
    # (matmuls on views vs whole arrays) can move a weight by ~1e-7; the learning rate is 1e-2.
    for name, value in tree_flatten(flat_model.trainable_parameters()):
        np.testing.assert_allclose(np.array(value), np.array(params[name]), rtol=1e-5, atol=2e-6, err_msg=name)
    assert flat_state.keys() == state.keys() and len(state) > 2  # step, learning rate and every moment
    for name in state:
        np.testing.assert_allclose(np.array(flat_state[name]), np.array(state[name]), rtol=1e-5, atol=1e-8, err_msg=name)

    # A per-tensor state (an older checkpoint) is adopted by a flat step and continues identically.
    opt = optim.AdamW(learning_rate=1e-2, weight_decay=0.1)
    opt.init(model.trainable_parameters())
    opt.state.update(tree_unflatten(list(state.items())))
    step = build_step(model, opt, loss_fn, max_grad_norm=0.5, flat=True)
    adopted = dict(tree_flatten(optimizer_state(opt, step.layout)))
    assert adopted.keys() == state.keys()
    assert all(mx.array_equal(adopted[k], state[k]).item() for k in state)
    gradient = gradient_window(gradient_tree(mx.arange(sum(step.layout.sizes), dtype=mx.float32), step.layout), step.layout)
    assert mx.array_equal(gradient, mx.arange(gradient.size, dtype=mx.float32)).item()


def test_schedule_values():
    cfg = OptimConfig(learning_rate=1e-3, min_learning_rate=1e-5, warmup_steps=10, schedule="cosine")
    assert learning_rate_at(1, cfg, 100) == pytest.approx(1e-4)
    assert learning_rate_at(10, cfg, 100) == pytest.approx(1e-3)
    assert learning_rate_at(55, cfg, 100) == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5)
    assert learning_rate_at(100, cfg, 100) == pytest.approx(1e-5)
    linear = OptimConfig(learning_rate=1e-3, warmup_steps=0, schedule="linear")
    assert learning_rate_at(1, linear, 11) == pytest.approx(1e-3 * 10 / 11)
    assert learning_rate_at(11, linear, 11) == pytest.approx(0.0)
    constant = OptimConfig(learning_rate=2e-4, warmup_steps=4, schedule="constant")
    assert [learning_rate_at(k, constant, 50) for k in (1, 4, 50)] == pytest.approx([5e-5, 2e-4, 2e-4])
    for k in (1, 7, 10, 11, 60, 100):  # the traced version agrees with the Python one
        assert learning_rate_at(mx.array(k), cfg, 100).item() == pytest.approx(learning_rate_at(k, cfg, 100), rel=1e-5)
    flat = OptimConfig(learning_rate=3e-4, warmup_steps=0, schedule="constant")
    assert isinstance(learning_rate_at(mx.array(5), flat, 10), mx.array)
    assert learning_rate_at(mx.array(5), flat, 10).item() == pytest.approx(3e-4)


def test_optimizer_step_k_uses_rate_k():
    cfg = OptimConfig(optimizer="sgd", learning_rate=0.1, warmup_steps=3, schedule="linear")
    opt = build_optimizer(cfg, total_steps=6)
    layer = nn.Linear(2, 1, bias=False)
    layer.weight = mx.zeros((1, 2))
    grads = {"weight": mx.ones((1, 2))}
    for k in range(1, 7):
        before = layer.weight[0, 0].item()
        opt.update(layer, grads)
        mx.eval(layer.parameters())
        used = before - layer.weight[0, 0].item()
        assert used == pytest.approx(learning_rate_at(k, cfg, 6), abs=1e-7), k
