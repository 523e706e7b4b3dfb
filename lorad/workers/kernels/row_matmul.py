"""Row-invariant matmul: out = x w^T for any number of rows, each row's bits independent of how
many rows share the product (cuBLAS picks kernels, and splits of K, by shape).

A program owns one [BLOCK_M, BLOCK_N] tile of out and sweeps all of K in BLOCK_K steps, one
tl.dot a step accumulating in fp32, loads pipelined NUM_STAGES deep: no split of K, so every
output element is the same chain of fp32 multiply-adds over K in ascending order whatever the
row count, which reaches the kernel only as masks and the grid (not specialized: one compiled
variant for every batch). Tiles are visited GROUP_M row tiles at a time along N, so that a wave
of programs shares its tiles of w in L2. The decode GEMV (decode_gemv.py) is this kernel's
arithmetic with one row tile; whether tiles of other shapes (another MMA instruction on Hopper:
wgmma for 64 rows and more) give the same bits is what benchmarks/probe_row_matmul.py measures
before the model uses it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.configs import MatmulConfig
from lorad.workers.kernels.launch_math import cdiv

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["num_rows"])
def _row_matmul_kernel(x_ptr, w_ptr, stride_w, out_ptr, num_rows, N, K,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(num_rows, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M row tiles take each column tile in turn: program pid's (row tile, column tile).
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    in_rows = rows[:, None] < num_rows
    # Rows past the batch read row 0 and outputs past N read w's row N - 1: the loads stay
    # unmasked but for K, the store drops them.
    x_rows = tl.where(rows < num_rows, rows, 0).to(tl.int64)
    w_rows = tl.minimum(cols, N - 1).to(tl.int64)
    x_ptrs = x_ptr + x_rows[:, None] * K + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + w_rows[:, None] * stride_w + ks[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            xk = tl.load(x_ptrs)
            wk = tl.load(w_ptrs)
        else:
            in_k = (k0 + ks)[None, :] < K
            xk = tl.load(x_ptrs, mask=in_k, other=0.0)
            wk = tl.load(w_ptrs, mask=in_k, other=0.0)
        # "ieee" matters for fp32 operands only (no TF32); bf16/fp16 products are exact in fp32.
        acc = tl.dot(xk, tl.trans(wk), acc, input_precision="ieee")
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], out,
             mask=in_rows & (cols[None, :] < N))


def unsupported(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None) -> str:
    """Why row_matmul cannot take these inputs, or "" when it can."""
    if x.dim() != 2 or w.dim() != 2:
        return f"x and w must be 2-D, got x {tuple(x.shape)} and w {tuple(w.shape)}"
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        return f"x and w must share a dtype of {DTYPES}, got x {x.dtype} and w {w.dtype}"
    if out_dtype not in (None, x.dtype, torch.float32):
        return f"out_dtype must be x's dtype {x.dtype} or torch.float32, got {out_dtype}"
    if w.shape[1] != x.shape[1]:
        return f"x has {x.shape[1]} columns (K) but w {w.shape[1]}"
    if w.shape[1] > 1 and w.stride(1) != 1:
        return f"w's rows must be contiguous, got strides {w.stride()}"
    if x.device != w.device:
        return f"x is on {x.device} but w on {w.device}"
    return ""


def matmul_output(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None,
                  reason: str, caller: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What row_matmul and the decode GEMV do before their launch: refuse (ValueError naming
    the caller and the reason, when there is one), allocate out [M, N] of out_dtype (None: x's
    dtype). -> (out, x with packed rows), or (out, None) when no launch is needed (no rows or
    outputs; zeros for K = 0)."""
    if reason:
        raise ValueError(f"{caller}: {reason}")
    num_rows, num_in = x.shape
    out = torch.empty(num_rows, w.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    if num_rows == 0 or w.shape[0] == 0:
        return out, None
    if num_in == 0:
        return out.zero_(), None
    # The kernels step from row to row of x by K: packed rows (a no-op for the model's inputs).
    return out, x.contiguous()


def row_matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
               config: MatmulConfig = MatmulConfig()) -> torch.Tensor:
    """-> [M, N] = x w^T, summed in fp32 over K in order and stored as out_dtype (None: x's
    dtype, one rounding; torch.float32: the unrounded sum). x: [M, K], any M; w: [N, K] of x's
    dtype with contiguous rows. Raises ValueError for inputs it does not take."""
    out, x = matmul_output(x, w, out_dtype, unsupported(x, w, out_dtype), "row_matmul")
    if x is None:
        return out
    (num_rows, num_in), num_out = x.shape, w.shape[0]
    grid = (cdiv(num_rows, config.block_m) * cdiv(num_out, config.block_n),)
    _row_matmul_kernel[grid](
        x, w, w.stride(0), out, num_rows, num_out, num_in, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        EVEN_K=num_in % config.block_k == 0, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps)
    return out
