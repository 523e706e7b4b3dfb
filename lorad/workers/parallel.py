"""Tensor-parallel setup of one worker rank: the process groups and the two model collectives.

Layers call `all_reduce` (row-parallel outputs, the vocab-parallel embedding) and
`all_gather_last_dim` (vocab-parallel logits) themselves. Control traffic (step agreement, sampled
ids) uses `cpu_group`; this file does not implement it. With gloo, CUDA tensors are reduced through
host copies, so several ranks can share one GPU (`--parallel 2 --dist-backend gloo` on one card).
With --all-reduce oneshot (or auto on CUDA) decode-size sums read peer memory (peer_reduce.py);
CPU ranks on one host add small tensors up through shared memory (shm_reduce.py).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lorad.workers.cluster_store import bound_gloo_backend, tcp_store
from lorad.workers.peer_reduce import OneshotAllReduce, map_peer_buffers, resolve_all_reduce
from lorad.workers.shm_reduce import SLOT_BYTES, ShmAllReduce, map_shared_segment, shm_problem

log = logging.getLogger("lorad.worker")

if TYPE_CHECKING:  # a kernel module: the CPU path never imports triton
    from lorad.workers.kernels.configs import OneshotConfig


class TensorParallel:
    """This rank's place in the tensor-parallel group and the collectives the model uses."""

    def __init__(self, rank: int, world_size: int, device: torch.device, group=None,
                 cpu_group=None, backend: str = "gloo", host_ranks: range | None = None,
                 oneshot: OneshotAllReduce | None = None,
                 shm: ShmAllReduce | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.group = group  # model collectives: NCCL on CUDA, gloo on CPU; None at world 1
        self.cpu_group = cpu_group  # gloo, for control; None at world 1
        self.backend = backend
        # The ranks on this rank's host, sharing its memory: all of them, unless several hosts
        # (--nnodes) each run a contiguous range.
        self.host_ranks = range(world_size) if host_ranks is None else host_ranks
        # Set while a CUDA graph is captured in segments (cuda_graph.SegmentedGraph): each
        # collective then ends a segment and runs eagerly between the replays of two.
        self.segmenter = None
        # The one-shot all-reduce over peer memory, for the tensors it takes; None: NCCL/gloo.
        self.oneshot = oneshot
        # CPU ranks on one host: small tensors' sums through shared memory; None: gloo's.
        self.shm = shm

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `x`, the same bits on every rank. May reuse `x`'s storage."""
        if self.world_size == 1:
            return x
        if self.segmenter is not None:
            return self.segmenter.collective(lambda: self._all_reduce_any(x))
        return self._all_reduce_any(x)

    def _all_reduce_any(self, x: torch.Tensor) -> torch.Tensor:
        if self.oneshot is not None and self.oneshot.applies(x):
            # The same rank-ordered sum as _all_reduce's at any world size, so a row's bits do
            # not change where the size moves a tensor from one path to the other.
            return self.oneshot.all_reduce(x)
        if self.shm is not None and self.shm.applies(x):
            # _all_reduce's arithmetic without gloo's latency (shm_reduce.py).
            return sum_in_rank_order(self.shm.all_gather(x))
        if self.backend == "gloo" and x.is_cuda:
            # gloo reduces host memory (its own CUDA path stages through the host too); copying
            # here keeps that in sight and the rank-order sum below the same on CPU and GPU.
            return self._all_reduce(x.cpu()).to(x.device)
        return self._all_reduce(x)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 2:
            # A ring or tree all-reduce adds in an order per element that depends on the
            # tensor's size (NCCL also picks its algorithm by size), so a row's bits would depend
            # on the batch. Gathering and adding in rank order is the same arithmetic for every
            # size (shared/DESIGN.md, "Numerics").
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            return sum_in_rank_order(parts)
        # Two ranks: a + b == b + a, so every rank has the same bits whatever the algorithm.
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate each rank's `x` (last dim sizes[rank]) along the last dim."""
        assert x.shape[-1] == sizes[self.rank], (x.shape, sizes, self.rank)
        if self.world_size == 1:
            return x
        if self.segmenter is not None:
            return self.segmenter.collective(lambda: self._all_gather_last_dim(x, sizes))
        return self._all_gather_last_dim(x, sizes)

    def _all_gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        width = max(sizes)
        # all_gather needs one shape on every rank; the vocab split can be uneven by one.
        padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
        if self.backend == "gloo" and padded.is_cuda:
            padded = padded.cpu()  # gloo gathers host memory; see all_reduce
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[..., :size] for part, size in zip(parts, sizes)],
                         dim=-1).to(x.device)


def sum_in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """parts[0] + parts[1] + ... in rank order in their dtype, into a new tensor (the parts stay
    as they were): the model's all-reduce arithmetic at any world size of 2 or more (for fp32
    parts, kernels/oneshot_reduce_reference.rank_ordered_sum's)."""
    total = parts[0] + parts[1]
    for part in parts[2:]:
        total += part
    return total


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str,
                         device: torch.device, timeout_s: float = 600,
                         host_ranks: range | None = None,
                         gloo_addr: str | None = None, cluster_flags: str = "",
                         all_reduce: str = "nccl",
                         oneshot_config: OneshotConfig | None = None) -> TensorParallel:
    """Join the group through a FileStore (`file://<path>`: no ports), or between hosts a TCP
    store (`tcp://ADDR:PORT`, cluster_store.py). World 1 needs no torch.distributed at all.
    all_reduce: --all-reduce (peer_reduce.resolve_all_reduce); oneshot_config: Tuning.oneshot."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    num_host_ranks = world_size if host_ranks is None else len(host_ranks)
    # Before joining: every rank refuses an impossible --all-reduce oneshot alike.
    requested = all_reduce
    all_reduce = resolve_all_reduce(all_reduce, device, world_size, backend, num_host_ranks)
    if device.type == "cuda":
        # Whatever the backend: Triton launches on the current device, not the tensors'.
        torch.cuda.set_device(device)
    if world_size == 1:
        return TensorParallel(0, 1, device, backend=backend, host_ranks=host_ranks)
    timeout = timedelta(seconds=timeout_s)
    if init_method.startswith("tcp://"):  # between hosts (--nnodes)
        where = {"store": tcp_store(init_method, rank, world_size, timeout, cluster_flags)}
    else:
        where = {"init_method": init_method}
    gloo = bound_gloo_backend(gloo_addr) if gloo_addr else "gloo"  # gloo_addr: between hosts
    if backend == "nccl":
        dist.init_process_group("nccl", **where, rank=rank, world_size=world_size,
                                timeout=timeout, device_id=device)
    else:
        dist.init_process_group(gloo, **where, rank=rank, world_size=world_size,
                                timeout=timeout)
    # A separate gloo group for control, so step agreement and the sampled-id broadcast never
    # queue behind (or interleave with) the model's collectives on the same communicator.
    cpu_group = dist.new_group(backend=gloo, timeout=timeout)
    oneshot = None
    if all_reduce == "oneshot":  # CUDA, NCCL, world 2 or more on one host
        assert oneshot_config is not None, "the one-shot all-reduce needs Tuning.oneshot"
        oneshot = map_peer_buffers(rank, world_size, device, dist.group.WORLD, cpu_group,
                                   oneshot_config)
        if oneshot is None and requested == "oneshot":
            raise RuntimeError("--all-reduce oneshot: a rank could not map its peer buffers "
                               "(its log says why); use --all-reduce nccl (or auto)")
    shm = None
    if backend == "gloo":
        problem = shm_problem(device, world_size, num_host_ranks)
        if problem is None:  # the same on every rank: one host, one device type
            shm = map_shared_segment(rank, world_size, init_method, cpu_group, timeout_s)
        if shm is not None:
            log.info("all-reduce: tensors up to %d KiB summed through shared memory in rank "
                     "order, larger ones by gloo", SLOT_BYTES // 1024)
        elif device.type == "cpu":
            log.info("all-reduce: gloo's for every tensor (%s)",
                     problem or "the shared mapping failed")
    return TensorParallel(rank, world_size, device, group=dist.group.WORLD,
                          cpu_group=cpu_group, backend=backend, host_ranks=host_ranks,
                          oneshot=oneshot, shm=shm)
