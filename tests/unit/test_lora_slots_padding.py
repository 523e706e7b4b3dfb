"""LoraSlots holds zeros past each slot's rank, which the expand kernel relies on (it multiplies
that padding by exact zeros instead of masking it), also when a slot is loaded again with an
adapter of a lower rank."""

from __future__ import annotations

import torch

from lorad.config.adapters import LoraModule
from lorad.workers.loader import WholeTensor
from lorad.workers.lora import LoraSlots


def module(rank: int) -> LoraModule:
    return LoraModule(layer=0, module="q_proj", rank=rank, scale=2.0, a_tensor="a",
                      b_tensor="b", in_features=6, out_features=5, dtype="F32")


def test_a_lower_rank_leaves_zeros_past_it():
    slots = LoraSlots(3, 4, 6, 5, (0, 6), (0, 5), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    slots.load(1, module(4), WholeTensor(torch.randn(4, 6, generator=gen)),
               WholeTensor(torch.randn(5, 4, generator=gen)))
    assert slots.lora_b[1].abs().min() > 0  # the rank-4 factors fill the slot
    a2, b2 = torch.randn(2, 6, generator=gen), torch.randn(5, 2, generator=gen)
    slots.load(1, module(2), WholeTensor(a2), WholeTensor(b2))
    assert torch.equal(slots.lora_a[1, :2], a2) and torch.equal(slots.lora_b[1, :, :2], b2)
    assert torch.count_nonzero(slots.lora_a[1, 2:]) == 0
    assert torch.count_nonzero(slots.lora_b[1, :, 2:]) == 0
    assert slots.ranks[1] == 2 and int(slots.rank_table[1]) == 2
    # The other slots are left as they were: zeros.
    assert torch.count_nonzero(slots.lora_b[0]) == 0 and torch.count_nonzero(slots.lora_b[2]) == 0
