"""Column- and row-parallel linear layers without bias: each owns its shard and its collective.

The model decides which output rows (column-parallel) or input columns (row-parallel) a rank
holds, so attention can split by whole KV-head groups; the layer slices its checkpoint tensor to
that range and, when row-parallel, all-reduces its output. Per-row LoRA deltas come later: they
hook in at the marked places (the batch's `row_adapter_slots` says which adapter each row uses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lorad.workers.parallel import TensorParallel


def check_shape(name: str, got: list[int] | tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(got)}, expected {want}")


def load_replicated(param: nn.Parameter, name: str, tensor_slice) -> None:
    """weight_loader of a parameter every rank holds whole (norm weights)."""
    check_shape(name, tensor_slice.get_shape(), tuple(param.shape))
    param.data.copy_(tensor_slice[:])


class ColumnParallelLinear(nn.Module):
    """y = x W^T for rows [out_start, out_end) of W: each rank a slice of the outputs."""

    def __init__(self, in_features: int, out_features: int, out_range: tuple[int, int],
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features  # the full, unsplit size
        self.out_start, self.out_end = out_range
        num_local = self.out_end - self.out_start
        # [out_end - out_start, in_features]
        self.weight = nn.Parameter(torch.empty(num_local, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, name: str, tensor_slice) -> None:
        check_shape(name, tensor_slice.get_shape(), (self.out_features, self.in_features))
        param.data.copy_(tensor_slice[self.out_start:self.out_end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_rows, in_features] -> [num_rows, out_end - out_start]
        # (LoRA: + scale * (x A^T) B[out_start:out_end]^T per row's slot.)
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W[:, in_start:in_end]^T: each rank a slice of the inputs."""

    def __init__(self, in_features: int, out_features: int, in_range: tuple[int, int],
                 tp: TensorParallel, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.in_features = in_features  # the full, unsplit size
        self.out_features = out_features
        self.in_start, self.in_end = in_range
        self.tp = tp
        num_local = self.in_end - self.in_start
        # [out_features, in_end - in_start]
        self.weight = nn.Parameter(torch.empty(out_features, num_local, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, name: str, tensor_slice) -> None:
        check_shape(name, tensor_slice.get_shape(), (self.out_features, self.in_features))
        param.data.copy_(tensor_slice[:, self.in_start:self.in_end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_rows, in_end - in_start] -> [num_rows, out_features], summed over ranks
        partial = self._partial_fp32(x)  # [num_rows, out_features] float32
        # (LoRA: the row-parallel delta is added here, in fp32, so it joins this all-reduce.)
        return self.tp.all_reduce(partial).to(x.dtype)

    def _partial_fp32(self, x: torch.Tensor) -> torch.Tensor:
        # The partial sums are added across ranks; rounding each to bf16 first would make the
        # result depend on the world size more than it must.
        if x.dtype == torch.float32:
            return F.linear(x, self.weight)
        if x.is_cuda:
            # cuBLAS accumulates in fp32 and can hand the fp32 result back without a rounding.
            return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        # The CPU has no mm with an fp32 output for bf16 inputs (torch 2.13); the CPU path is for
        # tests and small models, so upcasting the shard each step is acceptable there.
        return F.linear(x.float(), self.weight.float())
