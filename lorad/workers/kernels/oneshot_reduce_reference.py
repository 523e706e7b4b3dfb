"""The plain-torch math of kernels/oneshot_reduce.py: the rank-ordered fp32 sum, and the residual
add + RMSNorm after it as lorad.workers.layers does them. What the checks compare the kernels
with; no peer memory, no barrier.
"""

from __future__ import annotations

import torch


def rank_ordered_sum(partials: list[torch.Tensor]) -> torch.Tensor:
    """((p0 + p1) + p2) + ... in fp32: the order TensorParallel's gathered sum uses."""
    total = partials[0].float().clone()
    for part in partials[1:]:
        total += part.float()
    return total


def add_rms_norm(total: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (hidden, normed) as RMSNorm.add_and_norm's torch path: hidden = residual +
    total.to(dtype) (total alone without a residual), normed = weight * RMSNorm(hidden)."""
    dtype = weight.dtype
    hidden = total.to(dtype) if residual is None else residual + total.to(dtype)
    x = hidden.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return hidden, weight * x.to(dtype)
