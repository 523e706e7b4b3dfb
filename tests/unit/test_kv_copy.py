"""Copies on write of KV blocks (fork.py's StepPlan.block_copies): every layer's K and V of each
destination block equal the source's, other blocks are untouched, and a block reused as a
destination in the same step still gives its old content to the copy that reads it."""

from __future__ import annotations

import torch

from lorad.workers.kv_cache import PagedKVCache


def test_copy_blocks_copies_k_and_v_of_each_pair():
    cache = PagedKVCache(6, 4, 2, 8, torch.float32, torch.device("cpu"))
    cache.k.copy_(torch.randn_like(cache.k))
    cache.v.copy_(torch.randn_like(cache.v))
    k, v = cache.k.clone(), cache.v.clone()
    # block 1 is read by the first copy and written by the second
    cache.copy_blocks(torch.tensor([1, 4]), torch.tensor([3, 1]))
    assert torch.equal(cache.k[3], k[1]) and torch.equal(cache.v[3], v[1])
    assert torch.equal(cache.k[1], k[4]) and torch.equal(cache.v[1], v[4])
    for block in (0, 2, 4, 5):
        assert torch.equal(cache.k[block], k[block]) and torch.equal(cache.v[block], v[block])
