"""What the LoRA kernels share: the delta record the consumer kernels read (LoraDelta), the
padding of up to MAX_TABLES per-table arguments, and the Triton helpers of shrink and expand
(a tile's rows, the exact bf16-term MMA, work-item grouping).

A kernel module: imports torch, triton and other kernel modules, never a layer. The row tiles
themselves are lora_tiles.py's (built without triton).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.launch_math import cdiv

MAX_TABLES = 3  # q/k/v share an input; gate/up share one


def pad_tables(tables: Sequence) -> list:
    """1 to MAX_TABLES per-table arguments, padded to MAX_TABLES with the first: the kernels
    take MAX_TABLES of each and read only the first NUM_TABLES."""
    return list(tables) + [tables[0]] * (MAX_TABLES - len(tables))


def table_block_ends(sizes: Sequence[int], block: int) -> list[int]:
    """[0, e_0, e_1, ...]: table i owns the kernel's blocks [e_{i-1}, e_i) of `block` each,
    sizes[i] being its ranks or outputs."""
    ends = [0]
    for size in sizes:
        ends.append(ends[-1] + cdiv(size, block))
    return ends


@dataclass(frozen=True)
class LoraDelta:
    """One projection's LoRA delta on the kernel path, for the kernel that reads the projection's
    output next (add + RMSNorm, silu * up, rotary + KV write) to add: `delta[row]` widened-added
    to the rounded base output and rounded once, as the in-place expand would have, on the rows
    whose slot the table edits (`ranks[row_slots[row]] > 0`); its other rows hold no values.
    Computed on the side stream beside the base matmul (shrink, then expand into `delta`), so
    that no LoRA launch waits for the matmul."""

    delta: torch.Tensor  # [num_rows, out_end - out_start] float32
    ranks: torch.Tensor  # [num_slots] int32: the table's rank_table
    row_slots: torch.Tensor  # [num_rows] int64

    def apply_reference(self, out: torch.Tensor) -> torch.Tensor:
        """What a consumer kernel makes of `out` (plain torch, for tests)."""
        edited = (self.ranks[self.row_slots] > 0)[:, None]
        return torch.where(edited, (out.float() + self.delta).to(out.dtype), out)


@triton.jit
def load_tile(tile_slot_ptr, tile_rows_ptr, tile, BLOCK_M: tl.constexpr):
    """-> (slot, rows [BLOCK_M], in_tile [BLOCK_M]) of row tile `tile` (LoraTiles.tile_slot and
    tile_rows), loaded side by side: neither load waits on the other. Empty lanes get row 0,
    masked by in_tile."""
    slot = tl.load(tile_slot_ptr + tile)
    rows = tl.load(tile_rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    in_tile = rows >= 0
    return slot, tl.maximum(rows, 0), in_tile


@triton.jit
def _bf16_term(rest, i: tl.constexpr, PARTS: tl.constexpr):
    """-> (term i of a value being split into PARTS bf16 terms, what is left after it): `rest`
    starts as the value (in fp32 unless PARTS is 1) and each term is its bf16 rounding."""
    term = rest.to(tl.bfloat16)
    if i + 1 < PARTS:
        rest = rest - term.to(tl.float32)
    return term, rest


@triton.jit
def _split_start(value, PARTS: tl.constexpr):
    """The `rest` _bf16_term starts from: the value itself when it is one bf16 term, else fp32."""
    if PARTS == 1:
        start = value
    else:
        start = value.to(tl.float32)
    return start


@triton.jit
def exact_dot(a, b, acc, A_PARTS: tl.constexpr, B_PARTS: tl.constexpr):
    """acc + a @ b on the tensor cores with every product exact: a and b are each split into
    A_PARTS and B_PARTS bf16 terms (1 for bf16, 2 for fp16, 3 for fp32: the terms add up to the
    value exactly), and each pair of terms is one tl.dot accumulating in fp32. An MMA computes an
    output element from its own row of a and column of b, so a row's result never depends on
    the other rows of its tile."""
    rb = _split_start(b, B_PARTS)
    for j in tl.static_range(B_PARTS):
        bj, rb = _bf16_term(rb, j, B_PARTS)
        ra = _split_start(a, A_PARTS)
        for i in tl.static_range(A_PARTS):
            ai, ra = _bf16_term(ra, i, A_PARTS)
            acc = tl.dot(ai, bj, acc)
    return acc


@triton.jit
def group_size(num_items, most, target_items):
    """Consecutive pieces (K chunks, output blocks) a work item takes: 1 while the step's
    num_items (counted one piece each) are within target_items, more as they pass it, at most
    `most`; always 1 when target_items is 0. It changes which item computes a piece, never how."""
    group = tl.maximum(tl.minimum(num_items // tl.maximum(target_items, 1), most), 1)
    if target_items == 0:
        group = 1
    return group


# The bf16 terms exact_dot splits a value of each dtype into: also the factor-table dtypes the
# kernels take.
BF16_PARTS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


def bf16_parts(dtype: torch.dtype) -> int:
    """The bf16 terms exact_dot splits a value of this dtype into."""
    return BF16_PARTS[dtype]
