"""One edited projection of one layer (LoraModule) and the projection names adapters may edit.

A leaf of lorad.config: adapters.py builds these records and adapter_key.py hashes them, and
neither imports the other. No file reading or validation here.
"""

from __future__ import annotations

from dataclasses import dataclass

# The dense family's projections (and a Qwen2-MoE dense layer's).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A Qwen2-MoE sparse layer's shared expert: its MLP projections, under mlp.shared_expert.
SHARED_EXPERT_MODULES = ("shared_expert.gate_proj", "shared_expert.up_proj",
                         "shared_expert.down_proj")
MODULE_ORDER = TARGET_MODULES + SHARED_EXPERT_MODULES  # the identity key's and tables' order
PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
           **{module: "mlp" for module in SHARED_EXPERT_MODULES}}


@dataclass(frozen=True)
class LoraModule:
    """One edited projection of one layer."""

    layer: int
    module: str  # one of MODULE_ORDER
    rank: int
    scale: float  # lora_alpha / r (or / sqrt(r) with use_rslora), per pattern, times strength
    a_tensor: str  # name in the weights file; shape [rank, in_features]
    b_tensor: str  # name in the weights file; shape [out_features, rank]
    in_features: int = 0
    out_features: int = 0
    dtype: str = "F32"  # safetensors dtype of both factors: F32, BF16 or F16

    @property
    def full_name(self) -> str:
        return module_name(self.layer, self.module)


def module_name(layer: int, module: str) -> str:
    """A projection's full name in the transformers model (LlamaForCausalLM,
    Qwen2MoeForCausalLM), which PEFT's patterns are matched against."""
    return f"model.layers.{layer}.{PARENTS[module]}.{module}"
