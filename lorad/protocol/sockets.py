"""ZeroMQ sockets of one lorad instance and the private runtime directory that holds them.

Sockets are `ipc://` files inside a 0700 directory unique to the instance, so two daemons on one
host never collide and no other user can connect. Between hosts (--nnodes) they are tcp:// on
--master-addr with CURVE (curve.py). The coordinator binds; workers connect. A folder
left behind by a coordinator that was killed (its pid is in the name) is removed by the next one.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

import zmq

from lorad.config.errors import ConfigError
from lorad.protocol.codec import SOCKET_MAX_MSG_BYTES
from lorad.protocol.curve import ServerKeys, make_server


_RUNTIME_DIR_NAME = re.compile(r"lorad-.+-(\d+)-[0-9a-f]{8}")  # lorad-NAME-PID-RANDOM


def runtime_base(parent: str | None) -> Path:
    """Where instance folders go: --runtime-dir, else $XDG_RUNTIME_DIR, else the temp folder."""
    return Path(parent or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())


def remove_stale_runtime_dirs(parent: str | None) -> list[Path]:
    """Remove this user's instance folders whose coordinator process no longer exists (it was
    killed before it could clean up); returns what was removed. A folder whose pid is alive is
    kept, even if the pid was reused: a leftover folder is harmless, a removed live one is not."""
    base = runtime_base(parent)
    removed = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for path in entries:
        match = _RUNTIME_DIR_NAME.fullmatch(path.name)
        try:
            if match is None or path.is_symlink() or not path.is_dir() \
                    or path.stat().st_uid != os.getuid() or _pid_exists(int(match.group(1))):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def make_runtime_dir(parent: str | None, name: str) -> tuple[Path, str]:
    """Create a fresh 0700 directory for this instance; returns it and the instance id."""
    instance_id = f"{name}-{os.getpid()}-{secrets.token_hex(4)}"
    base = runtime_base(parent)
    if parent is not None:
        try:
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--runtime-dir {parent}: cannot create it: {exc}") from None
    path = base / f"lorad-{instance_id}"
    try:
        path.mkdir(mode=0o700)
    except OSError as exc:
        raise ConfigError(f"cannot create the runtime directory {path}: {exc}") from None
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode != 0o700:
        path.chmod(0o700)
    # ipc:// paths are limited to ~107 bytes by the kernel's sockaddr_un.
    if len(str(path)) > 80:
        raise ConfigError(f"runtime directory path {path} is too long for ipc sockets; "
                          "use --runtime-dir with a shorter path")
    return path, instance_id


def bind_publisher(ctx: zmq.Context, endpoint: str, keys: ServerKeys | None = None) -> zmq.Socket:
    """keys: CURVE (tcp:// between hosts); None on ipc://."""
    sock = ctx.socket(zmq.PUB)
    if keys is not None:
        _make_tcp_server(sock, endpoint, keys)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop an admission: the sequence must stay gapless
    _bind(sock, endpoint)
    return sock


def _bind(sock: zmq.Socket, endpoint: str) -> None:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        flags = " (--master-addr, --master-port + 1 and + 2)" if endpoint.startswith("tcp") else ""
        raise ConfigError(f"cannot listen on {endpoint}{flags}: {zmq.strerror(exc.errno)}") \
            from None


def _make_tcp_server(sock: zmq.Socket, endpoint: str, keys: ServerKeys) -> None:
    if endpoint.startswith("tcp://["):  # an IPv6 address; an IPv4 one keeps an IPv4 socket
        sock.setsockopt(zmq.IPV6, 1)
    make_server(sock, keys)


def connect_subscriber(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, SOCKET_MAX_MSG_BYTES)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def bind_puller(ctx: zmq.Context, endpoint: str, keys: ServerKeys | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    if keys is not None:
        _make_tcp_server(sock, endpoint, keys)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, SOCKET_MAX_MSG_BYTES)
    _bind(sock, endpoint)
    return sock


def connect_pusher(ctx: zmq.Context, endpoint: str, max_queued: int = 0) -> zmq.Socket:
    """max_queued: 0 queues without bound (results must not be lost); a status thread's socket
    keeps only a few reports for a coordinator that is not reading."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000 if max_queued == 0 else 0)  # let a final WorkerFailed out
    sock.setsockopt(zmq.SNDHWM, max_queued)
    sock.connect(endpoint)
    return sock
