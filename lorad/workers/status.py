"""A worker's status thread: a RankStatus to the coordinator every REPORT_INTERVAL_S, from start-up
on, even while the loop is blocked in a step or a collective; and an exit when the coordinator is
gone but the loop cannot notice (blocked in gloo waiting for a peer that will never come).

The thread has its own PUSH socket (zmq sockets are not thread-safe) and only reads the loop's
progress; it never touches the model, the planner or the loop's sockets.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from lorad.protocol import RankStatus, encode
from lorad.protocol.sockets import connect_pusher
from lorad.workers.block_manager import BlockManager

if TYPE_CHECKING:  # torch and the spill's files stay out of the status thread's imports
    from lorad.workers.spill import RankSpill

log = logging.getLogger("lorad.worker")

REPORT_INTERVAL_S = 0.25
# The loop checks the coordinator between rounds; this long after the thread saw it gone the loop
# is taken to be stuck, and the process exits from here.
COORDINATOR_GONE_EXIT_S = 2.0
MAX_QUEUED_REPORTS = 4  # a coordinator that is not reading needs no backlog of old reports


@dataclass
class LoopProgress:
    """Written by the loop thread only, read by the status thread (each field is one atomic
    attribute store under the GIL; a report may mix two rounds, which is harmless)."""

    phase: str = "loading"  # "loading", "ready", "serving"
    steps: int = 0  # rounds completed
    step_started: float | None = None  # time.monotonic() at the start of the current round
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    prefix_cached_blocks: int = 0
    prefix_evictions: int = 0
    spill: tuple[int, ...] = (0, 0, 0, 0, 0)  # RankStatus' spill counts, in its order
    adapters: tuple[int, ...] = (0,) * 7  # RankStatus' adapter counts, in its order

    def begin_round(self) -> None:
        self.step_started = time.monotonic()

    def end_round(self, blocks: BlockManager, spill: RankSpill | None = None,
                  adapters: tuple[int, ...] | None = None) -> None:
        self.kv_blocks_free = blocks.num_free_blocks
        self.kv_blocks_used = blocks.num_blocks - self.kv_blocks_free
        self.prefix_cached_blocks = blocks.num_cached_blocks
        self.prefix_evictions = blocks.num_evictions
        if spill is not None:
            self.spill = spill.counts()
        if adapters is not None:
            self.adapters = adapters
        self.steps += 1
        self.step_started = None

    def report(self, rank: int) -> RankStatus:
        started = self.step_started
        seconds = 0.0 if started is None else max(0.0, time.monotonic() - started)
        return RankStatus(rank, self.phase, self.steps, seconds, self.kv_blocks_used,
                          self.kv_blocks_free, self.prefix_cached_blocks, self.prefix_evictions,
                          *self.spill, *self.adapters)


def coordinator_alive(coordinator_pid: int, parent_pid: int) -> bool:
    if os.getppid() != parent_pid:
        return False  # re-parented: the process that started us has exited
    try:
        os.kill(coordinator_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class StatusThread(threading.Thread):
    def __init__(self, ctx: zmq.Context, endpoint: str, rank: int, coordinator_pid: int,
                 progress: LoopProgress) -> None:
        super().__init__(name=f"status-rank-{rank}", daemon=True)
        self._ctx = ctx
        self._endpoint = endpoint
        self._rank = rank
        self._coordinator_pid = coordinator_pid
        self._parent_pid = os.getppid()
        self.progress = progress
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=5)

    def run(self) -> None:
        sock = connect_pusher(self._ctx, self._endpoint, max_queued=MAX_QUEUED_REPORTS)
        gone_since = None
        try:
            while not self._stopped.wait(REPORT_INTERVAL_S):
                if coordinator_alive(self._coordinator_pid, self._parent_pid):
                    self._send(sock)
                    continue
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > COORDINATOR_GONE_EXIT_S:
                    log.error("the coordinator (pid %d) is gone and the step loop is stuck "
                              "(in round %d for %.1fs); exiting now", self._coordinator_pid,
                              self.progress.steps, self.progress.report(self._rank).step_seconds)
                    logging.shutdown()
                    os._exit(1)
        finally:
            sock.close(linger=0)

    def _send(self, sock: zmq.Socket) -> None:
        try:
            sock.send(encode(self.progress.report(self._rank)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the coordinator is not reading; the next report says the same, newer
