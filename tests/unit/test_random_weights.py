"""`--load-format random`: seeded weights of the checkpoint's shapes from config.json alone, the
same model at every world size, through the engine without a checkpoint; and the Llama-3-8B
shapes folder that benchmarks run on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from lorad.config import ModelConfig, ServeConfig, WorkerConfig
from lorad.workers.batch import ForwardBatch
from lorad.workers.engine import RANDOM_WEIGHTS_SEED, Engine
from lorad.workers.loader import RANDOM_STD
from lorad.workers.models.llama import LlamaForCausalLM
from lorad.workers.parallel import TensorParallel

REPO = Path(__file__).resolve().parents[2]
LLAMA3_8B = REPO / "scripts" / "configs" / "llama3-8b"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> Path:
    """config.json only: no weights, no tokenizer."""
    folder = tmp_path_factory.mktemp("random") / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 301, "hidden_size": 96, "intermediate_size": 100,
        "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 3,
        "max_position_embeddings": 64, "eos_token_id": 2, "tie_word_embeddings": False}))
    return folder


def random_model(config_dir: Path, seed: int, rank: int = 0, world: int = 1,
                 dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelConfig.from_dir(config_dir), TensorParallel(rank, world, CPU),
                             dtype, CPU)
    model.load_random_weights(seed)
    return model


def test_random_weights_have_the_checkpoint_shapes_and_run(config_dir):
    model = random_model(config_dir, seed=0)
    params = model.checkpoint_tensors()
    assert set(params) == set(model.checkpoint_shapes())
    assert params["model.layers.1.self_attn.k_proj.weight"].shape == (3 * 16, 96)
    assert params["lm_head.weight"].shape == (301, 96)
    for name, param in params.items():
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
        else:
            assert abs(param.std().item() - RANDOM_STD) < 0.1 * RANDOM_STD, name
            assert abs(param.mean().item()) < 0.1 * RANDOM_STD, name
    model.allocate_kv_cache(8, 4)
    batch = ForwardBatch.build([(list(range(3, 12)), 0, [0, 1, 2], True, 0),
                                (list(range(5, 10)), 0, [3, 4], True, 0)], 4)
    logits = model(batch)
    assert logits.shape == (2, 301) and torch.isfinite(logits).all()
    assert not torch.equal(logits[0], logits[1])


def test_random_weights_are_deterministic_by_seed(config_dir):
    first, again, other = (random_model(config_dir, seed).checkpoint_tensors()
                           for seed in (7, 7, 8))
    for name, param in first.items():
        assert torch.equal(param, again[name]), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(param, other[name]), name
    # Different tensors of one model are not copies of each other.
    assert not torch.equal(first["model.layers.0.mlp.gate_proj.weight"],
                           first["model.layers.0.mlp.up_proj.weight"])
    # bf16 is the fp32 model rounded.
    bf16 = random_model(config_dir, 7, dtype=torch.bfloat16).checkpoint_tensors()
    assert all(torch.equal(bf16[n], p.to(torch.bfloat16)) for n, p in first.items())


def test_every_world_size_holds_shards_of_the_same_model(config_dir):
    whole = random_model(config_dir, seed=3).checkpoint_tensors()
    shards = [random_model(config_dir, 3, rank, 3).checkpoint_tensors() for rank in range(3)]
    # 3 KV heads over 3 ranks: one KV head (16 rows of k/v, 32 of q) each; MLP 100 as 34/33/33.
    for name, dim in (("model.layers.0.self_attn.q_proj.weight", 0),
                      ("model.layers.0.self_attn.v_proj.weight", 0),
                      ("model.layers.1.self_attn.o_proj.weight", 1),
                      ("model.layers.1.mlp.up_proj.weight", 0),
                      ("model.layers.1.mlp.down_proj.weight", 1),
                      ("model.embed_tokens.weight", 0), ("lm_head.weight", 0)):
        assert torch.equal(torch.cat([s[name] for s in shards], dim=dim), whole[name]), name
    assert torch.equal(shards[2]["model.norm.weight"], whole["model.norm.weight"])


def test_engine_starts_on_random_weights_without_a_checkpoint(config_dir, tmp_path):
    assert not list(config_dir.glob("*.safetensors"))
    cfg = WorkerConfig(
        model_dir=str(config_dir), parallel=1, dtype="auto", device="cpu", dist_backend="auto",
        max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
        kv_cache_blocks=16, kv_cache_memory=None, num_threads=1, runtime_dir=str(tmp_path),
        instance_id="t", coordinator_pid=os.getpid(), load_format="random")
    engine = Engine.start(cfg, 0)
    assert engine.graphs is None  # the CPU never captures graphs
    expected = random_model(config_dir, RANDOM_WEIGHTS_SEED).checkpoint_tensors()
    for name, param in engine.model.checkpoint_tensors().items():
        assert torch.equal(param, expected[name]), name


def test_llama3_8b_shapes_folder():
    config = ModelConfig.from_dir(LLAMA3_8B)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size,
            config.vocab_size, config.tie_word_embeddings, config.torch_dtype) == \
        (4096, 32, 32, 8, 128, 14336, 128256, False, "bfloat16")
    assert config.rope_theta == 500000.0 and config.rope_scaling.factor == 8.0
    # On the meta device nothing is allocated: count the parameters Llama 3 8B has.
    model = LlamaForCausalLM(config, TensorParallel(0, 1, torch.device("meta")), torch.bfloat16,
                             torch.device("meta"))
    shapes = model.checkpoint_shapes()
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 8_030_261_248
    # The coordinator starts on it: config.json, tokenizer and limits are accepted.
    from lorad.daemon.main import load_served_model
    served = load_served_model(ServeConfig(model_dir=str(LLAMA3_8B), served_name="llama3-8b",
                                           load_format="random"))
    assert served.max_model_len == 8192 and served.vocab_size == 128256
    assert served.tokenizer.vocab_size <= config.vocab_size
