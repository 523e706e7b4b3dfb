"""The step's K and V into the paged cache by slot, padding rows (slot -1) skipped on the device.

The CPU path picks the rows to write with nonzero, which on CUDA waits for the device; here each
row's program reads its own slot and returns when it is -1, so the write needs no host sync and
can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.launch_math import next_power_of_2


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
                     stride_k_row, stride_k_head, stride_v_row, stride_v_head,
                     stride_cache_slot, stride_cache_head,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)  # over [kv_heads, head_dim] flattened
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    ok = offs < NUM_HEADS * HEAD_DIM
    dst = slot.to(tl.int64) * stride_cache_slot + head * stride_cache_head + dim
    k = tl.load(k_ptr + row.to(tl.int64) * stride_k_row + head * stride_k_head + dim, mask=ok)
    v = tl.load(v_ptr + row.to(tl.int64) * stride_v_row + head * stride_v_head + dim, mask=ok)
    tl.store(k_cache_ptr + dst, k, mask=ok)
    tl.store(v_cache_ptr + dst, v, mask=ok)


def write_kv(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k, v: [num_rows, kv_heads, head_dim]; slot_mapping: [num_rows] int64, -1 = padding;
    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim], contiguous."""
    num_rows, num_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_rows,)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (num_heads, head_dim) and k_cache.dtype == k.dtype == v.dtype
    assert k.stride(2) == 1 and v.stride(2) == 1
    if num_rows == 0:
        return
    _write_kv_kernel[(num_rows,)](
        k, v, slot_mapping, k_cache, v_cache, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_heads * head_dim, head_dim,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK=next_power_of_2(num_heads * head_dim), num_warps=4)
