"""LoRA expand: out[row] += scale[slot] * (t[row, :r] B[slot, :, :r]^T), in fp32, for up to three
outputs at once (the tables of projections that share an input), t being the sum of the shrink's
per-chunk partials, added here as they are read.

A program takes one work item at a time, (row tile, block of BLOCK_N outputs of one table): it
reads that block of its slot's B once for the tile's rows, and adds each row's delta to `out` in
one fp32 add (the column-parallel base output before its rounding, or the row-parallel partial
sum before the all-reduce). Every row gets the same arithmetic whatever shares its step: the
shrink's K-chunk partials summed by one reduction of fixed shape [BLOCK_M, MAX_CHUNKS, BLOCK_R]
(so every program reading a row gets the same bits, and the sum needs no launch of its own),
rank chunks of BLOCK_R in order, each reduced the same way, with one tile shape for every table;
no atomics. Rows of slot 0 are neither read nor written; rows of a slot the table does not edit
are read (no load waits on the rank) but not written. With deltas=True it writes the delta alone
into an fp32 buffer instead, for the next kernel to add, so that it runs beside the base matmul
instead of after it: the model's way, except for o_proj's and down_proj's partial sums at world
sizes above 1, which it adds into in place before their all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.launch_math import next_power_of_2
from lorad.workers.kernels.lora_shrink import MAX_TABLES, load_tile, pad_tables, table_block_ends
from lorad.workers.kernels.lora_tiles import LoraTiles, max_programs
from lorad.workers.kernels import pdl
from lorad.workers.kernels.pdl import launch_options
from lorad.workers.lora import STORED_DTYPES


@dataclass(frozen=True)
class ExpandConfig:
    block_n: int = 64
    # Rank chunk: adapters of rank <= 8 take one pass, rank 16 two. The [BLOCK_M, block_n,
    # block_r] products a pass holds set the registers, and so the programs a multiprocessor runs
    # at once (triton 3.6, sm_90, one table: on two warps 201 registers and 4 programs at 16, 111
    # and 9 at 8; on the one warp below, 189 and 10 at 8). On an H200 (bench_engine.py
    # --lora-configs, 2026-12-01, one run, graph replay ms, rank 16, two warps) 8 against 16:
    # 64 distinct adapters at batch 64 16.31 against 17.29, at batch 32 10.75 against 11.29; one
    # adapter at batch 32 6.92 against 6.97, at 64 8.46 against 8.58; the 2 x 512 prefill with
    # distinct adapters 45.33 against 45.68 ms; batch 1 the same. A rank chunk of 4 gained less
    # (15.90 at batch 64 distinct but 47.83 for that prefill).
    block_r: int = 8
    # One warp. On an H200 (bench_engine.py --lora-configs, 2026-12-01, one run, graph replay
    # ms, rank 16, block_r 8) against two: 64 distinct adapters at batch 64 15.70 against 16.39,
    # at 32 10.50 against 10.77; one adapter at batch 32 6.94 against 6.97, at 64 8.41 against
    # 8.54; the 2 x 512 prefill with distinct adapters 43.34 against 45.53 ms. (With block_r 16,
    # bench_lora_kernels.py --sweep had made two warps the choice: one slowed that prefill to
    # 73.0 ms against 45.9.) The warps and block_r set the order of the rank sum, so one config
    # serves prompts and decodes alike.
    num_warps: int = 1
    num_stages: int = 1  # the rank loop is one or two passes: nothing to pipeline


DEFAULT_CONFIG = ExpandConfig()


@triton.jit
def _expand_block(t_ptr, stride_t, stride_t_chunk, num_chunks, out_ptr, stride_out, N, b_ptr,
                  ranks_ptr, scales_ptr, max_rank, block, slot, rows, in_tile,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_R: tl.constexpr, MAX_CHUNKS: tl.constexpr, DELTA: tl.constexpr):
    # No load waits on the slot's rank: t, B, the scale and the base output are all requested
    # once the tile is known, and the rank only masks what they bring (a chain of one load
    # instead of three). So the rank loop runs over the table's padding (one pass at rank <= 8);
    # passes past the slot's rank add exact zeros, and nothing past it is used: t there was never
    # written, B is padding.
    rank = tl.load(ranks_ptr + slot)
    scale = tl.load(scales_ptr + slot)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < N
    chunks = tl.arange(0, MAX_CHUNKS)
    has_c = chunks < num_chunks
    outs = out_ptr + rows[:, None] * stride_out + cols[None, :]
    mask = in_tile[:, None] & in_n[None, :]
    if not DELTA:
        base = tl.load(outs, mask=mask)
    t_rows = t_ptr + rows[:, None, None] * stride_t + chunks[None, :, None] * stride_t_chunk
    in_t = in_tile[:, None, None] & has_c[None, :, None]  # [BLOCK_M, MAX_CHUNKS, 1]
    b_rows = b_ptr + (slot * N + cols)[:, None] * max_rank  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j0 in range(0, max_rank, BLOCK_R):
        ranks_j = j0 + tl.arange(0, BLOCK_R)
        in_r = ranks_j < max_rank
        parts = tl.load(t_rows + ranks_j[None, None, :], mask=in_t & in_r[None, None, :],
                        other=0.0)  # [BLOCK_M, MAX_CHUNKS, BLOCK_R]
        bj = tl.load(b_rows + ranks_j[None, :], mask=in_n[:, None] & in_r[None, :],
                     other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_R], widened exactly
        has_j = ranks_j < rank
        tj = tl.where(has_j[None, :], tl.sum(parts, axis=1), 0.0)  # [BLOCK_M, BLOCK_R]
        bj = tl.where(has_j[None, :], bj, 0.0)
        acc += tl.sum(tj[:, None, :] * bj[None, :, :], axis=2)
    # One rounding of base + delta: an output in the model dtype is widened, added to in fp32
    # and rounded back, as the torch path's `(out.float() + delta).to(dtype)`. Slots the table
    # does not edit (rank 0) are not written; that test is a block, since triton 3.9's
    # interpreter rejects a mask with a scalar in it.
    # DELTA: the delta alone, in fp32, into a buffer that a later kernel adds to the rounded
    # base output, as the torch path's `(out.float() + delta).to(dtype)` too.
    edited = tl.zeros([BLOCK_M], tl.int32) < rank
    delta = acc * scale
    if DELTA:
        tl.store(outs, delta, mask=mask & edited[:, None])
    else:
        tl.store(outs, (base.to(tl.float32) + delta).to(out_ptr.dtype.element_ty),
                 mask=mask & edited[:, None])


# The batch size must not pick another compiled variant (triton specializes ints equal to 1 or
# divisible by 16): one binary, so one order of sums, for every batch.
@triton.jit(do_not_specialize=["stride_t_table"])
def _expand_kernel(t_ptr, stride_t_table, stride_t, stride_t_chunk, num_chunks,
                   out0_ptr, out1_ptr, out2_ptr, stride_out0, stride_out1, stride_out2,
                   N0, N1, N2, b0_ptr, b1_ptr, b2_ptr,
                   ranks0_ptr, ranks1_ptr, ranks2_ptr, scales0_ptr, scales1_ptr, scales2_ptr,
                   max_rank0, max_rank1, max_rank2, blocks_end0, blocks_end1, num_blocks,
                   tile_rows_ptr, tile_slot_ptr, num_tiles_ptr, NUM_TABLES: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   MAX_CHUNKS: tl.constexpr, DELTA: tl.constexpr, PDL: tl.constexpr,
                   TRIGGER_LATE: tl.constexpr):
    pdl.start(PDL, TRIGGER_LATE)
    # Work item = (tile, block); table i owns blocks [blocks_end{i-1}, blocks_end{i}).
    num_items = (tl.load(num_tiles_ptr) * num_blocks).to(tl.int32)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        tile = item // num_blocks
        block = item - tile * num_blocks
        slot, rows, in_tile = load_tile(tile_slot_ptr, tile_rows_ptr, tile, BLOCK_M)
        if block < blocks_end0:
            _expand_block(t_ptr, stride_t, stride_t_chunk, num_chunks, out0_ptr, stride_out0, N0,
                          b0_ptr, ranks0_ptr, scales0_ptr, max_rank0, block, slot, rows,
                          in_tile, BLOCK_M, BLOCK_N, BLOCK_R, MAX_CHUNKS, DELTA)
        elif NUM_TABLES == 2:
            _expand_block(t_ptr + stride_t_table, stride_t, stride_t_chunk, num_chunks, out1_ptr,
                          stride_out1, N1, b1_ptr, ranks1_ptr, scales1_ptr, max_rank1,
                          block - blocks_end0, slot, rows, in_tile, BLOCK_M, BLOCK_N, BLOCK_R,
                          MAX_CHUNKS, DELTA)
        elif NUM_TABLES == 3:
            if block < blocks_end1:
                _expand_block(t_ptr + stride_t_table, stride_t, stride_t_chunk, num_chunks,
                              out1_ptr, stride_out1, N1, b1_ptr, ranks1_ptr, scales1_ptr,
                              max_rank1, block - blocks_end0, slot, rows, in_tile, BLOCK_M,
                              BLOCK_N, BLOCK_R, MAX_CHUNKS, DELTA)
            else:
                _expand_block(t_ptr + 2 * stride_t_table, stride_t, stride_t_chunk, num_chunks,
                              out2_ptr, stride_out2, N2, b2_ptr, ranks2_ptr, scales2_ptr,
                              max_rank2, block - blocks_end1, slot, rows, in_tile, BLOCK_M,
                              BLOCK_N, BLOCK_R, MAX_CHUNKS, DELTA)
    pdl.finish(PDL, TRIGGER_LATE)


def lora_expand(t: torch.Tensor, outs: Sequence[torch.Tensor], b_tables: Sequence[torch.Tensor],
                rank_tables: Sequence[torch.Tensor], scale_tables: Sequence[torch.Tensor],
                tiles: LoraTiles, num_programs: int | None = None,
                config: ExpandConfig | None = None, deltas: bool = False) -> None:
    """outs[i][row] += scale * (sum_c t[i, row, c, :rank] B_i[slot, :, :rank]^T), in place, for
    each row whose slot table i edits (rank = rank_tables[i][slot] > 0); no other element is
    touched.

    t: [num_tables, num_rows, num_k_chunks, width] float32 from lora_shrink; outs[i]: [num_rows,
    out_i] float32, or the model dtype (then widened, added to in fp32 and rounded back once; rows
    may be strided, as column slices of one projection output are); b_tables[i]: [num_slots, out_i,
    max_rank_i] fp32, bf16 or fp16 (read as fp32), contiguous; rank_tables[i]: [num_slots]
    int32; scale_tables[i]: [num_slots] float32.

    deltas: outs[i] are fp32 buffers that get the delta alone, scale * (t B^T) rounded to fp32,
    at the same elements (nothing else is written): a later kernel adds it to the rounded base
    output (lorad.workers.lora.LoraDelta), which then need not exist yet."""
    num_tables = len(b_tables)
    if not 1 <= num_tables <= MAX_TABLES or not (len(outs) == len(rank_tables)
                                                  == len(scale_tables) == num_tables):
        raise ValueError(f"1 to {MAX_TABLES} tables, each with its output, ranks and scales")
    config = config or DEFAULT_CONFIG  # read at the call: benchmarks swap it
    assert t.dim() == 4 and t.shape[0] == num_tables and t.stride(3) == 1
    assert tiles.num_rows == t.shape[1], "tiles of another batch"
    for out, b in zip(outs, b_tables):
        assert out.dtype in (torch.float32, torch.bfloat16, torch.float16)
        assert out.dtype == torch.float32 or not deltas
        assert out.stride(1) == 1
        assert out.shape == (t.shape[1], b.shape[1])
        assert b.dtype in STORED_DTYPES.values() and b.is_contiguous() and b.shape[2] <= t.shape[3]
    if tiles.max_tiles == 0:
        return
    blocks_end = table_block_ends([b.shape[1] for b in b_tables], config.block_n)
    num_blocks = blocks_end[-1]
    grid = (min(tiles.max_tiles * num_blocks, num_programs or max_programs(t.device)),)
    padded_outs, padded_b = pad_tables(outs), pad_tables(b_tables)
    _expand_kernel[grid](
        t, t.stride(0), t.stride(1), t.stride(2), t.shape[2],
        *padded_outs, *(o.stride(0) for o in padded_outs),
        *(b.shape[1] for b in padded_b), *padded_b, *pad_tables(rank_tables),
        *pad_tables(scale_tables),
        *(b.shape[2] for b in padded_b), blocks_end[1], blocks_end[min(2, num_tables)],
        num_blocks, tiles.tile_rows, tiles.tile_slot, tiles.num_tiles, NUM_TABLES=num_tables,
        BLOCK_M=tiles.block_m, BLOCK_N=config.block_n, BLOCK_R=config.block_r,
        MAX_CHUNKS=next_power_of_2(t.shape[2]), DELTA=deltas,
        TRIGGER_LATE=pdl.LORA_TRIGGER_LATE,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **launch_options(t.device, tiles.num_rows))
