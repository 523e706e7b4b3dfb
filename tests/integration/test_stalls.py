"""Stalled ranks at --parallel 2: one blocked inside a step (the LORAD_TEST_STALL_RANK hook, as a
hung kernel would be) and one frozen with SIGSTOP (it stops reporting). Each is found within its
deadline plus a margin, every open stream ends with one error event naming the stall, the daemon
exits 1, and the workers (blocked in a collective, or stopped) are killed, none left behind.
The systemd watchdog pings stop with the steps, before the daemon gives up.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from tests.integration.streams import Stream
from tests.integration.test_systemd_notify import NotifyListener
from tests.integration.test_worker_faults import NUM_STREAMS, _assert_failed_and_gone

STEP_TIMEOUT_S = 3
MARGIN_S = 6.0  # reports every 0.25s, the watch every 0.25s, then 2 slow shared cores


def test_rank_blocked_in_a_step(start_lorad):
    daemon = start_lorad("--parallel", "2", "--step-timeout", str(STEP_TIMEOUT_S),
                         env={"LORAD_TEST_STALL_RANK": "1:40"})
    pids = daemon.worker_pids()
    streams = [Stream(daemon.url) for _ in range(NUM_STREAMS)]
    for stream in streams:
        stream.wait_started()
        stream.join(STEP_TIMEOUT_S + MARGIN_S + 20)
    assert all(len(s.events) >= 3 for s in streams)  # tokens, then the error, then [DONE]
    last_token = max(s.event_times[-3] for s in streams)
    _assert_failed_and_gone(daemon, pids, streams, last_token, "stalled")
    message = streams[0].error_message()
    assert f"over --step-timeout {STEP_TIMEOUT_S}s" in message, message
    for stream in streams:
        assert stream.ended_at - last_token < STEP_TIMEOUT_S + MARGIN_S
        assert stream.ended_at - last_token > STEP_TIMEOUT_S - 0.5  # not before the deadline
    log = daemon.log()
    assert "LORAD_TEST_STALL_RANK: blocking in step" in log
    assert "sending SIGKILL to 2 worker(s)" in log


def test_frozen_rank_stops_reporting(start_lorad):
    folder = Path(tempfile.mkdtemp(prefix="lsd"))
    listener = NotifyListener(folder / "notify")
    daemon = start_lorad("--parallel", "2", env={"NOTIFY_SOCKET": str(folder / "notify"),
                                                 "WATCHDOG_USEC": "1000000"})
    pids = daemon.worker_pids()
    try:
        streams = [Stream(daemon.url) for _ in range(NUM_STREAMS)]
        for stream in streams:
            stream.wait_started()
        deadline = time.monotonic() + 15
        while sum(d == "WATCHDOG=1" for _, d in listener.messages) < 2:
            assert time.monotonic() < deadline, listener.messages
            time.sleep(0.05)
        os.kill(pids[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        for stream in streams:
            stream.join(30)
        last_token = max(s.event_times[-3] for s in streams)
        _assert_failed_and_gone(daemon, pids, streams, last_token,
                                "worker rank 1 stalled: no status report for")
        # One ping may still go out on a report from before the stop; none after that.
        late = [t - stopped_at for t, d in listener.messages if d == "WATCHDOG=1"
                and t > stopped_at + 1.5]
        assert not late, late
        assert listener.messages[-1][1] == "STOPPING=1"
    finally:
        if daemon.proc.poll() is None:  # the test failed: do not leave a stopped process
            os.kill(pids[1], signal.SIGKILL)
        listener.close()
        shutil.rmtree(folder)
