"""The decode step's elementwise work in three kernels per use instead of a dozen torch ops each:
residual add + RMSNorm, rotary + KV-cache write, and SwiGLU's silu(gate) * up. Each also adds
the LoRA deltas of its inputs that the expand left in fp32 buffers (LoraDelta).

Each program handles one row (or one row's head or column block) alone, with one block shape for
every batch, so a row's bits never depend on what else the step holds. Every rounding the torch
path does (lorad.workers.layers, lorad.workers.rotary; transformers' order) is done here too, at
the same places: model-dtype results of model-dtype ops, fp32 where the torch path goes to fp32.
The sums inside RMSNorm and the exp in silu may differ from torch's by an ulp (another order,
another exp); the GPU tests compare with the torch path within a stated tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.launch_math import cdiv, next_power_of_2
from lorad.workers.kernels.lora_common import LoraDelta
from lorad.workers.kernels.pdl import (launch_options, let_dependents_launch,
                                       wait_for_previous_only)


# --- residual add + RMSNorm -------------------------------------------------------------------

# The kernels that call this take row_slots_ptr unspecialized on alignment: the rows' slots are
# a row of the decode graphs' input block, at an offset that follows the batch size.
@triton.jit
def _lora_rank(ranks_ptr, row_slots_ptr, row):
    """-> the rank a LoRA table has for this row's adapter slot (0: no delta for the row)."""
    return tl.load(ranks_ptr + tl.load(row_slots_ptr + row))


@triton.jit
def _plus_lora(x, lora_row_ptr, offs, mask, rank):
    """x (model dtype, at offs of one row) plus the row's LoRA delta (a LoraDelta's fp32 row):
    widened, added in fp32 and rounded once, as the in-place expand does; x itself where the
    row's table rank is 0 (the delta buffer holds nothing there, and is read without waiting on
    the rank)."""
    d = tl.load(lora_row_ptr + offs, mask=mask, other=0.0)
    edited = tl.zeros_like(offs) < rank  # a block: triton 3.9's interpreter rejects a scalar
    return tl.where(edited, (x.to(tl.float32) + d).to(x.dtype), x)


@triton.jit
def _rms_scale(h, H, eps):
    """-> 1 / sqrt(mean(h^2) + eps) in fp32, over a whole row h (zeros past H)."""
    x = h.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / H
    return tl.rsqrt(variance + eps)


@triton.jit
def _normed(h, w, scale, dtype: tl.constexpr):
    """-> weight * RMSNorm(h) in the model dtype, elementwise (any piece of a row) given the
    row's _rms_scale: the normalised value rounded, then the product rounded, as RMSNorm does."""
    y = (h.to(tl.float32) * scale).to(dtype)
    return (w.to(tl.float32) * y.to(tl.float32)).to(dtype)


@triton.jit
def _add_and_norm_row(h, res_ptr, res_out_ptr, normed_ptr, w, cols, mask, H, eps,
                      dtype: tl.constexpr, HAS_RES: tl.constexpr):
    """One row's residual add + RMSNorm, given the layer's output h at `cols` in the model dtype
    (an fp32 sum after its all-reduce, or the embedding, rounded; its LoRA delta in): added to
    the residual in fp32 and rounded once, as `hidden + out.to(dtype)` (h alone without
    HAS_RES), stored to res_out_ptr, and weight w times its RMSNorm to normed_ptr (the row's
    pointers). Every add + norm kernel ends here: fused_ops', oneshot_reduce's, moe_glue's."""
    if HAS_RES:
        r = tl.load(res_ptr + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(res_out_ptr + cols, h, mask=mask)
    scale = _rms_scale(h, H, eps)
    tl.store(normed_ptr + cols, _normed(h, w, scale, dtype), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["row_slots_ptr"])
def _add_rms_norm_kernel(delta_ptr, stride_delta, res_ptr, stride_res, res_out_ptr,
                         stride_res_out, normed_ptr, stride_normed, weight_ptr, H, eps,
                         lora_ptr, stride_lora, lora_ranks_ptr, row_slots_ptr,
                         HAS_RES: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dtype = res_out_ptr.dtype.element_ty
    # Before the PDL wait: the norm's weight, the row's slot (a step input) and its rank.
    let_dependents_launch(PDL)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    lora_rank = 0
    if HAS_LORA:
        lora_rank = _lora_rank(lora_ranks_ptr, row_slots_ptr, row)
    wait_for_previous_only(PDL)
    h = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0).to(dtype)
    if HAS_LORA:
        h = _plus_lora(h, lora_ptr + row * stride_lora, cols, mask, lora_rank)
    _add_and_norm_row(h, res_ptr + row * stride_res, res_out_ptr + row * stride_res_out,
                      normed_ptr + row * stride_normed, w, cols, mask, H, eps, dtype, HAS_RES)


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, lora: LoraDelta | None = None,
                 pdl_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (hidden, normed): hidden = residual + delta.to(weight.dtype) (delta alone when residual
    is None), normed = RMSNorm(hidden). delta: [num_rows, H] fp32 or model dtype; residual:
    [num_rows, H] model dtype, overwritten with hidden (returned as hidden). lora: delta's LoRA
    delta, added to delta (in the model dtype) first, as LoraDelta says. pdl_rows: the step's
    PDL row limit (kernels/pdl.py; 0: no PDL)."""
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
    block = next_power_of_2(hidden_size)
    _add_rms_norm_kernel[(num_rows,)](
        delta, delta.stride(0), res_arg, stride_res, residual_out, residual_out.stride(0),
        normed, normed.stride(0), weight, hidden_size, eps, *_lora_args(lora, delta),
        _row_slots([lora], delta),
        HAS_RES=residual is not None, HAS_LORA=lora is not None, BLOCK=block,
        num_warps=_norm_warps(block),
        **launch_options(delta.device, num_rows, pdl_rows))
    return residual_out, normed


def _lora_args(lora: LoraDelta | None, out: torch.Tensor) -> tuple:
    """(delta buffer, its row stride, the table's ranks) for a kernel taking `out`'s LoRA delta;
    placeholders (never read) without one."""
    if lora is None:
        return out, 0, out
    assert lora.delta.shape == out.shape and lora.delta.stride(1) == 1
    assert lora.delta.dtype == torch.float32 and lora.delta.shape[0] == lora.row_slots.shape[0]
    return lora.delta, lora.delta.stride(0), lora.ranks


def _row_slots(loras: Sequence[LoraDelta | None], out: torch.Tensor) -> torch.Tensor:
    """The rows' adapter slots of the given LoRA deltas (one step's: the same tensor), or a
    placeholder (never read) without any."""
    given = [lora.row_slots for lora in loras if lora is not None]
    assert all(slots is given[0] for slots in given), "LoRA deltas of different steps"
    return given[0] if given else out


def _norm_warps(block: int) -> int:
    """Warps of a program holding a row of `block` elements (the row sum's order follows the
    layout, so it is part of a row's bits)."""
    return min(16, max(1, block // 256))


# --- rotary + KV-cache write ------------------------------------------------------------------

@triton.jit
def _cos_sin(cos_row, sin_row, HALF: tl.constexpr):
    """-> a position's cos and sin, each as (first half, second half), widened to fp32."""
    lo = tl.arange(0, HALF)
    return ((tl.load(cos_row + lo).to(tl.float32), tl.load(cos_row + HALF + lo).to(tl.float32)),
            (tl.load(sin_row + lo).to(tl.float32), tl.load(sin_row + HALF + lo).to(tl.float32)))


@triton.jit
def _rotate(x_ptr, cos, sin, lora_ptr, lora_rank, HALF: tl.constexpr, HAS_LORA: tl.constexpr):
    """One head rotated as `x * cos + rotate_half(x) * sin` in the model dtype (cos, sin: from
    _cos_sin): each product rounded, then the sum rounded; the head's LoRA delta added first
    (HAS_LORA). -> (first half, second half)."""
    lo = tl.arange(0, HALF)
    x1 = tl.load(x_ptr + lo)
    x2 = tl.load(x_ptr + HALF + lo)
    if HAS_LORA:
        everywhere = lo < HALF
        x1 = _plus_lora(x1, lora_ptr, lo, everywhere, lora_rank)
        x2 = _plus_lora(x2, lora_ptr + HALF, lo, everywhere, lora_rank)
    dtype = x1.dtype
    c1, c2 = cos
    s1, s2 = sin
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    out1 = ((f1 * c1).to(dtype).to(tl.float32) + (-f2 * s1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((f2 * c2).to(dtype).to(tl.float32) + (f1 * s2).to(dtype).to(tl.float32)).to(dtype)
    return out1, out2


@triton.jit(do_not_specialize_on_alignment=["row_slots_ptr"])
def _rotary_kv_kernel(q_ptr, stride_q, k_ptr, stride_k, v_ptr, stride_v, q_out_ptr,
                      stride_q_out, cos_ptr, sin_ptr, stride_table, positions_ptr, slots_ptr,
                      k_cache_ptr, v_cache_ptr, stride_cache_slot, NUM_Q_HEADS,
                      lq_ptr, stride_lq, lq_ranks_ptr, lk_ptr, stride_lk, lk_ranks_ptr,
                      lv_ptr, stride_lv, lv_ranks_ptr, row_slots_ptr,
                      HEAD_DIM: tl.constexpr, HAS_LQ: tl.constexpr, HAS_LK: tl.constexpr,
                      HAS_LV: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    lo = tl.arange(0, HALF)
    # Before the PDL wait: the row's position and KV slot (step inputs) and its cos and sin.
    let_dependents_launch(PDL)
    pos = tl.load(positions_ptr + row)
    cos, sin = _cos_sin(cos_ptr + pos * stride_table, sin_ptr + pos * stride_table, HALF)
    slot = tl.load(slots_ptr + row)
    wait_for_previous_only(PDL)
    if head < NUM_Q_HEADS:
        lq_rank = 0
        if HAS_LQ:
            lq_rank = _lora_rank(lq_ranks_ptr, row_slots_ptr, row)
        out1, out2 = _rotate(q_ptr + row * stride_q + head * HEAD_DIM, cos, sin,
                             lq_ptr + row * stride_lq + head * HEAD_DIM, lq_rank, HALF, HAS_LQ)
        dst = q_out_ptr + row * stride_q_out + head * HEAD_DIM
        tl.store(dst + lo, out1)
        tl.store(dst + HALF + lo, out2)
    else:
        if slot >= 0:  # padding rows write nothing
            kv_head = head - NUM_Q_HEADS
            lk_rank = 0
            if HAS_LK:
                lk_rank = _lora_rank(lk_ranks_ptr, row_slots_ptr, row)
            out1, out2 = _rotate(k_ptr + row * stride_k + kv_head * HEAD_DIM, cos, sin,
                                 lk_ptr + row * stride_lk + kv_head * HEAD_DIM, lk_rank, HALF,
                                 HAS_LK)
            dst = slot * stride_cache_slot + kv_head * HEAD_DIM
            tl.store(k_cache_ptr + dst + lo, out1)
            tl.store(k_cache_ptr + dst + HALF + lo, out2)
            full = tl.arange(0, HEAD_DIM)
            v = tl.load(v_ptr + row * stride_v + kv_head * HEAD_DIM + full)
            if HAS_LV:
                v = _plus_lora(v, lv_ptr + row * stride_lv + kv_head * HEAD_DIM, full,
                               full < HEAD_DIM, _lora_rank(lv_ranks_ptr, row_slots_ptr, row))
            tl.store(v_cache_ptr + dst + full, v)


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_table: torch.Tensor, sin_table: torch.Tensor, slot_mapping: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int,
                    head_dim: int, loras: Sequence[LoraDelta | None] = (None, None, None),
                    pdl_rows: int = 0) -> torch.Tensor:
    """Rotate q and k by each row's position, write rotated k and v into the paged cache at the
    row's slot (-1: padding, not written); -> rotated q [num_rows, q_heads, head_dim].

    q: [num_rows, q_heads * head_dim], k, v: [num_rows, kv_heads * head_dim] (column slices of
    one projection output are fine: rows may be strided, columns contiguous); cos_table,
    sin_table: [max_positions, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads,
    head_dim], contiguous. loras: q's, k's and v's LoRA deltas (or None), added to them first, as
    LoraDelta says. pdl_rows: the step's PDL row limit (kernels/pdl.py; 0: no PDL)."""
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
    _rotary_kv_kernel[(num_rows, num_q_heads + num_kv_heads)](
        q, q.stride(0), k, k.stride(0), v, v.stride(0), q_out, q_out.stride(0), cos_table,
        sin_table, cos_table.stride(0), positions, slot_mapping, k_cache, v_cache,
        num_kv_heads * head_dim, num_q_heads, *_lora_args(loras[0], q),
        *_lora_args(loras[1], k), *_lora_args(loras[2], v), _row_slots(loras, q),
        HEAD_DIM=head_dim,
        HAS_LQ=loras[0] is not None, HAS_LK=loras[1] is not None, HAS_LV=loras[2] is not None,
        num_warps=1,
        **launch_options(q.device, num_rows, pdl_rows),
        # No fused multiply-add: in fp32 it would skip the product's rounding that torch does.
        enable_fp_fusion=False)
    return q_out


# --- silu(gate) * up --------------------------------------------------------------------------

SILU_BLOCK = 1024


@triton.jit(do_not_specialize_on_alignment=["row_slots_ptr"])
def _silu_mul_kernel(gate_ptr, stride_gate, up_ptr, stride_up, out_ptr, stride_out, N,
                     lg_ptr, stride_lg, lg_ranks_ptr, lu_ptr, stride_lu, lu_ranks_ptr,
                     row_slots_ptr, BLOCK: tl.constexpr, HAS_LG: tl.constexpr,
                     HAS_LU: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    # Before the PDL wait: the row's ranks (its slot is a step input).
    let_dependents_launch(PDL)
    lg_rank = 0
    if HAS_LG:
        lg_rank = _lora_rank(lg_ranks_ptr, row_slots_ptr, row)
    lu_rank = 0
    if HAS_LU:
        lu_rank = _lora_rank(lu_ranks_ptr, row_slots_ptr, row)
    wait_for_previous_only(PDL)
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0)
    if HAS_LG:
        gate = _plus_lora(gate, lg_ptr + row * stride_lg, cols, mask, lg_rank)
    if HAS_LU:
        up = _plus_lora(up, lu_ptr + row * stride_lu, cols, mask, lu_rank)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype)  # as layers.silu_and_mul: fp32, then rounded
    tl.store(out_ptr + row * stride_out + cols,
             (act.to(tl.float32) * up.to(tl.float32)).to(dtype), mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor,
                 loras: Sequence[LoraDelta | None] = (None, None),
                 pdl_rows: int = 0) -> torch.Tensor:
    """silu(gate) * up -> [num_rows, N], contiguous. gate, up: [num_rows, N], columns contiguous
    (the two halves of one projection output are fine). loras: gate's and up's LoRA deltas (or
    None), added to them first, as LoraDelta says. pdl_rows: the step's PDL row limit
    (kernels/pdl.py; 0: no PDL)."""
    num_rows, n = gate.shape
    assert up.shape == gate.shape and gate.stride(1) == 1 and up.stride(1) == 1
    out = torch.empty(num_rows, n, dtype=gate.dtype, device=gate.device)
    if num_rows == 0:
        return out
    _silu_mul_kernel[(num_rows, cdiv(n, SILU_BLOCK))](
        gate, gate.stride(0), up, up.stride(0), out, out.stride(0), n,
        *_lora_args(loras[0], gate), *_lora_args(loras[1], up), _row_slots(loras, gate),
        BLOCK=SILU_BLOCK,
        HAS_LG=loras[0] is not None, HAS_LU=loras[1] is not None,
        num_warps=4, **launch_options(gate.device, num_rows, pdl_rows))
    return out
