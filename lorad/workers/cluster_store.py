"""torch.distributed between hosts: the store, which rank 0 serves on --master-addr only, and a
gloo backend whose pairs listen on one given address of this host.

torch's own TCPStore server listens on every interface; rank 0 binds a socket to the one address
instead and hands it over, the other ranks connect. torch's gloo binds what the host name
resolves to (or GLOO_SOCKET_IFNAME's interface). One host keeps its FileStore and plain gloo.
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


BOUND_GLOO = "lorad_gloo"


def bound_gloo_backend(addr: str) -> str:
    """The name of a gloo backend whose pairs listen on `addr` alone, registered once per
    process (torch.distributed keeps one registry; this process serves one rank)."""
    def create(store, rank: int, size: int, timeout: timedelta):
        # _Options and _devices are torch's private spelling of ProcessGroupGloo's devices;
        # tests/integration/test_hosts.py checks where the pairs listen.
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=addr)]
        return dist.ProcessGroupGloo(store, rank, size, options)

    if BOUND_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(BOUND_GLOO, create, devices=["cpu"])
    return BOUND_GLOO
