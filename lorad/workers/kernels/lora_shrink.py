"""LoRA shrink, split over K: t[row, c, :r] = x[row, chunk c] A[slot, :r, chunk c]^T in fp32, for
up to three tables that share x; lora_expand adds up the chunks, in one fixed order, as it reads t.

A program takes one work item at a time, (row tile, block of BLOCK_R ranks of one table, group of
consecutive chunks of K_CHUNK inputs): it reads that piece of its slot's A once for the tile's rows,
one chunk's partial sum after another (one chunk per group unless the step has many items, see
ITEMS_PER_SM). Splitting K is what fills the GPU at decode: a whole [BLOCK_R, K] sweep per program
left a 14336-wide down projection at batch 1 with 8 programs, each waiting on one load after
another. Each step is one MMA (exact_dot: a [BLOCK_M, BLOCK_K] tile of x against [BLOCK_K, BLOCK_R]
of A, fp32 accumulation on the tensor cores), so a tile's empty lanes (a tile of one row: distinct
adapters) cost little. Every row gets the same arithmetic whatever shares its step: an MMA
computes a row's outputs from that row alone, the chunk's steps are taken in order, with one tile
shape and one chunk size for every table and batch; each chunk's partial sum has its own place in
t, so no atomics. Rows of slot 0 are neither read nor written; ranks at or past a slot's rank (all
of them for a slot the table does not edit) are read with the rest, so that no load waits on the
rank, but not written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.launch_math import cdiv
from lorad.workers.kernels.lora_common import (BF16_PARTS, MAX_TABLES, bf16_parts, exact_dot,
                                               group_size, load_tile, pad_tables,
                                               table_block_ends)
from lorad.workers.kernels.lora_tiles import LoraTiles, max_programs, target_items
from lorad.workers.kernels import pdl
from lorad.workers.kernels.pdl import launch_options

# Work items per multiprocessor past which a shrink work item takes several K chunks in one
# sweep (its tile looked up once, its loads running on across the chunks): with distinct
# adapters at batch 64 one chunk per item made 3,072 items of 8 KB for q/k/v, each a chain of
# dependent loads (profile_graph.py, H200, 2026-12-01: the q/k/v shrink 40 us, down's 48). On
# the H200 (bench_engine.py --variant, graph replay ms, 6 against 0): 64 distinct adapters at
# batch 64 13.33 against 13.45 and 13.49 with bf16 tables, 13.15 against 13.39 with fp32 ones; at
# batch 32 and with one adapter the same within 0.04. 12 per multiprocessor: 13.40. (Those were
# the FMA kernels before the MMA ones; with these, 19:22 UTC, off: the same at batch 32, 7.28
# against 7.29, and at batch 1.) 3 against 6 on the tensor-core kernels (2026-12-02 05:15 UTC,
# graph replay ms): 64 distinct adapters at batch 64 9.017 against 9.178 and 9.190, at 32 6.721
# against 6.765; one adapter 5.662 and 6.962 against 5.678 and 6.975 at 32 and 64; 12: 9.217 at
# 64. With the expand's ITEMS_PER_SM at 4 too: below.
ITEMS_PER_SM = 3
# Steps of more rows than this launch the shrink without PDL even where the step's other kernels
# take it (None: as the step's kernels). Launched with PDL, the shrink's programs take their
# places on every SM before the norm ahead of it ends, and the base matmul beside it, which cuBLAS
# launches plainly, waits for them to leave: with 64 distinct adapters at batch 64 q/k/v's matmul
# started 9.3 us after the norm's end (profile_graph.py, H200, 2026-12-02 00:47 UTC). A setting
# for benchmarks to compare (bench_engine.py --variant 'lora_shrink.PDL_MAX_ROWS=32'); not
# measured yet.
PDL_MAX_ROWS: int | None = None


@dataclass(frozen=True)
class ShrinkConfig:
    # Ranks and inputs per work item: one [BLOCK_M, block_k] x [block_k, block_r] MMA a step
    # (both sides powers of two of at least 16, as tl.dot takes them). Decode rows are few, so
    # ranks and K chunks give the parallelism.
    block_r: int = 16
    block_k: int = 128
    # Inputs per chunk, a multiple of block_k: a fixed size, so a row's sums never depend on the
    # batch. Smaller means more programs but more partial sums for the expand to add.
    # 256 on an H200 (bench_engine.py --variant, 2026-12-01 19:22 UTC, graph replay ms): one adapter
    # at batch 1 4.81 against 4.90, but at batch 32 5.94 against 5.81, 64 distinct adapters at 32
    # 7.66 against 7.29.
    k_chunk: int = 512
    # 4 warps in the same run: 64 distinct at batch 32 7.32 against 7.29 (fp32 tables, three bf16
    # terms per factor: 9.92 against 9.04), one adapter the same.
    num_warps: int = 2
    # Loads in flight along a chunk (Hopper: cp.async into shared memory).
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_r", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} {value} is not a power of two >= 16 (a tl.dot side)")
        if self.k_chunk % self.block_k:
            raise ValueError(f"k_chunk {self.k_chunk} is not a multiple of block_k {self.block_k}")


DEFAULT_CONFIG = ShrinkConfig()


def num_k_chunks(in_features: int, config: ShrinkConfig | None = None) -> int:
    """The partial sums per row and rank that lora_shrink writes for this input width (config
    None: DEFAULT_CONFIG, read at the call)."""
    return cdiv(in_features, (config or DEFAULT_CONFIG).k_chunk)


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
                   PDL: tl.constexpr, TRIGGER_LATE: tl.constexpr):
    pdl.start(PDL, TRIGGER_LATE)
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
    pdl.finish(PDL, TRIGGER_LATE)


def lora_shrink(x: torch.Tensor, a_tables: Sequence[torch.Tensor],
                rank_tables: Sequence[torch.Tensor], tiles: LoraTiles,
                out: torch.Tensor | None = None, num_programs: int | None = None,
                config: ShrinkConfig | None = None,
                num_target_items: int | None = None) -> torch.Tensor:
    """-> t: [num_tables, num_rows, num_k_chunks(in_features), max(max_rank)] float32, the
    partial sums of each chunk of K (their sum in chunk order is x A^T; lora_expand adds them);
    t[i, row, :, :rank] is written for each row whose slot table i edits (rank =
    rank_tables[i][slot] > 0), nothing else.

    x: [num_rows, in_features] (bf16, fp16 or fp32); a_tables[i]: [num_slots, max_rank_i,
    in_features] fp32, bf16 or fp16 (all of one dtype; exact_dot splits them exactly into bf16
    terms), contiguous; rank_tables[i]: [num_slots] int32. num_target_items: where a work item
    starts taking several chunks (None: ITEMS_PER_SM per multiprocessor, read at the call; 0:
    never); it changes no bit of t."""
    if not 1 <= len(a_tables) <= MAX_TABLES or len(rank_tables) != len(a_tables):
        raise ValueError(f"1 to {MAX_TABLES} tables, each with its ranks")
    config = config or DEFAULT_CONFIG  # read at the call: benchmarks swap it
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
    grid = (min(num_items, num_programs or max_programs(x.device)),)
    padded = pad_tables(a_tables)
    _shrink_kernel[grid](
        x, x.stride(0), out, out.stride(0), out.stride(1), out.stride(2), *padded,
        *pad_tables(rank_tables),
        *(a.shape[1] for a in padded), blocks_end[1], blocks_end[min(2, len(a_tables))],
        num_blocks, shape[2], tiles.tile_rows, tiles.tile_slot, tiles.num_tiles, num_in,
        target_items(ITEMS_PER_SM, x.device) if num_target_items is None else num_target_items,
        NUM_TABLES=len(a_tables), BLOCK_M=tiles.block_m,
        BLOCK_R=config.block_r, BLOCK_K=config.block_k, K_CHUNK=config.k_chunk,
        NUM_STAGES=config.num_stages, X_PARTS=bf16_parts(x.dtype),
        A_PARTS=bf16_parts(a_tables[0].dtype), num_warps=config.num_warps,
        TRIGGER_LATE=pdl.LORA_TRIGGER_LATE,
        **launch_options(x.device, num_rows, PDL_MAX_ROWS))
    return out
