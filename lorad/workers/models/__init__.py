"""Model architectures the worker can run, by config.json's model_type.

lorad.config refuses other model types before a worker starts, so the lookup cannot miss.
"""

from lorad.workers.models.llama import LlamaForCausalLM

MODEL_CLASSES = {"llama": LlamaForCausalLM}

__all__ = ["LlamaForCausalLM", "MODEL_CLASSES"]
