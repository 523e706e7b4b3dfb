"""Tensor parallel across two "hosts" (cluster_hosts.py): output equal to one host's, each host
listening on its own address only, clean stops, a lost coordinator that stops the other host,
and refusals by name (other adapter files or flags on a host, a taken port).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.daemons import _running, post, start_daemon
from tests.tiny_models import make_tiny_llama
from tests.integration.cluster_hosts import (
    MASTER_ADDR, NODE1_ADDR, cluster_flags, kill_hosts, make_keys, master_port, start_cluster,
    start_node)

PROMPTS = ("hello", "the quick brown fox", "0 1 2 3")


def _greedy_texts(url: str, model: str = "tiny") -> list[str]:
    texts = []
    for prompt in PROMPTS:
        status, body = post(f"{url}/v1/completions",
                            {"model": model, "prompt": prompt, "max_tokens": 12,
                             "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        texts.append(body["choices"][0]["text"])
    return texts


def _listeners(port: int) -> set[str]:
    """The local addresses listening on `port` (IPv4), from /proc/net/tcp."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr_hex, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(addr_hex))))
    return found


def _pid_listeners(pid: int) -> set[str]:
    """The local addresses of the TCP sockets that process `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:
            addr_hex = fields[1].split(":")[0]
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(addr_hex))))
    return found


def _wait_exit(proc, timeout_s: float, what: str, log: str) -> int:
    try:
        return proc.wait(timeout_s)
    except Exception:
        pytest.fail(f"{what} did not exit within {timeout_s}s:\n{log[-3000:]}", pytrace=False)


def test_two_hosts_serve_as_one_host(tmp_path, tiny_model, start_lorad):
    one_host = start_lorad("--parallel", "2")
    expected = _greedy_texts(one_host.url)
    assert one_host.stop() == 0

    cluster = start_cluster(tmp_path, tiny_model)
    try:
        coordinator, node = cluster.coordinator, cluster.node
        health = coordinator.health()
        assert [r["state"] for r in health["ranks"]] == ["serving", "serving"]
        assert _greedy_texts(coordinator.url) == expected
        for port in (cluster.port, cluster.port + 1, cluster.port + 2):
            assert _listeners(port) == {MASTER_ADDR}, port
        pids = coordinator.worker_pids() + node.worker_pids()
        assert len(pids) == 2
        # Each host's processes listen on its own address only (the HTTP port is --host's).
        assert _pid_listeners(pids[0]) == {MASTER_ADDR}
        assert _pid_listeners(pids[1]) == {NODE1_ADDR}
        assert _pid_listeners(coordinator.proc.pid) == {MASTER_ADDR, "127.0.0.1"}
        assert "reached the coordinator at tcp://127.0.0.2" in node.log()
        assert coordinator.stop() == 0, coordinator.log()[-3000:]
        assert _wait_exit(node.proc, 30, "lorad node", node.log()) == 0, node.log()[-3000:]
        coordinator.assert_cleaned_up(pids)
        assert not list(node.runtime_parent.iterdir())
    finally:
        cluster.kill()


def test_a_lost_coordinator_stops_the_other_host(tmp_path, tiny_model):
    cluster = start_cluster(tmp_path, tiny_model)
    try:
        pids = cluster.coordinator.worker_pids() + cluster.node.worker_pids()
        cluster.coordinator.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        code = _wait_exit(cluster.node.proc, 30, "lorad node", cluster.node.log())
        assert code == 1, cluster.node.log()[-3000:]
        assert time.monotonic() - killed_at < 15
        deadline = time.monotonic() + 10
        while [pid for pid in pids if _running(pid)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if _running(pid)]
        assert not list(cluster.node.runtime_parent.iterdir())
    finally:
        cluster.kill()


def test_a_host_with_other_adapter_files_is_refused_by_name(tmp_path, tiny_model,
                                                           tiny_adapters):
    keys0, keys1 = make_keys(tmp_path)
    port = master_port()
    coordinator = start_daemon(tiny_model, *cluster_flags(2, port, keys0), "--adapter",
                               f"a={tiny_adapters['a']}", wait=False)
    node = start_node(tiny_model, *cluster_flags(2, port, keys1, node_rank=1), "--adapter",
                      f"a={tiny_adapters['b']}")  # the same name, other files on this host
    try:
        assert _wait_exit(coordinator.proc, 120, "lorad", coordinator.log()) == 1
        assert _wait_exit(node.proc, 60, "lorad node", node.log()) == 1, node.log()[-3000:]
        failure = [line for line in coordinator.log().splitlines() if "start-up failed" in line]
        assert failure, coordinator.log()[-3000:]
        assert "registry mismatch" in failure[0] and "on rank(s) [1]" in failure[0]
        assert "node 1 (lorad node): ranks 1..1" in failure[0], failure[0]
    finally:
        kill_hosts(coordinator, node)


@pytest.mark.parametrize("taken, code, wanted", [
    (1, 2, "lorad: error: cannot listen on tcp://127.0.0.2:{port} (--master-addr, "
           "--master-port + 1 and + 2): Address already in use"),
    (0, 1, "worker rank 0 failed to start: --master-port {port}: cannot listen on "
           "127.0.0.2:{port} for torch.distributed's store: Address already in use"),
])
def test_a_taken_port_is_named(tmp_path, tiny_model, taken, code, wanted):
    keys0, _ = make_keys(tmp_path)
    port = master_port()
    with socket.socket() as holder:
        holder.bind((MASTER_ADDR, port + taken))
        holder.listen()
        coordinator = start_daemon(tiny_model, *cluster_flags(2, port, keys0), wait=False)
        assert _wait_exit(coordinator.proc, 60, "lorad", coordinator.log()) == code
    assert wanted.format(port=port + taken) in coordinator.log(), coordinator.log()[-3000:]
    coordinator.assert_cleaned_up([])


def test_a_host_started_with_other_flags_is_refused_by_name(tmp_path):
    model = make_tiny_llama(tmp_path / "four-heads", num_key_value_heads=4)  # --parallel 4 fits
    keys0, keys1 = make_keys(tmp_path)
    port = master_port()
    coordinator = start_daemon(model, *cluster_flags(2, port, keys0), wait=False)
    node = start_node(model, *cluster_flags(4, port, keys1, node_rank=1))  # ranks 2 and 3
    try:
        assert _wait_exit(coordinator.proc, 120, "lorad", coordinator.log()) == 1
        assert _wait_exit(node.proc, 60, "lorad node", node.log()) == 1, node.log()[-3000:]
        assert "failed to start: this host was started with --parallel 4 --nnodes 2, node 0 " \
               "with --parallel 2 --nnodes 2: give every host the same" in coordinator.log(), \
            coordinator.log()[-3000:]
    finally:
        kill_hosts(coordinator, node)
