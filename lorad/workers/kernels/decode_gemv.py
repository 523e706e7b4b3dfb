"""Decode GEMV: out = x w^T for up to MAX_ROWS rows of x, streaming w once at close to copy
bandwidth, in fp32, rounded once to the model dtype or left in fp32 (a row-parallel partial sum),
optionally with each row's LoRA delta added in the epilogue (GemvLora: no expand launch).

A program owns BLOCK_N outputs (BLOCK_N rows of w) and sweeps all of K in BLOCK_K steps, loads
pipelined NUM_STAGES deep along K; the grid is cdiv(N, BLOCK_N) programs. Each step is one tl.dot
of a [BLOCK_M, BLOCK_K] tile of x (rows past the batch masked to 0) with a [BLOCK_K, BLOCK_N]
tile of w (tensor cores for bf16/fp16; exact fp32 products for fp32, no TF32). No split of K, so
no partial sums to reduce in a second kernel and no atomics. A row's bits never depend on the
batch: one tile shape and one compiled variant for every batch size (the row count is not
specialized; x and out are addressed with K and N, which a weight fixes), the same fp32 sum
order over K, and an MMA computes each output element from its own row of x alone. The LoRA
epilogue keeps that: each row gathers its own slot's rows of B and its own row of the shrink's
output, and adds its delta under a mask of its own rank.
Launched with PDL (kernels/pdl.py) in a decode step, as lorad's other kernels are: it lets the
kernel after it launch at its start, then waits for the one before it (letting it launch only
after the last store was slower: docs/performance-log.md: GEMV triggers late).
Deliberately not here: split-K (a narrow N, such as a tensor-parallel shard, gives few
programs; cuBLAS may win there), more than MAX_ROWS rows (prefill takes cuBLAS), bias, the LoRA
shrink (lora_shrink.py, launched beside this kernel).

The model (linear.py's base_matmul) uses it for the q/k/v and gate/up projections in steps of up
to 16 rows, each with its own tile (configs.GemvModelTiles); o and down keep cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.configs import GEMV_MAX_ROWS, GemvConfig
from lorad.workers.kernels.launch_math import cdiv, next_power_of_2
from lorad.workers.kernels.lora_common import MAX_TABLES
from lorad.workers.kernels.pdl import (launch_options, let_dependents_launch,
                                       wait_for_previous_only)

# The widest x tile: a decode step of up to 32 sequences in one tile.
MAX_ROWS = GEMV_MAX_ROWS
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class GemvLoraTable:
    """One projection's LoRA factors inside a fused weight: outputs [n_start, n_end) of w."""

    b: torch.Tensor  # [num_slots, n_end - n_start, max_rank] fp32, contiguous
    ranks: torch.Tensor  # [num_slots] int32; 0: the slot does not edit this projection
    scales: torch.Tensor  # [num_slots] fp32
    n_start: int
    n_end: int


@dataclass(frozen=True)
class GemvLora:
    """Each row's LoRA delta for decode_matmul to add in its epilogue, as lora_expand would."""

    t: torch.Tensor  # [num_tables, M, num_k_chunks, width] fp32: lora_shrink's output
    row_slots: torch.Tensor  # [M] int64: each row's adapter slot, 0 for none
    tables: tuple[GemvLoraTable, ...]  # 1 to MAX_TABLES, ascending; t[i] belongs to tables[i]


# The batch size must not pick another compiled variant (triton specializes ints equal to 1 or
# divisible by 16): one binary, so one order of sums, for every batch.
@triton.jit(do_not_specialize=["num_rows", "stride_t_table"])
def _decode_gemv_kernel(x_ptr, w_ptr, stride_w, out_ptr, num_rows, N, K,
                        t_ptr, stride_t_table, stride_t_row, stride_t_chunk, num_chunks,
                        row_slots_ptr, b0_ptr, b1_ptr, b2_ptr, ranks0_ptr, ranks1_ptr, ranks2_ptr,
                        scales0_ptr, scales1_ptr, scales2_ptr, n_start0, n_start1, n_start2,
                        n_end0, n_end1, n_end2, max_rank0, max_rank1, max_rank2,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                        NUM_TABLES: tl.constexpr, MAX_CHUNKS: tl.constexpr,
                        BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    n0 = tl.program_id(0) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    in_rows = rows[:, None] < num_rows  # [BLOCK_M, 1]
    # Outputs past N read row N - 1 again: w's loads stay unmasked, the store drops them.
    w_rows = tl.minimum(cols, N - 1).to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * K + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + w_rows[:, None] * stride_w + ks[None, :]  # [BLOCK_N, BLOCK_K]
    let_dependents_launch(PDL)
    # Table boundaries are multiples of BLOCK_N (or N): a program's outputs lie in one table or
    # in none, picked with scalar compares; tables never overlap. Each row's slot (a step
    # input), rank and scale (tables changed only between steps) are loaded before the PDL wait.
    if NUM_TABLES >= 1:
        slots = tl.load(row_slots_ptr + rows, mask=rows < num_rows, other=0)  # [BLOCK_M] int64
        ranks = tl.zeros([BLOCK_M], dtype=tl.int32)
        scales = tl.zeros([BLOCK_M], dtype=tl.float32)
        in0 = (n0 >= n_start0) & (n0 < n_end0)
        if in0:
            ranks, scales = _row_ranks(ranks0_ptr, scales0_ptr, slots)
    if NUM_TABLES >= 2:
        in1 = (n0 >= n_start1) & (n0 < n_end1)
        if in1:
            ranks, scales = _row_ranks(ranks1_ptr, scales1_ptr, slots)
    if NUM_TABLES >= 3:
        in2 = (n0 >= n_start2) & (n0 < n_end2)
        if in2:
            ranks, scales = _row_ranks(ranks2_ptr, scales2_ptr, slots)
    wait_for_previous_only(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        xk = _x_tile(x_ptrs, ks, k0, K, in_rows, EVEN_K)
        wk = _w_tile(w_ptrs, ks, k0, K, EVEN_K)
        # "ieee" matters for fp32 operands only (no TF32); bf16/fp16 products are exact in fp32.
        acc = tl.dot(xk, tl.trans(wk), acc, input_precision="ieee")
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = acc.to(out_ptr.dtype.element_ty)
    if NUM_TABLES >= 1:
        if in0:
            out = _lora_epilogue(acc, rows, cols, slots, ranks, scales, t_ptr, stride_t_row,
                                 stride_t_chunk, num_chunks, b0_ptr, n_start0, n_end0, max_rank0,
                                 out_ptr.dtype.element_ty, MAX_CHUNKS, BLOCK_R)
    if NUM_TABLES >= 2:
        if in1:
            out = _lora_epilogue(acc, rows, cols, slots, ranks, scales, t_ptr + stride_t_table,
                                 stride_t_row, stride_t_chunk, num_chunks, b1_ptr, n_start1,
                                 n_end1, max_rank1, out_ptr.dtype.element_ty, MAX_CHUNKS, BLOCK_R)
    if NUM_TABLES >= 3:
        if in2:
            out = _lora_epilogue(acc, rows, cols, slots, ranks, scales,
                                 t_ptr + 2 * stride_t_table, stride_t_row, stride_t_chunk,
                                 num_chunks, b2_ptr, n_start2, n_end2, max_rank2,
                                 out_ptr.dtype.element_ty, MAX_CHUNKS, BLOCK_R)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], out, mask=in_rows & (cols[None, :] < N))


@triton.jit
def _x_tile(x_ptrs, ks, k0, K, in_rows, EVEN_K: tl.constexpr):
    """-> x's [BLOCK_M, BLOCK_K] tile at columns k0 + ks (zeros past K and past the batch)."""
    if EVEN_K:
        return tl.load(x_ptrs, mask=in_rows, other=0.0)
    return tl.load(x_ptrs, mask=in_rows & ((k0 + ks)[None, :] < K), other=0.0)


@triton.jit
def _w_tile(w_ptrs, ks, k0, K, EVEN_K: tl.constexpr):
    """-> w's [BLOCK_N, BLOCK_K] tile at columns k0 + ks (zeros past K)."""
    if EVEN_K:
        return tl.load(w_ptrs)
    return tl.load(w_ptrs, mask=(k0 + ks)[None, :] < K, other=0.0)


@triton.jit
def _row_ranks(ranks_ptr, scales_ptr, slots):
    """-> each row's rank and scale in one table; rank 0 for slot 0 (rows past the batch have
    slot 0): such rows read no t and no B."""
    ranks = tl.load(ranks_ptr + slots, mask=slots != 0, other=0)
    return ranks, tl.load(scales_ptr + slots, mask=ranks > 0, other=0.0)


@triton.jit
def _lora_epilogue(acc, rows, cols, slots, ranks, scales, t_ptr, stride_t_row, stride_t_chunk,
                   num_chunks, b_ptr, n_start, n_end, max_rank,
                   OUT_TY: tl.constexpr, MAX_CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr):
    """-> acc rounded to OUT_TY, with scale * (sum_c t[row, c, :rank]) B[slot, cols, :rank]^T added
    in fp32 to the rounded value for each row its slot edits (rank > 0): lora_expand's one
    rounding of base + delta. Other rows get acc's bits as without LoRA."""
    edited = ranks > 0
    chunks = tl.arange(0, MAX_CHUNKS)
    t_rows = t_ptr + rows[:, None, None] * stride_t_row + chunks[None, :, None] * stride_t_chunk
    in_t = edited[:, None, None] & (chunks < num_chunks)[None, :, None]  # [BLOCK_M, MAX_CHUNKS, 1]
    # Each row's own slot's rows of B: one adapter on every row reads the same lines (L1/L2).
    b_rows = b_ptr + (slots[:, None] * (n_end - n_start) + (cols - n_start)[None, :]) * max_rank
    in_b = edited[:, None] & (cols < n_end)[None, :]  # [BLOCK_M, BLOCK_N]
    delta = tl.zeros_like(acc)
    for j0 in range(0, tl.max(ranks, axis=0), BLOCK_R):
        js = j0 + tl.arange(0, BLOCK_R)
        has_j = js[None, :] < ranks[:, None]  # [BLOCK_M, BLOCK_R]: each row's own rank
        parts = tl.load(t_rows + js[None, None, :], mask=in_t & has_j[:, None, :], other=0.0)
        tj = tl.sum(parts, axis=1)  # [BLOCK_M, BLOCK_R]: the K chunks' partial sums added
        bj = tl.load(b_rows[:, :, None] + js[None, None, :],
                     mask=in_b[:, :, None] & has_j[:, None, :], other=0.0)
        step = tl.sum(tj[:, None, :] * bj, axis=2)  # [BLOCK_M, BLOCK_N]
        # Steps past a row's rank leave it alone (not even + 0.0, which turns -0.0 into 0.0): the
        # loop's length follows the tile's largest rank, a row's bits only its own.
        delta = tl.where((j0 < ranks)[:, None], delta + step, delta)
    base = acc.to(OUT_TY)
    lora = (base.to(tl.float32) + delta * scales[:, None]).to(OUT_TY)
    return tl.where(edited[:, None], lora, base)


def unsupported(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
                config: GemvConfig = GemvConfig()) -> str:
    """Why decode_matmul cannot take these inputs with this tile, or "" when it can."""
    if x.dim() != 2 or w.dim() != 2:
        return f"x and w must be 2-D, got x {tuple(x.shape)} and w {tuple(w.shape)}"
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        return f"x and w must share a dtype of {DTYPES}, got x {x.dtype} and w {w.dtype}"
    if out_dtype not in (None, x.dtype, torch.float32):
        return f"out_dtype must be x's dtype {x.dtype} or torch.float32, got {out_dtype}"
    if x.shape[0] > config.block_m:
        return f"x has {x.shape[0]} rows, over the tile's block_m {config.block_m}"
    if w.shape[1] != x.shape[1]:
        return f"x has {x.shape[1]} columns (K) but w {w.shape[1]}"
    if w.shape[1] > 1 and w.stride(1) != 1:
        return f"w's rows must be contiguous, got strides {w.stride()}"
    if x.device != w.device:
        return f"x is on {x.device} but w on {w.device}"
    return ""


def supports(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
             config: GemvConfig = GemvConfig()) -> bool:
    """Whether decode_matmul takes these inputs with this tile (else the caller uses F.linear)."""
    return not unsupported(x, w, out_dtype, config)


def _check_lora(lora: GemvLora, num_rows: int, num_out: int, config: GemvConfig,
                device: torch.device) -> None:
    """Raises ValueError naming what about `lora` does not fit these rows, outputs and tile."""
    tables, t = lora.tables, lora.t
    if not 1 <= len(tables) <= MAX_TABLES:
        raise ValueError(f"GemvLora: 1 to {MAX_TABLES} tables, got {len(tables)}")
    if t.dim() != 4 or t.dtype != torch.float32 or t.shape[0] != len(tables) \
            or t.stride(3) != 1:
        raise ValueError(f"GemvLora: t must be [{len(tables)} tables, rows, chunks, width] fp32 "
                         f"with packed ranks, got {tuple(t.shape)} {t.dtype} strides {t.stride()}")
    if t.shape[1] != num_rows or lora.row_slots.shape != (num_rows,):
        raise ValueError(f"GemvLora: t {tuple(t.shape)} and row_slots "
                         f"{tuple(lora.row_slots.shape)} are of another batch than x's "
                         f"{num_rows} rows")
    if lora.row_slots.dtype != torch.int64:
        raise ValueError(f"GemvLora: row_slots must be int64, got {lora.row_slots.dtype}")
    previous_end = 0
    for i, table in enumerate(tables):
        where = f"GemvLora table {i} [{table.n_start}, {table.n_end})"
        if not previous_end <= table.n_start < table.n_end <= num_out:
            raise ValueError(f"{where}: not ascending and disjoint inside w's {num_out} outputs")
        previous_end = table.n_end
        # One program's outputs must belong to one table (or none).
        if table.n_start % config.block_n or (table.n_end % config.block_n
                                              and table.n_end != num_out):
            raise ValueError(f"{where}: a boundary is not a multiple of block_n "
                             f"{config.block_n} (nor w's last output)")
        b = table.b
        if (b.dim() != 3 or b.dtype != torch.float32 or not b.is_contiguous()
                or b.shape[1] != table.n_end - table.n_start or b.shape[2] > t.shape[3]):
            raise ValueError(f"{where}: b must be [slots, {table.n_end - table.n_start}, rank "
                             f"<= {t.shape[3]}] fp32 contiguous, got {tuple(b.shape)} {b.dtype}")
        if table.ranks.shape != (b.shape[0],) or table.ranks.dtype != torch.int32 \
                or table.scales.shape != (b.shape[0],) or table.scales.dtype != torch.float32:
            raise ValueError(f"{where}: ranks must be [{b.shape[0]}] int32 and scales "
                             f"[{b.shape[0]}] fp32")
    tensors = [t, lora.row_slots] + [x for tb in tables for x in (tb.b, tb.ranks, tb.scales)]
    if any(x.device != device for x in tensors):
        raise ValueError(f"GemvLora: every tensor must be on {device}")


def decode_matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
                  config: GemvConfig = GemvConfig(), lora: GemvLora | None = None,
                  pdl_rows: int = 0) -> torch.Tensor:
    """-> [M, N] = x w^T, summed in fp32 and stored as out_dtype (None: x's dtype, one rounding;
    torch.float32: the unrounded sum). Raises ValueError for inputs it does not take.

    x: [M, K] with M <= config.block_m, bf16, fp16 or fp32 (copied if its rows are not packed,
    which decode inputs are); w: [N, K] of x's dtype with contiguous rows (a slice of a larger
    matrix's rows or columns is fine). lora: each row's delta on the outputs its tables cover, as
    lora_expand adds it to this result (out rounded: rounded once more after the fp32 add).
    pdl_rows: the step's PDL row limit (kernels/pdl.py; 0: no PDL)."""
    reason = unsupported(x, w, out_dtype, config)
    if reason:
        raise ValueError(f"decode_matmul: {reason}")
    num_rows, num_in = x.shape
    num_out = w.shape[0]
    if lora is not None:
        _check_lora(lora, num_rows, num_out, config, x.device)
    out = torch.empty(num_rows, num_out, dtype=out_dtype or x.dtype, device=x.device)
    if num_rows == 0 or num_out == 0:
        return out
    if num_in == 0 and lora is None:
        return out.zero_()
    # The kernel steps from row to row of x by K: packed rows (a no-op for decode's inputs).
    x = x.contiguous()
    if lora is None:
        # Unused by the kernel (NUM_TABLES=0 compiles the epilogue out): any pointers will do.
        t, tables, lora_args = x, [], [x, 0, 0, 0, 0, x]
    else:
        t, tables = lora.t, list(lora.tables)
        lora_args = [t, t.stride(0), t.stride(1), t.stride(2), t.shape[2], lora.row_slots]
    padded = tables + [GemvLoraTable(t, t, t, 0, 0)] * (MAX_TABLES - len(tables))
    grid = (cdiv(num_out, config.block_n),)
    pdl = launch_options(x.device, num_rows, pdl_rows)
    _decode_gemv_kernel[grid](
        x, w, w.stride(0), out, num_rows, num_out, num_in, *lora_args,
        *(tb.b for tb in padded), *(tb.ranks for tb in padded), *(tb.scales for tb in padded),
        *(tb.n_start for tb in padded), *(tb.n_end for tb in padded),
        *(tb.b.shape[-1] for tb in padded), BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=num_in % config.block_k == 0,
        NUM_STAGES=config.num_stages, NUM_TABLES=len(tables),
        MAX_CHUNKS=next_power_of_2(t.shape[2]) if tables else 1,
        BLOCK_R=config.lora_block_r, num_warps=config.num_warps, **pdl)
    return out
