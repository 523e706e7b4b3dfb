"""A real daemon under a stand-in for systemd: the test binds the AF_UNIX datagram socket that
NOTIFY_SOCKET names, sets WATCHDOG_USEC, and reads what lorad says: EXTEND_TIMEOUT_USEC while
loading, READY=1 only after every rank was ready (warm-up step included), WATCHDOG=1 while the
ranks' steps progress, STOPPING=1 on SIGTERM, in that order. The workers must not see the socket.
"""

from __future__ import annotations

import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

WATCHDOG_USEC = 1_000_000  # pings expected about every 0.5s


class NotifyListener(threading.Thread):
    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []  # (arrival, datagram)
        self.on_ready = None  # called once, in this thread, when READY=1 arrives
        self._closed = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._closed.is_set():
            try:
                data = self.sock.recv(4096).decode()
            except socket.timeout:
                continue
            self.messages.append((time.monotonic(), data))
            if "READY=1" in data.split("\n") and self.on_ready is not None:
                self.on_ready()

    def first(self, line: str) -> int:
        """Index of the first datagram holding this line, or -1."""
        return next((i for i, (_, d) in enumerate(self.messages) if line in d.split("\n")), -1)

    def close(self) -> None:
        self._closed.set()
        self.join(5)
        self.sock.close()


@pytest.fixture
def listener():
    folder = Path(tempfile.mkdtemp(prefix="lsd"))
    listener = NotifyListener(folder / "notify")
    yield listener
    listener.close()
    shutil.rmtree(folder)


def test_ready_watchdog_stopping_in_order(start_lorad, listener):
    log_at_ready: list[str] = []
    daemon = start_lorad("--parallel", "2", wait=False,
                         env={"NOTIFY_SOCKET": listener.sock.getsockname(),
                              "WATCHDOG_USEC": str(WATCHDOG_USEC)})
    listener.on_ready = lambda: log_at_ready.append(daemon.log())
    deadline = time.monotonic() + 120
    while not log_at_ready:
        assert daemon.proc.poll() is None and time.monotonic() < deadline, daemon.log()[-3000:]
        time.sleep(0.05)
    # READY=1 came after each rank's warm-up step and Ready, not before.
    (log,) = log_at_ready
    assert log.count(" steps ran in ") == 2, log[-3000:]
    assert log.count("reading shard 1/1: model.safetensors") == 2  # load progress, per rank
    assert "worker rank 0 ready" in log and "worker rank 1 ready" in log
    ready = listener.first("READY=1")
    extend = next(i for i, (_, d) in enumerate(listener.messages)
                  if d.startswith("EXTEND_TIMEOUT_USEC="))
    assert 0 <= extend < ready

    pids = daemon.worker_pids()
    for pid in pids:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert not any(v.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_USEC=")) for v in environ)

    ready_at = listener.messages[ready][0]
    deadline = time.monotonic() + 15
    while sum(d == "WATCHDOG=1" for t, d in listener.messages if t > ready_at) < 3:
        assert time.monotonic() < deadline, listener.messages
        time.sleep(0.1)
    assert daemon.health()["status"] == "serving"

    assert daemon.stop(signal.SIGTERM) == 0, daemon.log()[-3000:]
    stopping = listener.first("STOPPING=1")
    watchdogs = [i for i, (_, d) in enumerate(listener.messages) if d == "WATCHDOG=1"]
    assert ready < watchdogs[0] and watchdogs[-1] < stopping, listener.messages
    assert stopping == len(listener.messages) - 1  # nothing after STOPPING=1
    daemon.assert_cleaned_up(pids)
