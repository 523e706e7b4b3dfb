"""Column-parallel projections that share an input and are multiplied as one matrix: q/k/v
(QKVParallelLinear) and gate/up (MergedColumnParallelLinear).

The layer owns the fused weight (its parts' rows one after another), a weight_loader that copies
this rank's rows of one part's checkpoint tensor into that part (shard_id: "q", "k", "v" or
"gate", "up"), one LoraSlots per part (an adapter may edit only some of them), and the choice of
path: on the kernel path one matmul (the decode GEMV or cuBLAS) with one LoRA shrink and expand
beside it, the deltas left to the next kernel (LoraDelta); on the torch path one product per part,
each adding its own delta. An optional bias per part (Qwen2's q/k/v), added before any delta.
gate/up also gives the MLP's activation (swiglu): in a decode step with no LoRA kernel for it,
silu(gate) * up in the decode GEMV's epilogue, else its product then layers.silu_and_mul. Not
here: the split into heads, rotary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from lorad.workers import cpu_threads
from lorad.workers.kernel_path import kernel_path
from lorad.workers.layers import silu_and_mul
from lorad.workers.linear import Plans, base_matmul, check_shape, takes_gemv
from lorad.workers.lora import LoraSlots, add_lora_deltas, edited_this_step, matmul_with_deltas
from lorad.workers.lora_rows import LoraRows

if TYPE_CHECKING:  # kernel modules: the CPU path never imports triton
    from lorad.workers.kernels.configs import GemvConfig
    from lorad.workers.kernels.lora_common import LoraDelta


def projection_with_deltas(x: torch.Tensor, weight: torch.Tensor, sizes: Sequence[int],
                           loras: Sequence[LoraSlots | None], lora_rows: LoraRows,
                           gemv: "GemvConfig | None", plans: Plans = None,
                           bias: torch.Tensor | None = None
                           ) -> tuple[list[torch.Tensor], tuple[LoraDelta | None, ...]]:
    """The kernel path's product of projections whose weights are rows of one matrix (q/k/v,
    gate/up): x weight^T in one matmul (plus bias, in the weight's row order, into the rounded
    product), split into the projections' outputs (column slices of one tensor), and each one's
    LoraDelta or None for the kernel that reads them next to add. gemv, plans: their decode
    GEMV tile and matmul plans for base_matmul. One shrink and one expand for them all run
    beside the matmul (a side stream), or add into the outputs after it and its bias in a step
    that adds its deltas in place (matmul_with_deltas): either way base + bias, then the delta,
    as peft."""
    def matmul() -> torch.Tensor:  # the bias in the GEMV's epilogue where it runs
        return base_matmul(x, weight, gemv, pdl_rows=lora_rows.pdl_rows, plans=plans, bias=bias)

    out, deltas = matmul_with_deltas(loras, x, lora_rows, matmul, sizes)
    return list(out.split(sizes, dim=1)), deltas


class FusedColumnParallelLinear(nn.Module):
    """y_p = x W_p^T for each part p, rows [start_p, end_p) of W_p on this rank, from one
    matrix whose rows are the parts' local rows in order."""

    def __init__(self, in_features: int, parts: dict[str, tuple[int, tuple[int, int]]],
                 dtype: torch.dtype, device: torch.device, bias: bool = False) -> None:
        """parts: shard_id -> (its full output size, the output range this rank holds); bias:
        each part has one (its checkpoint's `<part>_proj.bias`)."""
        super().__init__()
        self.in_features = in_features
        self.parts = dict(parts)
        self.sizes = tuple(end - start for _, (start, end) in parts.values())  # local rows
        # [sum of local rows, in_features]: the parts' rows, in order
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), in_features, dtype=dtype,
                                               device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias: nn.Parameter | None = None
        if bias:  # [sum of local rows]: the parts' biases, in the weight's row order
            self.bias = nn.Parameter(torch.zeros(sum(self.sizes), dtype=dtype, device=device),
                                     requires_grad=False)
            self.bias.weight_loader = self.bias_loader
        # The parts some adapter edits, by shard_id: submodules, so the model's buffers (and
        # the engine's count of its bytes) include their tables.
        self.loras = nn.ModuleDict()
        self.gemv: GemvConfig | None = None  # the kernel path's decode GEMV tile (tune())
        self.plans: Plans = None  # matmul_plan.plan_model_matmuls sets them on the kernel path

    def part_weight(self, shard_id: str) -> torch.Tensor:
        """[end - start, in_features]: a view of this part's rows of the fused weight."""
        index = list(self.parts).index(shard_id)
        start = sum(self.sizes[:index])
        return self.weight.data[start:start + self.sizes[index]]

    def part_bias(self, shard_id: str) -> torch.Tensor:
        """[end - start]: a view of this part's entries of the fused bias."""
        index = list(self.parts).index(shard_id)
        start = sum(self.sizes[:index])
        return self.bias.data[start:start + self.sizes[index]]

    def bias_loader(self, param: nn.Parameter, name: str, tensor_slice, shard_id: str) -> None:
        """Copy this rank's entries of part `shard_id`'s bias `name` into its part."""
        full, (start, end) = self.parts[shard_id]
        check_shape(name, tensor_slice.get_shape(), (full,))
        self.part_bias(shard_id).copy_(tensor_slice[start:end])

    def weight_loader(self, param: nn.Parameter, name: str, tensor_slice, shard_id: str) -> None:
        """Copy this rank's rows of part `shard_id`'s checkpoint tensor `name` into its part."""
        full, (start, end) = self.parts[shard_id]
        check_shape(name, tensor_slice.get_shape(), (full, self.in_features))
        self.part_weight(shard_id).copy_(tensor_slice[start:end])

    def add_lora_slots(self, shard_id: str, num_slots: int, max_rank: int,
                       dtype: torch.dtype = torch.float32) -> LoraSlots:
        # A whole, B split by rows like the weight: a part's delta needs no communication.
        full, out_range = self.parts[shard_id]
        lora = LoraSlots(num_slots, max_rank, self.in_features, full, (0, self.in_features),
                         out_range, self.weight.device, dtype)
        self.loras[shard_id] = lora
        return lora

    def lora(self, shard_id: str) -> LoraSlots | None:
        """Part `shard_id`'s slot tables; None while no adapter edits it."""
        return self.loras[shard_id] if shard_id in self.loras else None

    def part(self, shard_id: str) -> "FusedPart":
        """Part `shard_id` as an adapter module sees it (LlamaForCausalLM.lora_target)."""
        if shard_id not in self.parts:
            raise KeyError(f"no part {shard_id!r} in {', '.join(self.parts)}")
        return FusedPart(self, shard_id)

    def forward(self, x: torch.Tensor, lora_rows: LoraRows
                ) -> tuple[list[torch.Tensor], tuple[LoraDelta | None, ...]]:
        """x: [num_rows, in_features] -> (each part's output [num_rows, end - start], each one's
        LoraDelta or None). On the kernel path the outputs are column slices of one product and
        their deltas are left to the kernel that reads them next; on the torch path they are
        added here (one rounding of base + delta each, as peft does) and the deltas are None."""
        loras = [self.lora(shard_id) for shard_id in self.parts]
        if kernel_path(x.device):
            # The bias into the rounded product, before any delta (peft's order), in place too.
            return projection_with_deltas(x, self.weight, self.sizes, loras, lora_rows,
                                          self.gemv, self.plans,
                                          None if self.bias is None else self.bias.data)
        # One product per part, as each part's weight alone would give (the CPU's bits); the
        # bias added after it, so a row's bits are the product's plus its own bias.
        outs = [cpu_threads.linear(x, self.part_weight(shard_id)) for shard_id in self.parts]
        if self.bias is not None:
            outs = [out + self.part_bias(shard_id) for out, shard_id in zip(outs, self.parts)]
        return add_lora_deltas(loras, outs, x, lora_rows), (None,) * len(outs)


class FusedPart:
    """One part of a fused projection: what an adapter module edits (its LoraSlots)."""

    def __init__(self, layer: FusedColumnParallelLinear, shard_id: str) -> None:
        self.layer, self.shard_id = layer, shard_id

    @property
    def lora(self) -> LoraSlots | None:
        return self.layer.lora(self.shard_id)

    def add_lora_slots(self, num_slots: int, max_rank: int,
                       dtype: torch.dtype = torch.float32) -> LoraSlots:
        return self.layer.add_lora_slots(self.shard_id, num_slots, max_rank, dtype)


class QKVParallelLinear(FusedColumnParallelLinear):
    """q, k and v of this rank's KV heads (and their query heads) as one matrix."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 kv_head_range: tuple[int, int], dtype: torch.dtype,
                 device: torch.device, bias: bool = False) -> None:
        group = num_heads // num_kv_heads
        kv_start, kv_end = kv_head_range
        q_range = (kv_start * group * head_dim, kv_end * group * head_dim)
        kv_range = (kv_start * head_dim, kv_end * head_dim)
        super().__init__(hidden, {"q": (num_heads * head_dim, q_range),
                                  "k": (num_kv_heads * head_dim, kv_range),
                                  "v": (num_kv_heads * head_dim, kv_range)}, dtype, device,
                         bias)


class MergedColumnParallelLinear(FusedColumnParallelLinear):
    """gate and up over this rank's range of the intermediate size, as one matrix."""

    def __init__(self, hidden: int, intermediate: int, inter_range: tuple[int, int],
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(hidden, {"gate": (intermediate, inter_range),
                                  "up": (intermediate, inter_range)}, dtype, device)
        # silu(gate) * up in the decode GEMV's epilogue where it may run (swiglu_in_gemv):
        # GemvModelTiles.swiglu_epilogue, set by the owner's tune().
        self.swiglu_epilogue = False

    def swiglu(self, x: torch.Tensor, lora_rows: LoraRows) -> torch.Tensor:
        """x: [num_rows, in_features] -> silu(gate) * up [num_rows, end - start], each part's
        LoRA delta added to it first, as peft: one launch where swiglu_in_gemv says so, else
        forward() then silu_and_mul (two launches on the kernel path). The same bits either
        way (decode_gemv.decode_swiglu), so a row's never depend on its step's other rows."""
        if self.swiglu_in_gemv(x, lora_rows):
            from lorad.workers.kernels.decode_gemv import decode_swiglu  # the CPU: no triton
            return decode_swiglu(x, self.weight, self.gemv, lora_rows.pdl_rows)
        (gate, up), deltas = self(x, lora_rows)
        return silu_and_mul(gate, up, deltas, lora_rows.pdl_rows)

    def swiglu_in_gemv(self, x: torch.Tensor, lora_rows: LoraRows) -> bool:
        """Whether swiglu takes the decode GEMV's SwiGLU variant for this step: switched on,
        the product base_matmul would give by the GEMV (kernel path, a tile, the plan, few
        rows), no LoRA kernel for gate or up this step (edited_this_step: no row's adapter
        edits them, nor does a graph launch them always) and no bias."""
        loras = [self.lora(shard_id) for shard_id in self.parts]
        return (self.swiglu_epilogue and self.bias is None
                and takes_gemv(x, self.weight, self.gemv, None, self.plans)
                and not edited_this_step(loras, lora_rows))
