"""Decode GEMV: out = x w^T for up to MAX_ROWS rows of x, streaming w once at close to copy
bandwidth, in fp32, rounded once to the model dtype or left in fp32 (a row-parallel partial sum).

A program owns BLOCK_N outputs (BLOCK_N rows of w) and sweeps all of K in BLOCK_K steps, loads
pipelined NUM_STAGES deep along K; the grid is cdiv(N, BLOCK_N) programs. Each step is one tl.dot
of a [BLOCK_M, BLOCK_K] tile of x (rows past the batch masked to 0) with a [BLOCK_K, BLOCK_N]
tile of w (tensor cores for bf16/fp16; exact fp32 products for fp32, no TF32). No split of K, so
no partial sums to reduce in a second kernel and no atomics. A row's bits never depend on the
batch: one tile shape and one compiled variant for every batch size (the row count is not
specialized; x and out are addressed with K and N, which a weight fixes), the same fp32 sum
order over K, and an MMA computes each output element from its own row of x alone.
Launched with PDL (kernels/pdl.py) in a decode step, as lorad's other kernels are: it lets the
kernel after it launch at its start, then waits for the one before it (letting it launch only
after the last store was slower: docs/performance-log.md: GEMV trigger at its start).
Deliberately not here: split-K (a narrow N, such as a tensor-parallel shard, gives few
programs; cuBLAS may win there), more than MAX_ROWS rows (prefill takes cuBLAS), the LoRA
delta (the shrink and expand run beside this kernel; a delta added in this kernel's
epilogue was tried and left: docs/performance-log.md: GEMV LoRA epilogue). An optional bias
(Qwen2's q/k/v) is added in the epilogue to the rounded product, in fp32, and rounded again:
torch's `out.add_(bias)` bit for bit, without its launch.

The model (linear.py's base_matmul) uses it for the q/k/v and gate/up projections in steps of up
to 16 rows, each with its own tile (configs.GemvModelTiles); o and down keep cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.configs import GEMV_MAX_ROWS, GemvConfig
from lorad.workers.kernels.launch_math import cdiv
from lorad.workers.kernels.row_matmul import matmul_output
from lorad.workers.kernels.row_matmul import unsupported as matmul_unsupported
from lorad.workers.kernels.pdl import (launch_options, let_dependents_launch,
                                       wait_for_previous_only)

# The widest x tile: a decode step of up to 32 sequences in one tile.
MAX_ROWS = GEMV_MAX_ROWS


# The batch size must not pick another compiled variant (triton specializes ints equal to 1 or
# divisible by 16): one binary, so one order of sums, for every batch.
@triton.jit(do_not_specialize=["num_rows"])
def _decode_gemv_kernel(x_ptr, w_ptr, stride_w, out_ptr, bias_ptr, num_rows, N, K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr, HAS_BIAS: tl.constexpr,
                        PDL: tl.constexpr):
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
    if HAS_BIAS:  # rounded product + bias in fp32, rounded: torch's add_ of the two
        bias = tl.load(bias_ptr + w_rows).to(tl.float32)  # [BLOCK_N]; past N: never stored
        out = (out.to(tl.float32) + bias[None, :]).to(out_ptr.dtype.element_ty)
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


def unsupported(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
                config: GemvConfig = GemvConfig()) -> str:
    """Why decode_matmul cannot take these inputs with this tile, or "" when it can: what
    row_matmul refuses (the same arithmetic, any row count), or more rows than the tile's."""
    reason = matmul_unsupported(x, w, out_dtype)
    if reason or x.shape[0] <= config.block_m:
        return reason
    return f"x has {x.shape[0]} rows, over the tile's block_m {config.block_m}"


def supports(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
             config: GemvConfig = GemvConfig()) -> bool:
    """Whether decode_matmul takes these inputs with this tile (else the caller uses F.linear)."""
    return not unsupported(x, w, out_dtype, config)


def decode_matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
                  config: GemvConfig = GemvConfig(), pdl_rows: int = 0,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """-> [M, N] = x w^T, summed in fp32 and stored as out_dtype (None: x's dtype, one rounding;
    torch.float32: the unrounded sum). Raises ValueError for inputs it does not take.

    x: [M, K] with M <= config.block_m, bf16, fp16 or fp32 (copied if its rows are not packed,
    which decode inputs are); w: [N, K] of x's dtype with contiguous rows (a slice of a larger
    matrix's rows or columns is fine). pdl_rows: the step's PDL row limit (kernels/pdl.py; 0: no
    PDL). bias: [N] contiguous, of the output's dtype, added to the rounded product (None:
    none)."""
    out, x = matmul_output(x, w, out_dtype, unsupported(x, w, out_dtype, config),
                           "decode_matmul")
    if bias is not None and (bias.shape != (w.shape[0],) or bias.dtype != out.dtype
                             or not bias.is_contiguous()):
        raise ValueError(f"decode_matmul: bias of shape {tuple(bias.shape)} and {bias.dtype} "
                         f"for {w.shape[0]} outputs of {out.dtype}")
    if x is None:
        return out if bias is None else out.add_(bias)
    (num_rows, num_in), num_out = x.shape, w.shape[0]
    grid = (cdiv(num_out, config.block_n),)
    _decode_gemv_kernel[grid](
        x, w, w.stride(0), out, out if bias is None else bias, num_rows, num_out, num_in,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=num_in % config.block_k == 0, NUM_STAGES=config.num_stages,
        HAS_BIAS=bias is not None, num_warps=config.num_warps,
        **launch_options(x.device, num_rows, pdl_rows))
    return out
