"""The CPU ranks' all-reduce of small tensors through shared memory on their host.

gloo's all-reduce between two processes on one host cost 0.65-1.5 ms a call at a decode step's
size on a 2-core VM (over loopback TCP, through gloo's own threads), and the model makes two a
layer; this path about 40 us (docs/performance-log.md: CPU ranks' sums through shared memory).
Every rank copies its part into its own slot of one shared mapping, publishes the call's number
in its flag, and waits until every peer's flag has it: an all-gather, whose slots
TensorParallel adds up in rank order as it does gloo's (parallel.sum_in_rank_order), so every
rank gets the same bits, and the same bits as the gloo path.

Ordering: x86-64 keeps a core's stores in program order for every other core (TSO), so a peer
that sees a flag sees the slot written before it. The copies are plain stores at these sizes
(glibc's memcpy turns to non-temporal stores, which TSO does not order, only for copies of
megabytes: its threshold is a share of the last-level cache): SLOT_BYTES bounds them. Other
CPUs (weaker ordering) keep gloo. Two buffers in turn: a rank writes call n + 1's part only after
every peer published call n, which each does only after it finished adding call n - 1's slots,
the other buffer.

Waiting: a short spin, then sleeps that grow to 1 ms; a peer that exited (its pid gone) or that
has not arrived within the group's timeout ends the wait with a RuntimeError, as gloo's would.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import platform
import time

import torch
import torch.distributed as dist

from lorad.config.process_state import running

log = logging.getLogger("lorad.worker")

SLOT_BYTES = 256 * 1024  # the largest tensor taken (a decode step's: 64 rows x 1,024 fp32)
FLAG_STRIDE = 8  # int64 flags one cache line apart
HEADER_BYTES = 4096  # flags [world * FLAG_STRIDE] int64, then pids [world] int64
SPIN_S = 50e-6  # polls before the first sleep
MAX_SLEEP_S = 1e-3
PID_CHECK_S = 0.1  # how often a waiting rank looks for exited peers
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MACHINES = ("x86_64", "amd64")


def shm_problem(device: torch.device, world_size: int, num_host_ranks: int) -> str | None:
    """Why this group cannot sum through shared memory, or None."""
    if device.type != "cpu":
        return "the tensors are not on the CPU"
    if world_size < 2 or num_host_ranks != world_size:
        return "the ranks are not all on this host"
    if world_size * (FLAG_STRIDE + 1) * 8 > HEADER_BYTES:
        return f"{world_size} ranks are more than its header holds"
    if platform.machine().lower() not in MACHINES:
        return f"{platform.machine()} may reorder stores (only x86-64 is taken)"
    if not os.path.isdir("/dev/shm"):
        return "/dev/shm does not exist"
    return None


def segment_path(group_key: str) -> str:
    """The mapping's file, the same for every rank of one group (group_key: its init method)."""
    digest = hashlib.sha256(group_key.encode()).hexdigest()[:16]
    return f"/dev/shm/lorad-allreduce-{digest}"


class ShmAllReduce:
    """One rank's end of the shared mapping (map_shared_segment makes it)."""

    def __init__(self, rank: int, world_size: int, memory: mmap.mmap, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._memory = memory  # kept alive: the tensors below view it
        raw = torch.frombuffer(memory, dtype=torch.uint8)
        header = raw[:HEADER_BYTES].view(torch.int64)
        self.flags = header[:world_size * FLAG_STRIDE:FLAG_STRIDE]
        self.pids = header[world_size * FLAG_STRIDE:world_size * (FLAG_STRIDE + 1)]
        # [2 buffers, world, SLOT_BYTES]
        self.slots = raw[HEADER_BYTES:].view(2, world_size, SLOT_BYTES)
        self.calls = 0

    @staticmethod
    def size(world_size: int) -> int:
        return HEADER_BYTES + 2 * world_size * SLOT_BYTES

    def applies(self, x: torch.Tensor) -> bool:
        """Whether x takes this path; the same answer on every rank (same shape and dtype)."""
        return (x.device.type == "cpu" and x.dtype in DTYPES
                and x.numel() * x.element_size() <= SLOT_BYTES)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x, in rank order: views of the mapping, valid until this rank's next
        call (whose writing the peers do not wait for: add them up before it)."""
        self.calls += 1
        nbytes = x.numel() * x.element_size()
        buffer = self.slots[self.calls % 2]
        buffer[self.rank, :nbytes].view(x.dtype).view(x.shape).copy_(x)
        self.flags[self.rank] = self.calls
        self._wait(self.calls)
        return [buffer[r, :nbytes].view(x.dtype).view(x.shape) for r in range(self.world_size)]

    def _wait(self, call: int) -> None:
        started = time.monotonic()
        checked = started
        sleep = 0.0
        while int(self.flags.min()) < call:
            now = time.monotonic()
            if now - checked >= PID_CHECK_S:
                checked = now
                self._check_peers(call, now - started)
            if now - started < SPIN_S:
                continue
            sleep = min(MAX_SLEEP_S, max(2 * sleep, 10e-6))
            time.sleep(sleep)

    def _check_peers(self, call: int, waited_s: float) -> None:
        late = [r for r in range(self.world_size) if int(self.flags[r]) < call]
        for r in late:
            if not running(int(self.pids[r])):
                raise RuntimeError(f"all-reduce: rank {r} (pid {int(self.pids[r])}) exited "
                                   f"before call {call}")
        if late and waited_s > self.timeout_s:
            raise RuntimeError(f"all-reduce: rank(s) {late} did not reach call {call} within "
                               f"{self.timeout_s:.0f} s")


def map_shared_segment(rank: int, world_size: int, group_key: str, cpu_group,
                       timeout_s: float) -> ShmAllReduce | None:
    """Map the group's segment on every rank (rank 0 creates it; it is unlinked once every rank
    holds it, so nothing stays in /dev/shm). -> this rank's ShmAllReduce, or None on every rank
    when any rank could not map it (each says why in its log). Collective over cpu_group."""
    path = segment_path(group_key)
    size = ShmAllReduce.size(world_size)
    memory = shm = None
    if rank == 0:
        try:
            if os.path.exists(path):  # a crashed instance's, of this runtime folder
                os.unlink(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
                memory = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("all-reduce: cannot create %s (%s): gloo's for every tensor", path, exc)
    dist.barrier(group=cpu_group)  # created
    if rank != 0:
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                memory = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        except (OSError, ValueError) as exc:
            log.warning("all-reduce: cannot map %s (%s): gloo's for every tensor", path, exc)
    if memory is not None:
        shm = ShmAllReduce(rank, world_size, memory, timeout_s)
        shm.pids[rank] = os.getpid()
    # Every rank holds the mapping, its pid written before any call reads one.
    mapped = torch.tensor([int(shm is not None)], dtype=torch.int32)
    dist.all_reduce(mapped, op=dist.ReduceOp.MIN, group=cpu_group)
    if rank == 0 and os.path.exists(path):
        os.unlink(path)
    dist.barrier(group=cpu_group)  # unlinked before any rank goes on
    return shm if mapped.item() else None
