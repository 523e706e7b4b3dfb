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

A SwiGLU variant (decode_swiglu) takes gate's and up's rows of one matrix and stores only
h = silu(gate) * up: a program owns the same BLOCK_N outputs of gate and of up and keeps two
fp32 accumulators, each the plain kernel's accumulator (the same tl.dot shapes, the same K
order), rounds each to the model dtype as the plain kernel stores it, then does
fused_ops._silu_mul_kernel's arithmetic on the two (silu in fp32, rounded; the product in
fp32, rounded). So h is decode_matmul followed by fused_ops.silu_and_mul bit for bit, in one
launch, with half the programs (each reads twice the weight bytes) and no gate/up in memory.
It takes no LoRA delta and no bias: a step whose adapters edit gate or up takes the two
launches (fused_linear.py's MergedColumnParallelLinear.swiglu decides).

The model (linear.py's base_matmul) uses it for the q/k/v and gate/up projections in steps of up
to 16 rows, each with its own tile (configs.GemvModelTiles); o and down keep cuBLAS. gate/up
takes the SwiGLU variant in those steps where no LoRA kernel runs for it
(GemvModelTiles.swiglu_epilogue).
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


# As _decode_gemv_kernel, with up's accumulator beside gate's and silu(gate) * up stored.
@triton.jit(do_not_specialize=["num_rows"])
def _decode_swiglu_kernel(x_ptr, w_ptr, stride_w, out_ptr, num_rows, N, K,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    n0 = tl.program_id(0) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    in_rows = rows[:, None] < num_rows  # [BLOCK_M, 1]
    # Outputs past N read gate's and up's row N - 1 again: the loads stay unmasked.
    gate_rows = tl.minimum(cols, N - 1).to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * K + ks[None, :]  # [BLOCK_M, BLOCK_K]
    gate_ptrs = w_ptr + gate_rows[:, None] * stride_w + ks[None, :]  # [BLOCK_N, BLOCK_K]
    up_ptrs = w_ptr + (gate_rows + N)[:, None] * stride_w + ks[None, :]  # up: w's rows N..2N
    let_dependents_launch(PDL)
    wait_for_previous_only(PDL)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        xk = _x_tile(x_ptrs, ks, k0, K, in_rows, EVEN_K)
        gate_k = _w_tile(gate_ptrs, ks, k0, K, EVEN_K)
        up_k = _w_tile(up_ptrs, ks, k0, K, EVEN_K)
        acc_gate = tl.dot(xk, tl.trans(gate_k), acc_gate, input_precision="ieee")
        acc_up = tl.dot(xk, tl.trans(up_k), acc_up, input_precision="ieee")
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    # gate and up as the plain kernel stores them, then _silu_mul_kernel's arithmetic on them.
    dtype = out_ptr.dtype.element_ty
    gate = acc_gate.to(dtype)
    up = acc_up.to(dtype)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype)
    h = (act.to(tl.float32) * up.to(tl.float32)).to(dtype)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], h, mask=in_rows & (cols[None, :] < N))


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


def decode_swiglu(x: torch.Tensor, w: torch.Tensor, config: GemvConfig = GemvConfig(),
                  pdl_rows: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """-> h [M, N] = silu(x w[:N]^T) * (x w[N:]^T) in x's dtype, in one launch: bit for bit
    decode_matmul(x, w, None, config) followed by fused_ops.silu_and_mul on its two halves.
    Raises ValueError for inputs it does not take.

    x: [M, K] with M <= config.block_m, as decode_matmul takes it; w: [2N, K] of x's dtype, gate's
    N rows then up's (a gate/up projection's fused weight), rows contiguous. pdl_rows: the
    step's PDL row limit (kernels/pdl.py; 0: no PDL). out: a contiguous [M, N] tensor of x's
    dtype to write h into (tests hand it poisoned); None: a new one."""
    num_out = w.shape[0] // 2 if w.dim() == 2 else 0
    reason = unsupported(x, w, None, config)
    if not reason and w.shape[0] % 2:
        reason = f"w has {w.shape[0]} rows, not gate's and up's halves"
    new, x = matmul_output(x, w[:num_out], None, reason, "decode_swiglu")
    if out is None:
        out = new
    elif out.shape != new.shape or out.dtype != new.dtype or not out.is_contiguous():
        raise ValueError(f"decode_swiglu: out of shape {tuple(out.shape)} and {out.dtype} for "
                         f"h of {tuple(new.shape)} and {new.dtype}, contiguous")
    if x is None:  # no rows or outputs; for K = 0 the zeros are silu(0) * 0
        return out.copy_(new)
    num_rows, num_in = x.shape
    _decode_swiglu_kernel[(cdiv(num_out, config.block_n),)](
        x, w, w.stride(0), out, num_rows, num_out, num_in,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=num_in % config.block_k == 0, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps, **launch_options(x.device, num_rows, pdl_rows))
    return out
