"""How the model is split over ranks: balanced ranges, each rank's weight shards, the loader.

In one process: building a rank's model and loading its shard needs no collective, so every rank
of worlds 1-3 is built here and the shards are put back together and compared with the
checkpoint. The collectives themselves are exercised by test_llama_logits.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lorad.config import ConfigError, ModelConfig
from lorad.workers.models import LlamaForCausalLM
from lorad.config.partition import balanced_split
from lorad.workers.parallel import TensorParallel, init_tensor_parallel
from tests.tiny_models import make_tiny_llama

CPU = torch.device("cpu")


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_balanced_split_is_contiguous_and_even(parts):
    for n in range(0, 40):
        ranges = balanced_split(n, parts)
        assert len(ranges) == parts and ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        sizes = [end - start for start, end in ranges]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True), (n, sizes)


def test_balanced_split_examples():
    assert balanced_split(9, 2) == [(0, 5), (5, 9)]
    assert balanced_split(3, 3) == [(0, 1), (1, 2), (2, 3)]
    assert balanced_split(400, 3) == [(0, 134), (134, 267), (267, 400)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # 6 query heads over 3 KV heads, an intermediate size and vocab that 2 and 3 do not divide.
    return make_tiny_llama(tmp_path_factory.mktemp("split") / "m", hidden_size=48,
                           num_attention_heads=6, num_key_value_heads=3, intermediate_size=50,
                           num_hidden_layers=1, vocab_size=401, with_tokenizer=False)


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("split_tied") / "m", num_hidden_layers=1,
                           tie_word_embeddings=True, with_tokenizer=False)


def build(model_dir, rank: int, world: int) -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelConfig.from_dir(model_dir), TensorParallel(rank, world, CPU),
                             torch.float32, CPU)
    model.load_weights(str(model_dir))
    return model


COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                   "mlp.up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shards_put_back_together_are_the_checkpoint(checkpoint, world):
    full = load_file(str(checkpoint / "model.safetensors"))
    ranks = [build(checkpoint, rank, world).checkpoint_tensors() for rank in range(world)]
    for name, tensor in full.items():
        shards = [params[name] for params in ranks]
        if any(name.endswith(f"{module}.weight") for module in ROW_PARALLEL):
            joined = torch.cat(shards, dim=1)
        elif "norm" in name:
            assert all(torch.equal(s, tensor) for s in shards), name
            continue
        else:  # column-parallel linears, the embedding and the LM head split their rows
            joined = torch.cat(shards, dim=0)
        assert torch.equal(joined, tensor), name


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_takes_the_query_heads_of_its_kv_heads(checkpoint, world):
    config = ModelConfig.from_dir(checkpoint)
    d, g = config.head_dim, config.queries_per_kv
    full = load_file(str(checkpoint / "model.safetensors"))
    for rank, (kv_start, kv_end) in enumerate(balanced_split(config.num_key_value_heads, world)):
        attn = build(checkpoint, rank, world).model.layers[0].self_attn
        q_full = full["model.layers.0.self_attn.q_proj.weight"]
        k_full = full["model.layers.0.self_attn.k_proj.weight"]
        assert torch.equal(attn.qkv_proj.part_weight("q"), q_full[kv_start * g * d:kv_end * g * d])
        assert torch.equal(attn.qkv_proj.part_weight("k"), k_full[kv_start * d:kv_end * d])
        assert attn.attn.num_q_heads == (kv_end - kv_start) * g


def test_tied_head_reads_the_embedding(tied_checkpoint):
    with safe_open(str(tied_checkpoint / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    for rank in range(2):
        model = build(tied_checkpoint, rank, 2)
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_world_above_kv_heads_is_a_config_error(checkpoint):
    config = ModelConfig.from_dir(checkpoint)
    with pytest.raises(ConfigError, match=r"--parallel 4 .* 3 key-value heads"):
        LlamaForCausalLM(config, TensorParallel(0, 4, CPU), torch.float32, CPU)
    with pytest.raises(ConfigError, match="key-value heads"):
        LlamaForCausalLM.kv_cache_bytes_per_block(config, 0, 4, 16, torch.float32)


def test_kv_cache_bytes_follow_the_rank_heads(checkpoint):
    config = ModelConfig.from_dir(checkpoint)  # 3 KV heads of 8, 1 layer
    whole = LlamaForCausalLM.kv_cache_bytes_per_block(config, 0, 1, 16, torch.bfloat16)
    assert whole == 2 * 1 * 16 * 3 * 8 * 2
    per_rank = [LlamaForCausalLM.kv_cache_bytes_per_block(config, r, 2, 16, torch.bfloat16)
                for r in range(2)]
    assert per_rank == [whole * 2 // 3, whole // 3]
    model = build(checkpoint, 1, 2)
    model.allocate_kv_cache(5, 16)
    cache = model.model.layers[0].self_attn.kv_cache
    assert cache.k.shape == (5, 16, 1, 8) and cache.v.shape == (5, 16, 1, 8)


def test_sharded_checkpoint_loads_like_the_single_file(checkpoint, tmp_path):
    full = load_file(str(checkpoint / "model.safetensors"))
    names = sorted(full)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: full[n] for n in part}, str(tmp_path / file))
        weight_map.update({n: file for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    single = build(checkpoint, 1, 2).checkpoint_tensors()
    sharded = build(tmp_path, 1, 2).checkpoint_tensors()
    assert all(torch.equal(single[n], sharded[n]) for n in single)


def test_loader_refuses_missing_unknown_and_pickled(checkpoint, tmp_path):
    full = load_file(str(checkpoint / "model.safetensors"))
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    config = ModelConfig.from_dir(tmp_path)
    model = LlamaForCausalLM(config, TensorParallel(0, 1, CPU), torch.float32, CPU)

    save_file({n: t for n, t in full.items() if n != "model.norm.weight"},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="lacks 1 tensors .*model.norm.weight"):
        model.load_weights(str(tmp_path))

    save_file({**full, "model.layers.0.self_attn.q_norm.weight": torch.ones(8)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="q_norm.weight is not part of the model"):
        model.load_weights(str(tmp_path))

    save_file({**full, "model.norm.weight": torch.ones(7)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model.norm.weight has shape \(7,\)"):
        model.load_weights(str(tmp_path))

    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ConfigError, match="pickled"):
        model.load_weights(str(tmp_path))


def test_world_one_needs_no_process_group():
    tp = init_tensor_parallel(0, 1, "file:///nonexistent/store", "gloo", CPU)
    assert tp.group is None and tp.cpu_group is None and not torch.distributed.is_initialized()
    x = torch.randn(3, 5)
    assert tp.all_reduce(x) is x and tp.all_gather_last_dim(x, [5]) is x
