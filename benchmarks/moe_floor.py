"""The bytes one decode step must read on a Qwen2-MoE model (or a dense one), from the config
alone: the floor bench_engine.py sets beside a measured step. Pure arithmetic, no device.

A routed expert is read once per step and layer if any row picked it. Under uniform routing (each
row's top k a uniform draw of k of E experts, rows independent) an expert is missed by one row
with probability 1 - k/E, so a step of B rows touches E * (1 - (1 - k/E)^B) experts per layer
in expectation. Trained routers are skewed (fewer distinct experts, a lower floor); random
weights route near uniformly. bench_engine.py also counts the experts the router picked.
"""

from __future__ import annotations

from lorad.config import ModelConfig


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts a layer reads at `batch` rows of top-`top_k` uniform routing."""
    if num_experts == 0 or batch == 0:
        return 0.0
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def weight_parts(config: ModelConfig, element_size: int) -> dict[str, int]:
    """Bytes of each kind of weight in the whole model (one routed expert: `expert`, per sparse
    layer; `experts`: all of them)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    q_width = config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    attention = hidden * (q_width + 2 * kv_width) + q_width * hidden
    if config.qkv_bias:
        attention += q_width + 2 * kv_width
    sparse = sum(config.is_moe_layer(layer) for layer in range(layers))
    expert = 3 * hidden * config.moe_intermediate_size
    embedding = config.vocab_size * hidden
    parts = {
        "attention": layers * attention,
        "norms": (2 * layers + 1) * hidden,
        "dense_mlp": (layers - sparse) * 3 * hidden * config.intermediate_size,
        # gate/up/down and the sigmoid gate's one row
        "shared_expert": sparse * (3 * hidden * config.shared_expert_intermediate_size + hidden),
        "router": sparse * hidden * config.num_experts,
        "expert": expert,
        "experts": sparse * config.num_experts * expert,
        "embedding": embedding,
        "lm_head": 0 if config.tie_word_embeddings else embedding,
    }
    return {name: count * element_size for name, count in parts.items()}


def decode_bytes(config: ModelConfig, batch: int, kv_tokens: int, lora_bytes: int = 0,
                 element_size: int = 2, experts_per_layer: float | None = None
                 ) -> dict[str, float]:
    """Bytes one decode step of `batch` rows reads, by part, and their `total`: every dense
    weight; the routed experts touched (`experts_per_layer` per sparse layer, by default the
    uniform expectation); one embedding row per row (the table when tied: it is the LM head);
    `lora_bytes` (the factors of the batch's adapters); `kv_tokens` tokens of KV (every row's
    context summed), K and V of every layer."""
    weights = weight_parts(config, element_size)
    sparse = sum(config.is_moe_layer(layer) for layer in range(config.num_hidden_layers))
    if experts_per_layer is None:
        experts_per_layer = expected_experts(config.num_experts, config.num_experts_per_tok,
                                             batch)
    row = config.hidden_size * element_size
    parts = {name: float(weights[name]) for name in ("attention", "norms", "dense_mlp",
                                                     "shared_expert", "router", "lm_head")}
    parts["embedding"] = float(weights["embedding"] if config.tie_word_embeddings
                               else batch * row)
    parts["experts"] = sparse * experts_per_layer * weights["expert"]
    parts["lora"] = float(lora_bytes)
    parts["kv"] = float(2 * config.num_hidden_layers * config.num_key_value_heads
                        * config.head_dim * element_size * kv_tokens)
    parts["total"] = sum(parts.values())
    return parts
