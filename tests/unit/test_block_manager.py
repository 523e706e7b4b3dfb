"""The KV block pool: deterministic free-list order and strict bookkeeping."""

from __future__ import annotations

import pytest

from lorad.workers.block_manager import BlockManager


def test_allocate_in_order_and_reuse_freed_blocks_last():
    bm = BlockManager(6, 4)
    a = bm.allocate(2)
    b = bm.allocate(3)
    assert (a, b, bm.num_free_blocks) == ([0, 1], [2, 3, 4], 1)
    bm.free(a)
    assert bm.allocate(3) == [5, 0, 1]
    assert bm.num_free_blocks == 0


def test_two_pools_with_one_history_agree():
    pools = [BlockManager(8, 2), BlockManager(8, 2)]
    out = []
    for bm in pools:
        x, y = bm.allocate(3), bm.allocate(2)
        bm.free(x)
        out.append((y, bm.allocate(4)))
    assert out[0] == out[1]


def test_can_allocate_and_refusals():
    bm = BlockManager(3, 16)
    assert bm.can_allocate(3) and not bm.can_allocate(4)
    with pytest.raises(RuntimeError):
        bm.allocate(4)
    blocks = bm.allocate(1)
    bm.free(blocks)
    with pytest.raises(RuntimeError):
        bm.free(blocks)
    with pytest.raises(ValueError):
        BlockManager(0, 16)


def test_blocks_for():
    bm = BlockManager(4, 16)
    assert [bm.blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_a_shared_block_is_freed_by_its_last_holder():
    bm = BlockManager(4, 2)
    blocks = bm.allocate(2)
    bm.share(blocks)
    bm.share(blocks[:1])
    assert [bm.ref_count(b) for b in blocks] == [3, 2] and bm.num_shared == 2
    assert bm.is_shared(0) and not bm.is_shared(2)
    bm.free(blocks)
    assert [bm.ref_count(b) for b in blocks] == [2, 1] and bm.num_shared == 1
    assert bm.num_free_blocks == 2  # still held
    bm.free(blocks)
    assert bm.num_free_blocks == 3 and bm.num_shared == 0  # block 1 went back, 0 is held once
    bm.free([0])
    assert bm.num_free_blocks == 4 and bm.ref_count(0) == 0
    with pytest.raises(RuntimeError):
        bm.free([0])
    with pytest.raises(RuntimeError):
        bm.share([3])  # not allocated
