"""sd_notify over real AF_UNIX datagram sockets: a path and an abstract address receive the lines,
no NOTIFY_SOCKET is a no-op, and a socket nobody listens on is logged, never raised."""

from __future__ import annotations

import logging
import os
import socket

import pytest

from lorad.daemon import systemd


@pytest.fixture
def listener(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(5)
    yield sock, str(tmp_path / "notify")
    sock.close()


def test_path_address(listener, monkeypatch):
    sock, path = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert systemd.notify("READY=1", "STATUS=serving")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


def test_abstract_address(monkeypatch):
    name = f"lorad-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd.notify("WATCHDOG=1")
        assert sock.recv(4096) == b"WATCHDOG=1"


def test_no_notify_socket_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify("READY=1") is False


def test_send_errors_are_logged_not_raised(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    with caplog.at_level(logging.WARNING, logger="lorad.systemd"):
        assert systemd.notify("READY=1") is False
        assert systemd.notify("STOPPING=1") is False
    assert len([r for r in caplog.records if "cannot notify systemd" in r.message]) == 1


def test_watchdog_interval(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "20000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert systemd.watchdog_interval() == 10.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert systemd.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setenv("WATCHDOG_USEC", "0")
    assert systemd.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert systemd.watchdog_interval() is None


def test_child_environment_has_no_notify_variables(monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("WATCHDOG_USEC", "1000")
    monkeypatch.setenv("LORAD_SOMETHING", "kept")
    env = systemd.child_environment()
    assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env
    assert env["LORAD_SOMETHING"] == "kept"
