"""LoRA expand: out[row] += (scale[slot] * (t[row, :r] B[slot, :, :r]^T)) * strength[row], in fp32
(strength: the row's request's multiplier, 1.0 by default, an exact multiply), for up to three
outputs at once (the tables of projections that share an input), t being the sum of the shrink's
per-chunk partials, added here as they are read.

A program takes one work item at a time, (row tile, group of consecutive blocks of BLOCK_N outputs
of one table; one block per group unless the step has many items, see ExpandSteps): it reads each
block of its slot's B once for the tile's rows, and adds each row's delta to `out` in one fp32 add
(the column-parallel base output before its rounding, or the row-parallel partial sum before the
all-reduce). Every row gets the same arithmetic whatever shares its step: the shrink's K-chunk
partials summed by one reduction of fixed shape [BLOCK_M, MAX_CHUNKS, RANK_PAD] (so every program
reading a row gets the same bits, and the sum needs no launch of its own), then one MMA over the
ranks (exact_dot: t's fp32 sums split exactly into bf16 terms), which computes a row's outputs from
that row alone, with one tile shape for every table; no atomics. Rows of slot 0 are neither read nor
written; rows of a slot the table does not edit are read (no load waits on the rank) but not
written. With deltas=True it writes the delta alone into an fp32 buffer instead, for the next kernel
to add, so that it runs beside the base matmul instead of after it: the model's way, except for
o_proj's and down_proj's partial sums at world sizes above 1, which it adds into in place before
their all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.configs import ExpandConfig, ExpandSteps
from lorad.workers.kernels.launch_math import next_power_of_2
from lorad.workers.kernels.lora_common import (BF16_PARTS, MAX_TABLES, bf16_parts, exact_dot,
                                               group_size, load_tile, pad_tables,
                                               table_block_ends)
from lorad.workers.kernels.lora_tiles import LoraTiles, max_programs, target_items
from lorad.workers.kernels import pdl
from lorad.workers.kernels.pdl import launch_options


# The most bytes of B one pipeline stage holds: block_n narrows to fit wide ranks and 4-byte
# tables (it changes no bit), so the stages fit shared memory. 32 KiB is the default tile's at
# rank 64 in fp32 (128 x 64 x 4), which runs on an H200; the small steps' tile there (256 x 64
# x 4 at 3 stages) did not fit (tests/gpu/test_lora_kernels_gpu.py, ranks_to_64).
MAX_B_STAGE_BYTES = 32 * 1024


def fitting_block_n(block_n: int, rank_pad: int, itemsize: int) -> int:
    """block_n, halved until a stage of B (block_n x rank_pad x itemsize bytes) holds at most
    MAX_B_STAGE_BYTES, and at least 16 (a tl.dot side)."""
    while block_n > 16 and block_n * rank_pad * itemsize > MAX_B_STAGE_BYTES:
        block_n //= 2
    return block_n


@triton.jit
def _expand_blocks(t_ptr, stride_t, stride_t_chunk, num_chunks, out_ptr, stride_out, N, b_ptr,
                   ranks_ptr, scales_ptr, max_rank, first_block, num_item_blocks, slot, rows,
                   in_tile, strengths_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   RANK_PAD: tl.constexpr, MAX_CHUNKS: tl.constexpr, B_PARTS: tl.constexpr,
                   NUM_STAGES: tl.constexpr, DELTA: tl.constexpr):
    # Blocks [first_block, first_block + num_item_blocks) of one table, one after another with
    # B's loads running ahead: t's chunk sums are taken once, and each block is then computed
    # exactly as a work item of that block alone would compute it.
    # No load waits on the slot's rank: t, B, the scale and the base output are all requested
    # once the tile is known, and the rank only masks what they bring (a chain of one load
    # instead of three). t past the slot's rank was never written: it is replaced by zeros
    # before the MMA. B there is padding, which the tables must hold finite (LoraSlots keeps
    # zeros there), and is used as it is: the MMA then adds exact zeros for it (0 x finite). A
    # select on B as well cost each block a round trip through shared memory (triton 3.6,
    # sm_90: the load's shared buffer -> registers -> shared memory again for the MMA); without
    # it the expand is faster (docs/performance-log.md: expand without a select on B).
    rank = tl.load(ranks_ptr + slot)
    scale = tl.load(scales_ptr + slot)
    # Each row's request strength, after the slot's scale: x 1.0 is exact, so a row at 1.0 gets
    # the bits it got before strengths existed.
    strength = tl.load(strengths_ptr + rows, mask=in_tile, other=1.0)  # [BLOCK_M] fp32
    chunks = tl.arange(0, MAX_CHUNKS)
    has_c = chunks < num_chunks
    ranks_j = tl.arange(0, RANK_PAD)
    in_r = ranks_j < max_rank
    has_j = ranks_j < rank
    t_rows = (t_ptr + rows[:, None, None] * stride_t + chunks[None, :, None] * stride_t_chunk
              + ranks_j[None, None, :])
    parts = tl.load(t_rows, mask=in_tile[:, None, None] & has_c[None, :, None]
                    & in_r[None, None, :], other=0.0)  # [BLOCK_M, MAX_CHUNKS, RANK_PAD]
    tj = tl.where(has_j[None, :], tl.sum(parts, axis=1), 0.0)  # [BLOCK_M, RANK_PAD] fp32
    # Slots the table does not edit (rank 0) are not written; that test is a block, since
    # triton 3.9's interpreter rejects a mask with a scalar in it.
    edited = tl.zeros([BLOCK_M], tl.int32) < rank
    for block in tl.range(first_block, first_block + num_item_blocks, num_stages=NUM_STAGES):
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = cols < N
        outs = out_ptr + rows[:, None] * stride_out + cols[None, :]
        mask = in_tile[:, None] & in_n[None, :] & edited[:, None]
        b_rows = b_ptr + (slot * N + cols)[:, None] * max_rank + ranks_j[None, :]
        bj = tl.load(b_rows, mask=in_n[:, None] & in_r[None, :], other=0.0)  # [BLOCK_N, RANK_PAD]
        # t's fp32 sums split into three bf16 terms (exactly), B into its own: exact products.
        acc = exact_dot(tj, tl.trans(bj), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),
                        3, B_PARTS)
        delta = (acc * scale) * strength[:, None]
        if DELTA:
            # The delta alone, in fp32, into a buffer that a later kernel adds to the rounded
            # base output, as the torch path's `(out.float() + delta).to(dtype)` too.
            tl.store(outs, delta, mask=mask)
        else:
            # One rounding of base + delta: an output in the model dtype is widened, added to in
            # fp32 and rounded back, as the torch path's `(out.float() + delta).to(dtype)`.
            base = tl.load(outs, mask=mask)
            tl.store(outs, (base.to(tl.float32) + delta).to(out_ptr.dtype.element_ty),
                     mask=mask)


# The batch size must not pick another compiled variant (triton specializes ints equal to 1 or
# divisible by 16): one binary, so one order of sums, for every batch.
@triton.jit(do_not_specialize=["stride_t_table"])
def _expand_kernel(t_ptr, stride_t_table, stride_t, stride_t_chunk, num_chunks,
                   out0_ptr, out1_ptr, out2_ptr, stride_out0, stride_out1, stride_out2,
                   N0, N1, N2, b0_ptr, b1_ptr, b2_ptr,
                   ranks0_ptr, ranks1_ptr, ranks2_ptr, scales0_ptr, scales1_ptr, scales2_ptr,
                   max_rank0, max_rank1, max_rank2, blocks_end0, blocks_end1, num_blocks,
                   tile_rows_ptr, tile_slot_ptr, num_tiles_ptr, target_items, strengths_ptr,
                   NUM_TABLES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   RANK_PAD: tl.constexpr, MAX_CHUNKS: tl.constexpr, B_PARTS: tl.constexpr,
                   NUM_STAGES: tl.constexpr, DELTA: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    # Work item = (tile, group of consecutive blocks of one table); table i owns blocks
    # [blocks_end{i-1}, blocks_end{i}). A group is one block while the step's items are few,
    # more as they pass target_items, so that each item streams more of B behind one lookup of
    # its tile and one sum of its t. Which item computes a block changes none of its bits.
    num_tiles = tl.load(num_tiles_ptr).to(tl.int32)
    group = group_size(num_tiles * num_blocks, num_blocks, target_items)
    blocks0 = blocks_end0
    blocks1 = blocks_end1 - blocks_end0
    blocks2 = num_blocks - blocks_end1
    groups0 = tl.cdiv(blocks0, group)
    groups01 = groups0 + tl.cdiv(blocks1, group)
    items_per_tile = groups01 + tl.cdiv(blocks2, group)
    for item in range(tl.program_id(0), num_tiles * items_per_tile, tl.num_programs(0)):
        tile = item // items_per_tile
        g = item - tile * items_per_tile
        slot, rows, in_tile = load_tile(tile_slot_ptr, tile_rows_ptr, tile, BLOCK_M)
        if g < groups0:
            first = g * group
            _expand_blocks(t_ptr, stride_t, stride_t_chunk, num_chunks, out0_ptr, stride_out0,
                           N0, b0_ptr, ranks0_ptr, scales0_ptr, max_rank0, first,
                           tl.minimum(group, blocks0 - first), slot, rows, in_tile,
                           strengths_ptr, BLOCK_M, BLOCK_N, RANK_PAD, MAX_CHUNKS, B_PARTS,
                           NUM_STAGES, DELTA)
        elif NUM_TABLES == 2:
            first = (g - groups0) * group
            _expand_blocks(t_ptr + stride_t_table, stride_t, stride_t_chunk, num_chunks,
                           out1_ptr, stride_out1, N1, b1_ptr, ranks1_ptr, scales1_ptr, max_rank1,
                           first, tl.minimum(group, blocks1 - first), slot, rows, in_tile,
                           strengths_ptr, BLOCK_M, BLOCK_N, RANK_PAD, MAX_CHUNKS, B_PARTS,
                           NUM_STAGES, DELTA)
        elif NUM_TABLES == 3:
            if g < groups01:
                first = (g - groups0) * group
                _expand_blocks(t_ptr + stride_t_table, stride_t, stride_t_chunk, num_chunks,
                               out1_ptr, stride_out1, N1, b1_ptr, ranks1_ptr, scales1_ptr,
                               max_rank1, first, tl.minimum(group, blocks1 - first), slot, rows,
                               in_tile, strengths_ptr, BLOCK_M, BLOCK_N, RANK_PAD, MAX_CHUNKS,
                               B_PARTS, NUM_STAGES, DELTA)
            else:
                first = (g - groups01) * group
                _expand_blocks(t_ptr + 2 * stride_t_table, stride_t, stride_t_chunk, num_chunks,
                               out2_ptr, stride_out2, N2, b2_ptr, ranks2_ptr, scales2_ptr,
                               max_rank2, first, tl.minimum(group, blocks2 - first), slot, rows,
                               in_tile, strengths_ptr, BLOCK_M, BLOCK_N, RANK_PAD, MAX_CHUNKS,
                               B_PARTS, NUM_STAGES, DELTA)
    pdl.finish(PDL)


def lora_expand(t: torch.Tensor, outs: Sequence[torch.Tensor], b_tables: Sequence[torch.Tensor],
                rank_tables: Sequence[torch.Tensor], scale_tables: Sequence[torch.Tensor],
                tiles: LoraTiles, row_strengths: torch.Tensor | None = None,
                num_programs: int | None = None,
                config: ExpandConfig | None = None, deltas: bool = False,
                num_target_items: int | None = None, steps: ExpandSteps = ExpandSteps(),
                pdl_rows: int = 0) -> None:
    """outs[i][row] += (scale * (sum_c t[i, row, c, :rank] B_i[slot, :, :rank]^T)) * strength[row],
    in place, for each row whose slot table i edits (rank = rank_tables[i][slot] > 0); no other
    element is touched.

    t: [num_tables, num_rows, num_k_chunks, width] float32 from lora_shrink; outs[i]: [num_rows,
    out_i] float32, or the model dtype (then widened, added to in fp32 and rounded back once; rows
    may be strided, as column slices of one projection output are); b_tables[i]: [num_slots, out_i,
    max_rank_i] fp32, bf16 or fp16 (all of one dtype; exact_dot splits them exactly into bf16
    terms), contiguous, finite past each slot's rank (their values there are multiplied by zero,
    so any finite value adds nothing; LoraSlots holds zeros there); rank_tables[i]: [num_slots]
    int32; scale_tables[i]: [num_slots] float32; row_strengths: [num_rows] float32 (None: all
    1.0), each row's request strength.

    deltas: outs[i] are fp32 buffers that get the delta alone, scale * (t B^T) rounded to fp32,
    at the same elements (nothing else is written): a later kernel adds it to the rounded base
    output (lora_common.LoraDelta), which then need not exist yet.
    config: the tile (None: steps.config of the step's rows); its block_n narrows to
    fitting_block_n for wide ranks and fp32 tables.
    num_target_items: where a work item starts taking several blocks of outputs (None:
    steps.items_per_sm per multiprocessor; 0: never); it changes no bit.
    pdl_rows: the step's PDL row limit (kernels/pdl.py; 0: no PDL)."""
    num_tables = len(b_tables)
    if not 1 <= num_tables <= MAX_TABLES or not (len(outs) == len(rank_tables)
                                                  == len(scale_tables) == num_tables):
        raise ValueError(f"1 to {MAX_TABLES} tables, each with its output, ranks and scales")
    config = config or steps.config(t.shape[1])
    assert t.dim() == 4 and t.shape[0] == num_tables and t.stride(3) == 1
    assert tiles.num_rows == t.shape[1], "tiles of another batch"
    for out, b in zip(outs, b_tables):
        assert out.dtype in (torch.float32, torch.bfloat16, torch.float16)
        assert out.dtype == torch.float32 or not deltas
        assert out.stride(1) == 1
        assert out.shape == (t.shape[1], b.shape[1])
        assert b.dtype in BF16_PARTS and b.is_contiguous() and b.shape[2] <= t.shape[3]
        assert b.dtype == b_tables[0].dtype, "tables of one launch share a dtype"
    if tiles.max_tiles == 0:
        return
    if row_strengths is None:
        row_strengths = torch.ones(t.shape[1], dtype=torch.float32, device=t.device)
    assert row_strengths.dtype == torch.float32 and row_strengths.shape == (t.shape[1],)
    rank_pad = max(16, next_power_of_2(max(b.shape[2] for b in b_tables)))
    block_n = fitting_block_n(config.block_n, rank_pad, b_tables[0].element_size())
    blocks_end = table_block_ends([b.shape[1] for b in b_tables], block_n)
    num_blocks = blocks_end[-1]
    num_programs = num_programs or max_programs(t.device, tiles.programs_per_sm)
    grid = (min(tiles.max_tiles * num_blocks, num_programs),)
    padded_outs, padded_b = pad_tables(outs), pad_tables(b_tables)
    _expand_kernel[grid](
        t, t.stride(0), t.stride(1), t.stride(2), t.shape[2],
        *padded_outs, *(o.stride(0) for o in padded_outs),
        *(b.shape[1] for b in padded_b), *padded_b, *pad_tables(rank_tables),
        *pad_tables(scale_tables),
        *(b.shape[2] for b in padded_b), blocks_end[1], blocks_end[min(2, num_tables)],
        num_blocks, tiles.tile_rows, tiles.tile_slot, tiles.num_tiles,
        target_items(steps.items_per_sm, t.device, tiles.programs_per_sm)
        if num_target_items is None else num_target_items, row_strengths,
        NUM_TABLES=num_tables, NUM_STAGES=config.num_stages,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, RANK_PAD=rank_pad,
        MAX_CHUNKS=next_power_of_2(t.shape[2]), B_PARTS=bf16_parts(b_tables[0].dtype),
        DELTA=deltas,
        num_warps=config.num_warps,
        # No fused multiply-add: in place, (acc * scale) * strength + base would skip the
        # rounding of the delta that the fp32 buffer gives the consumers (strengths not 1.0).
        enable_fp_fusion=False,
        **launch_options(t.device, tiles.num_rows, pdl_rows))
