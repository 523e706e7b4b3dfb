"""`lorad node --nnodes N --node-rank R ...`: the agent of a host other than node 0.

Same flags and checks as `lorad`; starts this host's ranks (TCP + CURVE to node 0) and stops them
when one exits, the coordinator is lost, or on a signal: exit 0 after the coordinator's orderly
Shutdown or a signal, 1 on a failure. Serves no HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import sys
from collections.abc import Callable

import uvloop

from lorad.config import ConfigError, ServeConfig, WorkerConfig
from lorad.config.cli import parse_args
from lorad.daemon.coordinator_watch import CoordinatorWatch
from lorad.daemon.routes import ServedModel
from lorad.daemon.service import (
    WORKER_EXIT_GRACE_S, _worker_config, _write_private, with_cluster)
from lorad.daemon.supervisor import Supervisor
from lorad.protocol.curve import client_keys
from lorad.protocol.sockets import make_runtime_dir, remove_stale_runtime_dirs

log = logging.getLogger("lorad.node")

SHUTDOWN_WAIT_S = 2.0  # coordinator lost: how long its orderly Shutdown may take to show here


def main(argv: list[str], load_model: Callable[[ServeConfig], ServedModel]) -> int:
    """load_model: the coordinator's own checks and registry (main.load_served_model), so that
    this host's workers start with what node 0's would from the same files."""
    config = parse_args(argv, node=True)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        client_keys(config.cluster.key_dir)  # refused here, before anything loads
        model = load_model(config)
        return uvloop.run(run_node(config, model))
    except ConfigError as exc:
        print(f"lorad node: error: {exc}", file=sys.stderr)
        return 2


async def run_node(config: ServeConfig, model: ServedModel) -> int:
    for stale in remove_stale_runtime_dirs(config.runtime_dir):
        log.warning("removed the runtime directory %s left by an agent that no longer runs",
                    stale)
    runtime_dir, instance_id = make_runtime_dir(config.runtime_dir,
                                                f"node{config.cluster.node_rank}")
    try:
        worker_config = with_cluster(_worker_config(config, model, runtime_dir, instance_id),
                                     config)
        _write_private(worker_config.path, worker_config.to_json())
        return await _supervise(worker_config, config.startup_timeout)
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


async def _supervise(cfg: WorkerConfig, startup_timeout: float) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    supervisor = Supervisor(cfg)
    watch = CoordinatorWatch(cfg)
    tasks: list[asyncio.Task] = []
    try:
        await supervisor.start()
        log.info("node %d: ranks %s started; waiting for the coordinator at %s", cfg.node_rank,
                 list(cfg.local_ranks), cfg.admit_endpoint)
        exited = asyncio.create_task(supervisor.first_exit())
        lost = asyncio.create_task(watch.lost(startup_timeout))
        tasks = [exited, lost, asyncio.create_task(stop.wait())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if lost.done() and not exited.done():  # an orderly stop closes the coordinator last
            await asyncio.wait([exited], timeout=SHUTDOWN_WAIT_S)
        return await _stop(supervisor, exited, lost)
    finally:
        for task in tasks:
            task.cancel()
        await supervisor.stop(grace_s=0.0)
        watch.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _stop(supervisor: Supervisor, exited: asyncio.Task, lost: asyncio.Task) -> int:
    if exited.done() and exited.result()[1] == 0:
        log.info("worker rank %d exited after the coordinator's shutdown; waiting for the "
                 "others", exited.result()[0])
        await supervisor.stop(grace_s=WORKER_EXIT_GRACE_S)
        return 0
    if exited.done():
        log.error("worker rank %d exited with code %s; stopping this host's workers",
                  *exited.result())
        await supervisor.stop(grace_s=2.0)
        return 1
    if lost.done():
        log.error("%s; stopping this host's workers", lost.result())
        await supervisor.kill()  # they may be blocked in a collective with no peer left
        return 1
    log.info("signal received: stopping this host's workers")
    await supervisor.stop(grace_s=0.0)
    return 0
