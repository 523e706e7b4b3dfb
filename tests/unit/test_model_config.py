"""ModelConfig reads what the Llama family needs from config.json and refuses the rest by name."""

import json

import pytest

from lorad.config import ConfigError, ModelConfig

BASE = {
    "model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "eos_token_id": 2, "bos_token_id": 1,
}


def test_defaults_and_derived_values():
    cfg = ModelConfig.from_dict(dict(BASE))
    assert cfg.head_dim == 16 and cfg.queries_per_kv == 2
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.eos_token_ids == (2,) and not cfg.tie_word_embeddings


def test_rope_parameters_of_transformers_5_and_4_agree():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    v5 = ModelConfig.from_dict({**BASE, "rope_parameters": {**llama3, "rope_theta": 5e5}})
    v4 = ModelConfig.from_dict({**BASE, "rope_theta": 5e5, "rope_scaling": llama3})
    assert v5 == v4
    assert v5.rope_theta == 5e5 and v5.rope_scaling.factor == 8.0


def test_generation_config_adds_eos_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2, 7)


@pytest.mark.parametrize("change, words", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_key_value_heads": 3}, "multiple"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
    ({"rope_parameters": {"rope_type": "llama3"}}, "llama3"),
    ({"quantization_config": {"quant_method": "gguf"}}, "quantized"),
])
def test_refusals_name_the_field(change, words):
    with pytest.raises(ConfigError, match=words):
        ModelConfig.from_dict({**BASE, **change})


def test_missing_or_bad_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read config.json"):
        ModelConfig.from_dir(tmp_path)


MOE = {**BASE, "model_type": "qwen2_moe", "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
       "mlp_only_layers": [0], "use_sliding_window": False}


def test_qwen2_moe_fields_and_sparse_layers():
    cfg = ModelConfig.from_dict({**MOE, "num_hidden_layers": 4, "decoder_sparse_step": 1})
    assert cfg.qkv_bias and not cfg.norm_topk_prob  # transformers' defaults
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size) == (8, 2, 32, 48)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    step2 = ModelConfig.from_dict({**MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2,
                                   "mlp_only_layers": []})
    assert [step2.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert not ModelConfig.from_dict(dict(BASE)).is_moe_layer(0)  # Llama: dense, no biases
    assert not ModelConfig.from_dict(dict(BASE)).qkv_bias


@pytest.mark.parametrize("change, words", [
    ({"use_sliding_window": True}, "sliding-window"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding-window"),
    ({"num_experts_per_tok": 9}, "more than num_experts"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"mlp_only_layers": ["1"]}, "mlp_only_layers"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_qwen2_moe_refusals_name_the_field(change, words):
    with pytest.raises(ConfigError, match=words):
        ModelConfig.from_dict({**MOE, **change})
