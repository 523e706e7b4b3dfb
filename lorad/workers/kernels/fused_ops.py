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

import torch
import triton
import triton.language as tl


# --- residual add + RMSNorm -------------------------------------------------------------------

@triton.jit
def _add_row(delta_ptr, res_ptr, cols, mask, dtype: tl.constexpr, HAS_RES: tl.constexpr):
    """-> hidden at `cols` of one row, in the model dtype: the layer's output (an fp32 partial sum
    after its all-reduce, or the embedding) rounded to the model dtype, then added to the
    residual in the model dtype, as `hidden + out.to(dtype)`."""
    h = tl.load(delta_ptr + cols, mask=mask, other=0.0).to(dtype)
    if HAS_RES:
        r = tl.load(res_ptr + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)
    return h


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
def _add_rms_norm_kernel(delta_ptr, stride_delta, res_ptr, stride_res, res_out_ptr,
                         stride_res_out, normed_ptr, stride_normed, weight_ptr, H, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dtype = res_out_ptr.dtype.element_ty
    h = _add_row(delta_ptr + row * stride_delta, res_ptr + row * stride_res, cols, mask, dtype,
                 HAS_RES)
    tl.store(res_out_ptr + row * stride_res_out + cols, h, mask=mask)
    scale = _rms_scale(h, H, eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(normed_ptr + row * stride_normed + cols, _normed(h, w, scale, dtype), mask=mask)


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (hidden, normed): hidden = residual + delta.to(weight.dtype) (delta alone when residual
    is None), normed = RMSNorm(hidden). delta: [num_rows, H] fp32 or model dtype; residual:
    [num_rows, H] model dtype, overwritten with hidden (returned as hidden)."""
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
    block = triton.next_power_of_2(hidden_size)
    _add_rms_norm_kernel[(num_rows,)](
        delta, delta.stride(0), res_arg, stride_res, residual_out, residual_out.stride(0),
        normed, normed.stride(0), weight, hidden_size, eps,
        HAS_RES=residual is not None, BLOCK=block, num_warps=_norm_warps(block))
    return residual_out, normed


def _norm_warps(block: int) -> int:
    """Warps of a program holding a row of `block` elements. The row sum's order follows the
    layout, so add_rms_norm and add_rms_norm_shrink must agree on it to agree on the bits."""
    return min(16, max(1, block // 256))


# --- rotary + KV-cache write ------------------------------------------------------------------

@triton.jit
def _rotate(x_ptr, cos_ptr, sin_ptr, HALF: tl.constexpr):
    """One head rotated as `x * cos + rotate_half(x) * sin` in the model dtype: each product
    rounded, then the sum rounded. -> (first half, second half)."""
    lo = tl.arange(0, HALF)
    x1 = tl.load(x_ptr + lo)
    x2 = tl.load(x_ptr + HALF + lo)
    dtype = x1.dtype
    c1 = tl.load(cos_ptr + lo).to(tl.float32)
    c2 = tl.load(cos_ptr + HALF + lo).to(tl.float32)
    s1 = tl.load(sin_ptr + lo).to(tl.float32)
    s2 = tl.load(sin_ptr + HALF + lo).to(tl.float32)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    out1 = ((f1 * c1).to(dtype).to(tl.float32) + (-f2 * s1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((f2 * c2).to(dtype).to(tl.float32) + (f1 * s2).to(dtype).to(tl.float32)).to(dtype)
    return out1, out2


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
        out1, out2 = _rotate(q_ptr + row * stride_q + head * HEAD_DIM, cos_row, sin_row, HALF)
        dst = q_out_ptr + row * stride_q_out + head * HEAD_DIM
        tl.store(dst + lo, out1)
        tl.store(dst + HALF + lo, out2)
    else:
        slot = tl.load(slots_ptr + row)
        if slot >= 0:  # padding rows write nothing
            kv_head = head - NUM_Q_HEADS
            out1, out2 = _rotate(k_ptr + row * stride_k + kv_head * HEAD_DIM, cos_row, sin_row,
                                 HALF)
            dst = slot * stride_cache_slot + kv_head * HEAD_DIM
            tl.store(k_cache_ptr + dst + lo, out1)
            tl.store(k_cache_ptr + dst + HALF + lo, out2)
            full = tl.arange(0, HEAD_DIM)
            v = tl.load(v_ptr + row * stride_v + kv_head * HEAD_DIM + full)
            tl.store(v_cache_ptr + dst + full, v)


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_table: torch.Tensor, sin_table: torch.Tensor, slot_mapping: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int,
                    head_dim: int) -> torch.Tensor:
    """Rotate q and k by each row's position, write rotated k and v into the paged cache at the
    row's slot (-1: padding, not written); -> rotated q [num_rows, q_heads, head_dim].

    q: [num_rows, q_heads * head_dim], k, v: [num_rows, kv_heads * head_dim] (column slices of
    one projection output are fine: rows may be strided, columns contiguous); cos_table,
    sin_table: [max_positions, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads,
    head_dim], contiguous."""
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
    dtype = gate.dtype
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype)  # as layers.silu_and_mul: fp32, then rounded
    tl.store(out_ptr + row * stride_out + cols,
             (act.to(tl.float32) * up.to(tl.float32)).to(dtype), mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up -> [num_rows, N], contiguous. gate, up: [num_rows, N], columns contiguous
    (the two halves of one projection output are fine)."""
    num_rows, n = gate.shape
    assert up.shape == gate.shape and gate.stride(1) == 1 and up.stride(1) == 1
    out = torch.empty(num_rows, n, dtype=gate.dtype, device=gate.device)
    if num_rows == 0:
        return out
    _silu_mul_kernel[(num_rows, triton.cdiv(n, SILU_BLOCK))](
        gate, gate.stride(0), up, up.stride(0), out, out.stride(0), n, BLOCK=SILU_BLOCK,
        num_warps=4)
    return out
