"""A node agent's watch on the coordinator of another host: is it still there?

One SUB socket (subscribed to nothing, so no admission reaches it) on the coordinator's PUB
endpoint, with ZeroMQ heartbeats: a coordinator that exits closes the connection, a host that
stalls or drops off stops answering the pings. Reports, never acts (node.py stops the workers).
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from lorad.config import WorkerConfig
from lorad.protocol.curve import client_keys, make_clients

log = logging.getLogger("lorad.node")

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000  # a coordinator silent this long is taken for gone
EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
          | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)


class CoordinatorWatch:
    def __init__(self, cfg: WorkerConfig) -> None:
        self._endpoint = cfg.admit_endpoint
        self._ctx = zmq.asyncio.Context()
        make_clients(self._ctx, client_keys(cfg.cluster_key_dir))
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self._monitor = self._sock.get_monitor_socket(EVENTS)
        self._sock.connect(self._endpoint)

    async def lost(self, startup_timeout_s: float) -> str:
        """Returns why the coordinator is gone: reached, then disconnected, or never reached
        within startup_timeout_s."""
        reached, refused = False, False
        deadline = asyncio.get_running_loop().time() + startup_timeout_s
        while True:
            wait_s = None if reached else deadline - asyncio.get_running_loop().time()
            if wait_s is not None and wait_s <= 0:
                return (f"the coordinator at {self._endpoint} was not reached within "
                        f"--startup-timeout ({startup_timeout_s:g}s)")
            try:
                frames = await asyncio.wait_for(self._monitor.recv_multipart(), wait_s)
            except TimeoutError:
                continue
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and not reached:
                reached = True
                log.info("reached the coordinator at %s", self._endpoint)
            elif event == zmq.EVENT_DISCONNECTED and reached:
                return f"lost the coordinator at {self._endpoint} (gone or not answering)"
            elif event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                           zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL) and not refused:
                refused = True  # zmq retries every reconnect interval: said once
                log.error("the coordinator at %s refused this host's CURVE key: is node.key "
                          "in its authorized_keys, and coordinator.key its key?", self._endpoint)

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()
