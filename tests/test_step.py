"""The compiled step: exact accumulation, clipping, skipped non-finite updates, the schedule."""

import math

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from conftest import LLAMA_CONFIG, write_model
from mlxft import lora, models
from mlxft.config import AdapterConfig, OptimConfig
from mlxft.data import Example, make_batch
from mlxft.loss import loss_fn
from mlxft.errors import UserError
from mlxft.optim import build_optimizer, learning_rate_at, load_state
from mlxft.step import MASTER_KEY, LossScaler, build_step, gradient_tree, gradient_window, optimizer_state


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory):
    """The tiny Llama with a 2,048-token vocabulary: float16 and bfloat16 matmuls are slow on the CPU."""
    return write_model(tmp_path_factory.mktemp("small-vocab"), {**LLAMA_CONFIG, "vocab_size": 2048})


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


def params_after(model_dir, micro_batches, batch_size, optimizer_cls=optim.SGD, flat=None, loss_scale=None,
                 compile_first=False):
    model = lora_model(model_dir)
    opt = optimizer_cls(learning_rate=0.5)
    step = build_step(model, opt, loss_fn, flat=flat)
    if compile_first:
        step.compile_kernels(make_batch(micro_batches[0], batch_size, 4).arrays(), loss_scale)
    window = None
    for i, rows in enumerate(micro_batches):
        result, window = step(make_batch(rows, batch_size, 4).arrays(), window, update=i == len(micro_batches) - 1,
                              loss_scale=loss_scale)
        mx.eval(step.state, window)
    return dict(tree_flatten(model.trainable_parameters())), result


def test_accumulation_equals_one_big_batch(model_dir, flat=True):
    # Flat adapters only: test_flat_update_equals_per_tensor_update accumulates per tensor.
    rows = uneven_rows()
    big, big_result = params_after(model_dir, [rows], 6, flat=flat)
    # Each micro-batch's gradient is unscaled before it joins the window.
    small, small_result = params_after(model_dir, [rows[0:2], rows[2:4], rows[4:6]], 2, flat=flat,
                                       loss_scale=mx.array(1024.0))
    assert small_result.tokens.item() == big_result.tokens.item() == sum(e.supervised for e in rows)
    assert small_result.loss_sum.item() == pytest.approx(big_result.loss_sum.item(), rel=1e-5)
    start = dict(tree_flatten(lora_model(model_dir).trainable_parameters()))
    for name in big:
        moved = np.abs(np.array(big[name]) - np.array(start[name])).max()
        assert moved > 1e-4, name  # the step really updated this tensor
        np.testing.assert_allclose(np.array(small[name]), np.array(big[name]), rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("flat", [True, False])
def test_compiling_the_kernels_first_changes_nothing(llama_dir, flat):
    """What a data-parallel run does before its first step (mlxft.trainer): the training that
    follows is the same to the bit (an AdamW update, which reads the moments and the step count
    that the compile must leave untouched)."""
    rows = uneven_rows()
    micro_batches = [rows[0:2], rows[2:4], rows[4:6]]
    plain, plain_result = params_after(llama_dir, micro_batches, 2, optim.AdamW, flat=flat)
    first, first_result = params_after(llama_dir, micro_batches, 2, optim.AdamW, flat=flat, compile_first=True)
    assert first_result.loss_sum.item() == plain_result.loss_sum.item()
    for name in plain:
        np.testing.assert_array_equal(np.array(first[name]), np.array(plain[name]), err_msg=name)


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


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per-tensor"])
def test_a_window_without_supervised_tokens_changes_nothing(llama_dir, flat):
    # Its gradient is zero, on which AdamW still stepped along its moments and decayed the
    # weights (reachable through Trainer(datasets=...), which may hold unsupervised rows).
    model = lora_model(llama_dir)
    opt = optim.AdamW(learning_rate=1e-2, weight_decay=0.1)
    step = build_step(model, opt, loss_fn, flat=flat)
    result, _ = step(make_batch(uneven_rows(), 6, 4).arrays(), None, update=True)
    mx.eval(step.state)
    params = dict(tree_flatten(model.trainable_parameters()))
    moments = dict(tree_flatten({k: v for k, v in opt.state.items() if k not in ("step", "learning_rate")}))
    unsupervised = [Example(row.ids, np.zeros(len(row.ids), bool)) for row in uneven_rows()[:2]]
    result, _ = step(make_batch(unsupervised, 2, 4).arrays(), None, update=True)
    mx.eval(step.state)
    assert result.tokens.item() == 0 and not result.applied.item()
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
    assert learning_rate_at(11, cfg, 100) == pytest.approx(1e-3)  # the decay's first step
    assert learning_rate_at(56, cfg, 100) == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5)
    assert learning_rate_at(100, cfg, 100) == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 89 / 90)))
    linear = OptimConfig(learning_rate=1e-3, warmup_steps=0, schedule="linear")
    assert learning_rate_at(1, linear, 11) == pytest.approx(1e-3)
    assert learning_rate_at(11, linear, 11) == pytest.approx(1e-3 / 11)
    constant = OptimConfig(learning_rate=2e-4, warmup_steps=4, schedule="constant")
    assert [learning_rate_at(k, constant, 50) for k in (1, 4, 50)] == pytest.approx([5e-5, 2e-4, 2e-4])
    for k in (1, 7, 10, 11, 60, 100):  # the traced version agrees with the Python one
        assert learning_rate_at(mx.array(k), cfg, 100).item() == pytest.approx(learning_rate_at(k, cfg, 100), rel=1e-5)
    flat = OptimConfig(learning_rate=3e-4, warmup_steps=0, schedule="constant")
    assert isinstance(learning_rate_at(mx.array(5), flat, 10), mx.array)
    assert learning_rate_at(mx.array(5), flat, 10).item() == pytest.approx(3e-4)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_every_step_trains(schedule):
    """No warmup: step 1 uses the peak; the last step (even of a one-step run) stays above 0."""
    cfg = OptimConfig(learning_rate=1e-3, warmup_steps=0, schedule=schedule)
    for total in (1, 2, 5):
        rates = [learning_rate_at(k, cfg, total) for k in range(1, total + 1)]
        assert rates[0] == pytest.approx(1e-3) and rates[-1] > 1e-6, (total, rates)
        assert rates == sorted(rates, reverse=True)


@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
def test_adam_bias_correction_is_mlx_lms_by_default_and_pytorchs_on_request(optimizer):
    """A constant gradient of 1: the first update is lr * (1 - b1) / sqrt(1 - b2) = 3.16 lr as MLX
    and mlx-lm compute it, and lr exactly with bias correction (as PyTorch's AdamW)."""
    first_updates = []
    for corrected in (False, True):
        opt = build_optimizer(OptimConfig(optimizer=optimizer, learning_rate=1e-3, warmup_steps=0,
                                          schedule="constant", bias_correction=corrected), total_steps=10)
        params = {"w": mx.zeros((3,))}
        opt.init(params)
        first_updates.append(-opt.apply_gradients({"w": mx.ones((3,))}, params)["w"][0].item())
    assert first_updates[0] == pytest.approx(1e-3 * 0.1 / math.sqrt(0.001), rel=1e-3)
    assert first_updates[1] == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per-tensor"])
@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
def test_bias_correction_counts_only_the_updates_applied(optimizer, flat):
    """A discarded update (here a window without a supervised token) leaves the next update as
    it would have been: Adam's moments were not updated, so their correction must not count it
    (it did, and the first real update came out 0.74 of its size). The schedule still counts it."""

    def loss(model, x, weights):
        tokens = weights.sum()
        return (model(x).squeeze(-1) * weights).sum() / mx.maximum(tokens, 1), tokens

    x = mx.array([[1.0, 2.0], [3.0, -1.0]])
    supervised, unsupervised = (x, mx.array([1.0, 1.0])), (x, mx.array([0.0, 0.0]))
    cfg = OptimConfig(optimizer=optimizer, learning_rate=0.1, warmup_steps=0, schedule="constant",
                      bias_correction=True)
    weights, counts = [], []
    for windows in ([supervised, supervised], [unsupervised, supervised, supervised]):
        layer = nn.Linear(2, 1)
        layer.update(tree_map(mx.zeros_like, layer.parameters()))
        opt = build_optimizer(cfg, total_steps=10)
        step = build_step(layer, opt, loss, flat=flat)
        for batch in windows:
            mx.eval(step(batch, None, True)[0].applied, step.state)
        weights.append(layer.weight)
        counts.append(dict(tree_flatten(optimizer_state(opt, step.layout))))
    assert mx.allclose(weights[0], weights[1], rtol=1e-6, atol=0).item(), (weights[0], weights[1])
    # The first update is the learning rate exactly, whatever came before it.
    assert abs(weights[0][0, 0].item()) > 0.1
    assert [c["applied_updates"].item() for c in counts] == [2, 2]  # saved with the moments
    assert [c["step"].item() for c in counts] == [2, 3]


def test_older_checkpoints_count_every_step_as_applied():
    """Optimizer state saved before the applied count existed: its runs corrected by the step."""
    opt = build_optimizer(OptimConfig(bias_correction=True), total_steps=10)
    opt.init({"w": mx.zeros((3,))})
    moments = {"w.m": mx.ones((3,)), "w.v": mx.ones((3,))}
    load_state(opt, {"step": mx.array(7, mx.uint64), "learning_rate": mx.array(1e-3), **moments}, "opt")
    assert opt.state["applied_updates"].item() == 7 and opt.state["w"]["m"].tolist() == [1, 1, 1]
    load_state(opt, {"step": mx.array(7, mx.uint64), "applied_updates": mx.array(5, mx.uint64), **moments}, "opt")
    assert opt.state["applied_updates"].item() == 5


@pytest.mark.parametrize("saved, message", [
    ({}, "has no 'w.m'; the checkpoint is damaged"),
    ({"w.m": mx.ones((3,))}, "has no 'w.v'"),
    ({"w.m": mx.ones((3,)), "w.v": mx.ones((4,))}, r"'w.v' has shape \(4,\), but this run's parameter needs \(3,\)"),
    ({"w.m": mx.ones((3,)), "w.v": mx.ones((3,)), "x.m": mx.ones((3,))}, "holds 'x.m', which this run's optimizer"),
    ({"w.m": mx.ones((3,)), "w.v": mx.ones((3,)), "step": mx.ones((3,))}, "holds a non-scalar 'step'"),
])
def test_optimizer_state_of_other_parameters_is_refused_by_name(saved, message):
    # An empty or another run's optimizer.safetensors resumed with fresh moments, without a word.
    opt = build_optimizer(OptimConfig(), total_steps=10)
    opt.init({"w": mx.zeros((3,))})
    with pytest.raises(UserError, match=f"^run/optimizer.safetensors:? {message}"):
        load_state(opt, saved, "run/optimizer.safetensors")


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


@pytest.mark.parametrize("finetune, dtype, flat", [("full", mx.bfloat16, False), ("full", mx.bfloat16, True),
                                                   ("full", mx.float16, False), ("lora", mx.bfloat16, None)],
                         ids=["bf16-full", "bf16-full-flat", "fp16-full", "bf16-lora"])
def test_update_keeps_parameter_dtypes(small_vocab_dir, finetune, dtype, flat):
    """A bf16 model fully fine-tuned stays bf16 (a float32 token count once promoted every
    weight to float32); float16 weights stay float16 and finite (Adam's moments in float16 give
    NaN); half-precision weights have float32 masters and moments, of which they are the
    rounding; LoRA adapters stay float32, with no masters."""
    model, _, _, _ = models.load(str(small_vocab_dir), {mx.bfloat16: "bfloat16", mx.float16: "float16"}[dtype])
    lora.apply(model, AdapterConfig(finetune=finetune, rank=4), seed=0)
    before = dict(tree_flatten(model.parameters()))
    opt = optim.AdamW(learning_rate=1e-2, weight_decay=0.1)
    step = build_step(model, opt, loss_fn, max_grad_norm=1.0, flat=flat)
    result, _ = step(make_batch(uneven_rows(), 6, 4).arrays(), None, True, LossScaler(dtype == mx.float16).array)
    mx.eval(step.state)
    assert result.applied.item()
    trainable = dict(tree_flatten(model.trainable_parameters()))
    wanted = mx.float32 if finetune == "lora" else dtype
    for name, value in tree_flatten(model.parameters()):
        assert value.dtype == (wanted if name in trainable else dtype), name
    assert all(mx.isfinite(v).all().item() for v in trainable.values())
    assert any(not mx.array_equal(v, before[k]).item() for k, v in trainable.items())
    moments = dict(tree_flatten(optimizer_state(opt, step.layout)))
    assert {v.dtype for k, v in moments.items() if k not in ("step", "learning_rate")} == {mx.float32}
    masters = {k[len(MASTER_KEY) + 1:]: v for k, v in moments.items() if k.startswith(MASTER_KEY + ".")}
    assert masters.keys() == (trainable.keys() if finetune == "full" else set())
    for name, master in masters.items():
        assert mx.array_equal(master.astype(dtype), trainable[name]).item(), name


def test_float16_loss_scale_starts_usable(small_vocab_dir):
    """The scale multiplies the mean loss: at a few hundred supervised tokens the first step of
    a float16 model applies (scaling the summed loss overflowed until the scale fell ~2**8)."""
    model, _, _, _ = models.load(str(small_vocab_dir), "float16")
    lora.apply(model, AdapterConfig(rank=4), seed=0)
    mx.random.seed(1)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.05, model.trainable_parameters()))
    rng = np.random.default_rng(5)
    rows = [Example(rng.integers(0, 2000, size=100).astype(np.int32), np.arange(100) >= 20) for _ in range(4)]
    step = build_step(model, optim.AdamW(learning_rate=1e-3), loss_fn, max_grad_norm=1.0)
    scaler = LossScaler(True)
    result, _ = step(make_batch(rows, 4, 4).arrays(), None, True, scaler.array)
    assert result.tokens.item() > 300 and result.applied.item()



def bf16_full_model(model_dir, dtype=mx.bfloat16):
    """The tiny model in bf16, fully fine-tuned; ``dtype`` converts those same weights."""
    model, _, _, _ = models.load(str(model_dir), "bfloat16")
    lora.apply(model, AdapterConfig(finetune="full", rank=4), seed=0)
    model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))
    return model


def test_bf16_full_fine_tuning_keeps_float32_masters(small_vocab_dir):
    """At lr 1e-6 an Adam step (~1e-6) is far below a bf16 weight's spacing (~1e-4 at 0.02):
    updated in bf16 nearly every weight stays put. The float32 masters follow the float32 run of
    the same weights (up to bf16 compute), and the bf16 weights, their rounding, start to move."""
    batch = make_batch(uneven_rows()[:4], 4, 4).arrays()
    start = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(bf16_full_model(small_vocab_dir).trainable_parameters())}

    def moved(params):
        return {k: np.array(v.astype(mx.float32)) - start[k] for k, v in params.items()}

    runs = {}
    for dtype in (mx.bfloat16, mx.float32):
        model = bf16_full_model(small_vocab_dir, dtype)
        opt = optim.Adam(learning_rate=1e-6)
        step = build_step(model, opt, loss_fn)
        for _ in range(4):
            result, _ = step(batch, None, update=True)
            mx.eval(step.state)
            assert result.applied.item()
        runs[dtype] = model, opt
    model, opt = runs[mx.bfloat16]
    params = dict(tree_flatten(model.trainable_parameters()))
    masters = dict(tree_flatten(opt.state[MASTER_KEY]))
    assert MASTER_KEY not in runs[mx.float32][1].state
    assert {v.dtype for v in params.values()} == {mx.bfloat16} and {v.dtype for v in masters.values()} == {mx.float32}
    assert all(mx.array_equal(masters[k].astype(mx.bfloat16), v).item() for k, v in params.items())

    # The same four steps entirely in bf16 (what the step did before the masters).
    pure = bf16_full_model(small_vocab_dir)
    pure_opt = optim.Adam(learning_rate=1e-6)
    grad_fn = nn.value_and_grad(pure, lambda m, *b: loss_fn(m, *b)[0])
    for _ in range(4):
        _, grads = grad_fn(pure, *batch)
        pure.update(pure_opt.apply_gradients(grads, pure.trainable_parameters()))
        mx.eval(pure.parameters(), pure_opt.state)
    pure = dict(tree_flatten(pure.trainable_parameters()))
    assert {v.dtype for v in pure.values()} == {mx.bfloat16}

    reference = moved(dict(tree_flatten(runs[mx.float32][0].trainable_parameters())))
    norm = math.sqrt(sum(float((d ** 2).sum()) for d in reference.values()))

    def error(params):  # distance of the trajectory from the float32 one, relative to its length
        return math.sqrt(sum(float(((d - reference[k]) ** 2).sum()) for k, d in moved(params).items())) / norm

    def fraction_moved(params):
        return sum(int((d != 0).sum()) for d in moved(params).values()) / sum(d.size for d in reference.values())

    assert error(masters) < 0.15  # measured 0.06: the forward and backward passes run in bf16
    assert error(pure) > 0.9  # measured 0.99: the update rounds away
    assert fraction_moved(masters) == 1.0
    assert fraction_moved(params) > 2 * fraction_moved(pure)  # measured 5.6% against 1.4%


def test_lora_on_bf16_has_no_masters(small_vocab_dir):
    """Float32 adapters on a bf16 model: no master copies, state as before (flat moments)."""
    model, _, _, _ = models.load(str(small_vocab_dir), "bfloat16")
    lora.apply(model, AdapterConfig(rank=4), seed=0)
    opt = optim.AdamW(learning_rate=1e-2)
    step = build_step(model, opt, loss_fn, max_grad_norm=1.0)
    assert step.layout is not None
    result, _ = step(make_batch(uneven_rows()[:2], 2, 4).arrays(), None, update=True)
    mx.eval(step.state)
    assert result.applied.item() and MASTER_KEY not in opt.state
    assert set(opt.state) == {"step", "learning_rate", "_flat_trainables"}
    assert not any(k.startswith(MASTER_KEY) for k in dict(tree_flatten(optimizer_state(opt, step.layout))))


@pytest.mark.parametrize("flat", [False, True], ids=["per-tensor", "flat"])
def test_bf16_masters_resume_exactly_and_survive_skipped_steps(small_vocab_dir, tmp_path, flat):
    """The masters live in the optimizer state: a checkpoint of it (as the trainer saves and
    restores it) continues exactly like an uninterrupted run; a non-finite step leaves them."""
    rows = uneven_rows()
    batches = [make_batch(rows[i:i + 2], 2, 4).arrays() for i in (0, 2, 4)]

    def train(model, opt, parts, loss=loss_fn):
        step = build_step(model, opt, loss, max_grad_norm=1.0, flat=flat)
        assert (step.layout is not None) == flat
        for batch in parts:
            result, _ = step(batch, None, update=True)
            mx.eval(step.state)
        return step, result

    def state(model, opt, layout):
        return (dict(tree_flatten(model.trainable_parameters())), dict(tree_flatten(optimizer_state(opt, layout))))

    model, opt = bf16_full_model(small_vocab_dir), optim.AdamW(learning_rate=1e-5, weight_decay=0.1)
    step, _ = train(model, opt, batches[:1])
    weights, moments = state(model, opt, step.layout)
    assert any(k.startswith(MASTER_KEY + ".") for k in moments)
    mx.save_safetensors(str(tmp_path / "weights.safetensors"), weights)
    mx.save_safetensors(str(tmp_path / "optimizer.safetensors"), moments)
    step, _ = train(model, opt, batches[1:])
    expected = state(model, opt, step.layout)

    # A skipped (non-finite) step changes neither the weights nor the masters nor the moments.
    def exploding(m, *b):
        loss, n = loss_fn(m, *b)
        return loss * mx.array(float("inf")), n

    step, result = train(model, opt, batches[:1], exploding)
    assert not result.applied.item()
    for got, want in zip(state(model, opt, step.layout), expected):
        assert all(mx.array_equal(got[k], want[k]).item() for k in want if k != "step")

    # Restored as the trainer does: fresh model and optimizer, init, then the saved state.
    resumed, opt = bf16_full_model(small_vocab_dir), optim.AdamW(learning_rate=1e-5, weight_decay=0.1)
    resumed.load_weights(list(mx.load(str(tmp_path / "weights.safetensors")).items()), strict=False)
    opt.init(resumed.trainable_parameters())
    opt.state.update(tree_unflatten(list(mx.load(str(tmp_path / "optimizer.safetensors")).items())))
    step, _ = train(resumed, opt, batches[1:])
    got = state(resumed, opt, step.layout)
    for got_part, want_part in zip(got, expected):
        assert got_part.keys() == want_part.keys()
        for name, value in want_part.items():
            assert value.dtype == got_part[name].dtype and mx.array_equal(got_part[name], value).item(), name


@pytest.fixture(scope="module")
def small_vocab_lfm2_dir(tmp_path_factory):
    from conftest import LFM2_CONFIG

    return write_model(tmp_path_factory.mktemp("small-vocab-lfm2"), {**LFM2_CONFIG, "vocab_size": 2048})


@pytest.mark.parametrize("family, trainer_paths", [("llama", False), ("lfm2", False), ("lfm2", True)],
                         ids=["llama", "lfm2", "lfm2-recompute-mlp-normed-checkpointed"])
def test_adapters_cast_once_compute_what_each_layer_cast_computes(family, trainer_paths, small_vocab_dir,
                                                                  small_vocab_lfm2_dir, monkeypatch):
    """A bf16 model's float32 adapters go to their layers as one bf16 vector and come back as
    one: the same parameters and moments, bit for bit, as each layer casting its own, through
    a window of two micro-batches and the update; the model keeps its float32 adapters. Also
    through the layers' own backward passes the trainer installs (the MLP computed again, the
    norms recorded, a layer checkpointed)."""
    import mlxft.step
    from mlxft import fastmath, normed

    model_dir = small_vocab_dir if family == "llama" else small_vocab_lfm2_dir
    rows = uneven_rows()

    def run(cast_once: bool):
        if not cast_once:
            monkeypatch.setattr(mlxft.step, "_adapter_cast", lambda model, layout: None)
        model, _, _, _ = models.load(str(model_dir), "bfloat16")
        lora.apply(model, AdapterConfig(rank=4), seed=0)
        mx.random.seed(1)
        model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.05, model.trainable_parameters()))
        if trainer_paths:
            assert fastmath.enable(model, recompute_mlp=True) and normed.enable(model)
            models.checkpoint_layers(model, 1, False)
        opt = optim.Adam(learning_rate=1e-2)
        step = build_step(model, opt, loss_fn, max_grad_norm=1.0)
        monkeypatch.undo()
        assert (step.adapter_cast is not None and step.adapter_cast == mx.bfloat16) is cast_once
        window = None
        for i, part in enumerate([rows[:3], rows[3:]] * 2):
            result, window = step(make_batch(part, 3, 4).arrays(), window, update=i % 2 == 1)
            mx.eval(step.state, window)
            assert {v.dtype for _, v in tree_flatten(model.trainable_parameters())} == {mx.float32}
        state = dict(tree_flatten(optimizer_state(opt, step.layout)))
        return dict(tree_flatten(model.trainable_parameters())), state, result.grad_norm.item()

    cast_params, cast_state, cast_norm = run(True)
    params, state, norm = run(False)
    assert cast_norm == norm
    for name, value in params.items():
        assert mx.array_equal(cast_params[name], value).item(), name
    assert cast_state.keys() == state.keys()
    for name, value in state.items():
        assert mx.array_equal(cast_state[name], value).item(), name


def test_adapters_are_cast_once_only_where_layers_would_cast_them(small_vocab_dir):
    """Float32 models, DoRA (which computes in float32) and full fine-tuning keep their own arithmetic."""
    for dtype, finetune in (("float32", "lora"), ("bfloat16", "dora"), ("bfloat16", "full")):
        model, _, _, _ = models.load(str(small_vocab_dir), dtype)
        lora.apply(model, AdapterConfig(rank=4, finetune=finetune), seed=0)
        assert build_step(model, optim.Adam(learning_rate=1e-2), loss_fn).adapter_cast is None, (dtype, finetune)


def test_update_reads_the_trainables_a_user_replaced_or_wrote_into_between_steps(small_vocab_dir):
    """Between steps a user may load other adapters or write into one in place; the next update
    starts from what the model holds then, not from what the last update wrote."""
    rows = uneven_rows()
    model = lora_model(small_vocab_dir)
    opt = optim.Adam(learning_rate=1e-2)
    step = build_step(model, opt, loss_fn, max_grad_norm=1.0)
    assert step.layout is not None
    for _ in range(2):
        step(make_batch(rows, 6, 4).arrays(), None, True)
        mx.eval(step.state)
    mx.random.seed(7)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.05, model.trainable_parameters()))
    first = model.layers[0].self_attn.q_proj
    first.lora_b[...] = 0.25  # the same array object, new values
    expected = {k: mx.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    opt.learning_rate = 0.0  # an update that moves nothing: the model keeps what the update read
    step(make_batch(rows, 6, 4).arrays(), None, True)
    mx.eval(step.state)
    for name, value in tree_flatten(model.trainable_parameters()):
        assert mx.array_equal(expected[name], value).item(), name


def test_per_tensor_clipping_ignores_the_window_gradients_memory_layout(small_vocab_dir):
    """A window's gradient sums come from the matmul backward as column-major (transposed)
    arrays; restored from a checkpoint they are row-major. Clipped per tensor, the same values
    in either layout give the same norm and the same weights, to the bit (a float32 sum's order
    followed the layout, so a resumed full fine-tune differed by an ulp)."""
    rows = uneven_rows()

    def full_model():
        model, _, _, _ = models.load(str(small_vocab_dir), "float32")
        lora.apply(model, AdapterConfig(finetune="full", rank=4), seed=0)
        return model

    def build(model):
        step = build_step(model, optim.AdamW(learning_rate=1e-3), loss_fn, max_grad_norm=1.0, flat=False)
        assert step.layout is None
        return step

    _, window = build(full_model())(make_batch(rows[:3], 3, 4).arrays(), None, update=False)
    mx.eval(window)
    grads, loss_sum, tokens = window
    # As a checkpoint restores them (np.array alone would keep a column-major array's order).
    row_major = tree_map(lambda g: mx.array(np.ascontiguousarray(np.array(g))), grads)
    column_major = [k for k, g in tree_flatten(grads) if g.ndim == 2 and not memoryview(g).c_contiguous]
    assert column_major and all(memoryview(g).c_contiguous for _, g in tree_flatten(row_major))
    results = []
    for sums in (grads, row_major):
        model = full_model()
        step = build(model)
        result, _ = step(make_batch(rows[3:], 3, 4).arrays(), (sums, loss_sum, tokens), update=True)
        mx.eval(step.state)
        results.append((result.grad_norm, dict(tree_flatten(model.trainable_parameters()))))
    (norm, params), (restored_norm, restored_params) = results
    assert norm.item() > 1.0  # the clip really scales the gradients
    assert norm.item() == restored_norm.item()
    for name, value in params.items():
        assert mx.array_equal(restored_params[name], value).item(), name
