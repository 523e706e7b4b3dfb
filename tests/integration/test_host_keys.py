"""The control plane between hosts admits only listed CURVE keys and drops bad frames: a host
whose key is not in node 0's authorized_keys is refused (both sides log it) and the start fails;
a stranger's forged frame is never read; raw bytes on the port are ignored; an authorized peer's
forged, undecodable and oversized frames are dropped with a log line while serving goes on.
"""

from __future__ import annotations

import shutil
import socket
import time

import zmq

from lorad.protocol import MAX_FRAME_BYTES, RankStatus, StepResult, encode
from lorad.protocol.curve import client_keys, make_clients
from tests.daemons import _running, post, start_daemon
from tests.integration.cluster_hosts import (
    MASTER_ADDR, cluster_flags, kill_hosts, lorad_keys, make_keys, master_port, start_cluster,
    start_node)

FORGED_STATUS = encode(RankStatus(7, "serving", 1, 0.0, 0, 0))  # there are ranks 0 and 1


def _wait_for(read_log, text: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in read_log():
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{read_log()[-3000:]}"
        time.sleep(0.1)


def _push(endpoint: str, key_dir, frames: list[bytes], linger_ms: int,
          before_close=lambda: None) -> None:
    """Send `frames` from a CURVE client with the keys of `key_dir`; before_close() runs while
    the socket is still open (connecting, or refused and retrying)."""
    ctx = zmq.Context()
    make_clients(ctx, client_keys(str(key_dir)))
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.connect(endpoint)
    try:
        for frame in frames:
            sock.send(frame)
        before_close()
    finally:
        sock.close()
        ctx.term()


def test_a_host_with_an_unlisted_key_is_refused_by_name(tmp_path, tiny_model):
    keys0, keys1 = make_keys(tmp_path)
    (keys0 / "authorized_keys").write_bytes((keys0 / "node.key").read_bytes())  # node 0 only
    port = master_port()
    flags = ["--startup-timeout", "10"]
    coordinator = start_daemon(tiny_model, *cluster_flags(2, port, keys0), *flags, wait=False)
    node = start_node(tiny_model, *cluster_flags(2, port, keys1, node_rank=1), *flags)
    try:
        node_key = (keys1 / "node.key").read_text().strip()
        _wait_for(coordinator.log, f"refused a connection with CURVE key {node_key}")
        _wait_for(node.log, "refused this host's CURVE key")
        assert coordinator.proc.wait(40) == 1
        assert "ranks still loading: [1]" in coordinator.log()
        assert node.proc.wait(40) == 1, node.log()[-3000:]
        assert "was not reached within --startup-timeout" in node.log()
    finally:
        kill_hosts(coordinator, node)
    assert not list(node.runtime_parent.iterdir())


def test_strangers_and_bad_frames_are_dropped(tmp_path, tiny_model):
    cluster = start_cluster(tmp_path, tiny_model)
    coordinator = cluster.coordinator
    results = f"tcp://{MASTER_ADDR}:{cluster.port + 2}"
    try:
        pids = coordinator.worker_pids() + cluster.node.worker_pids()
        stranger = tmp_path / "stranger"
        assert lorad_keys(str(stranger)).returncode == 0
        shutil.copy(cluster.keys[1] / "coordinator.key", stranger / "coordinator.key")
        stranger_key = (stranger / "node.key").read_text().strip()
        _push(results, stranger, [FORGED_STATUS], linger_ms=0, before_close=lambda: _wait_for(
            coordinator.log, f"refused a connection with CURVE key {stranger_key}"))

        with socket.create_connection((MASTER_ADDR, cluster.port + 2), timeout=5) as raw:
            raw.sendall(b"\xff" * 64 + FORGED_STATUS)  # no ZMTP greeting, no CURVE: nonsense
        time.sleep(1.0)
        assert "dropped a RankStatus from rank 7" not in coordinator.log()

        oversized = bytes([RankStatus.KIND]) + b"\x00" * MAX_FRAME_BYTES
        garbage = bytes([StepResult.KIND]) + b"not msgpack \xc1"
        _push(results, cluster.keys[1], [FORGED_STATUS, garbage, oversized], linger_ms=20000)
        _wait_for(coordinator.log, f"exceeds the {MAX_FRAME_BYTES} limit")
        log = coordinator.log()
        assert "dropped a RankStatus from rank 7: there are 2 ranks" in log
        assert "undecodable StepResult" in log

        status, body = post(f"{coordinator.url}/v1/completions",
                            {"model": "tiny", "prompt": "hello", "max_tokens": 4})
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        assert [r["state"] for r in coordinator.health()["ranks"]] == ["serving", "serving"]
        assert coordinator.stop() == 0, coordinator.log()[-3000:]
        assert cluster.node.proc.wait(30) == 0, cluster.node.log()[-3000:]
        assert not [pid for pid in pids if _running(pid)]
    finally:
        cluster.kill()
