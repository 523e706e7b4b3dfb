"""Failure of a host at --parallel 2 over two "hosts": node 1's agent killed, stopped (SIGTERM)
or frozen with its workers. Every open stream ends with one error event, the coordinator exits 1,
and no process of either host is left (a thawed host finds the coordinator gone, exits 1).
"""

from __future__ import annotations

import os
import signal
import time

from tests.daemons import _running
from tests.integration.cluster_hosts import start_cluster
from tests.integration.streams import Stream

NUM_STREAMS = 3
END_WITHIN_S = 12.0  # from the fault to every stream's error event (2 slow shared cores)


def _open_streams(url: str) -> list[Stream]:
    streams = [Stream(url) for _ in range(NUM_STREAMS)]
    for stream in streams:
        stream.wait_started()
    return streams


def _assert_streams_failed(streams: list[Stream], since: float, log: str) -> list[str]:
    messages = []
    for stream in streams:
        stream.join(END_WITHIN_S + 20)
        assert stream.ended_at is not None, "a stream was left open"
        messages.append(stream.error_message())
        assert stream.ended_at - since < END_WITHIN_S, (stream.ended_at - since, log[-3000:])
    return messages


def _wait_gone(pids: list[int], timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while [pid for pid in pids if _running(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _running(pid)], "processes left running"


def test_killing_the_second_hosts_agent_fails_every_stream(tmp_path, tiny_model):
    cluster = start_cluster(tmp_path, tiny_model)
    coordinator, node = cluster.coordinator, cluster.node
    try:
        pids = coordinator.worker_pids() + node.worker_pids()
        streams = _open_streams(coordinator.url)
        killed_at = time.monotonic()
        node.proc.send_signal(signal.SIGKILL)
        messages = _assert_streams_failed(streams, killed_at, coordinator.log())
        assert all("worker rank" in m for m in messages), messages
        assert coordinator.proc.wait(30) == 1, coordinator.log()[-3000:]
        coordinator.assert_cleaned_up(pids)
        _wait_gone(pids)
    finally:
        cluster.kill()


def test_a_frozen_second_host_fails_every_stream_and_exits_when_thawed(tmp_path, tiny_model):
    cluster = start_cluster(tmp_path, tiny_model, "--step-timeout", "3")
    coordinator, node = cluster.coordinator, cluster.node
    try:
        node_pids = [node.proc.pid] + node.worker_pids()
        pids = coordinator.worker_pids() + node_pids
        streams = _open_streams(coordinator.url)
        frozen_at = time.monotonic()
        for pid in node_pids:
            os.kill(pid, signal.SIGSTOP)
        messages = _assert_streams_failed(streams, frozen_at, coordinator.log())
        assert all("worker rank" in m for m in messages), messages
        assert coordinator.proc.wait(30) == 1, coordinator.log()[-3000:]
        assert "stalled" in coordinator.log(), coordinator.log()[-3000:]
        for pid in node_pids:
            os.kill(pid, signal.SIGCONT)
        assert node.proc.wait(30) == 1, node.log()[-3000:]
        _wait_gone(pids)
        assert not list(node.runtime_parent.iterdir())
    finally:
        cluster.kill()


def test_stopping_the_second_hosts_agent_stops_its_workers_and_fails_the_cluster(
        tmp_path, tiny_model):
    cluster = start_cluster(tmp_path, tiny_model)
    coordinator, node = cluster.coordinator, cluster.node
    try:
        pids = coordinator.worker_pids() + node.worker_pids()
        streams = _open_streams(coordinator.url)
        stopped_at = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)  # systemctl stop lorad-node
        assert node.proc.wait(30) == 0, node.log()[-3000:]
        assert "signal received: stopping this host's workers" in node.log()
        _assert_streams_failed(streams, stopped_at, coordinator.log())
        assert coordinator.proc.wait(30) == 1, coordinator.log()[-3000:]
        _wait_gone(pids)
        assert not list(node.runtime_parent.iterdir())
    finally:
        cluster.kill()
