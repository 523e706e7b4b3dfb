"""The Qwen2-MoE model's pieces in-process: its checkpoint names and shapes are transformers',
its expert stacks split along the intermediate size and join back, and a row's bits through the
MoE block do not depend on which rows share the step or its experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lorad.config import ModelConfig
from lorad.workers.lora_rows import LoraRows
from lorad.workers.models import Qwen2MoeForCausalLM, model_class
from lorad.workers.parallel import TensorParallel
from tests.tiny_models import make_tiny_qwen2_moe

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen2_moe(tmp_path_factory.mktemp("moe") / "model", with_tokenizer=False,
                               seed=1)


def build(checkpoint, rank: int = 0, world: int = 1) -> Qwen2MoeForCausalLM:
    config = ModelConfig.from_dir(checkpoint)
    model = model_class(config)(config, TensorParallel(rank, world, CPU), torch.float32, CPU)
    model.load_weights(checkpoint)
    return model


def test_checkpoint_names_and_shapes_are_transformers(checkpoint):
    model = build(checkpoint)
    assert isinstance(model, Qwen2MoeForCausalLM)
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert model.checkpoint_shapes() == saved
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in saved  # sparse layer 0
    assert "model.layers.1.mlp.gate_proj.weight" in saved  # dense layer 1
    assert "model.layers.2.self_attn.q_proj.bias" in saved


def test_expert_shards_join_to_the_checkpoint(checkpoint):
    """At world 3 each rank holds 7, 7 and 6 of every expert's 20 intermediate rows."""
    ranks = [build(checkpoint, rank, 3).checkpoint_tensors() for rank in range(3)]
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        for name in ("model.layers.2.mlp.experts.5.gate_proj.weight",
                     "model.layers.2.mlp.experts.5.up_proj.weight",
                     "model.layers.0.self_attn.k_proj.bias"):
            assert torch.equal(torch.cat([r[name] for r in ranks]), f.get_tensor(name)), name
        down = "model.layers.0.mlp.experts.3.down_proj.weight"
        assert torch.equal(torch.cat([r[down] for r in ranks], dim=1), f.get_tensor(down))
        router = "model.layers.0.mlp.gate.weight"
        assert all(torch.equal(r[router], f.get_tensor(router)) for r in ranks)


def test_a_rows_bits_do_not_depend_on_its_neighbours(checkpoint, one_thread):
    """The block's output for each row is the same bits alone (padded to 8 rows, as every step
    is) and among 8 to 40 rows routed to the same and other experts."""
    block = build(checkpoint).model.layers[0].mlp
    rows = torch.randn(40, 72, generator=torch.Generator().manual_seed(0))
    lora = LoraRows(slots=(), groups=[])  # base rows only
    alone = [block(torch.cat([rows[i:i + 1], torch.zeros(7, 72)]), lora)[0][0]
             for i in range(40)]
    for n in (8, 9, 13, 40):
        out, _ = block(rows[:n], lora)
        for i in range(n):
            assert torch.equal(out[i], alone[i]), (n, i)


def test_qwen15_moe_a27b_shapes_folder():
    """scripts/configs' MoE shape: transformers' parameter count, built on the meta device."""
    from transformers import AutoConfig, Qwen2MoeForCausalLM as HFQwen2Moe

    folder = REPO / "scripts" / "configs" / "qwen1.5-moe-a2.7b"
    config = ModelConfig.from_dir(folder)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.shared_expert_intermediate_size, config.qkv_bias) == \
        (2048, 24, 16, 60, 4, 1408, 5632, True)
    assert all(config.is_moe_layer(i) for i in range(24))
    meta = torch.device("meta")
    shapes = model_class(config)(config, TensorParallel(0, 1, meta), torch.bfloat16,
                                 meta).checkpoint_shapes()
    with meta:
        reference = HFQwen2Moe(AutoConfig.from_pretrained(folder))
    total = sum(torch.Size(s).numel() for s in shapes.values())
    assert total == sum(p.numel() for p in reference.parameters())
    assert 14.3e9 < total < 14.4e9
    # The coordinator starts on it: config.json, tokenizer and limits are accepted.
    from lorad.config import ServeConfig
    from lorad.daemon.main import load_served_model
    served = load_served_model(ServeConfig(model_dir=str(folder), served_name="qwen-moe",
                                           load_format="random"))
    assert served.max_model_len == 8192 and served.vocab_size == 151936


def test_random_weights_are_the_same_model_at_every_world_size(checkpoint):
    """--load-format random fills the expert stacks by checkpoint name: 3 ranks' shards join to
    the whole of world 1."""
    config = ModelConfig.from_dir(checkpoint)

    def random_model(rank: int, world: int):
        model = model_class(config)(config, TensorParallel(rank, world, CPU), torch.float32, CPU)
        model.load_random_weights(seed=5)
        return model.checkpoint_tensors()
    whole, shards = random_model(0, 1), [random_model(rank, 3) for rank in range(3)]
    assert set(whole) == set(build(checkpoint).checkpoint_shapes())
    name = "model.layers.2.mlp.experts.6.up_proj.weight"
    assert torch.equal(torch.cat([s[name] for s in shards]), whole[name])
    assert whole[name].std() > 0.01
