"""Model architectures the worker can run, by config.json's model_type: the one place a worker
picks its model class.

lorad.config refuses other model types before a worker starts, so the lookup cannot miss.
"""

from lorad.config import ModelConfig
from lorad.workers.models.llama import LlamaForCausalLM
from lorad.workers.models.qwen2_moe import Qwen2MoeForCausalLM

MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class that builds `config`'s family (each composes the dense family's layers)."""
    return MODEL_CLASSES[config.model_type]


__all__ = ["LlamaForCausalLM", "MODEL_CLASSES", "Qwen2MoeForCausalLM", "model_class"]
