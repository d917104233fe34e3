"""Against the real thing: transformers + PEFT on PyTorch's CPU build.

mlxft's PEFT export loads with ``PeftModel.from_pretrained`` and gives mlxft's logits; an
adapter PEFT itself wrote (rsLoRA, DoRA, a subset of layers and modules) loads into mlxft with
PEFT's logits and can continue training; the fused directory loads in transformers with the
same logits. For a Llama and an LFM2 model.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PEFT tests need PyTorch: pip install -e '.[test]' (torch==2.13.0, CPU)")
peft = pytest.importorskip("peft", reason="the PEFT tests need peft: pip install -e '.[test]'")
transformers = pytest.importorskip("transformers")

from mlx.utils import tree_flatten  # noqa: E402

from mlxft import adapters  # noqa: E402
from mlxft.config import AdapterConfig  # noqa: E402
from mlxft.export import export  # noqa: E402
from mlxft.fuse import fuse  # noqa: E402

from adapter_runs import PROMPT_IDS, adapted, base_model, logits, max_rel_diff, synthetic_run, trained_run  # noqa: E402

# transformers' own deprecation notices while peft wraps the model; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

TOLERANCE = 1e-5  # relative to the largest logit; measured ~1e-6 (float32 in both)
_HF_BASES = {}


def hf_base(model_dir, root):
    """The test base re-written in Hugging Face layout (mlxft.fuse without an adapter)."""
    if str(model_dir) not in _HF_BASES:
        _HF_BASES[str(model_dir)] = fuse(None, str(model_dir), root / f"hf-{model_dir.name}")
    return _HF_BASES[str(model_dir)]


def torch_logits(model) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(PROMPT_IDS)).logits.float().numpy()


def load_torch(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


@pytest.mark.parametrize("family,kind", [("llama", "trained"), ("lfm2", "dora")])
def test_peft_export_gives_mlxft_logits(family, kind, llama_dir, lfm2_dir, runs_root, tmp_path):
    model_dir = {"llama": llama_dir, "lfm2": lfm2_dir}[family]
    run = trained_run(runs_root, model_dir) if kind == "trained" else synthetic_run(runs_root, model_dir, "dora", num_layers=2)
    ours = logits(adapted(run))

    peft_dir = export(run, "peft", tmp_path / "peft")
    peft_model = peft.PeftModel.from_pretrained(load_torch(hf_base(model_dir, runs_root)), str(peft_dir))
    theirs = torch_logits(peft_model)
    assert max_rel_diff(theirs, ours) < TOLERANCE
    assert max_rel_diff(logits(base_model(model_dir)), ours) > 1e-2  # the adapter matters

    # The fused directory in transformers: the same logits again.
    fused = fuse(str(run), None, tmp_path / "fused")
    assert max_rel_diff(torch_logits(load_torch(fused)), ours) < TOLERANCE


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_adapter_written_by_peft_loads_into_mlxft(family, llama_dir, lfm2_dir, runs_root, tmp_path):
    model_dir = {"llama": llama_dir, "lfm2": lfm2_dir}[family]
    base_dir = hf_base(model_dir, runs_root)
    torch.manual_seed(0)
    targets = ["q_proj", "v_proj", "down_proj"] if family == "llama" else ["q_proj", "in_proj", "w2"]
    config = peft.LoraConfig(r=4, lora_alpha=6, target_modules=targets, use_rslora=True, use_dora=family == "llama",
                             layers_to_transform=[1] if family == "llama" else [1, 2], layers_pattern="layers")
    peft_model = peft.get_peft_model(load_torch(base_dir), config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: make the adapter do something
                param.normal_(0, 0.05)
    peft_model.save_pretrained(str(tmp_path / "peft"))
    theirs = torch_logits(peft_model)

    loaded = adapters.load_with_adapter(str(base_dir), str(tmp_path / "peft"))
    assert loaded.spec.source == "peft" and loaded.spec.scale == pytest.approx(6 / 2)  # rsLoRA: alpha / sqrt(r)
    assert loaded.spec.fine_tune_type == ("dora" if family == "llama" else "lora")
    assert max_rel_diff(logits(loaded.model), theirs) < TOLERANCE

    # Continue training from it: same layout, PEFT's weights as the starting point.
    model = base_model(base_dir)
    settings = adapters.run_settings(tmp_path / "peft", model)
    assert settings["num_layers"] == (1 if family == "llama" else 2) and settings["alpha"] == pytest.approx(12.0)
    adapters.start_from(model, AdapterConfig(**settings), tmp_path / "peft")
    trainable = dict(tree_flatten(model.trainable_parameters()))
    assert set(trainable) == {k for k, _ in tree_flatten(loaded.model.trainable_parameters())}


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_peft_adapter_on_layers_mlx_lm_cannot_name_loads_exactly(family, llama_dir, lfm2_dir, runs_root, tmp_path):
    # mlx-lm's layout is "the last N layers"; PEFT may pick the first layer alone, or skip one.
    model_dir = {"llama": llama_dir, "lfm2": lfm2_dir}[family]
    base_dir = hf_base(model_dir, runs_root)
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"] if family == "llama" else ["w1", "w2"],
                             use_dora=family == "lfm2", layers_to_transform=[0] if family == "llama" else [0, 2],
                             layers_pattern="layers")
    peft_model = peft.get_peft_model(load_torch(base_dir), config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    peft_model.save_pretrained(str(tmp_path / "peft"))

    loaded = adapters.load_with_adapter(str(base_dir), str(tmp_path / "peft"))
    assert max_rel_diff(logits(loaded.model), torch_logits(peft_model)) < TOLERANCE
    assert max_rel_diff(logits(base_model(base_dir)), logits(loaded.model)) > 1e-3  # the adapter matters
    # The layers between hold a fresh adapter that changes nothing until trained.
    between = loaded.model.layers[1].self_attn.q_proj if family == "llama" else loaded.model.layers[1].feed_forward.w1
    assert not np.any(np.array(between.lora_b))

    model = base_model(base_dir)
    settings = adapters.run_settings(tmp_path / "peft", model)
    assert settings["num_layers"] == len(model.layers)
    adapters.start_from(model, AdapterConfig(**settings), tmp_path / "peft")
    assert max_rel_diff(logits(model), logits(loaded.model)) < TOLERANCE
