"""Adapters on a Qwen2-MoE base: the attention projections, the shared expert's and a dense
layer's MLP projections are served; a LoRA on a routed expert, the router or the shared expert's
gate is refused by name, in the tensors or in the config's targets; identity keys and per-rank
bytes cover the shared expert as the dense family's projections."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from lorad.config import ModelConfig
from lorad.config.adapter_memory import bytes_per_rank, total_bytes
from lorad.config.adapters import AdapterArg, load_adapter
from lorad.config.errors import ConfigError
from tests.adapter_folders import edit_config, edit_tensors
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama, make_tiny_qwen2_moe

PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """Layers 0 and 2 sparse, layer 1 dense."""
    return make_tiny_qwen2_moe(tmp_path_factory.mktemp("moe") / "base", with_tokenizer=False)


@pytest.fixture(scope="module")
def model(base_dir) -> ModelConfig:
    return ModelConfig.from_dir(base_dir)


@pytest.fixture(scope="module")
def good_dir(base_dir, tmp_path_factory) -> Path:
    """Rank 4 on q/k/v/o, the shared expert's gate/up/down and layer 1's gate/up/down."""
    return make_peft_adapter(base_dir, tmp_path_factory.mktemp("good") / "moe", r=4)


@pytest.fixture
def folder(good_dir, tmp_path) -> Path:
    return Path(shutil.copytree(good_dir, tmp_path / "adapter"))


def load(folder: Path, model, strength: float = 1.0):
    return load_adapter(AdapterArg("moe", str(folder), strength), 1, model)


def refused(folder: Path, model, *needles: str) -> str:
    with pytest.raises(ConfigError) as exc:
        load(folder, model)
    message = str(exc.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def test_the_served_modules_of_each_layer(good_dir, model):
    spec = load(good_dir, model)
    edits = {(m.layer, m.module) for m in spec.modules}
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    shared = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")
    assert edits == {(layer, m) for layer in (0, 2) for m in attention + shared} | \
        {(1, m) for m in attention + ("gate_proj", "up_proj", "down_proj")}
    down = next(m for m in spec.modules if m.module == "shared_expert.down_proj")
    assert (down.in_features, down.out_features) == (36, 72)  # the shared expert's 36
    # Split like the dense MLP: down's A by the shared expert's intermediate columns.
    assert sum(bytes_per_rank(spec, model, 3)) > total_bytes(spec)  # A's of q.. kept whole
    assert [m.module for m in spec.modules[:8]] == list(attention) + list(shared) + ["q_proj"]


def test_the_identity_key_covers_the_shared_expert(good_dir, model, tmp_path):
    key = load(good_dir, model).key
    copy = Path(shutil.copytree(good_dir, tmp_path / "other-name"))
    assert load(copy, model).key == key
    assert load(good_dir, model, strength=0.5).key != key

    def bump(tensors):
        tensors[f"{PREFIX}.2.mlp.shared_expert.down_proj.lora_B.weight"] += np.float32(1e-3)
    edit_tensors(copy, bump)
    assert load(copy, model).key != key


@pytest.mark.parametrize("tensor, needles", [
    ("0.mlp.experts.3.gate_proj", ("a routed expert", "mlp.experts.3")),
    ("2.mlp.experts.0.down_proj", ("a routed expert",)),
    ("0.mlp.gate", ("the MoE router", "mlp.gate")),
    ("2.mlp.shared_expert_gate", ("the shared expert's gate",)),
])
def test_loras_on_moe_internals_are_refused_by_tensor_name(folder, model, tensor, needles):
    def add(tensors):
        tensors[f"{PREFIX}.{tensor}.lora_A.weight"] = np.zeros((4, 72), np.float32)
        tensors[f"{PREFIX}.{tensor}.lora_B.weight"] = np.zeros((8, 4), np.float32)
    edit_tensors(folder, add)
    refused(folder, model, "adapter_model.safetensors", *needles, "shared expert's gate/up/down")


@pytest.mark.parametrize("tensor, needles", [
    ("0.mlp.down_proj", ("layer 0", "sparse (MoE) layer", "no dense MLP")),
    ("1.mlp.shared_expert.up_proj", ("layer 1", "dense layer", "no shared expert")),
])
def test_a_projection_the_layer_does_not_have_is_refused(folder, model, tensor, needles):
    def add(tensors):
        tensors[f"{PREFIX}.{tensor}.lora_A.weight"] = np.zeros((4, 72), np.float32)
        tensors[f"{PREFIX}.{tensor}.lora_B.weight"] = np.zeros((36, 4), np.float32)
    edit_tensors(folder, add)
    refused(folder, model, *needles)


@pytest.mark.parametrize("targets, needles", [
    (["q_proj", "gate"], ("model.layers.0.mlp.gate", "the MoE router")),
    (["q_proj", "experts"], ("mlp.experts", "the routed experts")),
    (".*shared_expert_gate", ("the shared expert's gate",)),
])
def test_targets_on_moe_internals_are_refused(folder, model, targets, needles):
    edit_config(folder, target_modules=targets)
    refused(folder, model, "adapter_config.json", "target_modules", *needles)


def test_peft_all_linear_reaches_the_shared_expert_gate_and_is_refused(base_dir, model,
                                                                        tmp_path):
    folder = make_peft_adapter(base_dir, tmp_path / "all", r=2, target_modules="all-linear")
    refused(folder, model, "mlp.shared_expert_gate", "the shared expert's gate")


def test_a_dotted_target_edits_only_the_shared_expert(base_dir, model, tmp_path):
    folder = make_peft_adapter(base_dir, tmp_path / "down", r=2,
                               target_modules=("o_proj", "shared_expert.down_proj"))
    spec = load(folder, model)
    assert {(m.layer, m.module) for m in spec.modules} == {
        (0, "o_proj"), (1, "o_proj"), (2, "o_proj"), (0, "shared_expert.down_proj"),
        (2, "shared_expert.down_proj")}


def test_a_moe_adapter_on_a_llama_base_and_without_a_base(good_dir, tmp_path):
    llama = ModelConfig.from_dir(make_tiny_llama(tmp_path / "llama", hidden_size=72,
                                                 num_attention_heads=6, num_key_value_heads=3,
                                                 num_hidden_layers=3, with_tokenizer=False))
    refused(good_dir, llama, "the base model (llama) has no shared expert")
    spec = load(good_dir, None)  # check-adapter without --model: names and pairs only
    assert not spec.shapes_checked and len(spec.modules) == 2 * 7 + 7


def test_check_adapter_describes_the_shared_expert(good_dir, model):
    from lorad.config.check_adapter import describe
    lines = describe(load(good_dir, model), str(good_dir), model, "base", 3)
    table = [line for line in lines if line.startswith("    ")]
    assert table[0].split() == ["module", "layers", "rank", "scale", "A", "[r,", "in]", "B",
                                "[out,", "r]"]
    shared_down = next(line for line in table if "shared_expert.down_proj" in line)
    assert shared_down.split()[1:3] == ["0,2", "4"] and "[4, 36]" in shared_down
    starts = {line.index(line.split()[1]) for line in table[1:]}
    assert len(starts) == 1  # one column for the layers whatever the module's name
