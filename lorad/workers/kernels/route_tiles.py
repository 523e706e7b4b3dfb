"""The MoE block's route and tile tables in one launch for small steps (decode): moe_glue.route's
weights and experts bit for bit, and fused_moe.expert_tiles' four tables entry for entry, from
one program over the step's [rows, experts] logits. Two launches cost 2.2 + 5.0 us a layer at
batch 1 on an H100, mostly launch latency (issue 34).

Row invariance: a row's softmax and top-k are reductions along its own row of the tile, in
moe_glue's ops (moe_math's exp, the same pairwise tree, div_rn, no fused multiply-add); the row
count is an unspecialized argument and the row block is fixed by MoeConfig.small_step_rows, so
one compiled variant serves every small step. Not here: larger steps (moe_glue.route, then
fused_moe's tables), the experts' products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.configs import MoeConfig
from lorad.workers.kernels.fused_moe import TILE_KERNEL_MAX_PAIRS, store_tile_tables
from lorad.workers.kernels.launch_math import cdiv
from lorad.workers.kernels.moe_glue import exp_fp32
from lorad.workers.kernels.pdl import launch_options, wait_for_previous


@triton.jit
def _pairwise_row_sums(x, ROWS: tl.constexpr, WIDTH: tl.constexpr, LOG_WIDTH: tl.constexpr):
    """moe_glue._pairwise_sum of each row of x: [ROWS, WIDTH] -> [ROWS]: a reduction over two
    elements is one add, so each row's tree is the 1D kernel's (and the torch path's)."""
    for level in tl.static_range(LOG_WIDTH):
        x = tl.sum(tl.reshape(x, [ROWS, 2, WIDTH >> (level + 1)]), axis=1)
    return tl.sum(x, axis=1)


@triton.jit
def _route_rows(x, lanes, in_e, TOP_K: tl.constexpr, NORM: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, LOG_E: tl.constexpr):
    """moe_glue._route_kernel's arithmetic along axis 1 of x: [BLOCK_R, BLOCK_E] fp32 logits
    (-inf past the experts) -> (probabilities, renormalised under NORM, [BLOCK_R, BLOCK_E] fp32;
    the picked lanes [BLOCK_R, BLOCK_E] bool, TOP_K a row)."""
    e = exp_fp32(x - tl.max(x, axis=1)[:, None])  # 0 past the experts
    probs = tl.math.div_rn(e, _pairwise_row_sums(e, BLOCK_R, BLOCK_E, LOG_E)[:, None])
    left = tl.where(in_e[None, :], probs, -1.0)  # below every probability: never picked
    chosen = tl.zeros([BLOCK_R, BLOCK_E], dtype=tl.int1)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)  # 0 + the first pick is the pick
    for _ in tl.static_range(TOP_K):
        top = tl.max(left, axis=1)
        # ties: the lowest expert
        pick = tl.min(tl.where(left == top[:, None], lanes[None, :], BLOCK_E), axis=1)
        picked = lanes[None, :] == pick[:, None]
        chosen = chosen | picked
        left = tl.where(picked, -1.0, left)
        total = total + top
    if NORM:
        probs = tl.math.div_rn(probs, total[:, None])
    return probs, chosen


@triton.jit
def _store_pair_order(pair_order_ptr, chosen, slot, rows, real, in_r, TOP_K: tl.constexpr):
    """expert_tiles' pair_order without a sort: a pair's place is its expert's first place plus
    the real rows above it of that expert (each row picks an expert once, so rows in order are
    pairs in order); the pairs of no expert (padding rows) follow, in pair order. Returns each
    expert's pair count [BLOCK_E] int32. chosen, slot: [BLOCK_R, BLOCK_E] (slot: the pick's
    place in its row); real, in_r: [BLOCK_R]."""
    routed = (chosen & real[:, None]).to(tl.int32)
    counts = tl.sum(routed, axis=0)
    above = tl.cumsum(routed, axis=0) - routed  # [BLOCK_R, BLOCK_E]
    place = (tl.cumsum(counts, axis=0) - counts)[None, :] + above
    padding = (in_r & ~real).to(tl.int32)
    padding_above = tl.cumsum(padding, axis=0) - padding  # [BLOCK_R]
    place_none = tl.sum(counts, axis=0) + padding_above[:, None] * TOP_K + slot
    place = tl.where(real[:, None], place, place_none)
    pair = rows[:, None] * TOP_K + slot
    tl.store(pair_order_ptr + place, pair.to(tl.int64), mask=chosen & in_r[:, None])
    return counts


# No argument holds the row count but num_rows, never specialized: one variant for every step.
@triton.jit(do_not_specialize=["num_rows"])
def _route_tiles_kernel(logits_ptr, stride_logits, real_rows_ptr, weights_ptr, experts_ptr,
                        pair_order_ptr, tile_expert_ptr, tile_start_ptr, tile_count_ptr,
                        num_rows, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                        NORM: tl.constexpr, HAS_PADDING: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_E: tl.constexpr, LOG_E: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """Up to BLOCK_R rows: moe_glue._route_kernel's weights and experts of each, then
    _expert_tiles_kernel's four tables of their pairs."""
    wait_for_previous(PDL)
    rows = tl.arange(0, BLOCK_R)
    lanes = tl.arange(0, BLOCK_E)
    in_r = rows < num_rows
    in_e = lanes < NUM_EXPERTS
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_logits + lanes[None, :],
                mask=in_r[:, None] & in_e[None, :], other=float("-inf")).to(tl.float32)
    x = tl.where(in_r[:, None], x, 0.0)  # rows past the step: finite, never stored
    probs, chosen = _route_rows(x, lanes, in_e, TOP_K, NORM, BLOCK_R, BLOCK_E, LOG_E)
    weights = probs.to(weights_ptr.dtype.element_ty)
    experts = tl.broadcast_to(lanes[None, :], [BLOCK_R, BLOCK_E]).to(tl.int64)
    real = in_r
    if HAS_PADDING:
        real = in_r & (tl.load(real_rows_ptr + rows, mask=in_r, other=0) != 0)
        weights = tl.where(real[:, None], weights, 0.0)
        experts = tl.where(real[:, None], experts, NUM_EXPERTS)
    slot = tl.cumsum(chosen.to(tl.int32), axis=1) - 1  # the pick's place in its row
    stored = chosen & in_r[:, None]
    flat = rows[:, None].to(tl.int64) * TOP_K + slot
    tl.store(weights_ptr + flat, weights, mask=stored)
    tl.store(experts_ptr + flat, experts, mask=stored)
    counts = _store_pair_order(pair_order_ptr, chosen, slot, rows, real, in_r, TOP_K)
    store_tile_tables(counts, tile_expert_ptr, tile_start_ptr, tile_count_ptr,
                      num_rows * TOP_K, NUM_EXPERTS, BLOCK_M, BLOCK_E, BLOCK_T)


def route_tiles_rows(top_k: int, config: MoeConfig) -> int:
    """The most rows of a step that route_tiles takes (0: none): config.small_step_rows, within
    the pairs the one-program tile tables take (TILE_KERNEL_MAX_PAIRS)."""
    return min(config.small_step_rows, TILE_KERNEL_MAX_PAIRS // top_k)


def route_tiles(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, config: MoeConfig,
                real_rows: torch.Tensor | None = None,
                out: tuple[torch.Tensor, ...] | None = None, num_warps: int = 4,
                pdl_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """moe_glue.route and expert_tiles(experts, num_experts, config.block_m) in one launch, for
    a step of 1 to route_tiles_rows(top_k, config) rows: logits [num_rows, num_experts] (rows
    may be strided) -> (weights [num_rows, top_k] of logits' dtype, experts [num_rows, top_k]
    int64, (pair_order, tile_expert, tile_start, tile_count)), the same bits as the two. out:
    the six tensors to write into (tests poison them); None: allocated. pdl_rows: the step's
    PDL row limit (kernels/pdl.py; 0: no PDL)."""
    num_rows, num_experts = logits.shape
    max_rows = route_tiles_rows(top_k, config)
    assert logits.stride(1) == 1 and 0 < top_k <= num_experts and 0 < num_rows <= max_rows
    num_pairs = num_rows * top_k
    num_tiles = cdiv(num_pairs, config.block_m) + num_experts
    device = logits.device
    weights, experts, *tiles = out or (
        torch.empty(num_rows, top_k, dtype=logits.dtype, device=device),
        torch.empty(num_rows, top_k, dtype=torch.int64, device=device),
        torch.empty(num_pairs, dtype=torch.int64, device=device),
        *(torch.empty(num_tiles, dtype=torch.int32, device=device) for _ in range(3)))
    block_r = triton.next_power_of_2(max_rows)
    block_e = triton.next_power_of_2(num_experts)
    _route_tiles_kernel[(1,)](
        logits, logits.stride(0), logits if real_rows is None else real_rows, weights, experts,
        *tiles, num_rows, NUM_EXPERTS=num_experts, TOP_K=top_k, NORM=norm_topk_prob,
        HAS_PADDING=real_rows is not None, BLOCK_R=block_r, BLOCK_E=block_e,
        LOG_E=block_e.bit_length() - 1, BLOCK_M=config.block_m,
        BLOCK_T=triton.next_power_of_2(cdiv(block_r * top_k, config.block_m) + num_experts),
        num_warps=num_warps,
        enable_fp_fusion=False,  # a fused multiply-add skips a rounding the torch path does
        **launch_options(device, num_rows, pdl_rows))
    return weights, experts, tuple(tiles)
