"""CURVE keys of a cluster's control plane, as files in --cluster-key-dir, and who may connect.

One Z85 key a file: coordinator.key/.secret (node 0), node.key/.secret (every host), and node 0's
authorized_keys; secrets 0600. The coordinator's ZAP handler admits only listed keys. Opens no
socket to a peer (sockets.py does).
"""

from __future__ import annotations

import logging
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from lorad.config.errors import ConfigError

log = logging.getLogger("lorad.curve")

COORDINATOR = "coordinator"
NODE = "node"
AUTHORIZED = "authorized_keys"
Z85_KEY_CHARS = 40
ZAP_DOMAIN = "lorad"  # the authenticator answers for this domain only


@dataclass(frozen=True)
class ServerKeys:
    """The coordinator's side: its secret, and the client keys it admits."""

    secret: bytes
    authorized: frozenset[bytes]


@dataclass(frozen=True)
class ClientKeys:
    """A worker's side: its own pair and the coordinator's public key."""

    public: bytes
    secret: bytes
    server: bytes


def write_pair(key_dir: Path, name: str) -> tuple[Path, Path]:
    """A new key pair as NAME.key (0644) and NAME.secret (0600); never overwrites a file."""
    public, secret = zmq.curve_keypair()
    key_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = (key_dir / f"{name}.key", key_dir / f"{name}.secret")
    for path, key, mode in ((paths[1], secret, 0o600), (paths[0], public, 0o644)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(key + b"\n")
    return paths


def read_key(path: Path, secret: bool = False) -> bytes:
    """One Z85 key from a file; a secret's file must be readable by its owner only."""
    try:
        if secret and stat.S_IMODE(path.stat().st_mode) & 0o077:
            raise ConfigError(f"--cluster-key-dir: {path} is readable by others; "
                              f"chmod 600 it")
        key = path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"--cluster-key-dir: cannot read {path}: {exc.strerror}") from None
    _check_z85(key, path)
    return key


def read_authorized(path: Path) -> frozenset[bytes]:
    """One key a line, anything after it a comment; other lines start with `#` (a Z85 key
    may hold a `#`, so a key is told by its length)."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise ConfigError(f"--cluster-key-dir: cannot read {path}: {exc.strerror}") from None
    keys = []
    for number, line in enumerate(lines, start=1):
        token = line.split(maxsplit=1)[0] if line.strip() else b"#"
        if len(token) != Z85_KEY_CHARS and token.startswith(b"#"):
            continue
        _check_z85(token, f"{path} line {number}")
        keys.append(token)
    if not keys:
        raise ConfigError(f"--cluster-key-dir: {path} lists no key: add each host's node.key")
    return frozenset(keys)


def server_keys(key_dir: str) -> ServerKeys:
    root = Path(key_dir)
    return ServerKeys(read_key(root / f"{COORDINATOR}.secret", secret=True),
                      read_authorized(root / AUTHORIZED))


def client_keys(key_dir: str) -> ClientKeys:
    root = Path(key_dir)
    return ClientKeys(read_key(root / f"{NODE}.key"), read_key(root / f"{NODE}.secret", True),
                      read_key(root / f"{COORDINATOR}.key"))


def _check_z85(key: bytes, path: Path | str) -> None:
    try:
        valid = len(key) == Z85_KEY_CHARS and len(zmq.utils.z85.decode(key)) == 32
    except (ValueError, KeyError, IndexError, struct.error):
        valid = False
    if not valid:
        raise ConfigError(f"--cluster-key-dir: {path} does not hold a Z85 CURVE key "
                          f"({Z85_KEY_CHARS} characters; `lorad keys` writes them)")


class KeyCheck:
    """The ZAP callback: admits listed keys, logs each refused key once."""

    def __init__(self, authorized: frozenset[bytes]) -> None:
        self._authorized = authorized
        self._refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._authorized:
            return True
        if key not in self._refused:  # a refused peer retries every reconnect interval
            self._refused.add(key)
            log.warning("refused a connection with CURVE key %s: not in %s", key.decode(),
                        AUTHORIZED)
        return False


def start_authenticator(ctx: zmq.Context, keys: ServerKeys) -> ThreadAuthenticator:
    """Admit only keys of authorized_keys on every CURVE server socket of `ctx`."""
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("lorad.zap"))
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, KeyCheck(keys.authorized))
    return auth


def make_server(sock: zmq.Socket, keys: ServerKeys) -> None:
    """Before bind: the socket speaks CURVE as the server, its peers checked by the ZAP handler."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


def make_clients(ctx: zmq.Context, keys: ClientKeys) -> None:
    """Every socket `ctx` makes from here on is a CURVE client of the coordinator."""
    ctx.setsockopt(zmq.IPV6, 1)  # --master-addr may be an IPv6 address (IPv4 works as well)
    ctx.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    ctx.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    ctx.setsockopt(zmq.CURVE_SERVERKEY, keys.server)
