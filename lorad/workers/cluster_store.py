"""torch.distributed's store between hosts: rank 0 serves it on --master-addr only.

torch's own TCPStore server listens on every interface; rank 0 binds a socket to the one address
instead and hands it over, the other ranks connect. One host keeps its FileStore (no port).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from urllib.parse import urlsplit

import torch.distributed as dist

from lorad.config.errors import ConfigError

LISTEN_BACKLOG = 128


def tcp_store(init_method: str, rank: int, world_size: int,
              timeout: timedelta) -> dist.TCPStore:
    """The store at `tcp://ADDR:PORT`: served by rank 0, bound to ADDR alone."""
    where = urlsplit(init_method)
    host, port = where.hostname, where.port
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart within TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--master-port {port}: cannot listen on {where.netloc} for "
                          f"torch.distributed's store: {exc.strerror}") from None
    sock.listen(LISTEN_BACKLOG)
    # detach(): the store owns the descriptor from here on (closing it would stop the server).
    return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())
