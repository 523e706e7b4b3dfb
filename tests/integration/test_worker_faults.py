"""Real workers that fail mid-stream at --parallel 2: one killed with SIGKILL, one raising inside a
step. Every open stream must end with one error event within seconds, the daemon must exit 1,
and no worker process or runtime folder may be left behind.
"""

from __future__ import annotations

import os
import signal
import time

from tests.integration.streams import Stream

NUM_STREAMS = 3
END_WITHIN_S = 10.0  # from the fault to every stream's error event (2 slow shared cores)


def _open_streams(daemon) -> list[Stream]:
    streams = [Stream(daemon.url) for _ in range(NUM_STREAMS)]
    for stream in streams:
        stream.wait_started()
    return streams


def _assert_failed_and_gone(daemon, pids: list[int], streams: list[Stream], since: float,
                            wanted: str) -> None:
    for stream in streams:
        stream.join(END_WITHIN_S + 20)
        assert stream.ended_at is not None, "a stream was left open"
        assert wanted in stream.error_message(), daemon.log()[-3000:]
        assert stream.ended_at - since < END_WITHIN_S, (stream.ended_at - since, daemon.log())
    assert daemon.proc.wait(30) == 1, daemon.log()[-3000:]
    daemon.assert_cleaned_up(pids)


def test_worker_killed_mid_stream(start_lorad):
    daemon = start_lorad("--parallel", "2")
    pids = daemon.worker_pids()
    streams = _open_streams(daemon)
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    _assert_failed_and_gone(daemon, pids, streams, killed_at,
                            "worker rank 1 exited unexpectedly with code -9")


def test_worker_raising_in_a_step(start_lorad):
    # Rank 1 raises in its 40th model step: the three streams are running by then (200 tokens
    # each), and rank 0 is left waiting for it inside a collective.
    daemon = start_lorad("--parallel", "2", env={"LORAD_TEST_RAISE_RANK": "1:40"})
    pids = daemon.worker_pids()
    streams = [Stream(daemon.url) for _ in range(NUM_STREAMS)]
    for stream in streams:
        stream.wait_started()
    for stream in streams:
        stream.join(END_WITHIN_S + 20)
    assert all(len(s.events) >= 3 for s in streams)  # tokens, then the error, then [DONE]
    last_token = max(s.event_times[-3] for s in streams)
    _assert_failed_and_gone(daemon, pids, streams, last_token,
                            "worker rank 1 failed: RuntimeError: LORAD_TEST_RAISE_RANK")
    assert "injected failure in step" in daemon.log()
