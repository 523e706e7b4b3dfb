"""torch.distributed between hosts: the TCP store, served by rank 0 on --master-addr alone (torch's
own listens everywhere), where every host's flags are compared first; and a gloo backend whose
pairs listen on one address of this host. One host keeps its FileStore and plain gloo.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from urllib.parse import urlsplit

import torch.distributed as dist

from lorad.config.errors import ConfigError

LISTEN_BACKLOG = 128


FLAGS_KEY = "lorad/cluster-flags"


def tcp_store(init_method: str, rank: int, world_size: int, timeout: timedelta,
              flags: str = "") -> dist.TCPStore:
    """The store at `tcp://ADDR:PORT`: served by rank 0, bound to ADDR alone. `flags`: what
    every host must be started with alike (--parallel, --nnodes); rank 0 posts its own, the
    others refuse to join with different ones, before any rank counts on them."""
    where = urlsplit(init_method)
    host, port = where.hostname, where.port
    if rank != 0:
        store = dist.TCPStore(host, port, world_size, False, timeout)
        node0 = store.get(FLAGS_KEY).decode()
        if node0 != flags:
            raise ConfigError(f"this host was started with {flags}, node 0 with {node0}: give "
                              "every host the same")
        return store
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
    store = dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                          master_listen_fd=sock.detach())
    store.set(FLAGS_KEY, flags)
    return store


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
