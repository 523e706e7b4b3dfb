"""The row-parallel linear layer (o, down) and the base product every projection uses.

The model decides which input columns a rank holds, so attention can split by whole KV-head
groups; the layer slices its checkpoint tensor to that range and all-reduces its output. It owns
its LoRA slots (lora.py), sharded the same way as its weight, and adds the per-row delta. The
column-parallel projections, fused q/k/v and gate/up, are fused_linear.py's; no bias here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lorad.workers import cpu_threads
from lorad.workers.kernel_path import kernel_path
from lorad.workers.lora import LoraSlots, PendingShrink, matmul_and_shrink, matmul_with_deltas
from lorad.workers.lora_rows import LoraRows
from lorad.workers.parallel import TensorParallel

if TYPE_CHECKING:  # a kernel module: the CPU path never imports triton
    from lorad.workers.kernels.configs import GemvConfig
    from lorad.workers.kernels.lora_common import LoraDelta

# The type of a layer's measured matmul plans: matmul_plan.MatmulPlan by the out_dtype its
# products ask for (None: the model dtype); None: not measured (the CPU path, tests), so cuBLAS
# beyond the decode GEMV.
Plans = dict | None


def plan_key(dtype: torch.dtype, out_dtype: torch.dtype | None) -> torch.dtype | None:
    """A layer's plans are keyed by out_dtype, None where it is the inputs' own dtype (an fp32
    model's fp32 partial sums are the model dtype's products)."""
    return None if out_dtype == dtype else out_dtype


def check_shape(name: str, got: list[int] | tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(got)}, expected {want}")


def _plan(x: torch.Tensor, out_dtype: torch.dtype | None, plans: Plans):
    """The layer's measured plan for these products (None: none measured)."""
    return None if plans is None else plans.get(plan_key(x.dtype, out_dtype))


def _gemv_takes(x: torch.Tensor, weight: torch.Tensor, gemv: "GemvConfig | None",
                out_dtype: torch.dtype | None, plan) -> bool:
    """takes_gemv on the kernel path, with the plan already looked up."""
    if gemv is None or (plan is not None and not plan.gemv_agrees):
        return False
    from lorad.workers.kernels import decode_gemv  # lazily: the CPU never imports triton
    return decode_gemv.supports(x, weight, out_dtype, gemv)


def takes_gemv(x: torch.Tensor, weight: torch.Tensor, gemv: "GemvConfig | None",
               out_dtype: torch.dtype | None = None, plans: Plans = None) -> bool:
    """Whether base_matmul gives x weight^T by the decode GEMV (the same arguments): the kernel
    path, a GEMV tile (gemv), a measured plan that found the GEMV's bits (or none measured),
    and inputs the tile takes (at most its block_m rows)."""
    return kernel_path(x.device) and _gemv_takes(x, weight, gemv, out_dtype,
                                                 _plan(x, out_dtype, plans))


def base_matmul(x: torch.Tensor, weight: torch.Tensor, gemv: "GemvConfig | None",
                out_dtype: torch.dtype | None = None, pdl_rows: int = 0,
                plans: Plans = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x weight^T summed in fp32, rounded to x's dtype (out_dtype None) or left in fp32. On the
    kernel path every row gets the same arithmetic whatever the row count (matmul_plan.py): in a
    step of few rows (a decode step), for a projection with a decode GEMV tile (gemv:
    Tuning.gemv's, None for none), the GEMV, launched with PDL like the kernels around it
    (cuBLAS's are not; pdl_rows: the step's PDL row limit); else, where the layer's measured
    plan says cuBLAS would split K, row_matmul; cuBLAS otherwise. bias: [out] of the output's
    dtype, added to the rounded product (the GEMV's epilogue, else an add in place; None:
    none)."""
    out = None
    if kernel_path(x.device):
        plan = _plan(x, out_dtype, plans)
        if _gemv_takes(x, weight, gemv, out_dtype, plan):
            from lorad.workers.kernels.decode_gemv import decode_matmul
            return decode_matmul(x, weight, out_dtype, gemv, pdl_rows=pdl_rows, bias=bias)
        tile = None if plan is None else plan.tile(x.shape[0])
        if tile is not None:
            from lorad.workers.kernels.row_matmul import row_matmul
            out = row_matmul(x, weight, out_dtype, tile)
    if out is None and (out_dtype is None or out_dtype == x.dtype):
        out = cpu_threads.linear(x, weight)
    elif out is None:
        out = torch.mm(x, weight.t(), out_dtype=out_dtype)
    return out if bias is None else out.add_(bias)


def load_replicated(param: nn.Parameter, name: str, tensor_slice) -> None:
    """weight_loader of a parameter every rank holds whole (norm weights)."""
    check_shape(name, tensor_slice.get_shape(), tuple(param.shape))
    param.data.copy_(tensor_slice[:])


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W[:, in_start:in_end]^T: each rank a slice of the inputs."""

    def __init__(self, in_features: int, out_features: int, in_range: tuple[int, int],
                 tp: TensorParallel, dtype: torch.dtype, device: torch.device,
                 gemv: "GemvConfig | None" = None) -> None:
        """gemv: its decode GEMV tile (Tuning.gemv's; None: cuBLAS), for base_matmul."""
        super().__init__()
        self.gemv = gemv
        self.plans: Plans = None  # matmul_plan.plan_model_matmuls sets them on the kernel path
        # Its owner reads only partial_sum (a block that adds to it and reduces once, moe.py's
        # shared expert), never forward: the products' out_dtype is always fp32.
        self.partial_only = False
        self.in_features = in_features  # the full, unsplit size
        self.out_features = out_features
        self.in_start, self.in_end = in_range
        self.tp = tp
        num_local = self.in_end - self.in_start
        # [out_features, in_end - in_start]
        self.weight = nn.Parameter(torch.empty(out_features, num_local, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.lora: LoraSlots | None = None

    def weight_loader(self, param: nn.Parameter, name: str, tensor_slice) -> None:
        check_shape(name, tensor_slice.get_shape(), (self.out_features, self.in_features))
        param.data.copy_(tensor_slice[:, self.in_start:self.in_end])

    def add_lora_slots(self, num_slots: int, max_rank: int,
                       dtype: torch.dtype = torch.float32) -> LoraSlots:
        # A split by columns like the weight, B whole: each rank's x_r A_r^T is a partial sum of
        # the shrink, and since the delta is linear in it, scale * (x_r A_r^T) B^T summed over
        # ranks is the full delta. It rides on the all-reduce the layer does anyway.
        self.lora = LoraSlots(num_slots, max_rank, self.in_features, self.out_features,
                              (self.in_start, self.in_end), (0, self.out_features),
                              self.weight.device, dtype)
        return self.lora

    def forward(self, x: torch.Tensor, lora_rows: LoraRows | None = None) -> torch.Tensor:
        """x: [num_rows, in_end - in_start] -> [num_rows, out_features]: the sum over ranks, not
        yet rounded to the model dtype (the model's residual add rounds it): fp32, except on
        CUDA at world size 1, where there is nothing to add across ranks and cuBLAS rounds its
        fp32 sum itself (its fp32-output kernels split K and add the parts in another kernel);
        the LoRA delta is then added as peft adds it, to the rounded base output, with one more
        rounding."""
        if not self._rounds_here(x):
            # The delta in fp32, before the reduce.
            return self.tp.all_reduce(self.partial_sum(x, lora_rows))
        pdl_rows = 0 if lora_rows is None else lora_rows.pdl_rows
        # [num_rows, out_features], the model dtype
        matmul = lambda: base_matmul(x, self.weight, self.gemv, pdl_rows=pdl_rows,  # noqa: E731
                                     plans=self.plans)
        # On the kernel path the shrink runs beside the matmul (a side stream); None otherwise.
        out, pending = matmul_and_shrink([self.lora], x, lora_rows, matmul)
        return self._plus_delta(out, x, lora_rows, pending)

    def partial_sum(self, x: torch.Tensor, lora_rows: LoraRows | None = None) -> torch.Tensor:
        """x: [num_rows, in_end - in_start] -> [num_rows, out_features] float32: this rank's
        x_r W_r^T plus its share of the LoRA delta, not reduced: forward() before its
        all-reduce, for a block that adds more to it and reduces once (moe.py)."""
        pdl_rows = 0 if lora_rows is None else lora_rows.pdl_rows
        out, pending = matmul_and_shrink([self.lora], x, lora_rows,
                                         lambda: self._partial_fp32(x, pdl_rows))
        return self._plus_delta(out, x, lora_rows, pending)

    def forward_with_delta(self, x: torch.Tensor, lora_rows: LoraRows | None
                           ) -> tuple[torch.Tensor, LoraDelta | None]:
        """forward(), but where the output is rounded to the model dtype here (CUDA, world size
        1) and the LoRA kernels run, with the delta left to the next kernel: (the base output,
        its LoraDelta or None, None in a step that adds its deltas in place). Otherwise
        (forward(x, lora_rows), None)."""
        kernels = lora_rows is not None and lora_rows.tiles is not None
        if not (kernels and self.lora is not None and self._rounds_here(x)):
            return self.forward(x, lora_rows), None
        out, deltas = matmul_with_deltas(
            [self.lora], x, lora_rows,
            lambda: base_matmul(x, self.weight, self.gemv, pdl_rows=lora_rows.pdl_rows,
                                plans=self.plans))
        return out, deltas[0]

    def matmul_out_dtype(self) -> torch.dtype | None:
        """The out_dtype its base products ask for on CUDA (None: the model dtype): the
        rounded output at world size 1 in a low-precision model (forward), else fp32 partial
        sums."""
        rounds = self.tp.world_size == 1 and self.weight.dtype != torch.float32
        return None if rounds and not self.partial_only else torch.float32

    def _rounds_here(self, x: torch.Tensor) -> bool:
        """Whether the output is cuBLAS's, in the model dtype (CUDA, world size 1, a
        low-precision x) rather than an fp32 partial sum for the all-reduce."""
        return x.is_cuda and self.tp.world_size == 1 and x.dtype != torch.float32

    def _plus_delta(self, out: torch.Tensor, x: torch.Tensor, lora_rows: LoraRows | None,
                    pending: PendingShrink | None) -> torch.Tensor:
        if pending is not None:
            return pending.expand_into([out])[0]
        return out if self.lora is None else self.lora.add_delta(out, x, lora_rows)

    def _partial_fp32(self, x: torch.Tensor, pdl_rows: int) -> torch.Tensor:
        # The partial sums are added across ranks; rounding each to bf16 first would make the
        # result depend on the world size more than it must.
        if x.is_cuda or x.dtype == torch.float32:
            # cuBLAS and the GEMV accumulate in fp32 and hand the fp32 sum back unrounded; an
            # fp32 model's go through the plans too (cuBLAS alone gave a row other bits with the
            # row count: the MoE shared expert's fp32 down_proj on an H100).
            return base_matmul(x, self.weight, self.gemv, torch.float32, pdl_rows, self.plans)
        # The CPU has no mm with an fp32 output for bf16 inputs (torch 2.13); the CPU path is for
        # tests and small models, so upcasting the shard each step is acceptable there.
        return F.linear(x.float(), self.weight.float())
