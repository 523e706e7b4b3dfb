"""Row tiles for the LoRA kernels: a step's adapter rows grouped by slot, built on the device.

The rows are sorted by slot (stably; slot-0 rows last) and cut into tiles of at most BLOCK_M rows
of one slot, so a program reads its slot's factors once for the whole tile. The shrink and expand
take the tiles of adapter rows, which come first; the fused kernels that add a delta as they read
a projection's output (fused_ops.py) take every tile, slot-0 rows' included, as they must write
every row. Plain torch ops with
static shapes and no host sync, so building the tiles can be captured in a CUDA graph along with
the kernels. No triton import: the model builds tiles without touching the kernel modules.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

BLOCK_M = 8  # rows per tile: shrink and expand share the tiles, so they share this


@dataclass(frozen=True)
class LoraTiles:
    """Which rows each tile holds. Tile k's rows are sorted_rows[tile_first[k] + i] for the
    i < BLOCK_M whose sorted_slots entry equals the tile's slot, sorted_slots[tile_first[k]]."""

    row_slots: torch.Tensor  # [num_rows] int64: each row's adapter slot, as given
    sorted_rows: torch.Tensor  # [num_rows] int64: row indices by slot, slot-0 rows last
    sorted_slots: torch.Tensor  # [num_rows] int64: the slot of each sorted row
    tile_first: torch.Tensor  # [num_rows] int64: first sorted position of each tile
    num_tiles: torch.Tensor  # [1] int64: tiles of adapter rows, the first ones
    max_tiles: int  # a bound on num_tiles known to Python: it sizes the kernels' grids
    num_tiles_all: torch.Tensor  # [1] int64: tiles of every row; tile_first[num_tiles_all:] unused
    max_tiles_all: int  # a bound on num_tiles_all known to Python

    @classmethod
    def build(cls, row_slots: torch.Tensor, max_tiles: int,
              max_tiles_all: int | None = None) -> "LoraTiles":
        """row_slots: [num_rows] int64, each row's adapter slot (0: none). max_tiles_all: None
        for the bound that holds for any mixture."""
        num_rows = row_slots.shape[0]
        positions = torch.arange(num_rows, device=row_slots.device)
        never = torch.iinfo(torch.int64).max
        keys = torch.where(row_slots == 0, never, row_slots)  # slot-0 rows sort last
        sorted_keys, sorted_rows = torch.sort(keys, stable=True)
        sorted_slots = torch.where(sorted_keys == never, 0, sorted_keys)
        new_slot = torch.cat([torch.ones(1, dtype=torch.bool, device=row_slots.device),
                              sorted_slots[1:] != sorted_slots[:-1]])
        slot_start = torch.cummax(torch.where(new_slot, positions, 0), 0).values
        starts_tile = (positions - slot_start) % BLOCK_M == 0
        tiles_so_far = torch.cumsum(starts_tile, 0)  # [num_rows] int64, non-decreasing
        # Tile k starts where the running count first reaches k + 1.
        tile_first = torch.searchsorted(tiles_so_far, positions + 1)
        # Tensors of their own: a view's address would be aligned for some batch sizes only, and
        # triton compiles a variant per pointer alignment.
        num_tiles = torch.cumsum(starts_tile & (sorted_slots != 0), 0)[-1:].clone()
        num_tiles_all = tiles_so_far[-1:].clone()
        if max_tiles_all is None:
            max_tiles_all = max_tiles_any_mixture(num_rows)
        return cls(row_slots, sorted_rows, sorted_slots, tile_first, num_tiles, max_tiles,
                   num_tiles_all, max_tiles_all)


def count_tiles(rows_per_slot: Iterable[int]) -> int:
    """The exact number of tiles, from the number of rows of each adapter slot (>= 1)."""
    return sum(-(-n // BLOCK_M) for n in rows_per_slot)


def max_tiles_any_mixture(num_rows: int) -> int:
    """A bound for every mixture of num_rows rows (a CUDA graph serves any): each tile has a
    row."""
    return num_rows


PROGRAMS_PER_SM = 8  # a persistent grid's size per multiprocessor: enough to hide load latency
CPU_PROGRAMS = 64  # under TRITON_INTERPRET=1 programs run one after another


def max_programs(device: torch.device) -> int:
    """The most programs a LoRA kernel launches; each loops over (tile, block) work items, so a
    graph sized for any mixture does not launch thousands of idle programs."""
    if device.type != "cuda":
        return CPU_PROGRAMS
    return PROGRAMS_PER_SM * _multiprocessors(device.index
                                              if device.index is not None
                                              else torch.cuda.current_device())


_SM_COUNTS: dict[int, int] = {}


def _multiprocessors(index: int) -> int:
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
