"""Decode attention over paged KV: one query token per sequence, split-KV with a fixed split size.

Two kernels. The split kernel gives each (sequence, KV head, split of SPLIT_SIZE context tokens)
its own program: the KV head's query heads are one tile, so they share every K/V load, and an
fp32 online softmax runs over the split's keys read through the block table. The reduce kernel
merges a sequence's splits one after another, in split order. A split's bounds and the merge
order depend only on that sequence's context length, never on the batch or on the grid, so a
row's result has the same bits in any batch. No host sync and a grid fixed by shapes alone, so a
decode step can be captured in a CUDA graph. Prefill chunks are paged_prefill_attention.py's.

Launched with PDL (kernels/pdl.py), both kernels read the context lengths before their wait (a
step input), and in steps of PREFETCH_MAX_SEQS sequences or fewer the split kernel asks L2 for
the K/V lines of its first split below each sequence's last position: earlier steps cached
them, and only the last position is the step's own token, written by the kernel ahead. The
chain of round trips a split waits on in such a step (length, block table, K/V) then starts
while the kernels ahead still run. The reduce kernel issues a group of splits' loads at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.launch_math import cdiv, next_power_of_2
from lorad.workers.kernels.pdl import (launch_options, let_dependents_launch, prefetch_l2,
                                       wait_for_previous_only)

# Context tokens per split. Larger splits write fewer partial results (fp32 [head_dim] per query
# head and split); smaller ones give short batches more programs. Fixed: the split bounds are part
# of a row's arithmetic.
# 128: at batch 1 and 512 tokens, 4 splits per KV head keep 32 programs busy (256 gave 16, and
# the kernel was latency-bound: 8.8 us per layer on an H200).
SPLIT_SIZE = 128
TILE_TOKENS = 64  # keys per step inside a split
# Programs per (sequence, KV head) of the split kernel, each taking every SPLIT_PROGRAMS-th split
# of its context. A graph's grid is sized for the longest context its block table holds (8192
# tokens: 64 splits), so one program per split launches mostly programs with nothing to do: on an
# H200 at 512 tokens of context (scripts/bench_paged_attention.py --table-tokens 8192) batch 32
# took 33.5 us that way and 28.0 with 16, batch 64 61.0 and 48.1; batch 1 and 2 the same.
SPLIT_PROGRAMS = 16
SPLIT_WARPS = 4  # the split kernel's warps (scripts/bench_paged_attention.py --warps sweeps it)
# The split kernel's software pipeline depth over its tiles (--stages); it changes no bit. On an
# H200 (2026-12-01) 3 took the kernel alone from 9.8 to 8.3 us at batch 1 but from 48.1 to 52.3 at
# batch 64, and in the engine gained nothing at batch 1 and lost 0.08 ms at 32.
SPLIT_STAGES = 2
# Splits the reduce kernel loads at once (each group's partial results in one round of loads),
# merged one after another in split order as before.
REDUCE_GROUP = 8
L2_LINE_BYTES = 128
# The split kernel's L2 prefetch before its PDL wait, in steps of at most this many sequences:
# at most 2 x 8 KV heads x SPLIT_PROGRAMS = 256 programs, one wave at 3 an SM. The prefetch
# adds no arithmetic but costs registers (triton 3.6, sm_90, 8B shape: 157 a thread against
# 119, 3 programs an SM against 4), which only a step with few programs can spare. On an H200
# (scripts/bench_paged_attention.py --table-tokens 8192, 2026-12-01, us per split + reduce,
# this kernel against the one before the prefetch and the grouped reduce) with the prefetch
# variant up to 16 sequences: batch 1 6.9 against 9.8 at 512 tokens, 16.4 against 19.0 at
# 4,096; batch 8 10.5 against 11.6 at 512 but 53.4 against 49.9 at 4,096; batch 16 17.4
# against 15.1 at 512, 93.8 against 86.0 at 4,096. Without it from 32 on: the same as before.
PREFETCH_MAX_SEQS = 2
# The split kernel reads the block ids of each program's first split's first tile before its
# PDL wait (the block tables are a step input), not masked by the context length, so that the
# two loads run together: after the wait that split's first K/V loads wait on nothing else
# (instead of the block ids, then K/V), and a program that starts after the wait waits on (length
# and ids at once) -> K/V instead of length -> ids -> K/V. Every split then takes its first tile
# apart from the rest, so which program or batch computes a split still does not change its
# arithmetic (check_decode_preload_same_bits). In steps of at most this many sequences. On an
# H200 (2026-12-02 04:54 UTC, bench_paged_attention.py --table-tokens 8192 --preload 0,1, us
# per split + reduce from a graph, late against early): batch 1 7.8 against 6.9 at 512 tokens,
# 17.0 against 16.7 at 4,096; batch 8 11.5 against 11.4, 49.0 against 55.6; batch 32 26.7
# against 28.8, 156.6 against 183.2; batch 64 48.1 against 55.8, 304.6 against 356.7. In the
# engine (bench_engine.py --variant, on at every batch, the setting then PRELOAD_TABLE; graph
# replay ms) batch 1 4.758 and 4.760 against main's 4.776 to 4.801 (one adapter, 64
# distinct), batch 64 9.466 against 9.258 and 9.268 with 64 distinct adapters. With
# PRELOAD_MAX_SEQS at 1, against 0 (05:11 UTC, batch 1): 4.410 and 4.400 against 4.394 with 64
# adapters loaded and none used, 4.713 and 4.715 against 4.737 with one adapter, 4.715 and
# 4.703 against 4.725 with 64 distinct; batches 32 and 64 the same within 0.02.
PRELOAD_MAX_SEQS = 1


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
                           out: torch.Tensor | None = None, split_size: int | None = None,
                           tile_size: int | None = None,
                           split_programs: int | None = None,
                           num_warps: int | None = None,
                           num_stages: int | None = None,
                           preload: bool | None = None) -> torch.Tensor:
    """q: [num_seqs, q_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads,
    head_dim]; block_tables: [num_seqs, max_blocks] int32; context_lens: [num_seqs] int32
    -> out [num_seqs, q_heads * head_dim] in q's dtype (zero rows where context_len is 0). A
    given out may have more rows than there are sequences (a batch padded with rows): those are
    written with zeros, which saves a fill of the whole output first.

    The grid covers max_blocks * block_size tokens per sequence: shapes only, so a CUDA graph
    captured with a block table of max_blocks columns serves any context up to that length.
    split_programs: programs per (sequence, KV head), each looping over splits (default
    SPLIT_PROGRAMS; 0: one per split of the widest context the table holds). Which program takes
    a split does not change its arithmetic; neither do num_warps and num_stages, the split
    kernel's warps and pipeline depth (split_size and tile_size do), nor preload, whether each
    split's first block ids are read early. None: the module's SPLIT_SIZE, TILE_TOKENS,
    SPLIT_PROGRAMS, SPLIT_WARPS, SPLIT_STAGES, and preload in steps of up to PRELOAD_MAX_SEQS
    sequences, read at the call."""
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    assert num_q_heads == group * num_kv_heads and k_cache.shape == v_cache.shape
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.stride(2) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert block_tables.shape[0] == num_seqs == context_lens.shape[0]
    split_size = SPLIT_SIZE if split_size is None else split_size
    tile_size = min(TILE_TOKENS if tile_size is None else tile_size, split_size)
    num_warps = SPLIT_WARPS if num_warps is None else num_warps
    num_stages = SPLIT_STAGES if num_stages is None else num_stages
    preload = num_seqs <= PRELOAD_MAX_SEQS if preload is None else preload
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
    if split_programs is None:
        split_programs = SPLIT_PROGRAMS
    pdl = launch_options(q.device, out.shape[0])
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
        PREFETCH=pdl["PDL"] and num_seqs <= PREFETCH_MAX_SEQS, PRELOAD=preload,
        num_warps=num_warps,
        num_stages=num_stages, **pdl)
    _decode_reduce_kernel[(out.shape[0], num_q_heads)](
        part_acc, part_max, part_sum, context_lens, out,
        part_max.stride(0), part_max.stride(1), out.stride(0), num_seqs,
        HEAD_DIM=head_dim, SPLIT=split_size, BLOCK_D=block_d, GROUP_SPLITS=REDUCE_GROUP,
        num_warps=1, **pdl)
    return out
