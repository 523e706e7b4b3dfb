"""Several hosts: --nnodes, --node-rank, --master-addr, --master-port, --cluster-key-dir.

A frozen ClusterConfig, validated with errors naming the flag, and what derives from it: each
node's contiguous range of ranks, the TCP endpoints off one address and port. One host (the
default) keeps everything on ipc:// and a FileStore; this module then derives nothing.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from lorad.config.errors import ConfigError

DEFAULT_MASTER_PORT = 29500
# Ports above --master-port: torch.distributed's store takes the port itself, the coordinator's
# PUB socket the next, its result PULL socket the one after.
ADMIT_PORT_OFFSET = 1
RESULTS_PORT_OFFSET = 2


@dataclass(frozen=True)
class ClusterConfig:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # node 0's IP address: the store and the coordinator bind it
    master_port: int | None = None
    key_dir: str | None = None  # --cluster-key-dir: this host's CURVE keys
    node_addr: str | None = None  # --node-addr: this host's IP for its ranks' collectives

    def __post_init__(self) -> None:
        if not isinstance(self.nnodes, int) or isinstance(self.nnodes, bool) or self.nnodes < 1:
            raise ConfigError(f"--nnodes must be a positive integer, got {self.nnodes!r}")
        if self.nnodes == 1:
            self._check_single_host()
            return
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be 0..{self.nnodes - 1} with --nnodes "
                              f"{self.nnodes}, got {self.node_rank!r}")
        if not self.master_addr:
            raise ConfigError(f"--nnodes {self.nnodes} needs --master-addr (node 0's address)")
        _check_address(self.master_addr, "--master-addr")
        if self.node_addr is not None:
            _check_address(self.node_addr, "--node-addr")
        port = self.master_port
        if not isinstance(port, int) or not 0 < port <= 65535 - RESULTS_PORT_OFFSET:
            raise ConfigError(f"--master-port must be 1..{65535 - RESULTS_PORT_OFFSET} (the two "
                              f"ports above it are used too), got {port!r}")
        if not self.key_dir:
            raise ConfigError(f"--nnodes {self.nnodes} needs --cluster-key-dir: the control "
                              "plane off loopback is encrypted with CURVE keys (`lorad keys`)")

    def _check_single_host(self) -> None:
        for flag, value in (("--node-rank", self.node_rank or None),
                            ("--master-addr", self.master_addr),
                            ("--master-port", self.master_port),
                            ("--cluster-key-dir", self.key_dir),
                            ("--node-addr", self.node_addr)):
            if value is not None:
                raise ConfigError(f"{flag} {value} needs --nnodes 2 or more")

    @property
    def gloo_addr(self) -> str | None:
        """Where this host's gloo pairs listen: --node-addr, on node 0 --master-addr; None:
        torch's choice (GLOO_SOCKET_IFNAME's interface, or what the host name resolves to)."""
        if self.node_addr is not None or not self.multi_host:
            return self.node_addr
        return self.master_addr if self.node_rank == 0 else None

    @property
    def multi_host(self) -> bool:
        return self.nnodes > 1

    def check_parallel(self, parallel: int) -> None:
        if parallel % self.nnodes:
            raise ConfigError(f"--parallel {parallel} does not split evenly over --nnodes "
                              f"{self.nnodes}: give each host the same number of ranks")

    def local_ranks(self, parallel: int) -> range:
        """This node's ranks: a contiguous range, node 0 holding rank 0 (the leader)."""
        per_node = parallel // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def node_of(self, rank: int, parallel: int) -> int:
        return rank // (parallel // self.nnodes)

    def flags(self, parallel: int) -> str:
        """What every host must be started with alike, as flags (checked in the store)."""
        return f"--parallel {parallel} --nnodes {self.nnodes}"

    def hosts_of_ranks(self, parallel: int) -> str:
        """Where each rank runs, for a message that names ranks: '' on one host."""
        if not self.multi_host:
            return ""
        per_node = parallel // self.nnodes
        nodes = [f"node {n} ({'coordinator' if n == 0 else 'lorad node'}): ranks "
                 f"{n * per_node}..{(n + 1) * per_node - 1}" for n in range(self.nnodes)]
        return f" [{'; '.join(nodes)}]"

    @property
    def instance_id(self) -> str:
        """The instance's name on every host (Hello and Ready carry it)."""
        return f"cluster@{_url_host(self.master_addr)}:{self.master_port}"

    def endpoint(self, offset: int) -> str:
        return f"tcp://{_url_host(self.master_addr)}:{self.master_port + offset}"


def _check_address(addr: str, flag: str) -> None:
    """An IP address (ZeroMQ and gloo bind addresses, not names), never a wildcard: a host
    listens on that one address only."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        raise ConfigError(f"{flag} must be an IP address of the host, got {addr!r}") from None
    if ip.is_unspecified:
        raise ConfigError(f"{flag} must be an address of the host, not the wildcard {addr}")


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
