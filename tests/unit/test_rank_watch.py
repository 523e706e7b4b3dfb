"""RankWatch: what each rank's latest report says, and when a rank counts as stalled (its round
past --step-timeout, or silent past REPORT_SILENCE_S), with the clock moved by monkeypatch."""

from __future__ import annotations

import pytest

from lorad.daemon import rank_watch
from lorad.daemon.rank_watch import REPORT_SILENCE_S, RankWatch
from lorad.protocol import RankStatus


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(rank_watch.time, "monotonic", lambda: now[0])
    return now


def test_states_follow_each_ranks_report(clock):
    watch = RankWatch(3, step_timeout=10)
    watch.take(RankStatus(0, "serving", 50, 0.0, 7, 93))
    watch.take(RankStatus(1, "loading", 0, 0.0, 0, 0))
    clock[0] += 1
    states = watch.states(engine_failed=False)
    assert [s.state for s in states] == ["serving", "starting", "starting"]
    assert (states[0].steps, states[0].kv_blocks_used, states[0].kv_blocks_free) == (50, 7, 93)
    assert states[0].seconds_since_report == 1.0 and states[2].seconds_since_report == -1.0
    assert watch.stalls() == []


def test_a_long_step_stalls_after_the_timeout_counting_the_silence(clock):
    watch = RankWatch(2, step_timeout=10)
    watch.take(RankStatus(0, "serving", 5, 0.0, 0, 10))
    watch.take(RankStatus(1, "serving", 5, 8.0, 3, 7))  # 8 s into round 6
    clock[0] += 1.5
    assert watch.stalls() == []
    watch.take(RankStatus(0, "serving", 6, 0.0, 0, 10))
    watch.take(RankStatus(1, "serving", 5, 9.5, 3, 7))
    clock[0] += 1
    ((rank, why),) = watch.stalls()
    assert rank == 1 and "its step 6 has run for 10.5s, over --step-timeout 10s" in why
    assert watch.states(engine_failed=False)[1].state == "stalled"
    assert watch.states(engine_failed=False)[1].step_seconds == 10.5


def test_silence_is_a_stall_unless_the_rank_ended(clock):
    watch = RankWatch(2)
    watch.take(RankStatus(0, "serving", 5, 0.0, 0, 10))
    watch.take(RankStatus(1, "serving", 5, 0.0, 0, 10))
    clock[0] += REPORT_SILENCE_S + 0.5
    assert [r for r, _ in watch.stalls()] == [0, 1]
    watch.mark_ended(1, "exited")
    ((rank, why),) = watch.stalls()
    assert rank == 0 and why.startswith("no status report for 5.5s")
    assert [s.state for s in watch.states(engine_failed=True)] == ["stalled", "exited"]


@pytest.mark.parametrize("msg,reason", [
    (RankStatus(2, "serving", 1, 0.0, 0, 0), "there are 2 ranks"),
    (RankStatus(-1, "serving", 1, 0.0, 0, 0), "there are 2 ranks"),
    (RankStatus(0, "serving", 1, float("nan"), 0, 0), "step_seconds nan"),
    (RankStatus(0, "serving", 1, -1.0, 0, 0), "step_seconds -1.0"),
])
def test_impossible_reports_are_refused(msg, reason):
    watch = RankWatch(2)
    assert reason in watch.take(msg)
    assert watch.states(engine_failed=False)[0].state == "starting"
