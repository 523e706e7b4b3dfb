"""gate/up's LoRA expand fused with SwiGLU: silu(gate + gate's delta) * (up + up's delta), read
once from the base gate/up output, for steps that add their deltas in place (ExpandSteps.in_place)
and would otherwise read and rewrite gate and up (lora_expand) only for silu * up to read them
again. Not for decode steps, whose deltas are fp32 buffers that silu * up adds itself.

Each row gets exactly the bits of lora_expand adding into gate and up in place followed by
fused_ops.silu_and_mul: its t_sums, block_delta and plus_delta at the tile the expand takes for
the step (the tiles' BLOCK_M, its RANK_PAD, the step's BLOCK_N narrowed by fitting_block_n, its
warps), so every sum and MMA has the same shape, then fused_ops.silu_mul. Two launches write each
row once: the tiled kernel here the rows of the adapter tiles (LoraTiles: every row of an adapter
slot is in one of them), fused_ops.silu_and_mul the rows of slot 0, which no tile holds. Rows of
a slot that gate's or up's table does not edit (rank 0) take that base output as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lorad.workers.kernels import pdl
from lorad.workers.kernels.configs import ExpandConfig, ExpandSteps
from lorad.workers.kernels.fused_ops import silu_and_mul, silu_mul
from lorad.workers.kernels.launch_math import cdiv, next_power_of_2
from lorad.workers.kernels.lora_common import (BF16_PARTS, bf16_parts, group_size, load_tile)
from lorad.workers.kernels.lora_expand import (block_delta, fitting_block_n, plus_delta,
                                               t_sums)
from lorad.workers.kernels.lora_tiles import LoraTiles, max_programs, target_items
from lorad.workers.kernels.pdl import launch_options


@triton.jit
def _table_rows(t_ptr, stride_t, stride_t_chunk, num_chunks, ranks_ptr, scales_ptr, max_rank,
                slot, rows, in_tile, BLOCK_M: tl.constexpr, RANK_PAD: tl.constexpr,
                MAX_CHUNKS: tl.constexpr):
    """-> (the slot's rank and scale in one table, the tile's rows of its t summed: t_sums)."""
    rank = tl.load(ranks_ptr + slot)
    scale = tl.load(scales_ptr + slot)
    tj = t_sums(t_ptr, stride_t, stride_t_chunk, num_chunks, max_rank, rank, rows, in_tile,
                BLOCK_M, RANK_PAD, MAX_CHUNKS)
    return rank, scale, tj


@triton.jit
def _with_delta(base, tj, b_ptr, N, max_rank, slot, rank, scale, strength, cols,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RANK_PAD: tl.constexpr,
                B_PARTS: tl.constexpr):
    """base [BLOCK_M, BLOCK_N] (model dtype, the tile's rows at cols) plus its delta, rounded
    once, where the slot's rank is above 0; base itself where the table does not edit it."""
    delta = block_delta(tj, b_ptr, N, max_rank, slot, cols, scale, strength, BLOCK_M, BLOCK_N,
                        RANK_PAD, B_PARTS)
    edited = tl.zeros([BLOCK_M], tl.int32) < rank  # a block: see _expand_blocks
    return tl.where(edited[:, None], plus_delta(base, delta), base)


# The batch size must not pick another compiled variant, and the t arguments are lora_expand's
# with its specializations, so that t's loads (and the sums' order) match its own.
@triton.jit(do_not_specialize=["stride_t_table"])
def _expand_silu_kernel(t_ptr, stride_t_table, stride_t, stride_t_chunk, num_chunks,
                        gate_ptr, stride_gate, up_ptr, stride_up, out_ptr, stride_out, N,
                        num_blocks, b_gate_ptr, b_up_ptr, ranks_gate_ptr, ranks_up_ptr,
                        scales_gate_ptr, scales_up_ptr, max_rank_gate, max_rank_up,
                        tile_rows_ptr, tile_slot_ptr, num_tiles_ptr, target_items, strengths_ptr,
                        HAS_GATE: tl.constexpr, HAS_UP: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, RANK_PAD: tl.constexpr, MAX_CHUNKS: tl.constexpr,
                        B_PARTS: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    # Work item = (tile, group of consecutive blocks of BLOCK_N columns), as lora_expand's items
    # (one block per item while they are few): which item computes a block changes no bit.
    num_tiles = tl.load(num_tiles_ptr).to(tl.int32)
    group = group_size(num_tiles * num_blocks, num_blocks, target_items)
    groups = tl.cdiv(num_blocks, group)
    for item in range(tl.program_id(0), num_tiles * groups, tl.num_programs(0)):
        tile = item // groups
        first = (item - tile * groups) * group
        slot, rows, in_tile = load_tile(tile_slot_ptr, tile_rows_ptr, tile, BLOCK_M)
        strength = tl.load(strengths_ptr + rows, mask=in_tile, other=1.0)  # [BLOCK_M] fp32
        # t's tables are the edited ones in order, at t_ptr and t_ptr + stride_t_table, as
        # lora_expand addresses them.
        if HAS_GATE:
            rank_g, scale_g, t_g = _table_rows(t_ptr, stride_t, stride_t_chunk, num_chunks,
                                               ranks_gate_ptr, scales_gate_ptr, max_rank_gate,
                                               slot, rows, in_tile, BLOCK_M, RANK_PAD,
                                               MAX_CHUNKS)
        if HAS_UP:
            if HAS_GATE:
                t_up_ptr = t_ptr + stride_t_table
            else:
                t_up_ptr = t_ptr
            rank_u, scale_u, t_u = _table_rows(t_up_ptr, stride_t, stride_t_chunk, num_chunks,
                                               ranks_up_ptr, scales_up_ptr, max_rank_up, slot,
                                               rows, in_tile, BLOCK_M, RANK_PAD, MAX_CHUNKS)
        for block in tl.range(first, tl.minimum(first + group, num_blocks),
                              num_stages=NUM_STAGES):
            cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = in_tile[:, None] & (cols < N)[None, :]
            gate = tl.load(gate_ptr + rows[:, None] * stride_gate + cols[None, :], mask=mask,
                           other=0.0)
            up = tl.load(up_ptr + rows[:, None] * stride_up + cols[None, :], mask=mask,
                         other=0.0)
            if HAS_GATE:
                gate = _with_delta(gate, t_g, b_gate_ptr, N, max_rank_gate, slot, rank_g,
                                   scale_g, strength, cols, BLOCK_M, BLOCK_N, RANK_PAD, B_PARTS)
            if HAS_UP:
                up = _with_delta(up, t_u, b_up_ptr, N, max_rank_up, slot, rank_u, scale_u,
                                 strength, cols, BLOCK_M, BLOCK_N, RANK_PAD, B_PARTS)
            tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], silu_mul(gate, up),
                     mask=mask)
    pdl.finish(PDL)


def lora_expand_silu(t: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                     b_tables: Sequence[torch.Tensor | None],
                     rank_tables: Sequence[torch.Tensor | None],
                     scale_tables: Sequence[torch.Tensor | None], tiles: LoraTiles,
                     row_slots: torch.Tensor, row_strengths: torch.Tensor | None = None,
                     num_programs: int | None = None, config: ExpandConfig | None = None,
                     num_target_items: int | None = None, steps: ExpandSteps = ExpandSteps(),
                     pdl_rows: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """-> silu(gate + gate's delta) * (up + up's delta) [num_rows, N], contiguous, each row's
    bits those of lora_expand(t, edited outputs, ...) adding in place, then
    fused_ops.silu_and_mul(gate, up); gate and up are only read.

    gate, up: [num_rows, N] in the model dtype (fp32 too: then nothing is rounded between the
    adds and silu), columns contiguous (the halves of one product).
    b_tables, rank_tables, scale_tables: (gate's, up's), each as lora_expand takes it, or None
    for one the step does not edit (at least one is edited); t: [num_edited, num_rows,
    num_k_chunks, width] float32 from lora_shrink, the edited tables' in that order.
    row_slots: [num_rows] int64, each row's slot (the rows of slot 0 are the ones outside the
    tiles); row_strengths: [num_rows] float32 (None: all 1.0). config, num_target_items,
    steps, pdl_rows: as lora_expand takes them (the same tile for the same bits). out: where to
    write ([num_rows, N] contiguous; None: a new tensor)."""
    edited = [b is not None for b in b_tables]
    tables = [b for b in b_tables if b is not None]
    num_rows, n = gate.shape
    assert len(b_tables) == len(rank_tables) == len(scale_tables) == 2 and tables
    assert all((b is None) == (r is None) == (s is None)
               for b, r, s in zip(b_tables, rank_tables, scale_tables))
    assert t.dim() == 4 and t.shape[:2] == (len(tables), num_rows) and t.stride(3) == 1
    assert up.shape == gate.shape and up.dtype == gate.dtype
    assert gate.stride(1) == 1 and up.stride(1) == 1
    assert tiles.num_rows == num_rows, "tiles of another batch"
    for b in tables:
        assert b.dtype in BF16_PARTS and b.is_contiguous() and b.shape[2] <= t.shape[3]
        assert b.dtype == tables[0].dtype and b.shape[1] == n
    if out is None:
        out = torch.empty(num_rows, n, dtype=gate.dtype, device=gate.device)
    if tiles.max_tiles and num_rows:
        config = config or steps.config(num_rows)
        if row_strengths is None:
            row_strengths = torch.ones(num_rows, dtype=torch.float32, device=t.device)
        assert row_strengths.dtype == torch.float32 and row_strengths.shape == (num_rows,)
        # lora_expand's tile: the rank padding of every edited table, its narrowed block.
        rank_pad = max(16, next_power_of_2(max(b.shape[2] for b in tables)))
        block_n = fitting_block_n(config.block_n, rank_pad, tables[0].element_size())
        num_blocks = cdiv(n, block_n)
        num_programs = num_programs or max_programs(t.device, tiles.programs_per_sm)
        b_args, ranks_args, scales_args = (_filled(pair)
                                           for pair in (b_tables, rank_tables, scale_tables))
        _expand_silu_kernel[(min(tiles.max_tiles * num_blocks, num_programs),)](
            t, t.stride(0), t.stride(1), t.stride(2), t.shape[2],
            gate, gate.stride(0), up, up.stride(0), out, out.stride(0), n, num_blocks,
            *b_args, *ranks_args, *scales_args, *(b.shape[2] for b in b_args),
            tiles.tile_rows, tiles.tile_slot, tiles.num_tiles,
            target_items(steps.items_per_sm, t.device, tiles.programs_per_sm)
            if num_target_items is None else num_target_items, row_strengths,
            HAS_GATE=edited[0], HAS_UP=edited[1], BLOCK_M=tiles.block_m, BLOCK_N=block_n,
            RANK_PAD=rank_pad, MAX_CHUNKS=next_power_of_2(t.shape[2]),
            B_PARTS=bf16_parts(tables[0].dtype), NUM_STAGES=config.num_stages,
            num_warps=config.num_warps,
            enable_fp_fusion=False,  # as lora_expand: the delta rounded before the add
            **launch_options(t.device, num_rows, pdl_rows))
    return silu_and_mul(gate, up, pdl_rows=pdl_rows, slot0_rows_of=row_slots, out=out)


def _filled(pair: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """gate's and up's argument, a table not edited taking the other's (never read)."""
    gate, up = pair
    return [gate if gate is not None else up, up if up is not None else gate]
