"""The LoRA kernels' row tiles built on the host (what the model uses) against the device build
(LoraTiles.build, the same tiles from a tensor of slots): equal for every mixture, at both tile
heights the kernels take; the tile count and the bound on it for any mixture."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lorad.workers.kernels.configs import TileConfig
from lorad.workers.kernels.lora_tiles import (LoraTiles, count_tiles, host_tiles,
                                              max_tiles_any_mixture)


def _mixtures(rng: random.Random, count: int) -> list[list[int]]:
    """Random steps: sizes 1 to 150, a few slots to many, base rows among them or none."""
    mixtures = [[0], [1], [0] * 40, [3] * 33, list(range(1, 65)), [2, 0] * 20]
    while len(mixtures) < count:
        num_rows = rng.randrange(1, 151)
        num_slots = rng.choice([1, 2, 4, 64])
        base_share = rng.choice([0.0, 0.3, 0.9])
        mixtures.append([0 if rng.random() < base_share else rng.randrange(1, num_slots + 1)
                         for _ in range(num_rows)])
    return mixtures


@pytest.mark.parametrize("block_m", (16, 32))
def test_host_tiles_equal_the_device_build(block_m):
    config = TileConfig(block_m=block_m)
    for slots in _mixtures(random.Random(block_m), 300):
        device = LoraTiles.build(torch.tensor(slots, dtype=torch.int64), len(slots), config)
        host = LoraTiles.from_host(np.array(slots, dtype=np.int64), len(slots), "cpu", config)
        for name in ("tile_slot", "tile_rows", "num_tiles"):
            got, want = getattr(host, name), getattr(device, name)
            assert got.dtype == want.dtype and torch.equal(got, want), (slots, name)
        assert host.block_m == block_m and host.num_rows == len(slots)
        per_slot = [slots.count(slot) for slot in set(slots) - {0}]
        assert int(host.num_tiles) == count_tiles(per_slot, block_m) \
            <= max_tiles_any_mixture(len(slots))


def test_host_tiles_keep_row_order_within_a_slot():
    row_slots = np.zeros(30, dtype=np.int64)
    row_slots[[0, 3, 4]] = 5
    row_slots[10:28] = 2
    tile_slot, tile_rows, num_tiles = host_tiles(row_slots, block_m=16)
    assert num_tiles == 3 and tile_slot.tolist() == [2, 2, 5] + [0] * 27  # slots ascending
    assert tile_rows[0].tolist() == list(range(10, 26))  # a slot's rows in tiles of 16, in order
    assert tile_rows[1].tolist() == [26, 27] + [-1] * 14
    assert tile_rows[2].tolist() == [0, 3, 4] + [-1] * 13
    assert (tile_rows[3:] == -1).all()
    assert host_tiles(np.zeros(4, dtype=np.int64), 16)[2] == 0


def _assert_same_tiles(got: LoraTiles, want: LoraTiles) -> None:
    for name in ("tile_slot", "tile_rows", "num_tiles", "max_tiles"):
        assert torch.equal(torch.as_tensor(getattr(got, name)),
                           torch.as_tensor(getattr(want, name))), name


def test_a_steps_rows_get_the_same_tiles_from_the_host_and_the_device():
    """LoraRows.from_batch's host build from the chunks and the device build from the row slots
    (LoraTiles.build) give the kernels the same tiles, prompt chunks and padding rows
    included."""
    from lorad.workers import lora_rows
    from lorad.workers.batch import ForwardBatch

    chunks = [(list(range(5, 25)), 0, [1, 2, 3, 4, 5], True, 2), ([7], 9, [6, 7, 8], True, 0),
              ([8], 3, [9], True, 1), (list(range(3)), 0, [10], False, 2), ([9], 4, [11, 12],
                                                                            True, 3)]
    batch = ForwardBatch.build(chunks, 4, "cpu", min_rows=32)
    host = lora_rows.LoraRows.from_batch(batch, use_kernels=True).tiles
    _assert_same_tiles(host, LoraTiles.build(batch.row_adapter_slots, host.max_tiles))
    assert int(host.num_tiles) == 4  # slot 2: 20 + 3 rows in two tiles; slots 1, 3


def test_a_step_captured_without_tiles_builds_them_on_the_device(monkeypatch):
    """Inside a CUDA graph capture whose batch holds no tiles, the step's tiles are built on the
    device from the row slots: tiles copied from the host would fix the captured mixture into
    every replay (tests/gpu/test_lora_kernels_gpu.py captures such a step on the H200; here the
    capture is stood in for, so that CI covers which build is taken)."""
    from lorad.workers.tuning import Tuning
    from lorad.workers import lora_rows
    from lorad.workers.batch import ForwardBatch

    chunks = [([7], 9, [6, 7, 8], True, 2), ([8], 3, [9], True, 0), ([9], 4, [11, 12], True, 1)]
    batch = ForwardBatch.build(chunks, 4, "cpu", min_rows=16)
    assert batch.lora_tiles is None
    outside = lora_rows.LoraRows.from_batch(batch, launch_always=True, use_kernels=True).tiles

    def no_host_copy(*args, **kwargs):
        raise AssertionError("tiles copied from the host during a capture")

    monkeypatch.setattr(LoraTiles, "from_host", no_host_copy)
    inside = lora_rows.step_tiles(batch, outside.max_tiles, Tuning(), capturing=True)
    _assert_same_tiles(inside, outside)


def test_prompt_steps_of_many_rows_add_their_deltas_in_place():
    """ExpandSteps.in_place_rows: a step with prompt chunks of at least that many rows adds its
    deltas in place; decode steps of any size, smaller prompt steps, 0 and the torch path do
    not."""
    import dataclasses

    from lorad.workers import lora_rows
    from lorad.workers.batch import ForwardBatch
    from lorad.workers.kernels.configs import ExpandSteps
    from lorad.workers.tuning import Tuning

    def in_place(chunks, rows: int, use_kernels: bool = True) -> bool:
        tuning = dataclasses.replace(Tuning(), expand=ExpandSteps(in_place_rows=rows))
        return lora_rows.LoraRows.from_batch(ForwardBatch.build(chunks, 4, "cpu"),
                                             use_kernels=use_kernels, tuning=tuning).in_place

    prompt = [(list(range(5, 45)), 0, list(range(10)), True, 1), ([7], 9, [20, 21, 22], True, 0)]
    decodes = [([7], 9, [20, 21, 22], True, 1 + i % 3) for i in range(48)]
    rows = ForwardBatch.build(prompt, 4, "cpu").row_adapter_slots.shape[0]  # 41 and padding
    assert in_place(prompt, rows) and in_place(prompt, 1)
    assert not in_place(prompt, rows + 1) and not in_place(prompt, 0)
    assert not in_place(decodes, 1)
    assert not in_place(prompt, 1, use_kernels=False)
    assert ExpandSteps().in_place_rows > 0
