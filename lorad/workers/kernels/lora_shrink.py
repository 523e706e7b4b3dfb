"""LoRA shrink: t[row, :r] = x[row] A[slot]^T in fp32, for up to three tables that share x.

A program takes one work item at a time, (row tile, block of BLOCK_R ranks of one table), and
sweeps the whole input dimension for it: it reads that block of its slot's A once for the tile's
rows. Every row gets the same arithmetic whatever shares its step: products accumulated per
(row, rank, lane) over K in BLOCK_K steps, then one reduction over the lanes, with one tile shape
for every table and batch; no split-K and no atomics. Rows of slot 0, ranks at or past a slot's
rank and slots a table does not edit (rank 0) are neither read nor written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.lora_tiles import BLOCK_M, LoraTiles, max_programs

MAX_TABLES = 3  # q/k/v share an input; gate/up share one


@dataclass(frozen=True)
class ShrinkConfig:
    block_r: int = 2  # ranks per work item: decode rows are few, so ranks give the parallelism
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3  # loads in flight along K (Hopper: cp.async into shared memory)


DEFAULT_CONFIG = ShrinkConfig()


@triton.jit
def _shrink_block(x_ptr, stride_x, t_ptr, stride_t, a_ptr, ranks_ptr, max_rank, block,
                  first, slot, sorted_rows_ptr, sorted_slots_ptr, num_rows, K,
                  BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                  NUM_STAGES: tl.constexpr):
    rank = tl.load(ranks_ptr + slot)
    j0 = block * BLOCK_R
    if j0 < rank:
        pos = first + tl.arange(0, BLOCK_M)
        in_tile = pos < num_rows
        in_tile = in_tile & (tl.load(sorted_slots_ptr + pos, mask=in_tile, other=0) == slot)
        rows = tl.load(sorted_rows_ptr + pos, mask=in_tile, other=0)
        ranks_j = j0 + tl.arange(0, BLOCK_R)
        has_j = ranks_j < rank
        x_rows = x_ptr + rows[:, None] * stride_x  # [BLOCK_M, 1]
        a_rows = a_ptr + (slot * max_rank + ranks_j)[:, None] * K  # [BLOCK_R, 1]
        acc = tl.zeros([BLOCK_M, BLOCK_R, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            cols = k0 + tl.arange(0, BLOCK_K)
            in_k = cols < K
            xk = tl.load(x_rows + cols[None, :], mask=in_tile[:, None] & in_k[None, :], other=0.0)
            ak = tl.load(a_rows + cols[None, :], mask=has_j[:, None] & in_k[None, :], other=0.0)
            acc += xk.to(tl.float32)[:, None, :] * ak[None, :, :]
        t = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_R]
        tl.store(t_ptr + rows[:, None] * stride_t + ranks_j[None, :], t,
                 mask=in_tile[:, None] & has_j[None, :])


# The batch size must not pick another compiled variant (triton specializes ints equal to 1 or
# divisible by 16): one binary, so one order of sums, for every batch.
@triton.jit(do_not_specialize=["stride_t_table", "num_rows"])
def _shrink_kernel(x_ptr, stride_x, t_ptr, stride_t_table, stride_t,
                   a0_ptr, a1_ptr, a2_ptr, ranks0_ptr, ranks1_ptr, ranks2_ptr,
                   max_rank0, max_rank1, max_rank2, blocks_end0, blocks_end1, num_blocks,
                   sorted_rows_ptr, sorted_slots_ptr, tile_first_ptr, num_tiles_ptr, num_rows, K,
                   NUM_TABLES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    # Work item = (tile, block); table i owns blocks [blocks_end{i-1}, blocks_end{i}).
    num_items = (tl.load(num_tiles_ptr) * num_blocks).to(tl.int32)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        tile = item // num_blocks
        block = item - tile * num_blocks
        first = tl.load(tile_first_ptr + tile)
        slot = tl.load(sorted_slots_ptr + first)
        if block < blocks_end0:
            _shrink_block(x_ptr, stride_x, t_ptr, stride_t, a0_ptr, ranks0_ptr, max_rank0,
                          block, first, slot, sorted_rows_ptr, sorted_slots_ptr, num_rows, K,
                          BLOCK_M, BLOCK_R, BLOCK_K, NUM_STAGES)
        elif NUM_TABLES == 2:
            _shrink_block(x_ptr, stride_x, t_ptr + stride_t_table, stride_t, a1_ptr, ranks1_ptr,
                          max_rank1, block - blocks_end0, first, slot, sorted_rows_ptr,
                          sorted_slots_ptr, num_rows, K, BLOCK_M, BLOCK_R, BLOCK_K, NUM_STAGES)
        elif NUM_TABLES == 3:
            if block < blocks_end1:
                _shrink_block(x_ptr, stride_x, t_ptr + stride_t_table, stride_t, a1_ptr,
                              ranks1_ptr, max_rank1, block - blocks_end0, first, slot,
                              sorted_rows_ptr, sorted_slots_ptr, num_rows, K,
                              BLOCK_M, BLOCK_R, BLOCK_K, NUM_STAGES)
            else:
                _shrink_block(x_ptr, stride_x, t_ptr + 2 * stride_t_table, stride_t, a2_ptr,
                              ranks2_ptr, max_rank2, block - blocks_end1, first, slot,
                              sorted_rows_ptr, sorted_slots_ptr, num_rows, K,
                              BLOCK_M, BLOCK_R, BLOCK_K, NUM_STAGES)


def lora_shrink(x: torch.Tensor, a_tables: Sequence[torch.Tensor],
                rank_tables: Sequence[torch.Tensor], tiles: LoraTiles,
                out: torch.Tensor | None = None, num_programs: int | None = None,
                config: ShrinkConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """-> t: [num_tables, num_rows, max(max_rank)] float32; t[i, row, :rank] is written for each
    row whose slot table i edits (rank = rank_tables[i][slot] > 0), nothing else.

    x: [num_rows, in_features] (bf16, fp16 or fp32); a_tables[i]: [num_slots, max_rank_i,
    in_features] fp32, contiguous; rank_tables[i]: [num_slots] int32."""
    if not 1 <= len(a_tables) <= MAX_TABLES or len(rank_tables) != len(a_tables):
        raise ValueError(f"1 to {MAX_TABLES} tables, each with its ranks")
    num_rows, num_in = x.shape
    assert tiles.sorted_rows.shape[0] == num_rows, "tiles of another batch"
    for a in a_tables:
        assert a.dtype == torch.float32 and a.is_contiguous() and a.shape[2] == num_in
    x = x if x.stride(1) == 1 else x.contiguous()
    width = max(a.shape[1] for a in a_tables)
    if out is None:
        out = torch.empty(len(a_tables), num_rows, width, dtype=torch.float32, device=x.device)
    assert out.shape == (len(a_tables), num_rows, width) and out.stride(2) == 1
    blocks_end = [0]
    for a in a_tables:
        blocks_end.append(blocks_end[-1] + triton.cdiv(a.shape[1], config.block_r))
    num_blocks = blocks_end[-1]
    if tiles.max_tiles == 0:
        return out
    grid = (min(tiles.max_tiles * num_blocks, num_programs or max_programs(x.device)),)
    padded = list(a_tables) + [a_tables[0]] * (MAX_TABLES - len(a_tables))
    ranks = list(rank_tables) + [rank_tables[0]] * (MAX_TABLES - len(rank_tables))
    _shrink_kernel[grid](
        x, x.stride(0), out, out.stride(0), out.stride(1), *padded, *ranks,
        *(a.shape[1] for a in padded), blocks_end[1], blocks_end[min(2, len(a_tables))],
        num_blocks, tiles.sorted_rows, tiles.sorted_slots, tiles.tile_first, tiles.num_tiles,
        num_rows, num_in, NUM_TABLES=len(a_tables), BLOCK_M=BLOCK_M, BLOCK_R=config.block_r,
        BLOCK_K=config.block_k, NUM_STAGES=config.num_stages, num_warps=config.num_warps)
    return out
