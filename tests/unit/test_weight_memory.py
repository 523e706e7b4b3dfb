"""The start-up memory check's count of a rank's weight bytes (the model built on the meta
device) against the bytes the real model allocates, and what the host reports free."""

from __future__ import annotations

import itertools

import pytest
import torch

from lorad.config import ModelConfig
from lorad.workers.engine import available_bytes, weight_bytes
from lorad.workers.models.llama import LlamaForCausalLM
from lorad.workers.parallel import TensorParallel
from tests.tiny_models import make_tiny_llama


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_are_what_each_rank_allocates(tmp_path, tied, dtype):
    config = ModelConfig.from_dir(make_tiny_llama(tmp_path / "m", tie_word_embeddings=tied,
                                                  num_key_value_heads=2, with_tokenizer=False))
    cpu = torch.device("cpu")
    for world_size in (1, 2):
        for rank in range(world_size):
            model = LlamaForCausalLM(config, TensorParallel(rank, world_size, cpu), dtype, cpu)
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in itertools.chain(model.parameters(), model.buffers())}
            assert weight_bytes(config, rank, world_size, dtype) == sum(storages.values()), \
                (world_size, rank)


def test_the_host_reports_memory_free():
    free = available_bytes(torch.device("cpu"))
    assert free is not None and 0 < free < 1 << 50
