"""Fused MoE: every routed expert of a layer in two launches, rows grouped by expert in tiles
of block_m (row, expert) pairs built on the device (no host sync, so a CUDA graph can hold it;
one launch up to TILE_KERNEL_MAX_PAIRS pairs, torch ops past it): gate/up with silu(gate) * up in
its epilogue, then down times the routing weight, in fp32, one output per pair (expert_pairs).

Row invariance: a tile holds pairs of one expert, one tile shape and one compiled variant serve
every batch (the pair count is not specialized), each tile sweeps all of K in block_k steps (no
split of K), and an MMA computes each output element from its own row alone: a row's bits never
depend on which other rows picked the same expert. A row's experts are then added in ascending
expert order, one after another (add_experts here, moe_glue.py's epilogue in the model), as the
torch path (moe.py) and transformers do.
Not here: the router, the shared expert, LoRA on experts, expert parallelism.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.configs import MoeConfig, fitting_itemsize
from lorad.workers.kernels.launch_math import cdiv
from lorad.workers.kernels.pdl import launch_options, wait_for_previous


def expert_tiles(experts: torch.Tensor, num_experts: int, block_m: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts: [num_rows, top_k] int64, each row's ascending, num_experts for a pair of no
    expert (a padding row's) -> (pair_order [num_pairs] int64: the flat pair index row * top_k
    + j of each pair, grouped by expert, rows in order within one, the pairs of no expert last;
    tile_expert, tile_start, tile_count [num_tiles] int32: each tile's expert (-1 for a spare
    tile), its first position in pair_order and its pair count). num_tiles is a bound fixed by
    the shapes (tile_bound), so nothing waits for the device."""
    flat = experts.reshape(-1)
    device = flat.device
    pair_order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # integer adds: any order, same counts
    counts = counts[:num_experts]  # the pairs of no expert sort last: no tile takes them
    tiles = (counts + block_m - 1) // block_m
    tiles_end = torch.cumsum(tiles, 0)
    num_tiles = tile_bound(flat.numel(), num_experts, block_m)
    t = torch.arange(num_tiles, device=device)
    expert = torch.searchsorted(tiles_end, t, right=True)  # num_experts past the last tile
    e = expert.clamp(max=num_experts - 1)
    within = t - (tiles_end[e] - tiles[e])  # the tile's index among its expert's
    start = torch.cumsum(counts, 0)[e] - counts[e] + within * block_m
    count = (counts[e] - within * block_m).clamp(0, block_m)
    spare = expert >= num_experts
    return (pair_order, torch.where(spare, -1, expert).to(torch.int32),
            torch.where(spare, 0, start).to(torch.int32),
            torch.where(spare, 0, count).to(torch.int32))


def tile_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most tiles num_pairs pairs can fill, the tables' length and the expert kernels'
    grid: an expert with c pairs takes cdiv(c, block_m) tiles, at most c and at most c / block_m
    + 1, so all together at most num_pairs and at most cdiv(num_pairs, block_m) + num_experts.
    The first bound is the smaller in small steps: a decode step of one sequence (padded to 8
    rows, batch.MIN_ROWS, so 32 pairs at top 4, 28 of them padding) launches 32 tiles a column
    block, not 62, of which 4 hold pairs; the others only wait for the kernel before it (PDL)
    and exit (docs/performance-log.md: MoE tiles bounded by the pairs)."""
    return min(num_pairs, cdiv(num_pairs, block_m) + num_experts)


# The most pairs the one-program tile kernel takes (a decode step of up to 128 rows at top 4);
# more (prefill) take expert_tiles' torch ops, whose launches are a small share there.
TILE_KERNEL_MAX_PAIRS = 512


# No argument holds the pair count but num_pairs, never specialized: one variant for every step.
@triton.jit(do_not_specialize=["num_pairs"])
def _expert_tiles_kernel(experts_ptr, pair_order_ptr, tile_expert_ptr, tile_start_ptr,
                         tile_count_ptr, num_pairs, NUM_EXPERTS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """expert_tiles in one program, for up to BLOCK_P pairs: the same tables, entry for entry."""
    wait_for_previous(PDL)
    p = tl.arange(0, BLOCK_P)
    in_p = p < num_pairs
    flat = tl.load(experts_ptr + p, mask=in_p, other=NUM_EXPERTS).to(tl.int32)
    # A stable sort by expert is a sort by (expert, pair): the keys are distinct.
    keys = tl.sort(flat * BLOCK_P + p)
    tl.store(pair_order_ptr + p, (keys % BLOCK_P).to(tl.int64), mask=in_p)
    e = tl.arange(0, BLOCK_E)
    counts = tl.histogram(flat, BLOCK_E, mask=in_p)  # [BLOCK_E]; bins from NUM_EXPERTS on: none
    counts = tl.where(e < NUM_EXPERTS, counts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, axis=0)
    tiles_begin = tiles_end - tiles
    pairs_begin = tl.cumsum(counts, axis=0) - counts
    # [BLOCK_T, BLOCK_E]: tile t is expert e's when it lies in e's range (one e at most).
    t = tl.arange(0, BLOCK_T)
    own = (tiles_begin[None, :] <= t[:, None]) & (t[:, None] < tiles_end[None, :])
    has_expert = tl.sum(own.to(tl.int32), axis=1) > 0
    expert = tl.sum(tl.where(own, e[None, :], 0), axis=1)
    within = t - tl.sum(tl.where(own, tiles_begin[None, :], 0), axis=1)
    start = tl.sum(tl.where(own, pairs_begin[None, :], 0), axis=1) + within * BLOCK_M
    count = tl.minimum(tl.sum(tl.where(own, counts[None, :], 0), axis=1) - within * BLOCK_M,
                       BLOCK_M)
    in_t = t < tl.minimum(num_pairs, tl.cdiv(num_pairs, BLOCK_M) + NUM_EXPERTS)  # tile_bound
    tl.store(tile_expert_ptr + t, tl.where(has_expert, expert, -1), mask=in_t)
    tl.store(tile_start_ptr + t, tl.where(has_expert, start, 0), mask=in_t)
    tl.store(tile_count_ptr + t, tl.where(has_expert, count, 0), mask=in_t)


def tiles_pair_block(num_rows: int, top_k: int, config: MoeConfig) -> int:
    """The pair block of expert_tiles_kernel for a step of num_rows rows (at most
    TILE_KERNEL_MAX_PAIRS pairs): sized for config.small_step_rows rows up to them, else the
    largest. Two compiled variants, by a row limit that the warm-up's row bands know."""
    small = config.small_step_rows
    if 0 < num_rows <= small:
        return min(TILE_KERNEL_MAX_PAIRS, max(16, triton.next_power_of_2(small * top_k)))
    return TILE_KERNEL_MAX_PAIRS


def expert_tiles_kernel(experts: torch.Tensor, num_experts: int, block_m: int,
                        out: tuple[torch.Tensor, ...] | None = None,
                        block_p: int = TILE_KERNEL_MAX_PAIRS, num_warps: int = 4,
                        pdl_rows: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """expert_tiles' tables in one launch, for up to block_p pairs (a power of two, at most
    TILE_KERNEL_MAX_PAIRS). out: the four tables to write into (tests poison them); None:
    allocated. pdl_rows: the step's PDL row limit (kernels/pdl.py; 0: no PDL)."""
    flat = experts.reshape(-1)
    num_pairs = flat.numel()
    assert num_pairs <= block_p <= TILE_KERNEL_MAX_PAIRS and flat.is_contiguous()
    num_tiles = tile_bound(num_pairs, num_experts, block_m)
    pair_order, tile_expert, tile_start, tile_count = out or (
        torch.empty(num_pairs, dtype=torch.int64, device=flat.device),
        *(torch.empty(num_tiles, dtype=torch.int32, device=flat.device) for _ in range(3)))
    _expert_tiles_kernel[(1,)](
        flat, pair_order, tile_expert, tile_start, tile_count, num_pairs,
        NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_P=block_p,
        BLOCK_E=triton.next_power_of_2(num_experts + 1),
        BLOCK_T=triton.next_power_of_2(cdiv(block_p, block_m) + num_experts),
        num_warps=num_warps, **launch_options(flat.device, experts.shape[0], pdl_rows))
    return pair_order, tile_expert, tile_start, tile_count


@triton.jit
def _tile(pair_order_ptr, tile_start_ptr, tile_count_ptr, tile, BLOCK_M: tl.constexpr):
    """A tile's lanes: (its first position in pair_order, the lanes' positions 0..BLOCK_M-1,
    which lanes hold a pair, the flat pair index of each (0 for an empty lane))."""
    start = tl.load(tile_start_ptr + tile)
    count = tl.load(tile_count_ptr + tile)
    m = tl.arange(0, BLOCK_M)
    valid = m < count
    pairs = tl.load(pair_order_ptr + start + m, mask=valid, other=0)
    return start, m, valid, pairs


# No argument holds the batch's size (the pair count reaches the kernels only as table entries
# and the grid): one compiled variant, so one order of sums, for every batch.
@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, pair_order_ptr, tile_expert_ptr, tile_start_ptr,
                    tile_count_ptr, N, K, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """h[p] = silu(x[row] W_gate^T) * (x[row] W_up^T) for the tile's pairs p of one expert;
    w: [num_experts, 2N, K] (gate rows, then up rows); h: [num_pairs, N] by pair position."""
    wait_for_previous(PDL)
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile)
    if e < 0:
        return
    start, m, valid, pairs = _tile(pair_order_ptr, tile_start_ptr, tile_count_ptr, tile, BLOCK_M)
    rows = pairs // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_cols = tl.minimum(cols, N - 1).to(tl.int64)  # past N: row N - 1 again, never stored
    ks = tl.arange(0, BLOCK_K)
    w_e = w_ptr + e.to(tl.int64) * 2 * N * K
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = (k0 + ks) < K
        xk = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + (k0 + ks)[None, :],
                     mask=valid[:, None] & in_k[None, :], other=0.0)
        gate = tl.load(w_e + w_cols[:, None] * K + (k0 + ks)[None, :], mask=in_k[None, :],
                       other=0.0)
        up = tl.load(w_e + (w_cols + N)[:, None] * K + (k0 + ks)[None, :], mask=in_k[None, :],
                     other=0.0)
        acc_gate = tl.dot(xk, tl.trans(gate), acc_gate, input_precision="ieee")
        acc_up = tl.dot(xk, tl.trans(up), acc_up, input_precision="ieee")
    # Rounded where the torch path rounds: each product, silu in fp32, the product of the two.
    dtype = h_ptr.dtype.element_ty
    g = acc_gate.to(dtype).to(tl.float32)
    silu = (g / (1 + tl.exp(-g))).to(dtype)
    h = (silu.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(h_ptr + (start + m)[:, None].to(tl.int64) * N + cols[None, :], h,
             mask=valid[:, None] & (cols[None, :] < N))


@triton.jit
def _down_kernel(h_ptr, w_ptr, weight_ptr, out_ptr, pair_order_ptr, tile_expert_ptr,
                 tile_start_ptr, tile_count_ptr, H, N, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[pair] = (h[p] W_down^T) * weight[pair] in fp32 for the tile's pairs; w: [num_experts,
    H, N]; out: [num_pairs, H] by flat pair index (row * top_k + j)."""
    wait_for_previous(PDL)
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile)
    if e < 0:
        return
    start, m, valid, pairs = _tile(pair_order_ptr, tile_start_ptr, tile_count_ptr, tile, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_cols = tl.minimum(cols, H - 1).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    w_e = w_ptr + e.to(tl.int64) * H * N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, N, BLOCK_K):
        in_k = (k0 + ks) < N
        hk = tl.load(h_ptr + (start + m)[:, None].to(tl.int64) * N + (k0 + ks)[None, :],
                     mask=valid[:, None] & in_k[None, :], other=0.0)
        wk = tl.load(w_e + w_cols[:, None] * N + (k0 + ks)[None, :], mask=in_k[None, :],
                     other=0.0)
        acc = tl.dot(hk, tl.trans(wk), acc, input_precision="ieee")
    weight = tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * H + cols[None, :], acc * weight[:, None],
             mask=valid[:, None] & (cols[None, :] < H))


def add_experts(pairs: torch.Tensor) -> torch.Tensor:
    """pairs: [num_rows, top_k, H] float32, each row's experts in ascending order -> their sum,
    added one expert after another (transformers' order), each row on its own."""
    total = pairs[:, 0]
    for j in range(1, pairs.shape[1]):
        total = total + pairs[:, j]
    return total


def expert_pairs(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 weights: torch.Tensor, experts: torch.Tensor, config: MoeConfig = MoeConfig(),
                 buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
                 pdl_rows: int = 0) -> torch.Tensor:
    """-> [num_rows, top_k, H] float32: each (row, expert) pair's down product times its
    weight, a padding pair (expert num_experts) not written. x: [num_rows, K]; gate_up:
    [num_experts, 2N, K] (each expert's gate rows then up rows); down: [num_experts, H, N];
    weights, experts: [num_rows, top_k], each row's experts ascending (moe_glue.route's).
    buffers: (h [num_pairs, N] of x's dtype, pairs [num_pairs, H] float32) to write into
    (tests poison them); None: allocated. The tile tables take one launch up to
    TILE_KERNEL_MAX_PAIRS pairs (the same tables as expert_tiles'). pdl_rows: the step's PDL
    row limit (kernels/pdl.py; 0: no PDL)."""
    num_rows, top_k = experts.shape
    pdl = launch_options(x.device, num_rows, pdl_rows)
    config = fitting_itemsize(config, gate_up.element_size())
    num_experts, two_n, num_in = gate_up.shape
    num_inter, hidden = two_n // 2, down.shape[1]
    num_pairs = num_rows * top_k
    h, pairs = buffers or (
        torch.empty(num_pairs, num_inter, dtype=x.dtype, device=x.device),
        torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device))
    if num_pairs == 0 or num_inter == 0:  # a rank with none of the intermediate size: zeros
        return pairs.zero_().view(num_rows, top_k, hidden)
    if num_pairs <= TILE_KERNEL_MAX_PAIRS:
        pair_order, tile_expert, tile_start, tile_count = expert_tiles_kernel(
            experts.contiguous(), num_experts, config.block_m,
            block_p=tiles_pair_block(num_rows, top_k, config),
            pdl_rows=pdl_rows)
    else:
        pair_order, tile_expert, tile_start, tile_count = expert_tiles(
            experts.contiguous(), num_experts, config.block_m)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    tiles = tile_expert.shape[0]
    _gate_up_kernel[(tiles, cdiv(num_inter, config.block_n))](
        x, gate_up, h, pair_order, tile_expert, tile_start, tile_count, num_inter, num_in,
        TOP_K=top_k, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl)
    _down_kernel[(tiles, cdiv(hidden, config.block_n))](
        h, down, weights.contiguous(), pairs, pair_order, tile_expert, tile_start, tile_count,
        hidden, num_inter, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl)
    return pairs.view(num_rows, top_k, hidden)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              experts: torch.Tensor, config: MoeConfig = MoeConfig(),
              buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
              real_rows: torch.Tensor | None = None) -> torch.Tensor:
    """-> [num_rows, H] float32: every row's routed experts, weighted and summed, as moe.py's
    torch path computes them (routed_experts_torch), from weights and experts [num_rows, top_k]
    in any order; the rest as expert_pairs. real_rows: [num_rows] bool, the rows that are not
    padding (None: all): the others read no expert and get zeros, so a padded decode step reads
    the experts of its real rows only. The block's kernel path takes expert_pairs and
    moe_glue's epilogue instead (route sorts, the epilogue adds)."""
    num_rows = experts.shape[0]
    num_experts, two_n, _ = gate_up.shape
    if two_n == 0 or num_rows == 0:  # a rank with none of the intermediate size
        return torch.zeros(num_rows, down.shape[1], dtype=torch.float32, device=x.device)
    if real_rows is not None:  # no expert (num_experts) for a padding row's pairs: no tile
        experts = torch.where(real_rows[:, None], experts, num_experts)
    experts, order = torch.sort(experts, dim=1)  # ascending: the order the sum takes
    weights = weights.gather(1, order)
    total = add_experts(expert_pairs(x, gate_up, down, weights, experts, config, buffers))
    if real_rows is None:
        return total
    return torch.where(real_rows[:, None], total, 0.0)  # no pair of a padding row was written
