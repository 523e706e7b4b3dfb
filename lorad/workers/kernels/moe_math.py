"""The MoE block's router and gate arithmetic (exp, softmax, top-k, renormalisation, sigmoid)
spelt in plain torch ops of one fixed order, which kernels/moe_glue.py repeats op for op: the
CPU path and the kernels give the same bits on any device.

Why not torch.softmax/torch.exp: their bits differ by device and CPU (Sleef vs CUDA's expf, vector
widths set the sum order), and a Triton kernel can repeat neither. Here exp is a Cephes-style
polynomial of IEEE adds and multiplies (no fused multiply-add: the kernels compile without it),
the softmax sums pairwise, ties go to the lowest expert. Triton-free, as configs.py: the CPU path
imports it. Not here: the kernels, the router's product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Every constant is exactly a float32 (tests/unit/test_moe_math.py), so torch, numpy and triton
# multiply by the same value. exp(x) = 2^n * p(r), x = n ln2 + r, ln2 split in two (Cephes).
EXP_MIN, EXP_MAX = -80.0, 80.0  # outside, 0 and exp(80): no denormal anywhere downstream
LOG2E = 1.4426950216293335
LN2_HI = 0.693359375  # 9 bits: n * LN2_HI is exact for |n| < 2^15
LN2_LO = -0.00021219444170128554
EXP_POLY = (0.00019875691214110702, 0.001398199936375022, 0.008333452045917511,
            0.04166579619050026, 0.1666666567325592, 0.5)


def exp_fp32(x: torch.Tensor) -> torch.Tensor:
    """exp of a float32 tensor within 2 ulp, 0 below EXP_MIN, exp(EXP_MAX) above it."""
    clamped = x.clamp(EXP_MIN, EXP_MAX)
    n = torch.floor(clamped * LOG2E + 0.5)
    r = clamped - n * LN2_HI
    r = r - n * LN2_LO
    p = EXP_POLY[0] * r
    for c in EXP_POLY[1:-1]:
        p = (p + c) * r
    p = p + EXP_POLY[-1]
    y = (p * (r * r) + r) + 1.0
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)  # 2^n, n in [-116, 116]
    return torch.where(x < EXP_MIN, 0.0, y * scale)


def pairwise_row_sum(x: torch.Tensor) -> torch.Tensor:
    """x: [num_rows, n] -> [num_rows, 1]: zeros pad n to a power of two, then halves are added
    (column i to column i + half) until one is left, the tree a Triton reshape-sum repeats."""
    width = 1 << max(0, (x.shape[1] - 1).bit_length())
    total = F.pad(x, (0, width - x.shape[1]))
    while total.shape[1] > 1:
        half = total.shape[1] // 2
        total = total[:, :half] + total[:, half:]
    return total


def softmax_fp32(logits: torch.Tensor) -> torch.Tensor:
    """logits: [num_rows, num_experts] -> float32 probabilities: exp(x - max) / their sum."""
    x = logits.float()
    e = exp_fp32(x - x.max(dim=-1, keepdim=True).values)
    return e / pairwise_row_sum(e)


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
          real_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [num_rows, num_experts] -> (weights [num_rows, top_k] in logits' dtype, experts
    [num_rows, top_k] int64): each row's top_k experts by probability (ties: the lowest expert
    first), renormalised (a sum in that order) when norm_topk_prob, then in ascending expert
    order. Rows that real_rows ([num_rows] bool, None: all) marks as padding get expert
    num_experts (none) and weight 0."""
    probs = softmax_fp32(logits)
    weights, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, experts = weights[:, :top_k], experts[:, :top_k]
    if norm_topk_prob:
        total = weights[:, 0]
        for j in range(1, top_k):
            total = total + weights[:, j]
        weights = weights / total[:, None]
    experts, order = torch.sort(experts, dim=-1)
    weights = weights.to(logits.dtype).gather(-1, order)
    if real_rows is None:
        return weights, experts
    return (torch.where(real_rows[:, None], weights, 0.0),
            torch.where(real_rows[:, None], experts, logits.shape[1]))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), each op rounded to x's dtype (as torch rounds its ops), exp_fp32's exp:
    torch.sigmoid's vector and scalar paths give an element other bits by its place (CPU)."""
    e = exp_fp32(-x.float()).to(x.dtype)
    return 1 / (1 + e)
