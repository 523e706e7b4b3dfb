"""Row tiles for the LoRA kernels: a step's adapter rows grouped by slot.

The rows are sorted by slot (stably; slot-0 rows last) and cut into tiles of at most block_m rows
of one slot, so a program reads its slot's factors once for the whole tile. The model builds them
on the host, where each row's slot is known from the step's chunks (host_tiles; the decode
graphs' inputs hold them as a step input, cuda_graph.py): a device build is some 30 small
kernels each step. LoraTiles.build makes the same tiles on the device from a tensor of slots
(plain torch ops with static shapes and no host sync), for benchmarks and tests. No triton
import: the model builds tiles without touching the kernel modules.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from lorad.workers.kernels.configs import TileConfig

CPU_PROGRAMS = 64  # under TRITON_INTERPRET=1 programs run one after another

@dataclass(frozen=True)
class LoraTiles:
    """Which rows each tile holds, as the kernels read them: tile k's slot, tile_slot[k], and its
    block_m entries of tile_rows (-1 for an empty lane), two loads that do not wait on each
    other. The tiles of adapter rows are the first num_tiles."""

    tile_slot: torch.Tensor  # [num_rows] int64: each tile's slot (0 past num_tiles)
    tile_rows: torch.Tensor  # [num_rows, block_m] int64: each tile's rows, -1 for empty lanes
    num_tiles: torch.Tensor  # [1] int64: tiles of adapter rows; later entries are unused
    max_tiles: int  # a bound on num_tiles known to Python: it sizes the kernels' grids
    programs_per_sm: int = TileConfig.programs_per_sm  # the kernels' persistent grids

    @property
    def num_rows(self) -> int:
        """The rows of the batch the tiles were built for."""
        return self.tile_rows.shape[0]

    @property
    def block_m(self) -> int:
        """Rows per tile (TileConfig.block_m when they were built)."""
        return self.tile_rows.shape[1]

    @classmethod
    def from_host(cls, row_slots: np.ndarray, max_tiles: int, device: torch.device | str,
                  config: TileConfig = TileConfig()) -> "LoraTiles":
        """host_tiles(row_slots), copied to `device`."""
        tile_slot, tile_rows, num_tiles = host_tiles(row_slots, config.block_m)
        return cls(torch.from_numpy(tile_slot).to(device), torch.from_numpy(tile_rows).to(device),
                   torch.tensor([num_tiles], dtype=torch.int64, device=device), max_tiles,
                   config.programs_per_sm)

    @classmethod
    def build(cls, row_slots: torch.Tensor, max_tiles: int,
              config: TileConfig = TileConfig()) -> "LoraTiles":
        """row_slots: [num_rows] int64, each row's adapter slot (0: none)."""
        block_m = config.block_m
        num_rows = row_slots.shape[0]
        positions = torch.arange(num_rows, device=row_slots.device)
        never = torch.iinfo(torch.int64).max
        keys = torch.where(row_slots == 0, never, row_slots)  # slot-0 rows sort last
        sorted_keys, sorted_rows = torch.sort(keys, stable=True)
        sorted_slots = torch.where(sorted_keys == never, 0, sorted_keys)
        new_slot = torch.cat([torch.ones(1, dtype=torch.bool, device=row_slots.device),
                              sorted_slots[1:] != sorted_slots[:-1]])
        slot_start = torch.cummax(torch.where(new_slot, positions, 0), 0).values
        starts_tile = ((positions - slot_start) % block_m == 0) & (sorted_slots != 0)
        tiles_so_far = torch.cumsum(starts_tile, 0)  # [num_rows] int64, non-decreasing
        # Tile k starts at sorted position tile_first[k], where the running count first reaches
        # k + 1; past the last tile that is num_rows: no slot, no rows.
        tile_first = torch.searchsorted(tiles_so_far, positions + 1)
        # A tensor of its own: a view's address would be aligned for some batch sizes only, and
        # triton compiles a variant per pointer alignment.
        num_tiles = tiles_so_far[-1:].clone()
        last = max(num_rows - 1, 0)
        tile_slot = torch.where(tile_first < num_rows, sorted_slots[tile_first.clamp(max=last)], 0)
        # A tile's rows: the next block_m sorted positions that still hold its slot.
        lanes = tile_first[:, None] + torch.arange(block_m, device=row_slots.device)
        in_tile = (lanes < num_rows) & (sorted_slots[lanes.clamp(max=last)] == tile_slot[:, None])
        tile_rows = torch.where(in_tile, sorted_rows[lanes.clamp(max=last)], -1)
        return cls(tile_slot, tile_rows, num_tiles, max_tiles, config.programs_per_sm)


def host_tiles(row_slots: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray, int]:
    """LoraTiles.build's tiles on the host, from row_slots [num_rows] int64 (each row's slot, 0
    for none): -> (tile_slot [num_rows], tile_rows [num_rows, block_m], num_tiles), int64 numpy
    arrays holding slot 0 and empty lanes (-1) past the tiles; block_m rows per tile."""
    num_rows = len(row_slots)
    tile_slot = np.zeros(num_rows, dtype=np.int64)
    tile_rows = np.full((num_rows, block_m), -1, dtype=np.int64)
    rows = np.flatnonzero(row_slots)
    if rows.size == 0:
        return tile_slot, tile_rows, 0
    rows = rows[np.argsort(row_slots[rows], kind="stable")]  # by slot, in row order within one
    slots = row_slots[rows]
    positions = np.arange(rows.size)
    new_slot = np.ones(rows.size, dtype=bool)
    new_slot[1:] = slots[1:] != slots[:-1]
    lane = (positions - np.maximum.accumulate(np.where(new_slot, positions, 0))) % block_m
    tile = np.cumsum(lane == 0) - 1  # a slot's rows in tiles of block_m, slots ascending
    tile_rows[tile, lane] = rows
    tile_slot[tile] = slots
    return tile_slot, tile_rows, int(tile[-1]) + 1


def count_tiles(rows_per_slot: Iterable[int], block_m: int) -> int:
    """The exact number of tiles of block_m rows, from the number of rows of each adapter slot
    (>= 1)."""
    return sum(-(-n // block_m) for n in rows_per_slot)


def max_tiles_any_mixture(num_rows: int) -> int:
    """A bound for every mixture of num_rows rows (a CUDA graph serves any): each tile has a
    row."""
    return num_rows


def max_programs(device: torch.device, programs_per_sm: int) -> int:
    """The most programs a LoRA kernel launches; each loops over (tile, block) work items, so a
    graph sized for any mixture does not launch thousands of idle programs."""
    if device.type != "cuda":
        return CPU_PROGRAMS
    return programs_per_sm * _multiprocessors(device.index
                                              if device.index is not None
                                              else torch.cuda.current_device())


def target_items(items_per_sm: int, device: torch.device, programs_per_sm: int) -> int:
    """Work items a LoRA kernel aims at before its items take several pieces each:
    items_per_sm per multiprocessor (0: one piece per item; CPU_PROGRAMS stands for the
    multiprocessors' programs on the CPU)."""
    return items_per_sm * max_programs(device, programs_per_sm) // programs_per_sm


_SM_COUNTS: dict[int, int] = {}


def _multiprocessors(index: int) -> int:
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
