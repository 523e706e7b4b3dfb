"""The start-up report: how long this instance took to serve, and where the time went.

At READY the coordinator logs one line (`ready in 41.2 s (coordinator 0.6 s, workers up 1.1 s,
weights 12.3 s, ...)`); /health shows it as `startup_s` and `startup_phases_s`, /metrics as
lorad_startup_seconds and lorad_startup_phase_seconds. The phases are the coordinator's own (its
process start to the workers' spawn), then the slowest rank's as that rank measured them; the rest
of the total is the wait for Hello, the agreement and opening the port. Measures only.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from lorad.protocol import StartupPhase


@dataclass(frozen=True)
class StartupReport:
    total_s: float  # from this process's start to READY
    phases: tuple[tuple[str, float], ...]  # (name, seconds) in the order they ran

    @classmethod
    def measure(cls, started_at: float, spawned_at: float,
                rank_phases: list[StartupPhase]) -> "StartupReport":
        """Now is READY; started_at and spawned_at are on time.monotonic()."""
        phases = (("coordinator", spawned_at - started_at),)
        phases += tuple((p.name, p.seconds) for p in rank_phases)
        return cls(time.monotonic() - started_at, phases)

    def describe(self) -> str:
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases)
        return f"ready in {self.total_s:.1f} s ({parts})"


def slowest_rank(phases_by_rank: dict[int, list[StartupPhase]]) -> list[StartupPhase]:
    """The phases of the rank that took longest: the one the start waited for."""
    rank = max(phases_by_rank, key=lambda r: (sum(p.seconds for p in phases_by_rank[r]), -r))
    return phases_by_rank[rank]


def process_started_at() -> float:
    """When this process started, on time.monotonic(), as the kernel recorded it (so the
    interpreter's start and the imports count); now where /proc is not there. The kernel keeps
    it in clock ticks (10 ms), rounded down: the total errs long, never short."""
    now = time.monotonic()
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        start_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: ticks since boot
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - start_s
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - max(0.0, age_s)
