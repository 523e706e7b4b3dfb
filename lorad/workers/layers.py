"""The small layers that need no sharding: RMSNorm (with the residual add before it) and the
SwiGLU activation.

Both are row-wise, and both are written so a row's bits do not depend on its neighbours. On CUDA
with triton they run as fused kernels (kernels/fused_ops.py); the torch code here is the CPU path
and the reference those kernels are tested against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lorad.workers.kernel_path import kernel_path
from lorad.workers.linear import load_replicated

if TYPE_CHECKING:  # a kernel module: the CPU path never imports triton
    from lorad.workers.kernels.lora_common import LoraDelta
    from lorad.workers.parallel import TensorParallel


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

    def add_and_norm(self, delta: torch.Tensor, residual: torch.Tensor | None,
                     lora: LoraDelta | None = None,
                     pdl_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden, normed): the residual stream with a layer's output added in the model
        dtype (`residual + delta.to(dtype)`, or delta alone when residual is None), and its norm.
        delta: [num_rows, hidden_size], fp32 (a row-parallel sum) or the model dtype. On CUDA
        the residual is updated in place. lora (the kernel path only): delta's LoRA delta, added
        to it first. pdl_rows: the step's PDL row limit (kernel path). delta may also be an
        output left to this add (moe.MoeSum: a MoE block's at one rank), which adds itself."""
        if not isinstance(delta, torch.Tensor):
            assert lora is None and residual is not None
            return delta.add_and_norm(residual, self.weight, self.eps)
        if kernel_path(delta.device):
            from lorad.workers.kernels.fused_ops import add_rms_norm
            return add_rms_norm(delta, residual, self.weight, self.eps, lora, pdl_rows)
        assert lora is None, "LoRA deltas are left to the next kernel on the kernel path only"
        dtype = self.weight.dtype
        hidden = delta.to(dtype) if residual is None else residual + delta.to(dtype)
        return hidden, self(hidden)

    def reduce_add_and_norm(self, partial: torch.Tensor, residual: torch.Tensor | None,
                            tp: TensorParallel,
                            pdl_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """add_and_norm(tp.all_reduce(partial), residual): partial is a row-parallel layer's
        fp32 partial sum, its LoRA delta in it. One kernel that reads the peers' partials where
        the one-shot all-reduce takes the tensor (peer_reduce.py), the two steps otherwise."""
        oneshot = tp.oneshot
        if oneshot is not None and oneshot.applies(partial) and kernel_path(partial.device):
            return oneshot.all_reduce_add_norm(partial, residual, self.weight, self.eps)
        return self.add_and_norm(tp.all_reduce(partial), residual, pdl_rows=pdl_rows)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor,
                 loras: tuple[LoraDelta | None, LoraDelta | None] = (None, None),
                 pdl_rows: int = 0) -> torch.Tensor:
    """silu(gate) * up, with silu in fp32 as x / (1 + exp(-x)); loras (the kernel path only):
    gate's and up's LoRA deltas, added to them first. pdl_rows: the step's PDL row limit."""
    if kernel_path(gate.device):
        from lorad.workers.kernels.fused_ops import silu_and_mul as fused_silu_and_mul
        return fused_silu_and_mul(gate, up, loras, pdl_rows)
    assert all(lora is None for lora in loras), "LoRA deltas are left to kernels on the kernel path"
    # On the CPU, F.silu (fp32) takes a scalar path for a tensor's last few elements that gives
    # other bits than its vector path, so a row's result would depend on the batch's length.
    # exp, add and divide give the same bits on both paths (measured, torch 2.13).
    g = gate.float()
    return (g / (1 + torch.exp(-g))).to(gate.dtype) * up
