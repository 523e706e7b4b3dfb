"""One rank's one-shot all-reduce (--all-reduce): whether it runs, its peer buffers (torch's
symmetric memory, CUDA IPC, no NVLink multicast: [flags | two halves]) and the calls into its
kernels. NCCL stays for larger tensors and wherever this cannot run (docs/multi-gpu.md).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lorad.config.errors import ConfigError

if TYPE_CHECKING:  # kernel modules: the CPU path never imports triton
    from lorad.workers.kernels.configs import OneshotConfig
    from lorad.workers.kernels.oneshot_reduce import PeerBuffers

log = logging.getLogger(__name__)

FLAG_BYTES_ALIGN = 256  # the partials start on a 256-byte boundary after the flags


def oneshot_problem(device: torch.device, world_size: int, backend: str,
                    num_host_ranks: int) -> str | None:
    """-> why the one-shot all-reduce cannot run for this rank (None: it can, if every rank can
    map its buffers, which map_peer_buffers agrees on)."""
    if device.type != "cuda":
        return f"needs CUDA, and the workers run on {device.type}"
    if world_size < 2:
        return f"needs --parallel 2 or more, got {world_size}"
    if backend != "nccl":
        return f"needs --dist-backend nccl, got {backend}"
    if num_host_ranks != world_size:
        return "reads peers' GPU memory on one host, and the ranks span several hosts"
    try:
        import triton  # noqa: F401
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as exc:
        return f"needs triton and torch's symmetric memory ({exc})"
    return None


def resolve_all_reduce(name: str, device: torch.device, world_size: int, backend: str,
                       num_host_ranks: int) -> str:
    """--all-reduce as this rank runs it: 'oneshot' or 'nccl' (the process group's collective,
    gloo's on the CPU). 'oneshot' that cannot run is a ConfigError; 'auto' falls back."""
    if name == "nccl":
        return "nccl"
    problem = oneshot_problem(device, world_size, backend, num_host_ranks)
    if problem is None:
        return "oneshot"
    if name == "oneshot":
        raise ConfigError(f"--all-reduce oneshot {problem}: use --all-reduce nccl (or auto)")
    return "nccl"


class OneshotAllReduce:
    """The one-shot all-reduce of one rank, over mapped peer buffers: for the tensors it takes
    (fp32 partial sums of decode size), the rank-ordered sum, alone or with add + RMSNorm."""

    def __init__(self, peers: PeerBuffers, keep_alive=None) -> None:
        self.peers = peers
        self._keep_alive = keep_alive  # the symmetric allocation and its handle

    def applies(self, x: torch.Tensor) -> bool:
        """Whether x is one for the one-shot path; the same answer on every rank (same shape)."""
        return x.is_cuda and self.peers.supports(x)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        from lorad.workers.kernels.oneshot_reduce import all_reduce_sum
        return all_reduce_sum(x, self.peers)

    def all_reduce_add_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                            weight: torch.Tensor, eps: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden, normed): RMSNorm.add_and_norm of the all-reduced x, in one kernel."""
        from lorad.workers.kernels.oneshot_reduce import all_reduce_add_rms_norm
        return all_reduce_add_rms_norm(x, self.peers, residual, weight, eps)


def buffer_layout(config: OneshotConfig, world_size: int) -> tuple[int, int]:
    """-> (bytes of the flags region, fp32 elements of one rank's allocation in all)."""
    flag_bytes = -(-config.num_programs * world_size * 4 // FLAG_BYTES_ALIGN) * FLAG_BYTES_ALIGN
    return flag_bytes, flag_bytes // 4 + 2 * config.max_rows * config.max_hidden


def agree(cpu_group, ok: bool) -> bool:
    """Whether every rank of cpu_group (gloo) says ok: an int tensor reduced by MIN, no pickle."""
    flag = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_group)
    return bool(flag.item())


def map_peer_buffers(rank: int, world_size: int, device: torch.device, group, cpu_group,
                     config: OneshotConfig) -> OneshotAllReduce | None:
    """Allocate this rank's symmetric buffer, zero its flags and meet the others at the
    rendezvous (group: the NCCL group). Collective: every rank of the group calls it. -> None
    on every rank when any rank could not map (auto then runs NCCL everywhere)."""
    from torch.distributed import _symmetric_memory as symm_mem

    from lorad.workers.kernels.oneshot_reduce import PeerBuffers
    # No NVLink multicast objects (docs/multi-gpu.md); read by torch at its first allocation.
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    flag_bytes, num_elements = buffer_layout(config, world_size)
    buffer = handle = None
    try:
        if symm_mem.get_backend(device) != "CUDA":
            symm_mem.set_backend("CUDA")  # CUDA IPC between the GPUs of one host, not NVSHMEM
        buffer = symm_mem.empty(num_elements, dtype=torch.float32, device=device)
        buffer[:flag_bytes // 4].view(torch.int32).zero_()
        torch.cuda.synchronize(device)  # zeroed before any peer can publish into it
    except RuntimeError as exc:
        log.warning("one-shot all-reduce: no symmetric buffer on rank %d (%s)", rank, exc)
        buffer = None
    if not agree(cpu_group, buffer is not None):
        return None
    handle = symm_mem.rendezvous(buffer, group)
    addresses = [int(a) for a in handle.buffer_ptrs]  # in group rank order
    assert len(addresses) == world_size and handle.rank == rank
    signals = torch.tensor(addresses, dtype=torch.int64, device=device)
    data = torch.tensor([a + flag_bytes for a in addresses], dtype=torch.int64, device=device)
    counters = torch.zeros(config.num_programs, dtype=torch.int32, device=device)
    peers = PeerBuffers(rank, world_size, data, config.max_hidden,
                        config.max_rows * config.max_hidden, config.max_rows, config.max_hidden,
                        config.num_programs, signals, counters)
    dist.barrier(group=cpu_group)  # every rank's flags are zero before any kernel runs
    log.info("one-shot all-reduce: %d ranks, up to %d rows of %d, %d programs", world_size,
             config.max_rows, config.max_hidden, config.num_programs)
    return OneshotAllReduce(peers, (buffer, handle))
