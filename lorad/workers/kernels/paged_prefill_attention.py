"""Prefill attention over paged KV: chunks of several tokens, causal, varlen over query_starts.

One program per (sequence, KV head, tile of the chunk's query tokens): the tile's tokens times
the KV head's query heads are the rows of one dot, so those heads share every K/V load, and an
fp32 online softmax runs over the context up to the tile's last position, read through the block
table. A program reads only its own sequence, so a chunk's rows do not depend on its neighbours.
Eager only (the grid follows the longest chunk); decode steps use paged_attention.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.launch_math import cdiv, next_power_of_2
from lorad.workers.kernels.paged_attention import load_kv_tile, online_softmax_step

ROWS_PER_TILE = 64  # query tokens x query heads of one KV head per program
TILE_TOKENS = 64  # keys per step


@triton.jit(do_not_specialize=["stride_table"])
def _prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, lens_ptr, starts_ptr, ends_ptr, out_ptr,
        scale,
        stride_q_token, stride_q_head, stride_k_block, stride_k_token, stride_k_head,
        stride_v_block, stride_v_token, stride_v_head, stride_table, stride_out_token,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, QUERY_TOKENS: tl.constexpr, TILE: tl.constexpr,
        BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    query_tile = tl.program_id(2)
    first_row = tl.load(starts_ptr + seq)
    num_queries = tl.load(ends_ptr + seq) - first_row
    tile_first = query_tile * QUERY_TOKENS
    if tile_first >= num_queries:
        return  # past this sequence's chunk
    context_len = tl.load(lens_ptr + seq)
    # The chunk holds the last num_queries positions of the context.
    first_pos = context_len - num_queries
    keys_end = tl.minimum(context_len, first_pos + tile_first + QUERY_TOKENS)

    # Row r of the tile: query token r // GROUP_PAD, query head r % GROUP_PAD of this KV head.
    rows = tl.arange(0, QUERY_TOKENS * GROUP_PAD)
    token = tile_first + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (token < num_queries) & (rows % GROUP_PAD < GROUP)
    # Rows that are not real see every key of the tile: no row is left with no key at all.
    query_pos = tl.where(row_ok, first_pos + token, keys_end - 1)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    token_row = (first_row + token).to(tl.int64)
    q = tl.load(q_ptr + token_row[:, None] * stride_q_token + head[:, None] * stride_q_head
                + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    row_max = tl.full([QUERY_TOKENS * GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([QUERY_TOKENS * GROUP_PAD], tl.float32)
    acc = tl.zeros([QUERY_TOKENS * GROUP_PAD, BLOCK_D], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_table
    for tile_start in range(0, keys_end, TILE):
        pos = tile_start + tl.arange(0, TILE)
        pos_ok = pos < keys_end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table, pos, pos_ok, kv_head, dims, dim_ok,
                            stride_k_block, stride_k_token, stride_k_head, stride_v_block,
                            stride_v_token, stride_v_head, BLOCK_SIZE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        scores = tl.where(pos[None, :] <= query_pos[:, None], scores, float("-inf"))
        # Key 0 is in the first tile and every row may see it, so the max is finite throughout.
        row_max, row_sum, acc = online_softmax_step(scores, v, row_max, row_sum, acc,
                                                    DOT_PRECISION)

    out = acc / row_sum[:, None]
    tl.store(out_ptr + token_row[:, None] * stride_out_token + head[:, None] * HEAD_DIM
             + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor,
                            query_starts: torch.Tensor, max_query_len: int, scale: float,
                            out: torch.Tensor | None = None,
                            tile_size: int = TILE_TOKENS,
                            query_ends: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_rows, q_heads, head_dim], sequence i's tokens at rows query_starts[i] to
    query_ends[i] (the last positions of its context; query_ends None: query_starts[i + 1], and
    query_starts has num_seqs + 1 entries); k_cache, v_cache: [num_blocks, block_size, kv_heads,
    head_dim]; block_tables: [num_seqs, max_blocks] int32; context_lens: [num_seqs] int32;
    query_starts, query_ends: int32; max_query_len: the longest chunk (sizes the grid)
    -> out [num_rows, q_heads * head_dim] in q's dtype. Rows of no sequence are left as they are
    in `out` (zeros when it is allocated here)."""
    num_rows, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    num_seqs = context_lens.shape[0]
    assert num_q_heads == group * num_kv_heads and k_cache.shape == v_cache.shape
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.stride(2) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    if query_ends is None:  # a tensor of its own: a view one entry in is another alignment
        query_starts, query_ends = query_starts[:-1], query_starts[1:].clone()
    assert block_tables.shape[0] == num_seqs
    assert query_starts.shape[0] == query_ends.shape[0] == num_seqs
    if out is None:
        out = torch.zeros(num_rows, num_q_heads * head_dim, dtype=q.dtype, device=q.device)
    assert out.shape == (num_rows, num_q_heads * head_dim) and out.stride(1) == 1
    if num_seqs == 0 or max_query_len == 0:
        return out
    group_pad = next_power_of_2(group)
    query_tokens = max(1, ROWS_PER_TILE // group_pad)
    grid = (num_seqs, num_kv_heads, cdiv(max_query_len, query_tokens))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, query_starts, query_ends, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        QUERY_TOKENS=query_tokens, TILE=tile_size, BLOCK_D=next_power_of_2(head_dim),
        # fp32 stays fp32 (no tf32 rounding of q and k): it is compared with the CPU path.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2)
    return out
