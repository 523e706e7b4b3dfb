"""The start-up memory check's count of a rank's weight bytes (the model built on the meta
device) against the bytes the real model allocates, and what the host reports free."""

from __future__ import annotations

import itertools

import pytest
import torch

from lorad.config import ModelConfig
from lorad.config.adapters import AdapterArg, load_adapter
from lorad.workers.engine import available_bytes, weight_bytes
from lorad.workers.models.llama import LlamaForCausalLM
from lorad.workers.parallel import TensorParallel
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_adapters", [0, 2])
def test_weight_bytes_are_what_each_rank_allocates(tmp_path, tied, dtype, num_adapters):
    checkpoint = make_tiny_llama(tmp_path / "m", tie_word_embeddings=tied, num_key_value_heads=2,
                                 with_tokenizer=False)
    config = ModelConfig.from_dir(checkpoint)
    # Different ranks and modules: the tables pad each projection to its largest rank.
    folders = [make_peft_adapter(checkpoint, tmp_path / "a", r=4, seed=1),
               make_peft_adapter(checkpoint, tmp_path / "b", r=8, seed=2,
                                 target_modules=("q_proj", "v_proj", "down_proj"))]
    adapters = tuple(load_adapter(AdapterArg(f"x{slot}", str(folder)), slot, config)
                     for slot, folder in enumerate(folders[:num_adapters], start=1))
    cpu = torch.device("cpu")
    for world_size in (1, 2):
        for rank in range(world_size):
            model = LlamaForCausalLM(config, TensorParallel(rank, world_size, cpu), dtype, cpu)
            model.load_adapters(adapters)
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in itertools.chain(model.parameters(), model.buffers())}
            counted = weight_bytes(config, rank, world_size, dtype, adapters)
            assert counted == sum(storages.values()), (world_size, rank)
            # Every table an adapter module got, found through what it edits (not through
            # the module tree, which a table kept outside it would escape).
            targets = {(m.layer, m.module) for spec in adapters for m in spec.modules}
            tables = {id(t): t for layer, module in targets
                      for t in model.lora_target(layer, module).lora.buffers()}
            table_bytes = sum(t.numel() * t.element_size() for t in tables.values())
            assert counted - weight_bytes(config, rank, world_size, dtype) == table_bytes
            assert table_bytes > 0 or not num_adapters


def test_the_host_reports_memory_free():
    free = available_bytes(torch.device("cpu"))
    assert free is not None and 0 < free < 1 << 50
