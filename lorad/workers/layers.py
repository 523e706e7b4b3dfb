"""The small layers that need no sharding: RMSNorm and the SwiGLU activation.

Both are row-wise, and both are written so a row's bits do not depend on its neighbours.
"""

from __future__ import annotations

import torch
from torch import nn

from lorad.workers.linear import load_replicated


class RMSNorm(nn.Module):
    """Normalise in fp32 and scale in the model dtype, in transformers' order of operations."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        # [hidden_size], the same on every rank
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = load_replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_rows, hidden_size]
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)  # [num_rows, 1]
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, with silu in fp32 as x / (1 + exp(-x))."""
    # On the CPU, F.silu (fp32) takes a scalar path for a tensor's last few elements that gives
    # other bits than its vector path, so a row's result would depend on the batch's length.
    # exp, add and divide give the same bits on both paths (measured, torch 2.13).
    g = gate.float()
    return (g / (1 + torch.exp(-g))).to(gate.dtype) * up
