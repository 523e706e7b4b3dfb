"""The coordinator killed with SIGKILL mid-stream: its workers (one mid-step, the other waiting for
it in a collective, or idle) must exit on their own within seconds, and a new daemon started with
the same --runtime-dir and port must start and serve, removing the folder the dead one left.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request

from tests.daemons import _running
from tests.integration.streams import Stream

WORKERS_GONE_WITHIN_S = 6.0


def test_coordinator_killed_then_restarted(start_lorad):
    first = start_lorad("--parallel", "2")
    pids = first.worker_pids()
    (stale,) = list(first.runtime_parent.iterdir())
    stream = Stream(first.url)
    stream.wait_started()
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    killed_at = time.monotonic()
    while any(_running(pid) for pid in pids):
        assert time.monotonic() - killed_at < WORKERS_GONE_WITHIN_S, \
            f"workers still running {WORKERS_GONE_WITHIN_S}s after the coordinator died:\n" \
            f"{first.log()[-3000:]}"
        time.sleep(0.1)
    stream.join(10)
    assert stream.ended_at is not None and stream.events[-1:] != [b"[DONE]"]  # cut, not ended
    assert stale.exists()  # nobody cleaned up after a SIGKILL

    port = int(first.url.rsplit(":", 1)[1])
    second = start_lorad("--parallel", "2", runtime_parent=first.runtime_parent, port=port)
    assert not stale.exists()
    assert f"removed the runtime directory {stale}" in second.log()
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4}).encode()
    request = urllib.request.Request(second.url + "/v1/completions", data=body)
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert json.loads(resp.read())["choices"][0]["finish_reason"] in ("stop", "length")
    new_pids = second.worker_pids()
    assert second.stop() == 0, second.log()[-3000:]
    second.assert_cleaned_up(new_pids)
