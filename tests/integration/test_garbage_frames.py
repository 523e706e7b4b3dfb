"""Garbage on the coordinator's results socket: a local process that connects a zmq PUSH to it and
sends empty, undecodable, truncated, wrongly typed, wrong-kind, unknown-kind and oversized frames
and a status report from a rank that does not exist. Each is dropped with a log line, and the daemon
keeps serving. (A worker's SUB socket fed the same: tests/integration/test_worker_loop.py.)
"""

from __future__ import annotations

import json
import time
import urllib.request

import msgpack
import zmq

from lorad.protocol import (
    MAX_FRAME_BYTES, Hello, RankStatus, SeqOutput, StepResult, encode)

GARBAGE = [
    b"",  # too short
    bytes([StepResult.KIND]) + b"not msgpack at all \xc1",
    encode(StepResult(1, [SeqOutput("x", [5], None, 3)], 1, 0, 9))[:-3],  # truncated
    bytes([RankStatus.KIND]) + msgpack.packb([0, "serving", "many", 0.0] + [0] * 16),  # str: int
    encode(Hello(2, "someone")),  # a coordinator's message, not a worker's
    bytes([200]) + msgpack.packb([1]),  # no such kind
    bytes([RankStatus.KIND]) + b"\x00" * MAX_FRAME_BYTES,  # one byte over the limit
]
FORGED_STATUS = encode(RankStatus(7, "serving", 1, 0.0, 0, 0))  # there are only ranks 0 and 1


def test_garbage_on_the_results_socket_is_dropped_and_logged(start_lorad):
    daemon = start_lorad("--parallel", "2")
    pids = daemon.worker_pids()
    (instance_dir,) = list(daemon.runtime_parent.iterdir())
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(f"ipc://{instance_dir}/results.sock")
    try:
        for frame in GARBAGE + [FORGED_STATUS]:
            push.send(frame)
    finally:
        push.close()  # lingers until every frame is handed over
        ctx.term()

    def all_dropped(log: str) -> bool:
        # The forged status comes last and is logged after the garbage: wait for both, or the
        # check below races the coordinator's log (seen once in a fresh-clone CI run).
        return (log.count("dropped an invalid message") >= len(GARBAGE)
                and "dropped a RankStatus from rank 7" in log)

    deadline = time.monotonic() + 20
    while not all_dropped(daemon.log()):
        assert time.monotonic() < deadline, daemon.log()[-4000:]
        time.sleep(0.1)
    log = daemon.log()
    assert "dropped a RankStatus from rank 7: there are 2 ranks" in log
    for reason in ("too short", "undecodable StepResult", "RankStatus.steps: expected int",
                   "unexpected message kind 1", "unexpected message kind 200",
                   f"exceeds the {MAX_FRAME_BYTES} limit"):
        assert reason in log, reason

    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4}).encode()
    request = urllib.request.Request(daemon.url + "/v1/completions", data=body)
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert json.loads(resp.read())["usage"]["completion_tokens"] >= 1
    health = daemon.health()
    assert health["status"] == "serving"
    assert [r["state"] for r in health["ranks"]] == ["serving", "serving"]
    assert daemon.stop() == 0, daemon.log()[-4000:]
    daemon.assert_cleaned_up(pids)
