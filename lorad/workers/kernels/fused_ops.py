"""The decode step's elementwise work in three kernels per use instead of a dozen torch ops each:
residual add + RMSNorm, rotary + KV-cache write, and SwiGLU's silu(gate) * up.

Each program handles one row (or one row's head or column block) alone, with one block shape for
every batch, so a row's bits never depend on what else the step holds. Every rounding the torch
path does (lorad.workers.layers, lorad.workers.rotary; transformers' order) is done here too, at
the same places: model-dtype results of model-dtype ops, fp32 where the torch path goes to fp32.
The sums inside RMSNorm and the exp in silu may differ from torch's by an ulp (another order,
another exp); the GPU tests compare with the torch path within a stated tolerance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.lora_expand import DEFAULT_CONFIG as EXPAND_CONFIG
from lorad.workers.kernels.lora_expand import plus_lora_delta
from lorad.workers.kernels.lora_shrink import tile_rows
from lorad.workers.kernels.lora_tiles import BLOCK_M

if TYPE_CHECKING:
    from lorad.workers.lora import PendingShrink


# --- residual add + RMSNorm -------------------------------------------------------------------

ADD_NORM_LORA_BLOCK = 256  # LoRA variant: columns per step of the delta

@triton.jit
def _rms_norm_row(h, weight_ptr, normed_ptr, cols, mask, H, eps):
    """Store RMSNorm(h) for one row h [BLOCK] in the model dtype, in transformers' order."""
    dtype = h.dtype
    x = h.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / H
    y = (x * tl.rsqrt(variance + eps)).to(dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(normed_ptr + cols, (w.to(tl.float32) * y.to(tl.float32)).to(dtype), mask=mask)


@triton.jit
def _add_rms_norm_kernel(delta_ptr, stride_delta, res_ptr, stride_res, res_out_ptr,
                         stride_res_out, normed_ptr, stride_normed, weight_ptr, H, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dtype = res_out_ptr.dtype.element_ty
    # The layer's output (an fp32 partial sum after its all-reduce, or the embedding) rounded to
    # the model dtype, then added to the residual in the model dtype: `hidden + out.to(dtype)`.
    h = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0).to(dtype)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(res_out_ptr + row * stride_res_out + cols, h, mask=mask)
    _rms_norm_row(h, weight_ptr, normed_ptr + row * stride_normed, cols, mask, H, eps)


@triton.jit
def _add_rms_norm_lora_kernel(delta_ptr, stride_delta, res_ptr, stride_res, normed_ptr,
                              stride_normed, weight_ptr, H, eps, t_ptr, stride_t,
                              stride_t_chunk, num_chunks, b_ptr, ranks_ptr, scales_ptr, max_rank,
                              row_slots_ptr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_R: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    # The LoRA variant, for a projection's output in the model dtype (o/down at world size 1):
    # a program per row adds the row's delta (one rounding, as the expand adds it) block by block
    # as it adds the output to the residual, then normalises the stored row as the plain kernel
    # does. Per row rather than per tile: the norm needs whole rows, and rows of one slot reading
    # its B each is cheaper than a few programs doing all the work.
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(row_slots_ptr + row)
    rows = tl.full([1], 0, tl.int64) + row
    one = rows >= 0
    dtype = res_ptr.dtype.element_ty
    for c0 in range(0, H, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        in_n = cols < H
        out = tl.load(delta_ptr + row * stride_delta + cols[None, :], mask=in_n[None, :],
                      other=0.0)
        out = plus_lora_delta(out, t_ptr, stride_t, stride_t_chunk, num_chunks, b_ptr, ranks_ptr,
                              scales_ptr, max_rank, H, slot, rows, one, cols, in_n, 1, BLOCK_N,
                              BLOCK_R, MAX_CHUNKS)
        r = tl.load(res_ptr + row * stride_res + cols[None, :], mask=in_n[None, :], other=0.0)
        h = (out.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_ptr + row * stride_res + cols[None, :], h, mask=in_n[None, :])
    tl.debug_barrier()  # the row's sums, written by other threads of this program, are visible
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    h = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    _rms_norm_row(h, weight_ptr, normed_ptr + row * stride_normed, cols, mask, H, eps)


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float,
                 lora: PendingShrink | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (hidden, normed): hidden = residual + delta.to(weight.dtype) (delta alone when residual
    is None), normed = RMSNorm(hidden). delta: [num_rows, H] fp32 or model dtype; residual:
    [num_rows, H] model dtype, overwritten with hidden (returned as hidden). lora: the pending
    shrink of the projection whose output delta is (in the model dtype), whose delta is added to
    it as it is read, instead of an expand before this."""
    num_rows, hidden_size = delta.shape
    assert weight.shape == (hidden_size,) and delta.stride(1) == 1
    dtype = weight.dtype
    if residual is None:
        residual_out = torch.empty(num_rows, hidden_size, dtype=dtype, device=delta.device)
        res_arg, stride_res = residual_out, 0
    else:
        assert residual.shape == delta.shape and residual.dtype == dtype
        assert residual.stride(1) == 1
        residual_out, res_arg, stride_res = residual, residual, residual.stride(0)
    normed = torch.empty(num_rows, hidden_size, dtype=dtype, device=delta.device)
    if num_rows == 0:
        return residual_out, normed
    if lora is not None:
        assert residual is not None and delta.dtype == dtype, "a projection's output"
        lora.wait()
        t, b, ranks, scales = lora.table(0)
        assert t.shape[0] == num_rows and b.shape[1] == hidden_size
        _add_rms_norm_lora_kernel[(num_rows,)](
            delta, delta.stride(0), residual, residual.stride(0), normed, normed.stride(0),
            weight, hidden_size, eps, t, t.stride(0), t.stride(1), t.shape[1], b, ranks, scales,
            b.shape[2], lora.tiles.row_slots, BLOCK=triton.next_power_of_2(hidden_size),
            BLOCK_N=ADD_NORM_LORA_BLOCK, BLOCK_R=EXPAND_CONFIG.block_r,
            MAX_CHUNKS=triton.next_power_of_2(t.shape[1]),
            num_warps=min(16, max(1, triton.next_power_of_2(hidden_size) // 256)))
        return residual_out, normed
    block = triton.next_power_of_2(hidden_size)
    _add_rms_norm_kernel[(num_rows,)](
        delta, delta.stride(0), res_arg, stride_res, residual_out, residual_out.stride(0),
        normed, normed.stride(0), weight, hidden_size, eps,
        HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return residual_out, normed


# --- rotary + KV-cache write ------------------------------------------------------------------

@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2):
    """One head (or a tile of rows' heads) rotated as `x * cos + rotate_half(x) * sin` in the
    model dtype, from its two halves: each product rounded, then the sum rounded. -> (first half,
    second half)."""
    dtype = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    c1 = c1.to(tl.float32)
    c2 = c2.to(tl.float32)
    s1 = s1.to(tl.float32)
    s2 = s2.to(tl.float32)
    out1 = ((f1 * c1).to(dtype).to(tl.float32) + (-f2 * s1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((f2 * c2).to(dtype).to(tl.float32) + (f1 * s2).to(dtype).to(tl.float32)).to(dtype)
    return out1, out2


@triton.jit
def _rotate_row(x_ptr, cos_ptr, sin_ptr, HALF: tl.constexpr):
    lo = tl.arange(0, HALF)
    return _rotate(tl.load(x_ptr + lo), tl.load(x_ptr + HALF + lo), tl.load(cos_ptr + lo),
                   tl.load(cos_ptr + HALF + lo), tl.load(sin_ptr + lo),
                   tl.load(sin_ptr + HALF + lo))


@triton.jit
def _rotary_kv_kernel(q_ptr, stride_q, k_ptr, stride_k, v_ptr, stride_v, q_out_ptr,
                      stride_q_out, cos_ptr, sin_ptr, stride_table, positions_ptr, slots_ptr,
                      k_cache_ptr, v_cache_ptr, stride_cache_slot, NUM_Q_HEADS,
                      HEAD_DIM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    lo = tl.arange(0, HALF)
    pos = tl.load(positions_ptr + row)
    cos_row = cos_ptr + pos * stride_table
    sin_row = sin_ptr + pos * stride_table
    if head < NUM_Q_HEADS:
        out1, out2 = _rotate_row(q_ptr + row * stride_q + head * HEAD_DIM, cos_row, sin_row,
                                 HALF)
        dst = q_out_ptr + row * stride_q_out + head * HEAD_DIM
        tl.store(dst + lo, out1)
        tl.store(dst + HALF + lo, out2)
    else:
        slot = tl.load(slots_ptr + row)
        if slot >= 0:  # padding rows write nothing
            kv_head = head - NUM_Q_HEADS
            out1, out2 = _rotate_row(k_ptr + row * stride_k + kv_head * HEAD_DIM, cos_row,
                                     sin_row, HALF)
            dst = slot * stride_cache_slot + kv_head * HEAD_DIM
            tl.store(k_cache_ptr + dst + lo, out1)
            tl.store(k_cache_ptr + dst + HALF + lo, out2)
            full = tl.arange(0, HEAD_DIM)
            v = tl.load(v_ptr + row * stride_v + kv_head * HEAD_DIM + full)
            tl.store(v_cache_ptr + dst + full, v)


@triton.jit
def _with_delta(x_ptr, stride_x, col0, rows, in_tile, t_ptr, stride_t, stride_t_chunk, num_chunks,
                b_ptr, ranks_ptr, scales_ptr, max_rank, N, slot, HALF: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    """A tile's rows of one head (columns col0 + [0, 2 * HALF)) of a projection output, each half
    plus its LoRA delta as the expand adds it. -> (first half, second half) [BLOCK_M, HALF]."""
    lo = tl.arange(0, HALF)
    every = lo < HALF
    cols1 = col0 + lo
    cols2 = cols1 + HALF
    x_rows = x_ptr + rows[:, None] * stride_x
    x1 = tl.load(x_rows + cols1[None, :], mask=in_tile[:, None], other=0.0)
    x2 = tl.load(x_rows + cols2[None, :], mask=in_tile[:, None], other=0.0)
    x1 = plus_lora_delta(x1, t_ptr, stride_t, stride_t_chunk, num_chunks, b_ptr, ranks_ptr,
                         scales_ptr, max_rank, N, slot, rows, in_tile, cols1, every, BLOCK_M,
                         HALF, BLOCK_R, MAX_CHUNKS)
    x2 = plus_lora_delta(x2, t_ptr, stride_t, stride_t_chunk, num_chunks, b_ptr, ranks_ptr,
                         scales_ptr, max_rank, N, slot, rows, in_tile, cols2, every, BLOCK_M,
                         HALF, BLOCK_R, MAX_CHUNKS)
    return x1, x2


# One binary for every batch (see lora_expand.py): the row count must not pick a variant.
@triton.jit(do_not_specialize=["num_rows"])
def _rotary_kv_lora_kernel(q_ptr, stride_q, k_ptr, stride_k, v_ptr, stride_v, q_out_ptr,
                           stride_q_out, cos_ptr, sin_ptr, stride_table, positions_ptr, slots_ptr,
                           k_cache_ptr, v_cache_ptr, stride_cache_slot, NUM_Q_HEADS,
                           tq_ptr, tk_ptr, tv_ptr, stride_t, stride_t_chunk, num_chunks,
                           bq_ptr, bk_ptr, bv_ptr, rq_ptr, rk_ptr, rv_ptr, sq_ptr, sk_ptr, sv_ptr,
                           max_rank_q, max_rank_k, max_rank_v, NQ, NKV, sorted_rows_ptr,
                           sorted_slots_ptr, tile_first_ptr, num_tiles_ptr, num_rows,
                           HEAD_DIM: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                           MAX_CHUNKS: tl.constexpr):
    # The LoRA variant: a program per (row tile of one slot, head), so a tile reads its slot's
    # B rows of the head once. q, k and v get their deltas (one rounding each, as the expand
    # adds them) before the rotation and the cache write, exactly as expand-then-rotate does.
    tile = tl.program_id(0)
    head = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    if tile < tl.load(num_tiles_ptr):
        first = tl.load(tile_first_ptr + tile)
        slot = tl.load(sorted_slots_ptr + first)
        rows, in_tile = tile_rows(first, slot, sorted_rows_ptr, sorted_slots_ptr, num_rows,
                                  BLOCK_M)
        lo = tl.arange(0, HALF)
        pos = tl.load(positions_ptr + rows, mask=in_tile, other=0)
        cos_rows = cos_ptr + pos[:, None] * stride_table + lo[None, :]
        sin_rows = sin_ptr + pos[:, None] * stride_table + lo[None, :]
        c1 = tl.load(cos_rows)
        c2 = tl.load(cos_rows + HALF)
        s1 = tl.load(sin_rows)
        s2 = tl.load(sin_rows + HALF)
        if head < NUM_Q_HEADS:
            x1, x2 = _with_delta(q_ptr, stride_q, head * HEAD_DIM, rows, in_tile, tq_ptr,
                                 stride_t, stride_t_chunk, num_chunks, bq_ptr, rq_ptr, sq_ptr,
                                 max_rank_q, NQ, slot, HALF, BLOCK_M, BLOCK_R, MAX_CHUNKS)
            out1, out2 = _rotate(x1, x2, c1, c2, s1, s2)
            q_dst = q_out_ptr + rows[:, None] * stride_q_out + head * HEAD_DIM + lo[None, :]
            tl.store(q_dst, out1, mask=in_tile[:, None])
            tl.store(q_dst + HALF, out2, mask=in_tile[:, None])
        else:
            kv_head = head - NUM_Q_HEADS
            cache_slot = tl.load(slots_ptr + rows, mask=in_tile, other=-1)
            writes = (in_tile & (cache_slot >= 0))[:, None]  # padding rows write nothing
            dst = (cache_slot * stride_cache_slot + kv_head * HEAD_DIM)[:, None] + lo[None, :]
            x1, x2 = _with_delta(k_ptr, stride_k, kv_head * HEAD_DIM, rows, in_tile, tk_ptr,
                                 stride_t, stride_t_chunk, num_chunks, bk_ptr, rk_ptr, sk_ptr,
                                 max_rank_k, NKV, slot, HALF, BLOCK_M, BLOCK_R, MAX_CHUNKS)
            out1, out2 = _rotate(x1, x2, c1, c2, s1, s2)
            tl.store(k_cache_ptr + dst, out1, mask=writes)
            tl.store(k_cache_ptr + dst + HALF, out2, mask=writes)
            v1, v2 = _with_delta(v_ptr, stride_v, kv_head * HEAD_DIM, rows, in_tile, tv_ptr,
                                 stride_t, stride_t_chunk, num_chunks, bv_ptr, rv_ptr, sv_ptr,
                                 max_rank_v, NKV, slot, HALF, BLOCK_M, BLOCK_R, MAX_CHUNKS)
            tl.store(v_cache_ptr + dst, v1, mask=writes)
            tl.store(v_cache_ptr + dst + HALF, v2, mask=writes)


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_table: torch.Tensor, sin_table: torch.Tensor, slot_mapping: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int,
                    head_dim: int, lora: PendingShrink | None = None) -> torch.Tensor:
    """Rotate q and k by each row's position, write rotated k and v into the paged cache at the
    row's slot (-1: padding, not written); -> rotated q [num_rows, q_heads, head_dim].

    q: [num_rows, q_heads * head_dim], k, v: [num_rows, kv_heads * head_dim] (column slices of
    one projection output are fine: rows may be strided, columns contiguous); cos_table,
    sin_table: [max_positions, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads,
    head_dim], contiguous. lora: the pending shrink of q/k/v (in that order), whose deltas are
    added to q, k and v as they are read, instead of an expand before this."""
    num_rows = q.shape[0]
    num_kv_heads = k_cache.shape[2]
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two for the kernel"
    assert q.shape[1] == num_q_heads * head_dim and k.shape == v.shape
    assert k.shape == (num_rows, num_kv_heads * head_dim) and k_cache.shape[3] == head_dim
    assert q.stride(1) == k.stride(1) == v.stride(1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert cos_table.is_contiguous() and sin_table.is_contiguous()
    q_out = torch.empty(num_rows, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_rows == 0:
        return q_out
    if lora is not None:
        lora.wait()
        (tq, bq, rq, sq), (tk, bk, rk, sk), (tv, bv, rv, sv) = (lora.table(i) for i in range(3))
        tiles = lora.tiles
        assert tq.shape[0] == num_rows
        _rotary_kv_lora_kernel[(tiles.max_tiles_all, num_q_heads + num_kv_heads)](
            q, q.stride(0), k, k.stride(0), v, v.stride(0), q_out, q_out.stride(0), cos_table,
            sin_table, cos_table.stride(0), positions, slot_mapping, k_cache, v_cache,
            num_kv_heads * head_dim, num_q_heads, tq, tk, tv, tq.stride(0), tq.stride(1),
            tq.shape[1], bq, bk, bv, rq, rk, rv, sq, sk, sv, bq.shape[2], bk.shape[2],
            bv.shape[2], q.shape[1], k.shape[1], tiles.sorted_rows, tiles.sorted_slots,
            tiles.tile_first, tiles.num_tiles_all, num_rows, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M,
            BLOCK_R=EXPAND_CONFIG.block_r, MAX_CHUNKS=triton.next_power_of_2(tq.shape[1]),
            num_warps=4, enable_fp_fusion=False)
        return q_out
    _rotary_kv_kernel[(num_rows, num_q_heads + num_kv_heads)](
        q, q.stride(0), k, k.stride(0), v, v.stride(0), q_out, q_out.stride(0), cos_table,
        sin_table, cos_table.stride(0), positions, slot_mapping, k_cache, v_cache,
        num_kv_heads * head_dim, num_q_heads, HEAD_DIM=head_dim, num_warps=1,
        # No fused multiply-add: in fp32 it would skip the product's rounding that torch does.
        enable_fp_fusion=False)
    return q_out


# --- silu(gate) * up --------------------------------------------------------------------------

SILU_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gate_ptr, stride_gate, up_ptr, stride_up, out_ptr, stride_out, N,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, _silu(gate, up), mask=mask)


SILU_LORA_SUB_BLOCKS = 4  # LoRA variant: a program's columns, in blocks of the expand's width


@triton.jit
def _silu(gate, up):
    dtype = gate.dtype
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype)  # as layers.silu_and_mul: fp32, then rounded
    return (act.to(tl.float32) * up.to(tl.float32)).to(dtype)


# One binary for every batch (see lora_expand.py): the row count must not pick a variant.
@triton.jit(do_not_specialize=["num_rows"])
def _silu_mul_lora_kernel(gate_ptr, stride_gate, up_ptr, stride_up, out_ptr, stride_out, N,
                          tg_ptr, tu_ptr, stride_t, stride_t_chunk, num_chunks, bg_ptr, bu_ptr,
                          rg_ptr, ru_ptr, sg_ptr, su_ptr, max_rank_g, max_rank_u,
                          sorted_rows_ptr, sorted_slots_ptr, tile_first_ptr, num_tiles_ptr,
                          num_rows, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          SUB_BLOCKS: tl.constexpr, BLOCK_R: tl.constexpr,
                          MAX_CHUNKS: tl.constexpr):
    # The LoRA variant: a program per (row tile of one slot, SUB_BLOCKS * BLOCK_N columns); gate
    # and up get their deltas (one rounding each, as the expand adds them) before the product.
    tile = tl.program_id(0)
    if tile < tl.load(num_tiles_ptr):
        first = tl.load(tile_first_ptr + tile)
        slot = tl.load(sorted_slots_ptr + first)
        rows, in_tile = tile_rows(first, slot, sorted_rows_ptr, sorted_slots_ptr, num_rows,
                                  BLOCK_M)
        for sub in tl.static_range(SUB_BLOCKS):
            cols = (tl.program_id(1) * SUB_BLOCKS + sub) * BLOCK_N + tl.arange(0, BLOCK_N)
            in_n = cols < N
            mask = in_tile[:, None] & in_n[None, :]
            gate = tl.load(gate_ptr + rows[:, None] * stride_gate + cols[None, :], mask=mask,
                           other=0.0)
            up = tl.load(up_ptr + rows[:, None] * stride_up + cols[None, :], mask=mask,
                         other=0.0)
            gate = plus_lora_delta(gate, tg_ptr, stride_t, stride_t_chunk, num_chunks, bg_ptr,
                                   rg_ptr, sg_ptr, max_rank_g, N, slot, rows, in_tile, cols,
                                   in_n, BLOCK_M, BLOCK_N, BLOCK_R, MAX_CHUNKS)
            up = plus_lora_delta(up, tu_ptr, stride_t, stride_t_chunk, num_chunks, bu_ptr,
                                 ru_ptr, su_ptr, max_rank_u, N, slot, rows, in_tile, cols,
                                 in_n, BLOCK_M, BLOCK_N, BLOCK_R, MAX_CHUNKS)
            tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], _silu(gate, up),
                     mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor,
                 lora: PendingShrink | None = None) -> torch.Tensor:
    """silu(gate) * up -> [num_rows, N], contiguous. gate, up: [num_rows, N], columns contiguous
    (the two halves of one projection output are fine). lora: the pending shrink of gate/up (in
    that order), whose deltas are added to gate and up as they are read, instead of an expand
    before this."""
    num_rows, n = gate.shape
    assert up.shape == gate.shape and gate.stride(1) == 1 and up.stride(1) == 1
    out = torch.empty(num_rows, n, dtype=gate.dtype, device=gate.device)
    if num_rows == 0:
        return out
    if lora is not None:
        lora.wait()
        (tg, bg, rg, sg), (tu, bu, ru, su) = lora.table(0), lora.table(1)
        tiles, block_n = lora.tiles, EXPAND_CONFIG.block_n
        assert tg.shape[0] == num_rows
        _silu_mul_lora_kernel[(tiles.max_tiles_all,
                               triton.cdiv(n, block_n * SILU_LORA_SUB_BLOCKS))](
            gate, gate.stride(0), up, up.stride(0), out, out.stride(0), n, tg, tu, tg.stride(0),
            tg.stride(1), tg.shape[1], bg, bu, rg, ru, sg, su, bg.shape[2], bu.shape[2],
            tiles.sorted_rows, tiles.sorted_slots, tiles.tile_first, tiles.num_tiles_all,
            num_rows, BLOCK_M=BLOCK_M, BLOCK_N=block_n, SUB_BLOCKS=SILU_LORA_SUB_BLOCKS,
            BLOCK_R=EXPAND_CONFIG.block_r, MAX_CHUNKS=triton.next_power_of_2(tg.shape[1]),
            num_warps=4)
        return out
    _silu_mul_kernel[(num_rows, triton.cdiv(n, SILU_BLOCK))](
        gate, gate.stride(0), up, up.stride(0), out, out.stride(0), n, BLOCK=SILU_BLOCK,
        num_warps=4)
    return out
