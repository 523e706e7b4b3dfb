"""RoPE frequency tables equal transformers' own init functions, bit for bit."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from lorad.config import RopeScaling
from lorad.workers.rotary import inverse_frequencies


@pytest.mark.parametrize("theta, scaling", [
    (10000.0, None),
    (500000.0, RopeScaling(8.0, 1.0, 4.0, 8192)),   # Llama 3.1
    (500000.0, RopeScaling(32.0, 1.0, 4.0, 8192)),  # Llama 3.2
    (100000.0, RopeScaling(4.0, 2.0, 8.0, 256)),    # every band populated at head_dim 64
])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_inverse_frequencies_match_transformers(theta, scaling, head_dim):
    params = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        params = {"rope_type": "llama3", "rope_theta": theta, "factor": scaling.factor,
                  "low_freq_factor": scaling.low_freq_factor,
                  "high_freq_factor": scaling.high_freq_factor,
                  "original_max_position_embeddings": scaling.original_max_position_embeddings}
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                         max_position_embeddings=131072, rope_parameters=params)
    if scaling is None:
        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert torch.equal(inverse_frequencies(head_dim, theta, scaling), expected)
