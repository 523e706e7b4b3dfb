"""ZeroMQ sockets of one lorad instance and the private runtime directory that holds them.

Sockets are `ipc://` files inside a 0700 directory unique to the instance, so two daemons on one
host never collide and no other user can connect. The coordinator binds; workers connect.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

import zmq

from lorad.config.errors import ConfigError


def make_runtime_dir(parent: str | None, name: str) -> tuple[Path, str]:
    """Create a fresh 0700 directory for this instance; returns it and the instance id."""
    instance_id = f"{name}-{os.getpid()}-{secrets.token_hex(4)}"
    base = Path(parent or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
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


def bind_publisher(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop an admission: the sequence must stay gapless
    sock.bind(endpoint)
    return sock


def connect_subscriber(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def bind_puller(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(endpoint)
    return sock


def connect_pusher(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)  # let a final WorkerFailed reach the coordinator
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    return sock
