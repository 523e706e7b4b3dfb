"""Two "hosts" on this machine for the several-hosts tests: node 0 (the coordinator, `lorad`) and
node 1 (`lorad node`), each with its own key folder written by `lorad keys` and its own runtime
folder; node 0 listens on 127.0.0.2, node 1's ranks on 127.0.0.1 (--node-addr), two loopback
addresses. Real processes, real sockets.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.daemons import (REPO, LOW_PORT, Daemon, scratch_dir, scratch_file, start_daemon,
                           wait_healthy)

MASTER_ADDR = "127.0.0.2"  # node 0's address; Linux routes all of 127/8 to loopback
NODE1_ADDR = "127.0.0.1"  # node 1's (--node-addr): where its ranks' gloo pairs listen
LORAD = [sys.executable, "-m", "lorad.daemon"]


@dataclass
class Node:
    proc: subprocess.Popen
    log_path: Path
    runtime_parent: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_pids(self) -> list[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(p) for p in path.read_text().split()]


def lorad_keys(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*LORAD, "keys", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def make_keys(root: Path) -> tuple[Path, Path]:
    """Node 0's key folder (coordinator pair, its node pair, authorized_keys) and node 1's,
    set up as docs/operations.md says: node 1's node.key appended to node 0's list."""
    node0, node1 = root / "keys0", root / "keys1"
    for args in ((str(node0), "--coordinator"), (str(node1),)):
        done = lorad_keys(*args)
        assert done.returncode == 0, done.stderr
    (node1 / "coordinator.key").write_bytes((node0 / "coordinator.key").read_bytes())
    with open(node0 / "authorized_keys", "ab") as listed:
        listed.write((node1 / "node.key").read_bytes())
    return node0, node1


def master_port() -> int:
    """A port P with P, P+1 and P+2 free on MASTER_ADDR, below the ephemeral range."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(LOW_PORT, 30000)
        if all(_free(port + i) for i in range(3)):
            return port
    raise RuntimeError("no three free ports in a row")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((MASTER_ADDR, port))
        except OSError:
            return False
    return True


def cluster_flags(parallel: int, port: int, key_dir: Path, node_rank: int | None = None):
    flags = ["--parallel", str(parallel), "--nnodes", "2", "--master-addr", MASTER_ADDR,
             "--master-port", str(port), "--cluster-key-dir", str(key_dir)]
    if node_rank is None:
        return flags
    return flags + ["--node-rank", str(node_rank), "--node-addr", NODE1_ADDR]


def start_node(model_dir: Path, *flags: str, env: dict[str, str] | None = None) -> Node:
    runtime_parent = scratch_dir("lrn-")
    log_path = scratch_file(runtime_parent.name, ".log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*LORAD, "node", "--model", str(model_dir),
                                 "--runtime-dir", str(runtime_parent), *flags],
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return Node(proc, log_path, runtime_parent)


@dataclass
class Cluster:
    coordinator: Daemon
    node: Node
    keys: tuple[Path, Path]
    port: int

    def kill(self) -> None:
        for proc in (self.coordinator.proc, self.node.proc):
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)


def start_cluster(tmp_path: Path, model_dir: Path, *flags: str, parallel: int = 2) -> Cluster:
    """Node 0 (coordinator, ranks 0..P/2-1) and node 1 (the rest), serving once both joined."""
    keys = make_keys(tmp_path)
    port = master_port()
    coordinator = start_daemon(model_dir, *cluster_flags(parallel, port, keys[0]), *flags,
                               wait=False)
    node = start_node(model_dir, *cluster_flags(parallel, port, keys[1], node_rank=1), *flags)
    cluster = Cluster(coordinator, node, keys, port)
    try:
        wait_healthy(coordinator)
    except BaseException:
        cluster.kill()
        raise
    return cluster


def kill_hosts(coordinator: Daemon, node) -> None:
    """End both hosts' agents however a test left them, then check the coordinator's host."""
    for proc in (coordinator.proc, node.proc):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    coordinator.assert_cleaned_up([])
