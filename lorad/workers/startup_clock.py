"""This rank's start-up timed by phase, from its spawn to Ready; the phases travel in Ready.

The coordinator turns them into its "ready in" log line, /health's `startup` and the
lorad_startup_* gauges (lorad/daemon/startup.py). Measures only; decides nothing.
"""

from __future__ import annotations

import time

from lorad.protocol import StartupPhase


class StartupClock:
    def __init__(self, started_at: float) -> None:
        """started_at: time.monotonic() when the coordinator spawned this process (one clock for
        every process of the host), so the first phase counts exec and imports."""
        self._last = started_at
        self._seconds: dict[str, float] = {}  # in the order the phases first ran

    def mark(self, phase: str) -> None:
        """The time since the previous mark went to `phase`; a phase that comes back (adapters
        are checked before the weights and loaded after) adds up."""
        now = time.monotonic()
        self._seconds[phase] = self._seconds.get(phase, 0.0) + (now - self._last)
        self._last = now

    def phases(self) -> list[StartupPhase]:
        return [StartupPhase(name, seconds) for name, seconds in self._seconds.items()]
