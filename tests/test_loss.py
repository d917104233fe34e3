"""The loss: exact against float64, blind to masked tokens, equal on both head paths."""

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxft import lora, memory, models
from mlxft.config import AdapterConfig
from mlxft.data import Example, make_batch
from mlxft.errors import UserError
from mlxft import loss as loss_module
from mlxft.loss import cross_entropy, hidden_loss, loss_fn, token_cross_entropy
from conftest import VOCAB


def brute_force(logits, targets, weights, smoothing):
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll = -logp[np.arange(len(targets)), targets]
    smooth = -logp.mean(-1)
    per_token = (1 - smoothing) * nll + smoothing * smooth
    return (per_token * weights).sum() / weights.sum(), weights.sum()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_matches_float64(smoothing):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(37, 501)).astype(np.float32) * 4
    targets = rng.integers(0, 501, size=37)
    weights = (rng.random(37) > 0.3).astype(np.float32)
    loss, n = cross_entropy(mx.array(logits), mx.array(targets), mx.array(weights), smoothing)
    expected, expected_n = brute_force(logits, targets, weights, smoothing)
    assert n.item() == expected_n
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def _load_lora(model_dir, dropout=0.0):
    model, tokenizer, _, _ = models.load(str(model_dir), "float32")
    lora.apply(model, AdapterConfig(rank=4, dropout=dropout), seed=0)
    # Non-zero B so the adapters affect the output and receive full gradients.
    model.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.05, model.trainable_parameters()))
    return model


def _rows(seed=0):
    """Rows with a prompt, a supervised middle and an unsupervised tail."""
    rng = np.random.default_rng(seed)
    rows = []
    for n in (9, 14, 5):
        ids = rng.integers(0, 1000, size=n).astype(np.int32)
        mask = np.zeros(n, bool)
        mask[n // 3 : n - 1] = True
        rows.append(Example(ids, mask))
    return rows


def test_masked_tokens_do_not_move_loss_or_gradients(model_dir):
    """Rewriting every token after the last supervised target (unsupervised targets) and
    every padding token leaves the loss and all gradients unchanged."""
    model = _load_lora(model_dir)
    grad_fn = nn.value_and_grad(model, lambda m, *b: loss_fn(m, *b)[0])
    rows = _rows()
    base = make_batch(rows, 4, 8)
    loss, grads = grad_fn(model, *base.arrays())

    changed = []
    for e in rows:
        ids = e.ids.copy()
        last = np.nonzero(e.mask)[0].max()
        ids[last + 1 :] = 777
        changed.append(Example(ids, e.mask))
    other = make_batch(changed, 4, 8)
    for row, e in enumerate(rows):
        other.inputs[row, len(e.ids) - 1 :] = 123
    assert not np.array_equal(other.inputs, base.inputs)
    loss2, grads2 = grad_fn(model, *other.arrays())
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-6)
    for (k, g), (_, g2) in zip(tree_flatten(grads), tree_flatten(grads2)):
        np.testing.assert_allclose(np.array(g2), np.array(g), rtol=1e-5, atol=1e-7, err_msg=k)
    assert base.supervised == sum(int(e.mask[1:].sum()) for e in rows)


def test_weighted_positions_ignore_their_targets():
    logits = mx.random.normal((6, 50))
    weights = mx.array([1, 1, 0, 1, 0, 0], dtype=mx.float32)
    a = cross_entropy(logits, mx.array([1, 2, 3, 4, 5, 6]), weights)[0]
    b = cross_entropy(logits, mx.array([1, 2, 40, 4, 41, 42]), weights)[0]
    assert a.item() == b.item()


def test_projected_head_equals_full_logits(model_dir, monkeypatch):
    """Projecting only supervised positions gives the loss and gradients of full logits."""
    model = _load_lora(model_dir)
    batch = make_batch(_rows(1), 4, 8).arrays()
    grad_fn = nn.value_and_grad(model, lambda m, *b: loss_fn(m, *b)[0])
    loss, grads = grad_fn(model, *batch)
    monkeypatch.setattr("mlxft.loss.output_head", lambda m: None)
    loss_full, grads_full = grad_fn(model, *batch)
    assert loss.item() == pytest.approx(loss_full.item(), rel=1e-5)
    for (k, g), (_, g2) in zip(tree_flatten(grads), tree_flatten(grads_full)):
        np.testing.assert_allclose(np.array(g), np.array(g2), rtol=1e-4, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("count,keep_mlp", [(0, False), (1, False), (0, True)])
def test_gradient_checkpointing_changes_nothing_but_memory(model_dir, count, keep_mlp):
    model = _load_lora(model_dir)
    batch = make_batch(_rows(2), 4, 8).arrays()
    grad_fn = nn.value_and_grad(model, lambda m, *b: loss_fn(m, *b)[0])
    loss, grads = grad_fn(model, *batch)
    models.checkpoint_layers(model, count, keep_mlp)
    assert type(model.layers[0]).__name__ == type(model.layers[0]).__mro__[1].__name__
    assert models.is_checkpointed(model.layers[0]) and not models.is_checkpointed(_load_lora(model_dir).layers[0])
    assert [models.is_checkpointed(layer) for layer in model.layers[1:]] == [not count] * (len(model.layers) - 1)
    if not count and not keep_mlp:  # the settings a model cannot take, once
        with pytest.raises(UserError, match="model.checkpoint_layers: 99 exceeds the model's"):
            models.checkpoint_layers(_load_lora(model_dir), 99)
        other_family = _load_lora(model_dir)
        other_family.model_type = "qwen2"  # one whose layer parts checkpoint_keep_mlp does not name
        with pytest.raises(UserError, match="model.checkpoint_keep_mlp: not supported for qwen2 models"):
            models.checkpoint_layers(other_family, 0, keep_mlp=True)
    loss2, grads2 = grad_fn(model, *batch)
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-6)
    assert [k for k, _ in tree_flatten(grads)] == [k for k, _ in tree_flatten(grads2)]
    # keep_mlp computes the SwiGLU with mlxft's own exp on the CPU, within 3e-7 of MLX's.
    tolerance = {"rtol": 1e-4, "atol": 1e-6} if keep_mlp else {"rtol": 1e-5, "atol": 1e-7}
    for (k, g), (_, g2) in zip(tree_flatten(grads), tree_flatten(grads2)):
        np.testing.assert_allclose(np.array(g2), np.array(g), err_msg=k, **tolerance)


@pytest.mark.parametrize("keep_mlp", [False, True])
def test_recomputed_layers_draw_the_forward_passes_dropout_masks(model_dir, keep_mlp, monkeypatch):
    # With mx.checkpoint made a pass-through, the same layers draw the same masks from the same
    # keys without recomputing: the gradient of exactly the function the forward pass computed.
    # A recomputation drawing fresh masks from MLX's global random state was off by up to 80%.
    batch = make_batch(_rows(2), 4, 8).arrays()

    def gradients():
        model = _load_lora(model_dir, dropout=0.5)
        models.checkpoint_layers(model, 0, keep_mlp)
        model.train()
        mx.random.seed(3)
        loss, grads = nn.value_and_grad(model, lambda m, *b: loss_fn(m, *b)[0])(model, *batch)
        mx.eval(loss, grads)
        return loss, grads

    mx.random.seed(0)
    recomputed = gradients()
    monkeypatch.setattr(mx, "checkpoint", lambda fn: fn)
    mx.random.seed(0)
    kept = gradients()
    assert recomputed[0].item() == pytest.approx(kept[0].item(), rel=1e-6)
    for (k, g), (_, g2) in zip(tree_flatten(recomputed[1]), tree_flatten(kept[1])):
        np.testing.assert_allclose(np.array(g), np.array(g2), rtol=1e-4, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_chunked_loss_equals_the_whole(model_dir, finetune):
    """Scoring supervised positions in recomputed chunks changes neither loss nor gradients,
    including the output head's (tied embedding or lm_head) under full fine-tuning."""
    model, *_ = models.load(str(model_dir), "float32")
    lora.apply(model, AdapterConfig(rank=4, finetune=finetune), seed=0)
    rng = np.random.default_rng(3)
    rows = []
    for n in (40, 23, 31):
        mask = np.ones(n, bool)
        mask[: n // 4] = False
        rows.append(Example(rng.integers(10, 5000, size=n).astype(np.int32), mask))
    batch = make_batch(rows, 3, 8).arrays()
    count = batch[1].shape[0]
    assert count > 2 * 34 and count % 34 and batch[3][count // 34 * 34:].sum() > 0  # the last chunk: short, supervised

    def loss_and_grads(chunk):
        grad_fn = nn.value_and_grad(model, lambda m, *a: loss_fn(m, *a, label_smoothing=0.1, chunk=chunk)[0])
        loss, grads = grad_fn(model, *batch)
        return loss.item(), dict(tree_flatten(grads))

    whole, whole_grads = loss_and_grads(0)
    chunked, chunked_grads = loss_and_grads(34)
    assert chunked == pytest.approx(whole, rel=1e-6)
    assert whole_grads.keys() == chunked_grads.keys()
    for name, g in whole_grads.items():
        np.testing.assert_allclose(np.array(chunked_grads[name]), np.array(g), rtol=1e-4, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_token_cross_entropy_backward_equals_autograd(dtype, smoothing):
    """The written-out backward gives MLX's autograd gradient, in the logits' own dtype,
    compiled or not."""
    rng = np.random.default_rng(1)
    logits = mx.array(rng.normal(size=(29, 301)).astype(np.float32) * 3).astype(dtype)
    targets = mx.array(rng.integers(0, 301, size=29))
    weights = mx.array(rng.random(29).astype(np.float32))

    def ours(x):
        return (token_cross_entropy(x, targets, smoothing) * weights).sum()

    def autograd(x):
        ce = nn.losses.cross_entropy(x.astype(mx.float32), targets, label_smoothing=smoothing, reduction="none")
        return (ce * weights).sum()

    expected_value, expected = mx.value_and_grad(autograd)(logits)
    for fn in (mx.value_and_grad(ours), mx.compile(mx.value_and_grad(ours))):
        value, grad = fn(logits)
        assert grad.dtype == dtype
        assert value.item() == pytest.approx(expected_value.item(), rel=1e-6)
        np.testing.assert_allclose(np.array(grad.astype(mx.float32)), np.array(expected.astype(mx.float32)),
                                   rtol=1e-2 if dtype == mx.bfloat16 else 1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,bound", [(mx.bfloat16, 1.6), (mx.float32, 1.1)])
def test_compiled_cross_entropy_gradient_keeps_no_float32_vocabulary_temporaries(dtype, bound):
    """Compiled, the gradient costs the forward's float32 copy of the logits (for the
    log-partition) plus the gradient in the logits' dtype; autograd of the plain expression
    costs twice that (3.0 and 2.0 units of N x vocab x 4 bytes when measured)."""
    count, vocab = 256, 32000
    logits = (mx.random.normal((count, vocab), key=mx.random.key(0)) * 3).astype(dtype)
    targets = mx.random.randint(0, vocab, (count,), key=mx.random.key(1))
    mx.eval(logits, targets)
    grad = mx.compile(mx.grad(lambda x: token_cross_entropy(x, targets).sum()))
    assert memory._probe(grad, logits) / (count * vocab * 4) <= bound


@pytest.mark.parametrize("quantize", [0, 4])
@pytest.mark.parametrize("smoothing,chunk", [(0.0, 0), (0.1, 16)])
def test_head_gradient_in_the_forward_pass_equals_the_backward_passes(model_dir, quantize, smoothing, chunk):
    """The training loss, whose frozen head's input gradient is computed in the forward pass a
    chunk at a time, gives the loss and adapter gradients of the plain cross-entropy, for a
    float and a quantized head."""
    model, *_ = models.load(str(model_dir), "float32", quantize=quantize)
    lora.apply(model, AdapterConfig(rank=4), seed=0)
    model.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.05, model.trainable_parameters()))
    assert loss_module.frozen_head(model) is not None
    batch = make_batch(_rows(4) + _rows(5), 6, 8).arrays()
    assert batch[1].shape[0] > 2 * 16

    def loss_and_grads(training):
        grad_fn = nn.value_and_grad(model, lambda m, *a: loss_fn(m, *a, label_smoothing=smoothing, chunk=chunk,
                                                                 training=training)[0])
        loss, grads = grad_fn(model, *batch)
        return loss.item(), dict(tree_flatten(grads))

    # Scaled per token before or after the head's matmul: float32 rounding apart.
    assert_same_loss_and_gradients(loss_and_grads(True), loss_and_grads(False), spread=1e-4)


def test_a_large_vocabularys_default_head_chunk_is_floored_and_its_chunks_add_up(model_dir, monkeypatch):
    """Qwen3's 151,936-row head on the CPU: the default chunk (8M logits over the vocabulary)
    rounds below 64 tokens and is floored there, and the chunks, the last one short, give the
    plain loss's loss and gradients. The test models' 8,256-row head takes any test batch in
    one chunk, so the logit budget is scaled down to give Qwen3's chunk."""
    monkeypatch.setattr(loss_module, "_head_chunk_logits", lambda: 2**23 * VOCAB // 151936)
    chunks = []
    scored = loss_module.loss_and_logit_gradient
    monkeypatch.setattr(loss_module, "loss_and_logit_gradient",
                        lambda scores, logits, *rest: chunks.append(logits.shape[0]) or scored(scores, logits, *rest))
    model, *_ = models.load(str(model_dir), "float32")
    lora.apply(model, AdapterConfig(rank=4), seed=0)
    model.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.05, model.trainable_parameters()))
    batch = make_batch([row for seed in range(5) for row in _rows(seed)], 15, 6).arrays()  # 144 positions
    count = batch[1].shape[0]
    assert count > 2 * 64 and count % 64

    def loss_and_grads(training):
        grad_fn = nn.value_and_grad(model, lambda m, *a: loss_fn(m, *a, training=training)[0])
        loss, grads = grad_fn(model, *batch)
        return loss.item(), dict(tree_flatten(grads))

    trained = loss_and_grads(True)
    assert chunks == [64] * (count // 64) + [count % 64]
    assert_same_loss_and_gradients(trained, loss_and_grads(False), spread=1e-4)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_gpu_scores_from_the_softmax_match_the_float32_copy(smoothing):
    """A GPU's training loss reads the log-partition off the softmax instead of a float32 copy of
    the logits: in float32 the same to rounding; in bfloat16 a token's loss to 2**-8 of the
    largest probability (under 0.004) and each logit's gradient to one rounding."""
    rng = np.random.default_rng(0)
    # Spread so that some tokens are near certain and others near uniform.
    logits = rng.normal(size=(1024, 3001)).astype(np.float32) * rng.choice([0.3, 3.0, 12.0], size=(1024, 1))
    targets = mx.array(np.where(rng.random(1024) < 0.5, logits.argmax(-1), rng.integers(0, 3001, size=1024)))

    def loss_and_gradient(scores, dtype):
        ce, grad = loss_module.loss_and_logit_gradient(scores, mx.array(logits).astype(dtype), targets, smoothing)
        return np.array(ce), np.array(grad.astype(mx.float32))

    for dtype, loss_tolerance, gradient_tolerance in ((mx.float32, 2e-5, 1e-6), (mx.bfloat16, 4e-3, 2**-8)):
        ce, grad = loss_and_gradient(loss_module._scores_from_softmax, dtype)
        expected_ce, expected_grad = loss_and_gradient(loss_module._scores_on_cpu, dtype)
        assert np.isfinite(ce).all()
        np.testing.assert_allclose(ce, expected_ce, rtol=0, atol=loss_tolerance, err_msg=str(dtype))
        np.testing.assert_allclose(grad, expected_grad, rtol=0, atol=gradient_tolerance, err_msg=str(dtype))
    # The bfloat16 losses' errors do not lean one way (their spread is about 0.0015).
    assert abs((ce - expected_ce).mean()) < 2e-4


def test_gpu_scores_give_the_same_training_loss_and_gradients(model_dir, monkeypatch):
    """Through the whole training loss (float32, as the CPU tests run), the GPU's scores give the
    CPU's loss and adapter gradients."""
    model, *_ = models.load(str(model_dir), "float32")
    lora.apply(model, AdapterConfig(rank=4), seed=0)
    model.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.05, model.trainable_parameters()))
    batch = make_batch(_rows(4) + _rows(5), 6, 8).arrays()

    def loss_and_grads():
        grad_fn = nn.value_and_grad(model, lambda m, *a: loss_fn(m, *a, chunk=16, training=True)[0])
        loss, grads = grad_fn(model, *batch)
        return loss.item(), dict(tree_flatten(grads))

    expected = loss_and_grads()
    monkeypatch.setattr(loss_module, "_device_scores", lambda: loss_module._scores_from_softmax)
    assert_same_loss_and_gradients(loss_and_grads(), expected, spread=1e-4)


def assert_same_loss_and_gradients(actual, expected, spread: float):
    """``(loss, {name: gradient})`` pairs agree: the loss to 1e-6, each gradient to 1e-4 relative
    or ``spread`` of its largest entry (summation order moves the small entries)."""
    assert actual[0] == pytest.approx(expected[0], rel=1e-6)
    assert actual[1].keys() == expected[1].keys()
    for name, g in expected[1].items():
        g = np.array(g)
        np.testing.assert_allclose(np.array(actual[1][name]), g, rtol=1e-4, atol=spread * np.abs(g).max(), err_msg=name)


def test_a_trained_head_keeps_the_backward_pass(model_dir):
    """Full fine-tuning trains the head (tied embedding or lm_head): its gradient needs the
    logits' gradient in the backward pass, so the training loss keeps the plain path."""
    model, *_ = models.load(str(model_dir), "float32")
    lora.apply(model, AdapterConfig(finetune="full"), seed=0)
    assert loss_module.frozen_head(model) is None


@pytest.mark.parametrize("finetune, path", [("lora", "head_cross_entropy"), ("full", "chunked_cross_entropy")])
def test_loss_chunk_takes_the_head_gradient_in_the_forward_pass_unless_the_head_trains(model_dir, monkeypatch,
                                                                                      finetune, path):
    """With --loss-chunk, a frozen head's training loss still computes its input gradient in the
    forward pass; only a trained head takes the recomputed chunks (the same loss and gradients
    either way, so only which path ran tells them apart)."""
    model, *_ = models.load(str(model_dir), "float32")
    lora.apply(model, AdapterConfig(rank=4, finetune=finetune), seed=0)
    taken = []
    for name in ("head_cross_entropy", "chunked_cross_entropy"):
        original = getattr(loss_module, name)
        monkeypatch.setattr(loss_module, name, lambda *a, _name=name, _f=original, **k: taken.append(_name) or _f(*a, **k))
    hidden = mx.random.normal((40, model.args.hidden_size), key=mx.random.key(0))
    targets = mx.random.randint(0, model.args.vocab_size, (40,), key=mx.random.key(1))
    hidden_loss(model, hidden, targets, mx.ones((40,)), chunk=16, training=True)
    assert taken == [path]


def test_head_gradient_in_the_forward_pass_keeps_no_logits(llama_dir):
    """Compiled and paced (see mlxft.memory.pacing_limit), the training loss's gradient holds a
    chunk's logits and their exponentials and gradient at a time (an eighth of the logits'
    bytes each here), where the plain cross-entropy keeps all the logits for the backward
    pass. Unpaced, the CPU backend allocates the chunks as it queues them, most of them at once."""
    model, *_ = models.load(str(llama_dir), "float32")
    lora.apply(model, AdapterConfig(rank=4), seed=0)
    count = 512
    hidden = mx.random.normal((count, model.args.hidden_size), key=mx.random.key(0))
    targets = mx.random.randint(0, model.args.vocab_size, (count,), key=mx.random.key(1))
    weights = mx.ones((count,))
    mx.eval(hidden, targets)

    def peak(training):
        chunk = 64 if training else 0
        grad = mx.compile(mx.grad(lambda h: hidden_loss(model, h, targets, weights, chunk=chunk, training=training)[0]))
        return memory._paced_probe(grad, hidden)

    logits = count * model.args.vocab_size * 4
    plain, fused = peak(False), peak(True)
    assert plain > 0.95 * logits
    assert fused < 0.5 * plain, (fused / logits, plain / logits)  # measured 0.38 against 1.0


OTHER_FAMILIES = {  # plain heads outside models' known list, one with a logit scale, one soft-capped
    "starcoder2": {"model_type": "starcoder2", "norm_epsilon": 1e-5, "tie_word_embeddings": True},
    "granite": {"model_type": "granite", "logits_scaling": 4.0, "embedding_multiplier": 12.0,
                "attention_multiplier": 0.25, "residual_multiplier": 0.22, "attention_bias": False,
                "mlp_bias": False, "tie_word_embeddings": False},
    "gemma2": {"model_type": "gemma2", "head_dim": 16, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 2.0, "sliding_window": 64},
}


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_other_families_project_only_supervised_positions_with_their_own_loss(family, tmp_path):
    from conftest import LLAMA_CONFIG, write_model

    config = {k: v for k, v in LLAMA_CONFIG.items() if k != "model_type"} | OTHER_FAMILIES[family]
    model = models.load(str(write_model(tmp_path / family, config)), "float32")[0]
    assert models.output_head(model) is not None  # found by the load's probe
    model.unfreeze()  # the head trains too: its gradient must pass any transform the family applies
    rng = np.random.default_rng(0)
    inputs = mx.array(rng.integers(3, 1000, size=(2, 12)))
    positions = mx.array([3, 4, 5, 6, 15, 16, 17, 20, 21, 22])
    targets = mx.array(rng.integers(3, 1000, size=10))
    weights = mx.array([1.0] * 9 + [0.0])

    def whole(model):
        logits = model(inputs)
        return cross_entropy(logits.reshape(-1, logits.shape[-1])[positions], targets, weights)[0]

    expected, expected_grads = nn.value_and_grad(model, whole)(model)
    for chunk in (0, 4):
        def ours(model):
            return loss_fn(model, inputs, positions, targets, weights, chunk=chunk, training=True)[0]

        loss, grads = nn.value_and_grad(model, ours)(model)
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
        for (name, g), (_, e) in zip(tree_flatten(grads), tree_flatten(expected_grads)):
            assert mx.allclose(g, e, atol=1e-6, rtol=1e-4).item(), (family, chunk, name)


def test_a_family_whose_transform_is_unknown_keeps_its_own_logits(tmp_path, monkeypatch):
    from conftest import LLAMA_CONFIG, write_model

    monkeypatch.setattr(models, "_logit_transforms", lambda model: [None])  # Granite's scaling unknown
    config = {k: v for k, v in LLAMA_CONFIG.items() if k != "model_type"} | OTHER_FAMILIES["granite"]
    model = models.load(str(write_model(tmp_path / "granite", config)), "float32")[0]
    assert models.output_head(model) is None


def test_a_mixture_of_experts_in_half_precision_on_the_cpu_is_one_line(tmp_path):
    from conftest import LLAMA_CONFIG, write_model

    config = {k: v for k, v in LLAMA_CONFIG.items() if k != "model_type"} | {
        "model_type": "qwen3_moe", "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    path = str(write_model(tmp_path / "moe", config))
    assert models.output_head(models.load(path, "float32")[0]) is not None
    if mx.default_device() == mx.cpu:  # MLX's CPU GatherMM is float32 only: it had failed in a traceback
        with pytest.raises(UserError, match="mixture-of-experts layers compute in float32 only"):
            models.load(path, "bfloat16")
