"""bench_engine.py on the MoE shape, its CPU parts: the decode floor of moe_floor.py (the experts
uniform routing touches, every weight counted once), the adapters it writes for each family,
transformers' model of the family, the routed-expert count, and issue 34's targets."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from benchmarks.moe_floor import decode_bytes, expected_experts, weight_parts
from lorad.config import ModelConfig
from lorad.config.adapters import AdapterArg, load_adapter
from lorad.workers.models import model_class
from lorad.workers.moe import SparseMoeBlock
from lorad.workers.parallel import TensorParallel
from tests.tiny_models import make_tiny_llama, make_tiny_qwen2_moe

REPO = Path(__file__).resolve().parents[2]
MOE_SHAPE = REPO / "scripts/configs/qwen1.5-moe-a2.7b"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
SHARED = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="bench_engine imports triton's kernels")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    """Layers 0 and 2 sparse (8 experts, top 3), layer 1 dense; bench_engine's token ids."""
    return make_tiny_qwen2_moe(tmp_path_factory.mktemp("moe") / "base", with_tokenizer=False,
                               vocab_size=1024)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "base", with_tokenizer=False)


def test_expected_experts_under_uniform_routing():
    assert expected_experts(60, 4, 1) == pytest.approx(4)
    assert expected_experts(60, 4, 32) == pytest.approx(60 * (1 - (56 / 60) ** 32))  # 53.4
    assert expected_experts(60, 4, 0) == 0 and expected_experts(0, 0, 8) == 0
    counts = [expected_experts(60, 4, b) for b in (1, 2, 8, 32, 64, 512)]
    assert counts == sorted(counts) and counts[-1] < 60
    # Against draws: each row's top k a uniform sample of k of E experts.
    rng = random.Random(0)
    for batch in (1, 5, 16):
        draws = [len(set().union(*(rng.sample(range(8), 3) for _ in range(batch))))
                 for _ in range(4000)]
        assert sum(draws) / len(draws) == pytest.approx(expected_experts(8, 3, batch), rel=0.02)


@pytest.mark.parametrize("family", ["moe", "llama"])
def test_weight_parts_are_lorads_parameters(family, moe_dir, llama_dir):
    """Every weight of lorad's model counted once (the routed experts as `experts`)."""
    config = ModelConfig.from_dir(moe_dir if family == "moe" else llama_dir)
    meta = torch.device("meta")
    model = model_class(config)(config, TensorParallel(0, 1, meta), torch.bfloat16, meta)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    parts = weight_parts(config, 2)
    assert sum(v for name, v in parts.items() if name != "expert") == params
    if family == "moe":
        assert parts["experts"] == 2 * config.num_experts * parts["expert"]  # 2 sparse layers
        assert parts["dense_mlp"] == 2 * 3 * config.hidden_size * config.intermediate_size
    else:
        assert parts["experts"] == parts["router"] == parts["shared_expert"] == 0


def test_the_decode_floor_at_the_moe_shape():
    config = ModelConfig.from_dir(MOE_SHAPE)
    one = decode_bytes(config, 1, 0, element_size=1)  # bytes = parameters at 1 byte each
    # One step at batch 1 reads Qwen1.5-MoE-A2.7B's "2.7B activated" less the embedding table
    # (one row of it), and its 4 of 60 experts in each of 24 layers.
    assert one["experts"] == pytest.approx(24 * 4 * 3 * 2048 * 1408)
    assert one["embedding"] == 2048 and one["lm_head"] == 151936 * 2048
    assert (one["total"] + 151936 * 2048 - 2048) / 1e9 == pytest.approx(2.69, abs=0.01)
    # Batch 32 at 512 tokens each, bf16, with 4 adapters' factors: the parts add up.
    many = decode_bytes(config, 32, 32 * 512, lora_bytes=10**8)
    assert many["experts"] == pytest.approx(24 * expected_experts(60, 4, 32) * 3 * 2048 * 1408 * 2)
    assert many["kv"] == 2 * 24 * 16 * 128 * 2 * 32 * 512 and many["lora"] == 10**8
    assert many["total"] == pytest.approx(sum(v for k, v in many.items() if k != "total"))
    # A measured count replaces the expectation.
    assert decode_bytes(config, 32, 0, experts_per_layer=60)["experts"] == pytest.approx(
        weight_parts(config, 2)["experts"])


def test_a_tied_head_reads_the_table_once(moe_dir):
    import dataclasses
    config = dataclasses.replace(ModelConfig.from_dir(moe_dir), tie_word_embeddings=True)
    parts = decode_bytes(config, 4, 0)
    assert parts["lm_head"] == 0 and parts["embedding"] == 2 * config.vocab_size * 72


@needs_triton
@pytest.mark.parametrize("family", ["moe", "llama"])
def test_write_adapter_edits_what_the_family_serves(family, moe_dir, llama_dir, tmp_path):
    """lorad serves every module of it; peft puts a LoRA on exactly those in transformers'
    model of the family (no routed expert, router or shared expert gate)."""
    from peft import PeftModel

    from benchmarks.bench_engine import adapter_modules, hf_model, write_adapter
    base = moe_dir if family == "moe" else llama_dir
    config = ModelConfig.from_dir(base)
    folder = write_adapter(tmp_path / "adapter", config, 4)
    spec = load_adapter(AdapterArg("a", str(folder)), 1, config)
    edits = {(m.layer, m.module) for m in spec.modules}
    dense = ("gate_proj", "up_proj", "down_proj")
    if family == "moe":
        assert adapter_modules(config) == list(ATTENTION + SHARED + dense)
        assert edits == {(layer, m) for layer in (0, 2) for m in ATTENTION + SHARED} | \
            {(1, m) for m in ATTENTION + dense}
    else:
        assert edits == {(layer, m) for layer in range(config.num_hidden_layers)
                         for m in ATTENTION + dense}
    assert {m.rank for m in spec.modules} == {4}
    model = hf_model(str(base), torch.device("cpu"), torch.float32)
    expected = type(model).__name__
    assert expected == ("Qwen2MoeForCausalLM" if family == "moe" else "LlamaForCausalLM")
    peft_model = PeftModel.from_pretrained(model, folder)
    wrapped = {name.removeprefix("base_model.model.") for name, m in peft_model.named_modules()
               if hasattr(m, "lora_A")}
    assert wrapped == {m.full_name for m in spec.modules}


@needs_triton
def test_the_expert_counter_counts_a_steps_routes(moe_dir):
    from benchmarks.bench_engine import BLOCK_SIZE, count_experts
    config = ModelConfig.from_dir(moe_dir)
    cpu = torch.device("cpu")
    model = model_class(config)(config, TensorParallel(0, 1, cpu), torch.float32, cpu)
    model.load_random_weights(seed=0)
    model.allocate_kv_cache(1 + 6 * 2, BLOCK_SIZE)
    experts = [m.experts for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(experts) == 2
    # Top 3: one row, three distinct experts in each sparse layer; the step's 7 padding rows
    # (MIN_ROWS 8) read none.
    assert count_experts(model, [0], 5, 2, cpu) == 3
    assert 3 <= count_experts(model, [0] * 6, 5, 2, cpu) <= 8
    assert all("forward" not in vars(module) for module in experts)  # the method again


@needs_triton
def test_issue_34s_targets():
    from benchmarks import bench_engine
    saved = list(bench_engine.rows)
    bench_engine.rows[:] = []
    try:
        bench_engine.add_row("base", 1, "graph", 2.0e-3, 1.6e-3, 1.0e-3)
        bench_engine.add_row("base", 32, "graph", 4.0e-3, 3.5e-3, 3.0e-3)
        bench_engine.add_row("mixed4", 32, "graph", 5.0e-3, 4.5e-3, 3.2e-3)
        bench_engine.add_row("transformers+peft base", 32, "generate", 64e-3)
        bench_engine.add_row("transformers+peft mixed-4", 32, "generate", 90e-3)
        table = bench_engine.targets(moe=True)
    finally:
        bench_engine.rows[:] = saved
    lines = table.splitlines()
    assert "| MoE batch-1 decode, floor / time | >= 60% | 62% (1.60 vs 1.00 ms) | met |" in lines
    assert "| MoE base, batch 32, vs transformers+peft base | >= 20x | 16.0x (8,000 vs 500 " \
        "tok/s) | not met |" in lines
    assert any(line.startswith("| MoE mixed4, batch 32") and "18.0x" in line for line in lines)


@needs_triton
def test_transformers_model_of_the_moe_shape_has_the_floors_weights():
    """transformers' Qwen2-MoE of the benchmark's config (on the meta device: no memory) holds
    what weight_parts counts: 14.3B parameters, in bf16."""
    from benchmarks.bench_engine import hf_model
    model = hf_model(str(MOE_SHAPE), torch.device("meta"))
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # put back
    parts = weight_parts(ModelConfig.from_dir(MOE_SHAPE), 1)
    total = sum(p.numel() for p in model.parameters())
    assert total == sum(v for name, v in parts.items() if name != "expert") == 14_315_784_192


@needs_triton
def test_the_floor_of_lorads_moe_model_with_adapters(moe_dir, tmp_path):
    """bench_engine's Floor on a MoE model: moe_floor's bytes with the LoRA factors of the
    batch's distinct slots as lorad's tables hold them; the experts counted with adapters."""
    from benchmarks.bench_engine import BLOCK_SIZE, Floor, count_experts, load_adapters
    from benchmarks.bench_engine import write_adapter
    config = ModelConfig.from_dir(moe_dir)
    cpu = torch.device("cpu")
    model = model_class(config)(config, TensorParallel(0, 1, cpu), torch.float32, cpu)
    model.load_random_weights(seed=0)
    model.allocate_kv_cache(1 + 8 * 2, BLOCK_SIZE)
    folder = write_adapter(tmp_path / "adapter", config, 4, torch.float32)
    _, spec = load_adapters(model, folder, 4)
    per_adapter = sum(m.rank * (m.in_features + m.out_features) * 4 for m in spec.modules)
    floor = Floor(model, bandwidth=1e9)
    slots = [1, 2, 3, 4, 1, 2]
    want = decode_bytes(config, 6, 6 * 10, lora_bytes=4 * per_adapter, element_size=4)
    assert floor.decode_seconds(slots, [10] * 6) * 1e9 == pytest.approx(want["total"])
    assert floor.decode_seconds([0] * 6, [10] * 6) * 1e9 == pytest.approx(want["total"] - want[
        "lora"])
    assert 3 <= count_experts(model, slots, 5, 2, cpu) <= 8
