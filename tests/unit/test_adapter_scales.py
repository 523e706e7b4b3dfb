"""Ranks and scales per module against real `peft`: the folder is loaded back with
PeftModel.from_pretrained and every LoRA layer's r and scaling["default"] must equal lorad's,
bit for bit, for plain LoRA, rank_pattern/alpha_pattern (names, suffixes, regexes, overlaps),
use_rslora, layers_to_transform, regex target_modules and exclude_modules.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lorad.config.adapters import AdapterArg, load_adapter
from lorad.config.model import ModelConfig
from tests.tiny_models import make_tiny_llama

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("base"), with_tokenizer=False)


def make_adapter(base_dir: Path, out: Path, **lora) -> Path:
    """A PEFT folder with random A and B, for any LoraConfig arguments."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ALL, **lora}
    model = get_peft_model(base, LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM", **lora))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    model.save_pretrained(out, safe_serialization=True)
    return out


def peft_ranks_and_scales(base_dir: Path, folder: Path) -> dict[str, tuple[int, float]]:
    """{module name in LlamaForCausalLM: (r, scaling)} of the folder loaded back by peft."""
    import torch
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder)
    return {name.removeprefix("base_model.model."): (layer.r["default"],
                                                     layer.scaling["default"])
            for name, layer in model.named_modules()
            if isinstance(layer, LoraLayer) and "default" in layer.scaling}


CASES = {
    "plain": {},
    "rank by short name": {"rank_pattern": {"q_proj": 2}},
    "rank and alpha by full name": {"rank_pattern": {"model.layers.0.self_attn.q_proj": 8},
                                    "alpha_pattern": {"model.layers.0.self_attn.q_proj": 3}},
    "rslora": {"use_rslora": True},
    "rslora with patterns": {"use_rslora": True, "r": 3, "rank_pattern": {"v_proj": 9},
                             "alpha_pattern": {"down_proj": 5.5}},
    "first pattern wins (short first)": {
        "rank_pattern": {"k_proj": 3, "model.layers.0.self_attn.k_proj": 5}},
    "first pattern wins (full first)": {
        "rank_pattern": {"model.layers.1.self_attn.q_proj": 6, "q_proj": 2}},
    "regex keys": {"rank_pattern": {r"layers\.1\.mlp\.\w+_proj": 3},
                   "alpha_pattern": {r"(q|v)_proj": 16}},
    "a key matches after a dot only": {"alpha_pattern": {"proj": 1, "_proj": 2}},
    "layers_to_transform": {"layers_to_transform": [1], "target_modules": ["q_proj", "v_proj"]},
    "layers_pattern": {"layers_to_transform": 0, "layers_pattern": "layers"},
    "regex target_modules": {"target_modules": r".*layers\.0\..*(q|k)_proj"},
    "exclude_modules": {"exclude_modules": ["down_proj", "model.layers.1.self_attn.o_proj"]},
    "all-linear": {"target_modules": "all-linear", "lora_alpha": 6},
}


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_and_scales_match_peft(base_dir, tmp_path, case):
    folder = make_adapter(base_dir, tmp_path / "adapter", **CASES[case])
    expected = peft_ranks_and_scales(base_dir, folder)
    model = ModelConfig.from_dir(base_dir)
    spec = load_adapter(AdapterArg("a", str(folder)), 1, model)
    assert {m.full_name: (m.rank, m.scale) for m in spec.modules} == expected
    halved = load_adapter(AdapterArg("a", str(folder), strength=0.5), 1, model)
    assert {m.full_name: m.scale for m in halved.modules} == {
        name: scale * 0.5 for name, (_, scale) in expected.items()}
