"""The MoE block's glue on the kernel path, one launch each per layer: route (softmax, top-k,
renormalise, round, sort by expert, padding rows to no expert) and the epilogue (a row's experts
added, padding rows zeroed, the shared expert scaled by its sigmoid gate and added; on one rank,
where no all-reduce comes between, in the next residual add + RMSNorm's launch instead:
epilogue_add_norm). They replace ~60 tiny torch kernels a layer that cost more than the experts'
products at decode.

Bits: kernels/moe_math.py's torch ops, op for op (its exp, its pairwise sum, IEEE division,
no fused multiply-add), so they equal the CPU path's. Row invariance: a program per row (route)
or per row and column block (epilogue), no argument holds the row count. Not here: the experts'
products and their tiles (fused_moe.py), the router's and the gate's GEMV (decode_gemv.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorad.workers.kernels import moe_math
from lorad.workers.kernels.fused_ops import _add_and_norm_row, _norm_warps
from lorad.workers.kernels.launch_math import cdiv, next_power_of_2
from lorad.workers.kernels.pdl import (launch_options, let_dependents_launch, wait_for_previous,
                                       wait_for_previous_only)

EXP_MIN = tl.constexpr(moe_math.EXP_MIN)
EXP_MAX = tl.constexpr(moe_math.EXP_MAX)
LOG2E = tl.constexpr(moe_math.LOG2E)
LN2_HI = tl.constexpr(moe_math.LN2_HI)
LN2_LO = tl.constexpr(moe_math.LN2_LO)
P0, P1, P2, P3, P4, P5 = (tl.constexpr(c) for c in moe_math.EXP_POLY)
EPILOGUE_BLOCK = 512


@triton.jit
def exp_fp32(x):
    """moe_math.exp_fp32, op for op."""
    clamped = tl.minimum(tl.maximum(x, EXP_MIN), EXP_MAX)
    n = tl.floor(clamped * LOG2E + 0.5)
    r = clamped - n * LN2_HI
    r = r - n * LN2_LO
    p = P0 * r
    p = (p + P1) * r
    p = (p + P2) * r
    p = (p + P3) * r
    p = (p + P4) * r
    p = p + P5
    y = (p * (r * r) + r) + 1.0
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(x < EXP_MIN, 0.0, y * scale)


@triton.jit
def _pairwise_sum(x, WIDTH: tl.constexpr, LOG_WIDTH: tl.constexpr):
    """moe_math.pairwise_row_sum of x: [WIDTH] (zeros past the row): a reduction over two
    elements is one add, so the tree is the torch path's, whatever the layout."""
    for level in tl.static_range(LOG_WIDTH):
        x = tl.sum(tl.reshape(x, [2, WIDTH >> (level + 1)]), axis=0)
    return tl.sum(x, axis=0)


@triton.jit
def _route_kernel(logits_ptr, stride_logits, real_rows_ptr, weights_ptr, experts_ptr,
                  num_experts, TOP_K: tl.constexpr, NORM: tl.constexpr,
                  HAS_PADDING: tl.constexpr, BLOCK_E: tl.constexpr, LOG_E: tl.constexpr,
                  PDL: tl.constexpr):
    """One row: its top TOP_K of num_experts logits as moe_math.route picks, weighs and orders
    them, stored in ascending expert order (each picked expert's slot is its rank)."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_E)
    in_e = lanes < num_experts
    x = tl.load(logits_ptr + row * stride_logits + lanes, mask=in_e,
                other=float("-inf")).to(tl.float32)
    e = exp_fp32(x - tl.max(x, axis=0))  # 0 past the experts
    probs = tl.math.div_rn(e, _pairwise_sum(e, BLOCK_E, LOG_E))
    left = tl.where(in_e, probs, -1.0)  # below every probability: never picked
    chosen = lanes < 0
    total = 0.0  # 0 + the first pick is the pick: moe_math's sum from its first
    for _ in tl.static_range(TOP_K):
        top = tl.max(left, axis=0)
        pick = tl.min(tl.where(left == top, lanes, BLOCK_E), axis=0)  # ties: lowest expert
        chosen = chosen | (lanes == pick)
        left = tl.where(lanes == pick, -1.0, left)
        total = total + top
    if NORM:
        probs = tl.math.div_rn(probs, total)
    weights = probs.to(weights_ptr.dtype.element_ty)
    experts = lanes.to(tl.int64)
    if HAS_PADDING:
        real = tl.load(real_rows_ptr + row) != 0
        weights = tl.where(real, weights, 0.0)
        experts = tl.where(real, experts, num_experts)
    slot = row * TOP_K + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(weights_ptr + slot, weights, mask=chosen)
    tl.store(experts_ptr + slot, experts, mask=chosen)


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
          real_rows: torch.Tensor | None = None,
          out: tuple[torch.Tensor, torch.Tensor] | None = None, pdl_rows: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_math.route on the kernel path, one launch: logits [num_rows, num_experts] (rows may
    be strided) -> (weights [num_rows, top_k] of logits' dtype, experts [num_rows, top_k] int64,
    each row's ascending; num_experts and weight 0 for rows real_rows ([num_rows] bool) marks
    as padding). out: (weights, experts) to write into (tests poison them); None: allocated.
    pdl_rows: the step's PDL row limit (kernels/pdl.py; 0: no PDL)."""
    num_rows, num_experts = logits.shape
    assert logits.stride(1) == 1 and 0 < top_k <= num_experts
    weights, experts = out or (
        torch.empty(num_rows, top_k, dtype=logits.dtype, device=logits.device),
        torch.empty(num_rows, top_k, dtype=torch.int64, device=logits.device))
    if num_rows == 0:
        return weights, experts
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(num_rows,)](
        logits, logits.stride(0), logits if real_rows is None else real_rows, weights, experts,
        num_experts, TOP_K=top_k, NORM=norm_topk_prob, HAS_PADDING=real_rows is not None,
        BLOCK_E=block_e, LOG_E=block_e.bit_length() - 1, num_warps=1,
        enable_fp_fusion=False,  # a fused multiply-add skips a rounding the torch path does
        **launch_options(logits.device, num_rows, pdl_rows))
    return weights, experts


@triton.jit
def _sigmoid(g, DTYPE: tl.constexpr):
    """moe_math.sigmoid of g (fp32, a DTYPE value), each op rounded to DTYPE -> fp32."""
    e = exp_fp32(-g).to(DTYPE).to(tl.float32)
    t = (1.0 + e).to(DTYPE).to(tl.float32)
    return tl.math.div_rn(1.0, t).to(DTYPE).to(tl.float32)


@triton.jit
def _moe_row(pairs_ptr, real_rows_ptr, gate_ptr, stride_gate, shared_ptr, row, cols, mask, H,
             TOP_K: tl.constexpr, HAS_PADDING: tl.constexpr):
    """-> the block's output at `cols` of one row, fp32: its TOP_K pairs added in order (or 0
    for a padding row) + sigmoid(gate) * shared."""
    read = mask
    if HAS_PADDING:  # a padding row's pairs were never written: it adds zeros, as torch's where
        read = cols < tl.where(tl.load(real_rows_ptr + row) != 0, H, 0)
    routed = tl.load(pairs_ptr + row * TOP_K * H + cols, mask=read, other=0.0)
    for j in tl.static_range(1, TOP_K):
        routed = routed + tl.load(pairs_ptr + (row * TOP_K + j) * H + cols, mask=read, other=0.0)
    gate = tl.load(gate_ptr + row * stride_gate)
    scale = _sigmoid(gate.to(tl.float32), gate_ptr.dtype.element_ty)
    shared = tl.load(shared_ptr + row * H + cols, mask=mask, other=0.0)
    return routed + scale * shared


@triton.jit
def _epilogue_kernel(pairs_ptr, real_rows_ptr, gate_ptr, stride_gate, shared_ptr, out_ptr, H,
                     TOP_K: tl.constexpr, HAS_PADDING: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    """out[row] = (its TOP_K pairs added in order, or 0 for padding) + sigmoid(gate) * shared."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    out = _moe_row(pairs_ptr, real_rows_ptr, gate_ptr, stride_gate, shared_ptr, row, cols, mask,
                   H, TOP_K, HAS_PADDING)
    tl.store(out_ptr + row * H + cols, out, mask=mask)


def epilogue(pairs: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor,
             real_rows: torch.Tensor | None = None,
             out: torch.Tensor | None = None, pdl_rows: int = 0) -> torch.Tensor:
    """-> [num_rows, H] float32: routed + moe_math.sigmoid(gate).float() * shared, routed each
    row's pairs added j = 0, 1, ... (zeros for rows real_rows ([num_rows] bool) marks as
    padding, whose pairs are not read as numbers). pairs: [num_rows, top_k, H] float32
    (fused_moe.expert_pairs'); gate: [num_rows, 1] of the model dtype (rows may be strided);
    shared: [num_rows, H] float32. out: to write into (tests poison it); None: allocated.
    pdl_rows: the step's PDL row limit (kernels/pdl.py; 0: no PDL)."""
    num_rows, top_k, hidden = pairs.shape
    pairs, shared = pairs.contiguous(), shared.contiguous()  # no copy for the block's
    out = out if out is not None else torch.empty_like(shared)
    if num_rows == 0:
        return out
    _epilogue_kernel[(num_rows, cdiv(hidden, EPILOGUE_BLOCK))](
        pairs, pairs if real_rows is None else real_rows, gate, gate.stride(0), shared, out,
        hidden, TOP_K=top_k, HAS_PADDING=real_rows is not None, BLOCK=EPILOGUE_BLOCK,
        num_warps=4, enable_fp_fusion=False,  # scale * shared rounds before the add
        **launch_options(shared.device, num_rows, pdl_rows))
    return out


@triton.jit
def _epilogue_add_norm_kernel(pairs_ptr, real_rows_ptr, gate_ptr, stride_gate, shared_ptr,
                              res_ptr, stride_res, normed_ptr, stride_normed, weight_ptr, H,
                              eps, TOP_K: tl.constexpr, HAS_PADDING: tl.constexpr,
                              BLOCK: tl.constexpr, PDL: tl.constexpr):
    """A row's block output (_moe_row), then fused_ops' residual add + RMSNorm of it
    (_add_and_norm_row): the residual updated in place, the normed row written."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dtype = res_ptr.dtype.element_ty
    let_dependents_launch(PDL)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # before the wait: a weight
    wait_for_previous_only(PDL)
    out = _moe_row(pairs_ptr, real_rows_ptr, gate_ptr, stride_gate, shared_ptr, row, cols, mask,
                   H, TOP_K, HAS_PADDING)
    _add_and_norm_row(out.to(dtype), res_ptr + row * stride_res, res_ptr + row * stride_res,
                      normed_ptr + row * stride_normed, w, cols, mask, H, eps, dtype, True)


def epilogue_add_norm(pairs: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor,
                      real_rows: torch.Tensor | None, residual: torch.Tensor,
                      weight: torch.Tensor, eps: float,
                      pdl_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_ops.add_rms_norm(epilogue(pairs, gate, shared, real_rows), residual, weight, eps)
    in one launch, for one rank (the block's output needs no all-reduce first): -> (hidden,
    normed), hidden being residual, updated in place. The same arithmetic; one program a row
    holds the whole row, as add_rms_norm's. No fused multiply-add here (the epilogue's rule),
    so RMSNorm's sum of squares may round otherwise than in add_rms_norm, whose compiler may
    fuse it: the residual has the two launches' bits, the normed row may not on CUDA
    (docs/performance-log.md: MoE epilogue in the next add + norm)."""
    num_rows, top_k, hidden = pairs.shape
    pairs, shared = pairs.contiguous(), shared.contiguous()  # no copy for the block's
    dtype = weight.dtype
    assert residual.shape == (num_rows, hidden) and residual.dtype == dtype
    assert residual.stride(1) == 1 and weight.shape == (hidden,)
    normed = torch.empty(num_rows, hidden, dtype=dtype, device=residual.device)
    if num_rows == 0:
        return residual, normed
    block = next_power_of_2(hidden)
    _epilogue_add_norm_kernel[(num_rows,)](
        pairs, pairs if real_rows is None else real_rows, gate, gate.stride(0), shared,
        residual, residual.stride(0), normed, normed.stride(0), weight, hidden, eps,
        TOP_K=top_k, HAS_PADDING=real_rows is not None, BLOCK=block,
        num_warps=_norm_warps(block), enable_fp_fusion=False,  # the epilogue's rule
        **launch_options(residual.device, num_rows, pdl_rows))
    return residual, normed
