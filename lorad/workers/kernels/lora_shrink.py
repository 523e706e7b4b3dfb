"""LoRA shrink, split over K: t[row, c, :r] = x[row, chunk c] A[slot, :r, chunk c]^T in fp32, for
up to three tables that share x; lora_expand adds up the chunks, in one fixed order, as it reads t.

A program takes one work item at a time, (row tile, block of BLOCK_R ranks of one table, group of
consecutive chunks of K_CHUNK inputs): it reads that piece of its slot's A once for the tile's rows,
one chunk's partial sum after another (one chunk per group unless the step has many items, see
ShrinkConfig.items_per_sm). Splitting K is what fills the GPU at decode: a whole [BLOCK_R, K]
sweep per program left a 14336-wide down projection at batch 1 with 8 programs, each waiting on
one load after another. Each step is one MMA (exact_dot: a [BLOCK_M, BLOCK_K] tile of x
against [BLOCK_K, BLOCK_R] of A, fp32 accumulation on the tensor cores), so a tile's empty lanes
(a tile of one row: distinct adapters) cost little. Every row gets the same arithmetic whatever
shares its step: an MMA computes a row's outputs from that row alone, the chunk's steps are taken
in order, with one tile shape and one chunk size for every table and batch; each chunk's partial
sum has its own place in t, so no atomics. Rows of slot 0 are neither read nor written; ranks at
or past a slot's rank (all of them for a slot the table does not edit) are read with the rest, so
that no load waits on the rank, but not written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.configs import ShrinkConfig
from lorad.workers.kernels.launch_math import cdiv
from lorad.workers.kernels.lora_common import (BF16_PARTS, MAX_TABLES, bf16_parts, exact_dot,
                                               group_size, load_tile, pad_tables,
                                               table_block_ends)
from lorad.workers.kernels.lora_tiles import LoraTiles, max_programs, target_items
from lorad.workers.kernels import pdl
from lorad.workers.kernels.pdl import launch_options

def num_k_chunks(in_features: int, config: ShrinkConfig = ShrinkConfig()) -> int:
    """The partial sums per row and rank that lora_shrink writes for this input width."""
    return cdiv(in_features, config.k_chunk)


@triton.jit
def _shrink_block(x_ptr, stride_x, t_ptr, stride_t, stride_t_chunk, a_ptr, ranks_ptr, max_rank,
                  block, chunk, num_item_chunks, slot, rows, in_tile, K,
                  BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                  K_CHUNK: tl.constexpr, NUM_STAGES: tl.constexpr, X_PARTS: tl.constexpr,
                  A_PARTS: tl.constexpr):
    # Chunks [chunk, chunk + num_item_chunks) in one sweep of K, so that the loads run on across
    # a chunk's end: each chunk's sum starts from zero, takes its BLOCK_K steps in order and is
    # stored at its last step, exactly as a work item of that chunk alone would.
    # No load waits on the slot's rank: x and A are requested once the tile is known, and the
    # rank only masks the store (a chain of one load instead of two). A's rows past the rank are
    # padding; their columns of the product are never stored.
    rank = tl.load(ranks_ptr + slot)
    ranks_j = block * BLOCK_R + tl.arange(0, BLOCK_R)
    in_r = ranks_j < max_rank
    x_rows = x_ptr + rows[:, None] * stride_x  # [BLOCK_M, 1]
    a_rows = a_ptr + (slot * max_rank + ranks_j)[:, None] * K  # [BLOCK_R, 1]
    t_rows = t_ptr + rows[:, None] * stride_t + ranks_j[None, :]  # [BLOCK_M, BLOCK_R]
    stores = in_tile[:, None] & (ranks_j < rank)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    k_start = chunk * K_CHUNK
    for k0 in tl.range(k_start, k_start + num_item_chunks * K_CHUNK, BLOCK_K,
                       num_stages=NUM_STAGES):
        cols = k0 + tl.arange(0, BLOCK_K)
        in_k = cols < K
        xk = tl.load(x_rows + cols[None, :], mask=in_tile[:, None] & in_k[None, :], other=0.0)
        ak = tl.load(a_rows + cols[None, :], mask=in_r[:, None] & in_k[None, :], other=0.0)
        acc = exact_dot(xk, tl.trans(ak), acc, X_PARTS, A_PARTS)
        if (k0 + BLOCK_K) % K_CHUNK == 0:  # the chunk's last step
            tl.store(t_rows + (k0 // K_CHUNK) * stride_t_chunk, acc, mask=stores)
            acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)


# The batch size must not pick another compiled variant (triton specializes ints equal to 1 or
# divisible by 16): one binary, so one order of sums, for every batch.
@triton.jit(do_not_specialize=["stride_t_table"])
def _shrink_kernel(x_ptr, stride_x, t_ptr, stride_t_table, stride_t, stride_t_chunk,
                   a0_ptr, a1_ptr, a2_ptr, ranks0_ptr, ranks1_ptr, ranks2_ptr,
                   max_rank0, max_rank1, max_rank2, blocks_end0, blocks_end1, num_blocks,
                   num_chunks, tile_rows_ptr, tile_slot_ptr, num_tiles_ptr, K, target_items,
                   NUM_TABLES: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr,
                   NUM_STAGES: tl.constexpr, X_PARTS: tl.constexpr, A_PARTS: tl.constexpr,
                   PDL: tl.constexpr):
    pdl.start(PDL)
    # Work item = (tile, block, group of chunks); table i owns blocks [blocks_end{i-1},
    # blocks_end{i}). Groups vary fastest, so neighbouring programs read neighbouring parts of
    # the same A rows. A group is `group` consecutive chunks (the last group may have fewer):
    # one chunk while the step's items are few, more as they pass target_items, so that each
    # item streams more of A behind one lookup of its tile. Which item computes a chunk changes
    # none of its bits.
    num_tiles = tl.load(num_tiles_ptr).to(tl.int32)
    group = group_size(num_tiles * num_blocks * num_chunks, num_chunks, target_items)
    num_groups = tl.cdiv(num_chunks, group)
    items_per_tile = num_blocks * num_groups
    num_items = num_tiles * items_per_tile
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        tile = item // items_per_tile
        block = (item - tile * items_per_tile) // num_groups
        chunk = (item - tile * items_per_tile - block * num_groups) * group
        num_item_chunks = tl.minimum(group, num_chunks - chunk)
        slot, rows, in_tile = load_tile(tile_slot_ptr, tile_rows_ptr, tile, BLOCK_M)
        if block < blocks_end0:
            _shrink_block(x_ptr, stride_x, t_ptr, stride_t, stride_t_chunk, a0_ptr, ranks0_ptr,
                          max_rank0, block, chunk, num_item_chunks, slot, rows, in_tile, K,
                          BLOCK_M, BLOCK_R, BLOCK_K, K_CHUNK, NUM_STAGES, X_PARTS, A_PARTS)
        elif NUM_TABLES == 2:
            _shrink_block(x_ptr, stride_x, t_ptr + stride_t_table, stride_t, stride_t_chunk,
                          a1_ptr, ranks1_ptr, max_rank1, block - blocks_end0, chunk,
                          num_item_chunks, slot, rows, in_tile, K,
                          BLOCK_M, BLOCK_R, BLOCK_K, K_CHUNK, NUM_STAGES, X_PARTS, A_PARTS)
        elif NUM_TABLES == 3:
            if block < blocks_end1:
                _shrink_block(x_ptr, stride_x, t_ptr + stride_t_table, stride_t, stride_t_chunk,
                              a1_ptr, ranks1_ptr, max_rank1, block - blocks_end0, chunk,
                              num_item_chunks, slot, rows, in_tile, K,
                              BLOCK_M, BLOCK_R, BLOCK_K, K_CHUNK, NUM_STAGES, X_PARTS, A_PARTS)
            else:
                _shrink_block(x_ptr, stride_x, t_ptr + 2 * stride_t_table, stride_t,
                              stride_t_chunk, a2_ptr, ranks2_ptr, max_rank2, block - blocks_end1,
                              chunk, num_item_chunks, slot, rows, in_tile, K,
                              BLOCK_M, BLOCK_R, BLOCK_K, K_CHUNK, NUM_STAGES, X_PARTS, A_PARTS)
    pdl.finish(PDL)


def lora_shrink(x: torch.Tensor, a_tables: Sequence[torch.Tensor],
                rank_tables: Sequence[torch.Tensor], tiles: LoraTiles,
                out: torch.Tensor | None = None, num_programs: int | None = None,
                config: ShrinkConfig = ShrinkConfig(),
                num_target_items: int | None = None, pdl_rows: int = 0) -> torch.Tensor:
    """-> t: [num_tables, num_rows, num_k_chunks(in_features), max(max_rank)] float32, the
    partial sums of each chunk of K (their sum in chunk order is x A^T; lora_expand adds them);
    t[i, row, :, :rank] is written for each row whose slot table i edits (rank =
    rank_tables[i][slot] > 0), nothing else.

    x: [num_rows, in_features] (bf16, fp16 or fp32); a_tables[i]: [num_slots, max_rank_i,
    in_features] fp32, bf16 or fp16 (all of one dtype; exact_dot splits them exactly into bf16
    terms), contiguous; rank_tables[i]: [num_slots] int32. num_target_items: where a work item
    starts taking several chunks (None: config.items_per_sm per multiprocessor; 0: never); it
    changes no bit of t. pdl_rows: the step's PDL row limit (kernels/pdl.py; 0: no PDL)."""
    if not 1 <= len(a_tables) <= MAX_TABLES or len(rank_tables) != len(a_tables):
        raise ValueError(f"1 to {MAX_TABLES} tables, each with its ranks")
    num_rows, num_in = x.shape
    assert tiles.num_rows == num_rows, "tiles of another batch"
    for a in a_tables:
        assert a.dtype in BF16_PARTS and a.is_contiguous() and a.shape[2] == num_in
        assert a.dtype == a_tables[0].dtype, "tables of one launch share a dtype"
    x = x if x.stride(1) == 1 else x.contiguous()
    width = max(a.shape[1] for a in a_tables)
    shape = (len(a_tables), num_rows, num_k_chunks(num_in, config), width)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=x.device)
    assert out.shape == shape and out.stride(3) == 1
    blocks_end = table_block_ends([a.shape[1] for a in a_tables], config.block_r)
    num_blocks = blocks_end[-1]
    if tiles.max_tiles == 0:
        return out
    num_items = tiles.max_tiles * num_blocks * shape[2]
    grid = (min(num_items, num_programs or max_programs(x.device, tiles.programs_per_sm)),)
    padded = pad_tables(a_tables)
    _shrink_kernel[grid](
        x, x.stride(0), out, out.stride(0), out.stride(1), out.stride(2), *padded,
        *pad_tables(rank_tables),
        *(a.shape[1] for a in padded), blocks_end[1], blocks_end[min(2, len(a_tables))],
        num_blocks, shape[2], tiles.tile_rows, tiles.tile_slot, tiles.num_tiles, num_in,
        target_items(config.items_per_sm, x.device, tiles.programs_per_sm)
        if num_target_items is None else num_target_items,
        NUM_TABLES=len(a_tables), BLOCK_M=tiles.block_m,
        BLOCK_R=config.block_r, BLOCK_K=config.block_k, K_CHUNK=config.k_chunk,
        NUM_STAGES=config.num_stages, X_PARTS=bf16_parts(x.dtype),
        A_PARTS=bf16_parts(a_tables[0].dtype), num_warps=config.num_warps,
        **launch_options(x.device, num_rows, pdl_rows))
    return out
