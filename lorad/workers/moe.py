"""The mixture-of-experts block with a shared expert (Qwen2-MoE), tensor-parallel: a replicated
top-k router, routed experts split along their intermediate dimension, a shared expert (a dense
MLP, LoRA slots on its projections) scaled by its sigmoid gate, and one all-reduce for it all.

Each row's arithmetic is its own (per-row products on the CPU, kernels/fused_moe.py's tiles on
the kernel path), so its bits never depend on which other rows share the step or an expert. The
router's softmax/top-k and the gate's sigmoid are kernels/moe_math.py's ops on both paths (on the
kernel path one route and one epilogue launch, kernels/moe_glue.py), so the paths agree on them.
On one rank the kernel path leaves the epilogue to the next residual add + norm (MoeSum).
Not here: LoRA on the router, the gate or routed experts (lorad.config.adapters refuses them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from lorad.config import ModelConfig
from lorad.workers.attention import AttentionContext
from lorad.config.partition import balanced_split
from lorad.workers.fused_linear import MergedColumnParallelLinear
from lorad.workers.kernel_path import kernel_path
from lorad.workers.kernels import moe_math
from lorad.workers.kernels.configs import GemvConfig, MoeConfig, fitting_itemsize
from lorad.workers.linear import RowParallelLinear, check_shape, load_replicated
from lorad.workers.lora_rows import LoraRows
from lorad.workers.parallel import TensorParallel
from lorad.workers.streams import fork, join, on_stream, side_stream
from lorad.workers.tuning import Tuning

if TYPE_CHECKING:  # imports triton, which the CPU path never loads
    from lorad.workers.attention_cuda import CudaAttentionContext


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [num_rows, in], weight: [out, in] -> x weight^T [num_rows, out], each row its own
    [1, in] x [in, out] product: a plain matmul gives a row other bits with the row count for a
    narrow output (the router's experts, the gate's 1; MKL), and an expert's rows vary by step."""
    w_t = weight.t().unsqueeze(0).expand(x.shape[0], -1, -1)  # [num_rows, in, out]
    return torch.bmm(x.unsqueeze(1), w_t).squeeze(1)


class ReplicatedLinear(nn.Module):
    """y = x W^T with W whole on every rank (the router, the shared expert's gate): no bias."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device, weight: torch.Tensor | None = None) -> None:
        """weight: the [out_features, in_features] tensor to hold the weight (a view of a larger
        one, which the loader then fills in place); None: its own."""
        super().__init__()
        if weight is None:
            weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
        assert weight.shape == (out_features, in_features)
        # [out_features, in_features], the same on every rank
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = load_replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_rows, in_features] -> [num_rows, out_features] in x's dtype."""
        if kernel_path(x.device):
            return gemv_rows(x, self.weight)
        return rowwise_linear(x, self.weight)


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, pdl_rows: int = 0) -> torch.Tensor:
    """x weight^T on the kernel path through the decode GEMV, block_m rows a launch: one tile
    shape and no split of K whatever the row count, so a row's bits are its own (cuBLAS picks
    kernels by shape). A launch per block_m rows: cheap at decode, slow for a long prefill.
    Blocks of 16 outputs: the router's 61 outputs (Qwen1.5-MoE) in 4 programs, not 2 (5.1
    against 6.1 us on an H100: docs/performance-log.md: router GEMV in blocks of 16).
    pdl_rows: the step's PDL row limit (kernels/pdl.py; 0: no PDL)."""
    from lorad.workers.kernels.decode_gemv import decode_matmul  # the CPU never imports triton
    config = fitting_itemsize(GemvConfig(block_n=16, block_k=256), weight.element_size())
    step = config.block_m
    parts = [decode_matmul(x[i:i + step], weight, config=config, pdl_rows=pdl_rows)
             for i in range(0, x.shape[0], step)]
    if len(parts) == 1:  # a decode step: no copy (cat of one tensor is a kernel)
        return parts[0]
    return torch.cat(parts) if parts else x.new_empty(0, weight.shape[0])


class TopKRouter(ReplicatedLinear):
    """Each row's top-k experts and their weights, as transformers' Qwen2MoeTopKRouter: softmax
    in fp32 over the experts, top k, optionally renormalised, rounded to the model dtype; in
    kernels/moe_math.py's arithmetic, which the kernel path repeats bit for bit."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 weight: torch.Tensor | None = None) -> None:
        super().__init__(config.hidden_size, config.num_experts, dtype, device, weight)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob

    def route(self, x: torch.Tensor, real_rows: torch.Tensor | None = None,
              logits: torch.Tensor | None = None, pdl_rows: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [num_rows, hidden] -> (weights [num_rows, top_k] in x's dtype, experts
        [num_rows, top_k] int64, each row's ascending; num_experts and 0 for the rows real_rows
        ([num_rows] bool, None: all) marks as padding). Every rank computes the same bits from
        the same x, on either path (moe_math.route). logits: self(x) when the caller has them
        (rows may be strided); None: computed here. pdl_rows: the kernel path's PDL row limit
        (kernels/pdl.py; 0: no PDL)."""
        if logits is None:
            logits = self(x)  # [num_rows, num_experts]
        if kernel_path(x.device):
            from lorad.workers.kernels.moe_glue import route  # the CPU never imports triton
            return route(logits, self.top_k, self.norm_topk_prob, real_rows, pdl_rows=pdl_rows)
        return moe_math.route(logits, self.top_k, self.norm_topk_prob, real_rows)


class RoutedExperts(nn.Module):
    """Every routed expert's gate/up rows and down columns in this rank's range of the expert
    intermediate size: like the dense MLP's split, so each rank's down output is a partial sum
    and the block all-reduces once (expert parallelism: docs/moe.md)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 inter_range: tuple[int, int], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.inter_start, self.inter_end = inter_range
        num_local = self.inter_end - self.inter_start
        # [num_experts, 2 * num_local, hidden]: each expert's gate rows, then its up rows
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * num_local, hidden, dtype=dtype,
                                                device=device), requires_grad=False)
        # [num_experts, hidden, num_local]
        self.down = nn.Parameter(torch.empty(num_experts, hidden, num_local, dtype=dtype,
                                             device=device), requires_grad=False)
        self.gate_up.weight_loader = self.down.weight_loader = self.weight_loader
        self.config = MoeConfig()  # the fused kernel's tiles (the block's tune())

    def checkpoint_parts(self, prefix: str) -> dict[str, tuple[nn.Parameter, tuple, tuple]]:
        """Checkpoint name -> (parameter, shard id (projection, expert), full shape), for every
        expert's gate_proj, up_proj and down_proj under `prefix` (the block's `experts`)."""
        parts = {}
        for e in range(self.num_experts):
            for proj, param, shape in (("gate", self.gate_up, (self.intermediate, self.hidden)),
                                       ("up", self.gate_up, (self.intermediate, self.hidden)),
                                       ("down", self.down, (self.hidden, self.intermediate))):
                parts[f"{prefix}.{e}.{proj}_proj.weight"] = (param, (proj, e), shape)
        return parts

    def shard_view(self, shard_id: tuple[str, int]) -> torch.Tensor:
        """This rank's slice of one expert's projection, as the loader fills it."""
        proj, e = shard_id
        num_local = self.inter_end - self.inter_start
        if proj == "down":
            return self.down.data[e]
        return self.gate_up.data[e, (0 if proj == "gate" else num_local):][:num_local]

    def weight_loader(self, param: nn.Parameter, name: str, tensor_slice,
                      shard_id: tuple[str, int]) -> None:
        proj, _ = shard_id
        if proj == "down":
            check_shape(name, tensor_slice.get_shape(), (self.hidden, self.intermediate))
            self.shard_view(shard_id).copy_(tensor_slice[:, self.inter_start:self.inter_end])
        else:
            check_shape(name, tensor_slice.get_shape(), (self.intermediate, self.hidden))
            self.shard_view(shard_id).copy_(tensor_slice[self.inter_start:self.inter_end])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                real_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x: [num_rows, hidden]; weights, experts: [num_rows, top_k] (the router's) ->
        [num_rows, hidden] float32: this rank's partial sum of every row's weighted experts.
        real_rows: [num_rows] bool, the rows that are not padding (None: all): a padding row
        reads no expert and gets zeros. On the kernel path the fused kernel
        (kernels/fused_moe.py), else the torch path."""
        if kernel_path(x.device):
            from lorad.workers.kernels.fused_moe import fused_moe  # the CPU never imports triton
            return fused_moe(x, self.gate_up, self.down, weights, experts, self.config,
                             real_rows=real_rows)
        return routed_experts_torch(x, self.gate_up, self.down, weights, experts, real_rows)

    def pairs(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              pdl_rows: int = 0) -> torch.Tensor:
        """The kernel path's products, not yet added: [num_rows, top_k, hidden] float32, a
        padding pair (expert num_experts) not written (kernels/fused_moe.py's expert_pairs);
        pdl_rows: the step's PDL row limit (0: no PDL)."""
        from lorad.workers.kernels.fused_moe import expert_pairs  # the CPU never imports triton
        return expert_pairs(x, self.gate_up, self.down, weights, experts, self.config,
                            pdl_rows=pdl_rows)


def routed_experts_torch(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                         weights: torch.Tensor, experts: torch.Tensor,
                         real_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path of RoutedExperts.forward, and the reference fused_moe is checked against:
    gate_up [num_experts, 2 * local, hidden], down [num_experts, hidden, local] -> [num_rows,
    hidden] float32, each row's experts added in ascending order, as transformers adds them;
    zeros for rows that real_rows ([num_rows] bool, None: all) marks as padding, and for pairs
    of expert num_experts (none: the router's for padding)."""
    num_local = gate_up.shape[1] // 2
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    if real_rows is not None:  # padding rows pick no expert (-1 matches none below)
        experts = torch.where(real_rows[:, None], experts, -1)
    for e in torch.unique(experts).tolist():  # sorted
        if not 0 <= e < gate_up.shape[0]:
            continue
        rows, slots = torch.nonzero(experts == e, as_tuple=True)  # each row at most once
        products = rowwise_linear(x[rows], gate_up[e])  # [num_expert_rows, 2 * local]
        # layers.silu_and_mul's torch path, spelt out: this is the reference on CUDA too.
        gate = products[:, :num_local].float()
        h = (gate / (1 + torch.exp(-gate))).to(x.dtype) * products[:, num_local:]
        w_down = down[e]
        if h.dtype != torch.float32:  # the partial sum unrounded, as RowParallelLinear's
            h, w_down = h.float(), w_down.float()
        out.index_add_(0, rows, rowwise_linear(h, w_down) * weights[rows, slots, None].float())
    return out


class SharedExpert(nn.Module):
    """The dense MLP every row goes through, split over ranks as the dense family's (LoRA slots
    on gate, up and down); its output is left unreduced for the block's one all-reduce."""

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        inter_range = balanced_split(intermediate, tp.world_size)[tp.rank]
        self.gate_up_proj = MergedColumnParallelLinear(hidden, intermediate, inter_range, dtype,
                                                       device)
        self.down_proj = RowParallelLinear(intermediate, hidden, inter_range, tp, dtype, device)
        self.down_proj.partial_only = True  # partial_sum below, never its forward

    def partial_sum(self, x: torch.Tensor, lora: LoraRows) -> torch.Tensor:
        """x: [num_rows, hidden] -> [num_rows, hidden] float32, this rank's share, deltas in."""
        return self.down_proj.partial_sum(self.gate_up_proj.swiglu(x, lora), lora)


@dataclass(frozen=True)
class MoeSum:
    """The block's output on the kernel path at one rank, not yet added up: routed + sigmoid(gate)
    * shared, left to the residual add + RMSNorm that reads it next, which does the epilogue in
    its own launch (MoeConfig.fold_epilogue)."""

    pairs: torch.Tensor  # [num_rows, top_k, hidden] float32 (RoutedExperts.pairs)
    gate: torch.Tensor  # [num_rows, 1] the model dtype, rows strided
    shared: torch.Tensor  # [num_rows, hidden] float32, the shared expert's sum
    real_rows: torch.Tensor | None
    pdl_rows: int

    def add_and_norm(self, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm.add_and_norm of the block's output: -> (hidden, normed)."""
        from lorad.workers.kernels.moe_glue import epilogue_add_norm  # the CPU never imports triton
        return epilogue_add_norm(self.pairs, self.gate, self.shared, self.real_rows, residual,
                                 weight, eps, self.pdl_rows)

    def tensor(self) -> torch.Tensor:
        """The block's output as the epilogue launch gives it: [num_rows, hidden] float32."""
        from lorad.workers.kernels.moe_glue import epilogue  # the CPU never imports triton
        return epilogue(self.pairs, self.gate, self.shared, self.real_rows,
                        pdl_rows=self.pdl_rows)


class SparseMoeBlock(nn.Module):
    """Qwen2-MoE's sparse block: routed experts + sigmoid(gate(x)) * shared expert(x)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, tuning: Tuning) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.tp = tp
        # The router's rows, then the shared expert gate's row, in one weight, which the two
        # modules' weights view: on the kernel path one GEMV launch gives both (each output's
        # sum is its own, so the bits are those of a launch each).
        router_gate = torch.empty(config.num_experts + 1, hidden, dtype=dtype, device=device)
        self.register_buffer("router_gate", router_gate, persistent=False)
        self.gate = TopKRouter(config, dtype, device, router_gate[:config.num_experts])
        self.experts = RoutedExperts(config.num_experts, hidden, inter,
                                     balanced_split(inter, tp.world_size)[tp.rank], dtype, device)
        self.shared_expert = SharedExpert(hidden, config.shared_expert_intermediate_size, tp,
                                          dtype, device)
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, dtype, device,
                                                   router_gate[config.num_experts:])
        self.tune(tuning)

    def tune(self, tuning: Tuning) -> None:
        """Hand each layer its part of the kernels' settings: the shared expert the dense
        MLP's decode GEMV tiles, the routed experts the fused kernel's."""
        dtype = self.shared_expert.gate_up_proj.weight.dtype
        self.shared_expert.gate_up_proj.gemv = tuning.gemv.config("gate_up", dtype)
        self.shared_expert.gate_up_proj.swiglu_epilogue = tuning.gemv.swiglu_epilogue
        self.shared_expert.down_proj.gemv = tuning.gemv.config("down", dtype)
        self.experts.config = tuning.moe

    def forward(self, x: torch.Tensor, lora: LoraRows,
                ctx: AttentionContext | CudaAttentionContext | None = None
                ) -> tuple[torch.Tensor | MoeSum, None]:
        """x: [num_rows, hidden] -> ([num_rows, hidden] float32 sum over ranks, before its
        rounding to the model dtype (the residual add does it), None: no delta left over); on
        the kernel path at one rank with MoeConfig.fold_epilogue, that sum as a MoeSum, which
        the residual add reads.
        ctx: the step's; its padding rows read no routed expert (a decode step of one sequence
        pads to MIN_ROWS rows, whose experts would otherwise be read too). None: every row is
        routed."""
        real_rows = None if ctx is None else ctx.real_rows
        # The gate scales the shared expert's sum over ranks; scaling each rank's share first
        # is the same sum, so one all-reduce carries both.
        if kernel_path(x.device):
            parts = self._kernel_path(x, lora, real_rows)
            if self.tp.world_size == 1 and self.experts.config.fold_epilogue:
                return parts, None
            return self.tp.all_reduce(parts.tensor()), None
        logits, gate = self.gate(x), self.shared_expert_gate(x)  # gate: [num_rows, 1]
        weights, experts = self.gate.route(x, real_rows, logits)
        shared = self.shared_expert.partial_sum(x, lora)
        routed = self.experts(x, weights, experts, real_rows)
        scale = moe_math.sigmoid(gate).float()  # [num_rows, 1]
        return self.tp.all_reduce(routed + scale * shared), None

    def _kernel_path(self, x: torch.Tensor, lora: LoraRows,
                     real_rows: torch.Tensor | None) -> MoeSum:
        """forward's unreduced sum on the kernel path, its epilogue (the routed sum, padding,
        gate and add) not yet launched: the router's logits and the gate in one GEMV launch."""
        config = self.experts.config
        pdl_rows = lora.pdl_rows if config.pdl else 0  # the block's own kernels
        # The routed side on a side stream when overlap_shared (None: in line). Its tensors are
        # made there and read here only after the join; a later allocation there that reuses
        # their memory is queued after a later fork, so after this epilogue. x, made before the
        # fork, lives past the join.
        side = side_stream(x.device, "moe") if config.overlap_shared else None
        early = side is not None and x.shape[0] <= config.router_on_side_rows
        if early:
            fork(side)
        with on_stream(side if early else None):
            both = gemv_rows(x, self.router_gate, pdl_rows)  # [num_rows, num_experts + 1]
        logits, gate = both[:, :-1], both[:, -1:]
        if not early:
            fork(side)
        with on_stream(side):
            weights, experts = self.gate.route(x, real_rows, logits, pdl_rows)
            pairs = self.experts.pairs(x, weights, experts, pdl_rows)
        shared = self.shared_expert.partial_sum(x, lora)
        join(side)
        return MoeSum(pairs, gate, shared, real_rows, pdl_rows)
