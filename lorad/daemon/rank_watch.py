"""Each rank's latest RankStatus, what it says about the rank, and when a rank has stalled.

A rank is stalled when its current round has run longer than --step-timeout, or when it has not
reported for REPORT_SILENCE_S. Pure bookkeeping over reports and a clock: the engine client feeds
it messages and acts on what it finds (engine_client.py); no sockets, no tasks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields

from lorad.protocol import RankStatus

DEFAULT_STEP_TIMEOUT_S = 30.0
# Ranks report every 0.25s (lorad/workers/status.py); this much silence means the process is
# frozen (stopped, swapped out, or stuck holding the GIL), not merely busy.
REPORT_SILENCE_S = 5.0


@dataclass(frozen=True)
class RankState:
    """What /health, /ready and /metrics show for one rank."""

    rank: int
    state: str  # "starting", "serving", "stalled", "exited" or "failed"
    steps: int  # loop rounds the rank has completed (idle rounds included)
    kv_blocks_used: int
    kv_blocks_free: int
    seconds_since_report: float  # since the coordinator last heard from this rank; -1: never
    step_seconds: float = 0.0  # how long the rank's current round has run (0 between rounds)
    prefix_cached_blocks: int = 0  # full KV blocks in the prefix cache's index
    prefix_evictions: int = 0  # cached blocks taken back for other contents since the start
    # The disk spill: blocks held; since the start, writes, reads, failed reads, dropped entries
    spill_blocks: int = 0
    spill_writes: int = 0
    spill_reads: int = 0
    spill_read_failures: int = 0
    spill_drops: int = 0
    # Adapters: registered, device slots, slots holding one; since the start, copies into a
    # slot, slots taken back, copies from the host cache, copies read from disk
    adapters_registered: int = 0
    adapter_slots: int = 0
    adapter_slots_used: int = 0
    adapter_loads: int = 0
    adapter_evictions: int = 0
    adapter_host_hits: int = 0
    adapter_disk_reads: int = 0


# RankState's fields that are a RankStatus' counts as the rank sent them (same names).
_COUNTS = tuple(f.name for f in fields(RankState))[7:]


class RankWatch:
    def __init__(self, num_ranks: int, step_timeout: float = DEFAULT_STEP_TIMEOUT_S) -> None:
        self.num_ranks = num_ranks
        self.step_timeout = step_timeout
        # rank -> (its latest RankStatus, time.monotonic() when it arrived)
        self._reports: dict[int, tuple[RankStatus, float]] = {}
        self._ended: dict[int, str] = {}  # rank -> "exited" or "failed"
        # rank -> its KV pool in blocks, for ranks whose Ready arrived: loaded, agreed and warmed
        # up, so serving with an empty pool even before a report says so (one follows within its
        # period).
        self._ready: dict[int, int] = {}

    def take(self, msg: RankStatus) -> str | None:
        """Keep a report; returns why it was refused, or None."""
        if not 0 <= msg.rank < self.num_ranks:
            return f"dropped a RankStatus from rank {msg.rank}: there are {self.num_ranks} ranks"
        if not (math.isfinite(msg.step_seconds) and msg.step_seconds >= 0):
            return f"dropped a RankStatus from rank {msg.rank}: step_seconds {msg.step_seconds!r}"
        self._reports[msg.rank] = (msg, time.monotonic())
        return None

    def mark_ready(self, rank: int, num_kv_blocks: int) -> None:
        self._ready[rank] = num_kv_blocks

    def mark_ended(self, rank: int, how: str) -> None:
        """The rank's process exited ("exited") or reported WorkerFailed ("failed")."""
        self._ended.setdefault(rank, how)

    def states(self, engine_failed: bool) -> list[RankState]:
        now = time.monotonic()
        states = []
        for rank in range(self.num_ranks):
            report, received = self._reports.get(rank, (None, now))
            if rank in self._ready and (report is None or report.phase != "serving"):
                # Ready, and no report from its serving loop yet: an idle rank, pool all free.
                states.append(RankState(rank, self._ended.get(rank, "serving"),
                                        report.steps if report else 0, 0, self._ready[rank],
                                        now - received if report else -1.0))
                continue
            if report is None:
                states.append(RankState(rank, self._ended.get(rank, "starting"), 0, 0, 0, -1.0))
                continue
            silence = now - received
            step_seconds = report.step_seconds + silence if report.step_seconds else 0.0
            if rank in self._ended:
                state = self._ended[rank]
            elif self._stall_of(report, silence) is not None:
                state = "stalled"
            elif engine_failed:
                state = "failed"
            else:
                state = "serving" if report.phase == "serving" else "starting"
            states.append(RankState(rank, state, report.steps, report.kv_blocks_used,
                                    report.kv_blocks_free, silence, step_seconds,
                                    **{name: getattr(report, name) for name in _COUNTS}))
        return states

    def stalls(self) -> list[tuple[int, str]]:
        """(rank, why) for every rank that has reported, is still running and has stalled."""
        now = time.monotonic()
        return [(rank, why) for rank, (report, received) in sorted(self._reports.items())
                if rank not in self._ended
                and (why := self._stall_of(report, now - received)) is not None]

    def _stall_of(self, report: RankStatus, silence: float) -> str | None:
        if silence > REPORT_SILENCE_S:
            return f"no status report for {silence:.1f}s (the process is frozen)"
        if report.step_seconds and report.phase == "serving":
            step_seconds = report.step_seconds + silence
            if step_seconds > self.step_timeout:
                return (f"its step {report.steps + 1} has run for {step_seconds:.1f}s, over "
                        f"--step-timeout {self.step_timeout:g}s")
        return None
