"""The start-up report's parts: a rank's clock adds a phase that comes back, the report takes the
slowest rank's phases after the coordinator's own, and the process start is read from /proc."""

from __future__ import annotations

import time

from lorad.daemon.startup import StartupReport, process_started_at, slowest_rank
from lorad.protocol import StartupPhase
from lorad.workers.startup_clock import StartupClock


def test_clock_counts_from_the_spawn_and_adds_a_phase_that_comes_back():
    spawned_at = time.monotonic() - 1.0
    clock = StartupClock(spawned_at)
    clock.mark("workers up")
    clock.mark("adapters")
    time.sleep(0.01)
    clock.mark("weights")
    clock.mark("adapters")
    phases = clock.phases()
    assert [p.name for p in phases] == ["workers up", "adapters", "weights"]
    assert phases[0].seconds >= 1.0 and phases[2].seconds >= 0.01
    assert sum(p.seconds for p in phases) <= time.monotonic() - spawned_at


def test_report_is_the_coordinators_phase_then_the_slowest_ranks():
    by_rank = {0: [StartupPhase("weights", 2.0)], 1: [StartupPhase("weights", 3.0)],
               2: [StartupPhase("weights", 3.0)]}
    assert slowest_rank(by_rank) is by_rank[1]  # a tie goes to the lower rank
    now = time.monotonic()
    report = StartupReport.measure(now - 5.0, now - 4.5, by_rank[1])
    assert report.phases == (("coordinator", 0.5), ("weights", 3.0))
    assert 5.0 <= report.total_s < 6.0
    assert report.describe().startswith("ready in 5.0 s (coordinator 0.5 s, weights 3.0 s)")


def test_process_start_is_before_now_and_not_long_ago():
    started_at = process_started_at()
    assert 0 < time.monotonic() - started_at < 24 * 3600  # this pytest's own age
