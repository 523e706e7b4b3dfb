"""Decode attention over paged KV: one query token per sequence, split-KV with a fixed split size.

Two kernels. The split kernel gives each (sequence, KV head, split of split_size context tokens)
its own program: the KV head's query heads are one tile, so they share every K/V load, and an
fp32 online softmax runs over the split's keys read through the block table. The reduce kernel
merges a sequence's splits one after another, in split order. A split's bounds and the merge
order depend only on that sequence's context length, never on the batch or on the grid, so a
row's result has the same bits in any batch. No host sync and a grid fixed by shapes alone, so a
decode step can be captured in a CUDA graph. Prefill chunks are paged_prefill_attention.py's.

Launched with PDL (kernels/pdl.py), both kernels read the context lengths before their wait (a
step input), and in steps of prefetch_max_seqs sequences or fewer the split kernel asks L2 for
the K/V lines of its first split below each sequence's last position: earlier steps cached
them, and only the last position is the step's own token, written by the kernel ahead. The
chain of round trips a split waits on in such a step (length, block table, K/V) then starts
while the kernels ahead still run. The reduce kernel issues a group of splits' loads at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.configs import DecodeAttentionConfig
from lorad.workers.kernels.launch_math import cdiv, next_power_of_2
from lorad.workers.kernels.pdl import (launch_options, let_dependents_launch, prefetch_l2,
                                       wait_for_previous_only)

L2_LINE_BYTES = 128


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, table, pos, pos_ok, kv_head, dims, dim_ok,
                 stride_k_block, stride_k_token, stride_k_head, stride_v_block, stride_v_token,
                 stride_v_head, BLOCK_SIZE: tl.constexpr):
    """-> (k, v) [TILE, BLOCK_D]: one KV head's keys and values at context positions pos, read
    through the sequence's block table (zeros where not pos_ok); shared with the prefill
    kernel."""
    block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0)
    return load_kv_blocks(k_cache_ptr, v_cache_ptr, block, pos, pos_ok, kv_head, dims, dim_ok,
                          stride_k_block, stride_k_token, stride_k_head, stride_v_block,
                          stride_v_token, stride_v_head, BLOCK_SIZE)


@triton.jit
def load_kv_blocks(k_cache_ptr, v_cache_ptr, block, pos, pos_ok, kv_head, dims, dim_ok,
                   stride_k_block, stride_k_token, stride_k_head, stride_v_block, stride_v_token,
                   stride_v_head, BLOCK_SIZE: tl.constexpr):
    """load_kv_tile with the positions' block ids given: block [TILE], pos's entries of the
    block table (any valid id where not pos_ok)."""
    block = block.to(tl.int64)
    offset = pos % BLOCK_SIZE
    kv_ok = pos_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_cache_ptr + block[:, None] * stride_k_block + offset[:, None] * stride_k_token
                + kv_head * stride_k_head + dims[None, :], mask=kv_ok, other=0.0)
    v = tl.load(v_cache_ptr + block[:, None] * stride_v_block + offset[:, None] * stride_v_token
                + kv_head * stride_v_head + dims[None, :], mask=kv_ok, other=0.0)
    return k, v


@triton.jit
def online_softmax_step(scores, v, row_max, row_sum, acc, DOT_PRECISION: tl.constexpr):
    """One tile of keys into the fp32 online softmax: -> (row_max, row_sum, acc) updated with
    scores [rows, TILE] (-inf where masked; each row's max must stay finite) and v [TILE, D]."""
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    correction = tl.exp(row_max - new_max)
    probs = tl.exp(scores - new_max[:, None])
    row_sum = row_sum * correction + tl.sum(probs, axis=1)
    acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
    return new_max, row_sum, acc


@triton.jit
def _attend_tile(q, k, v, pos_ok, scale, row_max, row_sum, acc, DOT_PRECISION: tl.constexpr):
    """One tile of a decode split: the query heads' scores against the tile's keys (masked where
    not pos_ok) into the online softmax. -> (row_max, row_sum, acc)."""
    # Scaled after the product, as transformers does. [BLOCK_H, TILE]
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    scores = tl.where(pos_ok[None, :], scores, float("-inf"))
    return online_softmax_step(scores, v, row_max, row_sum, acc, DOT_PRECISION)


@triton.jit(do_not_specialize=["stride_table", "table_width", "stride_part_seq",
                               "stride_part_head"])
def _decode_split_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, lens_ptr,
        part_acc_ptr, part_max_ptr, part_sum_ptr, scale,
        stride_q_seq, stride_q_head, stride_k_block, stride_k_token, stride_k_head,
        stride_v_block, stride_v_token, stride_v_head, stride_table, table_width,
        stride_part_seq, stride_part_head,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        SPLIT: tl.constexpr, TILE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        DOT_PRECISION: tl.constexpr, LINES: tl.constexpr, LINE_ELEMS: tl.constexpr,
        PREFETCH: tl.constexpr, PRELOAD: tl.constexpr, PDL: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    let_dependents_launch(PDL)
    context_len = tl.load(lens_ptr + seq)  # a step input: read before the wait
    table = tables_ptr + seq.to(tl.int64) * stride_table
    first = tl.program_id(2)  # this program's first split
    blocks = 0  # with PRELOAD, the block ids of the current split's first tile; else unused
    if PRELOAD:  # also a step input, and not masked by the length: the two loads run together
        blocks = _first_tile_blocks(table, first, table_width, SPLIT, TILE, BLOCK_SIZE)
    if PREFETCH:
        first_pos = first * SPLIT
        if first_pos < context_len - 1:
            _prefetch_split(k_cache_ptr, v_cache_ptr, table, first_pos, context_len - 1, kv_head,
                            stride_k_block, stride_k_token, stride_k_head, stride_v_block,
                            stride_v_token, stride_v_head, HEAD_DIM, BLOCK_SIZE, SPLIT, LINES,
                            LINE_ELEMS)
    wait_for_previous_only(PDL)
    # Program p takes splits p, p + num_programs(2), ... of this sequence's context (none for a
    # padding row); splits past it are never read by the reduce. A split's arithmetic is the
    # same whichever program takes it.
    for split in range(first, tl.cdiv(context_len, SPLIT), tl.num_programs(2)):
        if PRELOAD:
            if split != first:  # the first split's were read before the wait
                blocks = _first_tile_blocks(table, split, table_width, SPLIT, TILE, BLOCK_SIZE)
        _decode_split(q_ptr, k_cache_ptr, v_cache_ptr, table, part_acc_ptr, part_max_ptr,
                      part_sum_ptr, scale, seq, kv_head, split, context_len, blocks, stride_q_seq,
                      stride_q_head, stride_k_block, stride_k_token, stride_k_head,
                      stride_v_block, stride_v_token, stride_v_head, stride_part_seq,
                      stride_part_head, GROUP, HEAD_DIM, BLOCK_SIZE, SPLIT, TILE, BLOCK_H, BLOCK_D,
                      DOT_PRECISION, PRELOAD)


@triton.jit
def _first_tile_blocks(table, split, table_width, SPLIT: tl.constexpr, TILE: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr):
    """-> [TILE] the block table's entries for the positions of `split`'s first tile, read
    within the table's width only (entries past the context are valid ids, never used to read
    K or V), so that the load waits on nothing but the table's address."""
    entries = (split * SPLIT + tl.arange(0, TILE)) // BLOCK_SIZE
    return tl.load(table + entries, mask=entries < table_width, other=0)


@triton.jit
def _prefetch_split(k_cache_ptr, v_cache_ptr, table, first, end, kv_head, stride_k_block,
                    stride_k_token, stride_k_head, stride_v_block, stride_v_token, stride_v_head,
                    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
                    LINES: tl.constexpr, LINE_ELEMS: tl.constexpr):
    """Before the PDL wait: the L2 lines of one KV head's keys and values at positions [first,
    min(first + SPLIT, end)), through the block table (the step's input). end excludes the step's
    own token. Masked positions point at block 0, a real block, as prefetch_l2 asks."""
    lane = tl.arange(0, SPLIT * LINES)  # one lane per (position, line of its row)
    pos = first + lane // LINES
    line = tl.minimum((lane % LINES) * LINE_ELEMS, HEAD_DIM - 1)
    block = tl.load(table + pos // BLOCK_SIZE, mask=pos < end, other=0).to(tl.int64)
    offset = pos % BLOCK_SIZE
    prefetch_l2(k_cache_ptr + block * stride_k_block + offset * stride_k_token
                + kv_head * stride_k_head + line)
    prefetch_l2(v_cache_ptr + block * stride_v_block + offset * stride_v_token
                + kv_head * stride_v_head + line)


@triton.jit
def _decode_split(q_ptr, k_cache_ptr, v_cache_ptr, table, part_acc_ptr, part_max_ptr,
                  part_sum_ptr, scale, seq, kv_head, split, context_len, first_blocks,
                  stride_q_seq, stride_q_head, stride_k_block, stride_k_token, stride_k_head,
                  stride_v_block, stride_v_token, stride_v_head, stride_part_seq,
                  stride_part_head, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, TILE: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  FIRST_GIVEN: tl.constexpr):
    """One split into its partial results. FIRST_GIVEN: first_blocks holds the block ids of the
    split's first tile (_first_tile_blocks), which is then taken before the loop over the
    others, with the same arithmetic; otherwise first_blocks is unused."""
    split_start = split * SPLIT
    split_end = tl.minimum(split_start + SPLIT, context_len)
    heads = tl.arange(0, BLOCK_H)  # this KV head's query heads, padded up to a dot's 16 rows
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < GROUP
    dim_ok = dims < HEAD_DIM
    q_heads = kv_head * GROUP + heads
    q = tl.load(q_ptr + seq * stride_q_seq + q_heads[:, None] * stride_q_head + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]

    row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # A split's first tile always holds a real key, so the new max is finite from then on.
    loop_start = split_start
    if FIRST_GIVEN:
        pos = split_start + tl.arange(0, TILE)
        pos_ok = pos < split_end
        k, v = load_kv_blocks(k_cache_ptr, v_cache_ptr, first_blocks, pos, pos_ok, kv_head, dims,
                              dim_ok, stride_k_block, stride_k_token, stride_k_head,
                              stride_v_block, stride_v_token, stride_v_head, BLOCK_SIZE)
        row_max, row_sum, acc = _attend_tile(q, k, v, pos_ok, scale, row_max, row_sum, acc,
                                             DOT_PRECISION)
        loop_start = split_start + TILE
    for tile_start in range(loop_start, split_end, TILE):
        pos = tile_start + tl.arange(0, TILE)
        pos_ok = pos < split_end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table, pos, pos_ok, kv_head, dims, dim_ok,
                            stride_k_block, stride_k_token, stride_k_head, stride_v_block,
                            stride_v_token, stride_v_head, BLOCK_SIZE)
        row_max, row_sum, acc = _attend_tile(q, k, v, pos_ok, scale, row_max, row_sum, acc,
                                             DOT_PRECISION)

    part = seq.to(tl.int64) * stride_part_seq + q_heads * stride_part_head + split  # [BLOCK_H]
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
             mask=head_ok[:, None] & dim_ok[None, :])
    tl.store(part_max_ptr + part, row_max, mask=head_ok)
    tl.store(part_sum_ptr + part, row_sum, mask=head_ok)


@triton.jit(do_not_specialize=["stride_part_seq", "stride_part_head", "num_seqs"])
def _decode_reduce_kernel(
        part_acc_ptr, part_max_ptr, part_sum_ptr, lens_ptr, out_ptr,
        stride_part_seq, stride_part_head, stride_out_seq, num_seqs,
        HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, BLOCK_D: tl.constexpr,
        GROUP_SPLITS: tl.constexpr, PDL: tl.constexpr):
    seq = tl.program_id(0)  # an output row; rows from num_seqs on pad the batch
    head = tl.program_id(1)
    let_dependents_launch(PDL)
    # A step input: read before the wait.
    context_len = tl.load(lens_ptr + seq, mask=seq < num_seqs, other=0)
    wait_for_previous_only(PDL)
    num_splits = tl.cdiv(context_len, SPLIT)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    part = seq.to(tl.int64) * stride_part_seq + head * stride_part_head
    group = tl.arange(0, GROUP_SPLITS)
    top = tl.full([], float("-inf"), tl.float32)
    for first in range(0, num_splits, GROUP_SPLITS):
        maxes = tl.load(part_max_ptr + part + first + group, mask=first + group < num_splits,
                        other=float("-inf"))
        top = tl.maximum(top, tl.max(maxes, axis=0))  # a max: exact in any order
    # Merged one split after another in split order: the same additions whatever the batch. A
    # group's loads do not depend on the sums, so they are issued together, one round trip a
    # group instead of one a split. Steps past the last split read the last one again (no
    # scalar masks) and leave the sums alone.
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = tl.zeros([], tl.float32)
    for first in range(0, num_splits, GROUP_SPLITS):
        for j in tl.static_range(GROUP_SPLITS):
            split = tl.minimum(first + j, num_splits - 1)
            weight = tl.exp(tl.load(part_max_ptr + part + split) - top)
            row = tl.load(part_acc_ptr + (part + split) * HEAD_DIM + dims, mask=dim_ok, other=0.0)
            split_sum = tl.load(part_sum_ptr + part + split)
            live = first + j < num_splits
            acc = tl.where(live, acc + weight * row, acc)
            total = tl.where(live, total + weight * split_sum, total)
    # total >= 1 when there is any context (the top split's sum counts its max key once); with
    # none, acc is 0 and so is the row: a padding sequence or row reads nothing, writes zeros.
    out = acc / tl.maximum(total, 1e-30)
    tl.store(out_ptr + seq.to(tl.int64) * stride_out_seq + head * HEAD_DIM + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None,
                           config: DecodeAttentionConfig = DecodeAttentionConfig(),
                           preload: bool | None = None, pdl_rows: int = 0) -> torch.Tensor:
    """q: [num_seqs, q_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads,
    head_dim]; block_tables: [num_seqs, max_blocks] int32; context_lens: [num_seqs] int32
    -> out [num_seqs, q_heads * head_dim] in q's dtype (zero rows where context_len is 0). A
    given out may have more rows than there are sequences (a batch padded with rows): those are
    written with zeros, which saves a fill of the whole output first.

    The grid covers max_blocks * block_size tokens per sequence: shapes only, so a CUDA graph
    captured with a block table of max_blocks columns serves any context up to that length.
    Which program takes a split does not change its arithmetic (config.split_programs); neither
    do the split kernel's warps and pipeline depth (split_size and tile_tokens do), nor preload,
    whether each split's first block ids are read early (None: in steps of up to
    config.preload_max_seqs sequences). pdl_rows: the step's PDL row limit (kernels/pdl.py; 0:
    no PDL)."""
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    assert num_q_heads == group * num_kv_heads and k_cache.shape == v_cache.shape
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.stride(2) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert block_tables.shape[0] == num_seqs == context_lens.shape[0]
    split_size = config.split_size
    tile_size = min(config.tile_tokens, split_size)
    preload = num_seqs <= config.preload_max_seqs if preload is None else preload
    assert split_size % tile_size == 0, "a split is whole tiles"
    if out is None:
        out = torch.empty(num_seqs, num_q_heads * head_dim, dtype=q.dtype, device=q.device)
    assert out.shape[0] >= num_seqs and out.shape[1] == num_q_heads * head_dim
    assert out.stride(1) == 1
    if num_seqs == 0:
        return out.zero_()
    max_splits = max(1, cdiv(block_tables.shape[1] * block_size, split_size))
    part_acc = torch.empty(num_seqs, num_q_heads, max_splits, head_dim, dtype=torch.float32,
                           device=q.device)
    part_max = torch.empty(num_seqs, num_q_heads, max_splits, dtype=torch.float32,
                           device=q.device)
    part_sum = torch.empty_like(part_max)
    block_d = next_power_of_2(head_dim)
    # fp32 stays fp32 (no tf32 rounding of q and k): it is compared with the CPU path.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    split_programs = config.split_programs
    pdl = launch_options(q.device, out.shape[0], pdl_rows)
    # The prefetch's lines of one cached K/V row: the row's bytes in L2 lines, a power of two.
    line_elems = max(1, L2_LINE_BYTES // k_cache.element_size())
    lines = next_power_of_2(cdiv(head_dim, line_elems))
    _decode_split_kernel[(num_seqs, num_kv_heads, min(max_splits, split_programs or max_splits))](
        q, k_cache, v_cache, block_tables, context_lens, part_acc, part_max, part_sum, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        block_tables.shape[1], part_max.stride(0), part_max.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, SPLIT=split_size,
        TILE=tile_size, BLOCK_H=max(16, next_power_of_2(group)),
        BLOCK_D=block_d, DOT_PRECISION=precision, LINES=lines, LINE_ELEMS=line_elems,
        PREFETCH=pdl["PDL"] and num_seqs <= config.prefetch_max_seqs, PRELOAD=preload,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl)
    _decode_reduce_kernel[(out.shape[0], num_q_heads)](
        part_acc, part_max, part_sum, context_lens, out,
        part_max.stride(0), part_max.stride(1), out.stride(0), num_seqs,
        HEAD_DIM=head_dim, SPLIT=split_size, BLOCK_D=block_d, GROUP_SPLITS=config.reduce_group,
        num_warps=1, **pdl)
    return out
