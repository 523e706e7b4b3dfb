"""The one-shot all-reduce over peer memory: the world's fp32 partials added in rank order 0..N-1
(the same bits on every rank, for any batch), alone or fused with the residual add and RMSNorm,
behind a per-program flag barrier (docs/multi-gpu.md). No buffer setup (workers/peer_reduce.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.fused_ops import _add_and_norm_row, _norm_warps
from lorad.workers.kernels.launch_math import cdiv, next_power_of_2

SUM_BLOCK = 1024  # columns per tile of the plain sum; a row's bits do not depend on it


@dataclass(frozen=True)
class PeerBuffers:
    """One rank's view of the world's one-shot buffers (workers/peer_reduce.py builds it on
    CUDA; the checks build one over plain tensors of one process)."""

    rank: int
    world_size: int
    data: torch.Tensor  # [world] int64: each rank's partials, [2 halves, max_rows, row_stride]
    row_stride: int  # elements between rows of a partial
    half_stride: int  # elements between the two halves (0: one half, no barrier)
    max_rows: int
    max_hidden: int
    num_programs: int  # the fixed grid: at most the programs that are resident at once
    signals: torch.Tensor | None  # [world] int64: each rank's [num_programs, world] int32 flags
    counters: torch.Tensor | None  # [num_programs] int32: this rank's epochs, one per program

    @property
    def synced(self) -> bool:
        return self.signals is not None

    def supports(self, x: torch.Tensor) -> bool:
        """Whether x ([num_rows, hidden] fp32, on this rank's device) fits the buffers."""
        return (x.dim() == 2 and x.dtype == torch.float32 and x.shape[0] <= self.max_rows
                and x.shape[1] <= self.max_hidden and x.stride(1) == 1)


@triton.jit
def _part(data_ptr, r, half):
    """-> the address of rank r's partials (the half of this epoch), as an fp32 pointer."""
    return tl.load(data_ptr + r).to(tl.pointer_type(tl.float32)) + half


# The barrier (docs/multi-gpu.md, "The flag protocol"): program p of rank r publishes epoch e
# (its counter + 1) into every peer's flags[p, r], releasing at system scope after a CTA barrier,
# then acquires its own flags[p, q] until every q has reached e. A program meets only the same
# program of its peers, so the grid is one fixed size on every call, every program resident at
# once. The partials alternate between two halves by the epoch's parity: a rank writes e's while
# a slow peer may still read e-1's, and e+1's only once every peer has arrived at e (and so has
# finished reading e-1, in the kernel before).
@triton.jit
def _meet_peers(signal_table_ptr, counters_ptr, rank, pid, WORLD: tl.constexpr):
    """The flag barrier of one program: publish this rank's next epoch to every peer, wait until
    every peer has published it here; -> the epoch. Every store of this program before the call
    is visible to the peers after it (CTA barrier, then a release at system scope)."""
    epoch = tl.load(counters_ptr + pid) + 1
    tl.debug_barrier()
    own = tl.load(signal_table_ptr + rank).to(tl.pointer_type(tl.int32)) + pid * WORLD
    for q in tl.static_range(WORLD):
        peer = tl.load(signal_table_ptr + q).to(tl.pointer_type(tl.int32)) + pid * WORLD
        tl.atomic_xchg(peer + rank, epoch, sem="release", scope="sys")
    for q in tl.static_range(WORLD):
        # At least this epoch: a fast peer may already have published the next one here.
        while (tl.atomic_add(own + q, 0, sem="acquire", scope="sys") - epoch) < 0:
            pass
    tl.debug_barrier()
    tl.store(counters_ptr + pid, epoch)  # only this program reads or writes its counter
    return epoch


@triton.jit
def _rank_ordered_sum(data_ptr, half, offs, mask, WORLD: tl.constexpr):
    """-> sum of every rank's partial at offs, in fp32, added in rank order 0..WORLD-1."""
    # .cg: peers' stores reach this GPU's L2 (or its own), never a stale L1 line.
    acc = tl.load(_part(data_ptr, 0, half) + offs, mask=mask, other=0.0, cache_modifier=".cg")
    for r in tl.static_range(1, WORLD):
        acc += tl.load(_part(data_ptr, r, half) + offs, mask=mask, other=0.0,
                       cache_modifier=".cg")
    return acc


@triton.jit
def _oneshot_sum_kernel(x_ptr, stride_x, data_ptr, row_stride, half_stride, signal_table_ptr,
                        counters_ptr, rank, out_ptr, stride_out, num_rows, H,
                        WORLD: tl.constexpr, BLOCK: tl.constexpr, SYNC: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    tiles_per_row = tl.cdiv(H, BLOCK)
    num_tiles = num_rows * tiles_per_row
    cols = tl.arange(0, BLOCK)
    half = 0
    if SYNC:
        half = ((tl.load(counters_ptr + pid) + 1) & 1) * half_stride
        mine = _part(data_ptr, rank, half)
        for t in range(pid, num_tiles, num_programs):
            row = (t // tiles_per_row).to(tl.int64)
            c = (t % tiles_per_row) * BLOCK + cols
            x = tl.load(x_ptr + row * stride_x + c, mask=c < H)
            tl.store(mine + row * row_stride + c, x, mask=c < H)
        _meet_peers(signal_table_ptr, counters_ptr, rank, pid, WORLD)
    for t in range(pid, num_tiles, num_programs):
        row = (t // tiles_per_row).to(tl.int64)
        c = (t % tiles_per_row) * BLOCK + cols
        total = _rank_ordered_sum(data_ptr, half, row * row_stride + c, c < H, WORLD)
        tl.store(out_ptr + row * stride_out + c, total, mask=c < H)


@triton.jit
def _oneshot_add_rms_norm_kernel(x_ptr, stride_x, data_ptr, row_stride, half_stride,
                                 signal_table_ptr, counters_ptr, rank, res_ptr, stride_res,
                                 res_out_ptr, stride_res_out, normed_ptr, stride_normed,
                                 weight_ptr, num_rows, H, eps, WORLD: tl.constexpr,
                                 BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
                                 SYNC: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dtype = res_out_ptr.dtype.element_ty
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    half = 0
    if SYNC:
        half = ((tl.load(counters_ptr + pid) + 1) & 1) * half_stride
        mine = _part(data_ptr, rank, half)
        for i in range(pid, num_rows, num_programs):
            x = tl.load(x_ptr + tl.cast(i, tl.int64) * stride_x + cols, mask=mask)
            tl.store(mine + tl.cast(i, tl.int64) * row_stride + cols, x, mask=mask)
        _meet_peers(signal_table_ptr, counters_ptr, rank, pid, WORLD)
    for i in range(pid, num_rows, num_programs):
        row = tl.cast(i, tl.int64)
        total = _rank_ordered_sum(data_ptr, half, row * row_stride + cols, mask, WORLD)
        # The sum rounded to the model dtype (the LoRA delta is already in the partials).
        _add_and_norm_row(total.to(dtype), res_ptr + row * stride_res,
                          res_out_ptr + row * stride_res_out, normed_ptr + row * stride_normed,
                          w, cols, mask, H, eps, dtype, HAS_RES)


def _common_args(x: torch.Tensor, peers: PeerBuffers) -> tuple:
    assert peers.supports(x), (tuple(x.shape), x.dtype, peers.max_rows, peers.max_hidden)
    signals = peers.signals if peers.synced else peers.data  # placeholders (never read)
    counters = peers.counters if peers.synced else peers.data
    return (x, x.stride(0), peers.data, peers.row_stride, peers.half_stride, signals, counters,
            peers.rank)


def all_reduce_sum(x: torch.Tensor, peers: PeerBuffers,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """-> [num_rows, hidden] fp32 (written into out if given): the rank-ordered sum of every
    rank's x (this rank's: x, with peers synced; otherwise the partials peers.data points at are
    summed and x gives the shape). Launched plainly, never with PDL: the barrier needs the
    previous call finished."""
    num_rows, hidden = x.shape
    if out is None:
        out = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)
    assert out.shape == x.shape and out.dtype == torch.float32 and out.stride(1) == 1
    if num_rows == 0 and not peers.synced:
        return out
    grid = (peers.num_programs if peers.synced else max(1, cdiv(num_rows * hidden, SUM_BLOCK)),)
    _oneshot_sum_kernel[grid](*_common_args(x, peers), out, out.stride(0), num_rows, hidden,
                              WORLD=peers.world_size, BLOCK=SUM_BLOCK, SYNC=peers.synced,
                              num_warps=4)
    return out


def all_reduce_add_rms_norm(x: torch.Tensor, peers: PeerBuffers, residual: torch.Tensor | None,
                            weight: torch.Tensor, eps: float, normed: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (hidden, normed), as fused_ops.add_rms_norm of all_reduce_sum(x, peers), bit for bit:
    hidden = residual + sum.to(weight.dtype) (the sum alone when residual is None), normed =
    RMSNorm(hidden). x: [num_rows, H] fp32, this rank's partial (LoRA delta included); residual:
    [num_rows, H] model dtype, overwritten with hidden (returned as hidden); normed: where the
    norm goes (a new tensor if None)."""
    num_rows, hidden_size = x.shape
    assert weight.shape == (hidden_size,)
    dtype = weight.dtype
    if residual is None:
        residual_out = torch.empty(num_rows, hidden_size, dtype=dtype, device=x.device)
        res_arg, stride_res = residual_out, 0
    else:
        assert residual.shape == x.shape and residual.dtype == dtype and residual.stride(1) == 1
        residual_out, res_arg, stride_res = residual, residual, residual.stride(0)
    if normed is None:
        normed = torch.empty(num_rows, hidden_size, dtype=dtype, device=x.device)
    assert normed.shape == x.shape and normed.dtype == dtype and normed.stride(1) == 1
    if num_rows == 0 and not peers.synced:
        return residual_out, normed
    block = next_power_of_2(hidden_size)
    grid = (peers.num_programs if peers.synced else max(1, num_rows),)
    _oneshot_add_rms_norm_kernel[grid](
        *_common_args(x, peers), res_arg, stride_res, residual_out, residual_out.stride(0),
        normed, normed.stride(0), weight, num_rows, hidden_size, eps, WORLD=peers.world_size,
        BLOCK=block, HAS_RES=residual is not None, SYNC=peers.synced,
        # The warps of add_rms_norm's row: the norm's sum order follows the layout.
        num_warps=_norm_warps(block))
    return residual_out, normed


def unsynced_peers(partials: list[torch.Tensor], rank: int = 0) -> PeerBuffers:
    """PeerBuffers over partials already in place (one process: the checks), no barrier."""
    rows, hidden = partials[0].shape
    stride = partials[0].stride(0)
    assert all(p.shape == (rows, hidden) and p.stride() == (stride, 1) for p in partials)
    table = torch.tensor([p.data_ptr() for p in partials], dtype=torch.int64,
                         device=partials[0].device)
    return PeerBuffers(rank, len(partials), table, stride, 0, rows, hidden, 1, None, None)
