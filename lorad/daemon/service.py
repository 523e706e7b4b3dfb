"""The coordinator's lifetime: start workers, agree, serve HTTP, then stop on a signal or a failure.

A signal (SIGTERM, SIGINT) starts a drain: new generation requests get a 503, open ones run on
for up to --shutdown-timeout, then whatever is left ends with an error; a second signal ends
the drain at once. Either way the exit status is 0. A worker that exits, reports WorkerFailed or
stalls ends every open stream with an error and stops the rest (exit 1). Whatever happens, the
worker processes are stopped and the runtime directory is removed before returning. Under
systemd it says READY=1 once every rank has loaded, agreed and run its warm-up step, pings the
watchdog while the ranks' steps progress, and says STOPPING=1 when a drain or a failure begins
(systemd.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import os
import re
import shutil
import signal
from pathlib import Path

from aiohttp import web

from lorad.config import ServeConfig, WorkerConfig, process_gc
from lorad.daemon import systemd
from lorad.daemon.admission import Admission, queue_bound
from lorad.daemon.engine_client import EngineClient, EngineFacts, StartupError, exit_message
from lorad.daemon.metrics import Metrics
from lorad.daemon.adapter_catalog import AdapterCatalog
from lorad.daemon.routes import AppState, ServedModel, build_app
from lorad.daemon.startup import StartupReport, process_started_at
from lorad.daemon.supervisor import WORKER_COMMAND, Supervisor
from lorad.protocol.sockets import make_runtime_dir, remove_stale_runtime_dirs

log = logging.getLogger("lorad")

HTTP_DRAIN_S = 5.0  # how long handlers get to write their final events before connections close
SHUTDOWN_MESSAGE = "the server is shutting down; this request was ended before it finished"
WORKER_EXIT_GRACE_S = 15.0  # after Shutdown, before SIGTERM
EXTEND_EVERY_S = 5.0  # while loading, ask systemd for EXTEND_BY_S more this often
EXTEND_BY_S = 20.0


async def serve(config: ServeConfig, model: ServedModel,
                worker_command: tuple[str, ...] = WORKER_COMMAND) -> int:
    """Run one lorad instance until a signal (returns 0) or a failure (returns 1)."""
    dir_name = re.sub(r"[^A-Za-z0-9_.-]+", "-", config.served_name)[:24] or "model"
    for stale in remove_stale_runtime_dirs(config.runtime_dir):
        log.warning("removed the runtime directory %s left by a coordinator that no longer "
                    "runs", stale)
    runtime_dir, instance_id = make_runtime_dir(config.runtime_dir, dir_name)
    try:
        worker_config = with_cluster(_worker_config(config, model, runtime_dir, instance_id),
                                     config)
        _write_private(worker_config.path, worker_config.to_json())
        return await _run(config, model, worker_config, worker_command)
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


async def _run(config: ServeConfig, model: ServedModel, worker_config: WorkerConfig,
               worker_command: tuple[str, ...]) -> int:
    loop = asyncio.get_running_loop()
    stop, hurry = asyncio.Event(), asyncio.Event()  # the first signal, a second one

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    engine = EngineClient(worker_config, config.step_timeout)
    supervisor = Supervisor(worker_config, worker_command)
    runner: web.AppRunner | None = None
    waits: list[asyncio.Task] = []
    try:
        try:
            await supervisor.start()
        except OSError as exc:
            log.error("cannot start the workers: %s", exc)
            return 1
        exited = asyncio.create_task(supervisor.first_exit())
        exited.add_done_callback(lambda t: t.cancelled() or engine.mark_exited(t.result()[0]))
        engine.exited_ranks = supervisor.exited_now
        stopped = asyncio.create_task(stop.wait())
        extending = asyncio.create_task(_extend_start_timeout(engine, config))
        waits = [exited, stopped, extending]
        facts = await _handshake(engine, config, exited, stopped)
        extending.cancel()
        if not isinstance(facts, EngineFacts):
            return facts
        max_queued = queue_bound(config.max_queued_requests, facts.max_num_seqs)
        catalog = AdapterCatalog(model.adapters, model.capacity, model.model_config, model.name,
                                 config.adapter_dir, config.pinned_adapters)
        state = AppState(model, engine, Admission(max_queued, config.request_timeout), Metrics(),
                         prefix_cache=config.prefix_cache, catalog=catalog,
                         deterministic=config.deterministic,
                         speculative_ngram=config.speculative_ngram)
        engine.on_step_result = state.metrics.step_result
        engine.start()
        runner = await _start_http(state, config)
        if runner is None:
            return 1
        _report_startup(engine, supervisor, facts)  # before any await: no probe answers without it
        log.info("serving %s at http://%s:%d (%d rank(s), %d KV blocks of %d tokens, at most %d "
                 "sequences a step, %d queued)", model.name, _url_host(config.host), config.port,
                 facts.num_ranks, facts.num_kv_blocks, facts.block_size, facts.max_num_seqs,
                 max_queued)
        process_gc.freeze(log)
        # Every rank has loaded, agreed on the registry and run its warm-up step (its Ready says
        # so), and the port is open.
        systemd.notify("READY=1", f"STATUS=serving {model.name} on {facts.num_ranks} rank(s)")
        waits.append(asyncio.create_task(_ping_watchdog(engine)))
        await asyncio.wait([exited, stopped, engine.failure], return_when=asyncio.FIRST_COMPLETED)
        if stopped.done() and not exited.done() and not engine.failure.done():
            await _drain(state, config.shutdown_timeout, hurry, exited)
        return await _stop(state, runner, supervisor, exited)
    finally:
        for task in waits:
            task.cancel()
        if runner is not None and runner.server is not None:
            await runner.cleanup()
        await supervisor.stop(grace_s=2.0)
        engine.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _handshake(engine: EngineClient, config: ServeConfig, exited: asyncio.Task,
                     stopped: asyncio.Task) -> EngineFacts | int:
    """The agreed engine facts, or the exit status if start-up failed or a signal came first."""
    handshake = asyncio.create_task(engine.handshake(config.parallel, config.startup_timeout))
    await asyncio.wait([handshake, exited, stopped], return_when=asyncio.FIRST_COMPLETED)
    if not handshake.done():
        handshake.cancel()
        if not exited.done():
            log.info("stopped by a signal during start-up")
            return 0
        rank, code = exited.result()
        log.error("start-up failed: worker rank %d exited with code %s before it was ready",
                  rank, code)
        return 1
    try:
        return handshake.result()
    except StartupError as exc:
        log.error("start-up failed: %s", exc)
        return 1


def _report_startup(engine: EngineClient, supervisor: Supervisor, facts: EngineFacts) -> None:
    """The `ready in` line, and the same report for /health and /metrics (startup.py)."""
    engine.startup = StartupReport.measure(process_started_at(), supervisor.started_at,
                                           facts.startup_phases)
    log.info("%s", engine.startup.describe())


async def _stop(state: AppState, runner: web.AppRunner, supervisor: Supervisor,
                exited: asyncio.Task) -> int:
    """Wind down after the first of: a worker exited, the engine failed, a signal."""
    if state.status != "draining":  # a signal's stop began with the drain, which said so
        systemd.notify("STOPPING=1")
    failure = state.engine.failure
    if exited.done() or failure.done():
        if failure.done():
            message = failure.result()
        else:
            message = exit_message(*exited.result())
        state.status = "failed"
        # A WorkerFailed message has already failed the engine (and its requests) by now.
        state.engine.fail(message)
        log.error("%s; ended %d open request(s) with an error; shutting down", message,
                  state.engine.num_failed_by_engine)
        await runner.cleanup()
        if state.engine.stalled:
            await supervisor.kill()  # blocked in a step or a collective: nothing else reaches it
        await supervisor.stop(grace_s=2.0)
        return 1
    state.status = "stopping"
    state.engine.abort_all(SHUTDOWN_MESSAGE)  # nothing is open after a drain; this is a guard
    state.engine.shutdown()
    await runner.cleanup()
    await supervisor.stop(grace_s=WORKER_EXIT_GRACE_S)
    return 0


async def _drain(state: AppState, timeout_s: float, hurry: asyncio.Event,
                 exited: asyncio.Task) -> None:
    """Admit nothing new, let open requests finish for up to timeout_s (a second signal, a
    worker exit or an engine failure ends the wait early), then end the rest with an error."""
    state.status = "draining"  # from here every new generation request gets a 503
    systemd.notify("STOPPING=1")  # systemd: the stop begins with the drain
    log.info("signal received: draining %d open request(s) for up to %gs (a second signal "
             "stops at once)", state.admission.num_open, timeout_s)
    idle = asyncio.create_task(state.admission.wait_idle())
    hurried = asyncio.create_task(hurry.wait())
    try:
        await asyncio.wait([idle, hurried, exited, state.engine.failure], timeout=timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        idle.cancel()
        hurried.cancel()
    if exited.done() or state.engine.failure.done() or state.admission.num_open == 0:
        return
    why = "a second signal" if hurry.is_set() else f"--shutdown-timeout ({timeout_s:g}s)"
    num_cut = state.admission.cut_all(SHUTDOWN_MESSAGE)
    log.warning("drain ended by %s: ending %d open request(s) with an error", why, num_cut)
    try:  # each handler writes its terminal event, then leaves
        await asyncio.wait_for(state.admission.wait_idle(), HTTP_DRAIN_S)
    except TimeoutError:
        log.warning("%d request(s) still writing after %gs; closing their connections",
                    state.admission.num_open, HTTP_DRAIN_S)


async def _extend_start_timeout(engine: EngineClient, config: ServeConfig) -> None:
    """While the ranks load, keep systemd's start timeout ahead of us, up to --startup-timeout
    (which fails the start by itself)."""
    deadline = asyncio.get_running_loop().time() + config.startup_timeout
    while True:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return
        systemd.notify(f"EXTEND_TIMEOUT_USEC={int(min(EXTEND_BY_S, left + 5) * 1e6)}",
                       f"STATUS=loading: {engine.num_ranks_ready} of {config.parallel} "
                       "rank(s) ready")
        await asyncio.sleep(EXTEND_EVERY_S)


async def _ping_watchdog(engine: EngineClient) -> None:
    """WATCHDOG=1 at half of WATCHDOG_USEC, but only when every rank's loop has completed rounds
    since the last ping: a stuck engine stops the pings and systemd restarts the service."""
    interval = systemd.watchdog_interval()
    if interval is None:
        return
    pinged: list[int] | None = None
    while True:
        await asyncio.sleep(interval)
        ranks = engine.rank_states()
        steps = [r.steps for r in ranks]
        if any(r.state != "serving" for r in ranks):
            continue
        if pinged is None or all(now > then for now, then in zip(steps, pinged)):
            systemd.notify("WATCHDOG=1")
            pinged = steps


async def _start_http(state: AppState, config: ServeConfig) -> web.AppRunner | None:
    # handler_cancellation: a client that hangs up cancels its handler, which cancels the
    # sequence even while it is still waiting for its first token.
    runner = web.AppRunner(build_app(state, config.api_key, config.admin_key),
                           handler_cancellation=True,
                           shutdown_timeout=HTTP_DRAIN_S)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, exc)
        await runner.cleanup()
        return None
    if not _is_loopback(config.host) and config.api_key is None:
        log.warning("listening on %s: the API is reachable from other machines and has no "
                    "authentication", config.host)
    return runner


def _worker_config(config: ServeConfig, model: ServedModel, runtime_dir: Path,
                   instance_id: str) -> WorkerConfig:
    return WorkerConfig(
        model_dir=str(Path(config.model_dir).resolve()), parallel=config.parallel,
        dtype=config.dtype, device=config.device, dist_backend=config.dist_backend,
        max_model_len=model.max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, block_size=config.block_size,
        kv_cache_blocks=config.kv_cache_blocks, kv_cache_memory=config.kv_cache_memory,
        num_threads=config.num_threads, runtime_dir=str(runtime_dir), instance_id=instance_id,
        coordinator_pid=os.getpid(), log_level=config.log_level,
        load_format=config.load_format, all_reduce=config.all_reduce,
        enforce_eager=config.enforce_eager, mixed_step_graphs=config.mixed_step_graphs,
        async_scheduling=config.async_scheduling,
        deterministic=config.deterministic,
        speculative_ngram=config.speculative_ngram,
        prefix_cache=config.prefix_cache, kv_spill_dir=config.kv_spill_dir,
        kv_spill_bytes=config.kv_spill_bytes, kernel_cache_dir=config.kernel_cache_dir,
        adapters=[spec.to_worker_dict() for spec in model.adapters],
        lora_slots=model.capacity.num_slots, lora_runtime=model.capacity.runtime,
        lora_max_rank=model.capacity.max_rank, lora_dtype=model.capacity.dtype,
        max_cpu_adapters=config.max_cpu_adapters,
        pinned_adapters=[a.adapter_id for a in model.adapters
                         if a.name in config.pinned_adapters])


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def with_cluster(worker_config: WorkerConfig, config: ServeConfig) -> WorkerConfig:
    """The worker config with the several-hosts settings (unchanged on one host). Every host
    names the instance alike without talking first; the workers watch the process that wrote
    it (the coordinator, or on another host its node agent, node.py)."""
    cluster = config.cluster
    if not cluster.multi_host:
        return worker_config
    return dataclasses.replace(
        worker_config, instance_id=cluster.instance_id, nnodes=cluster.nnodes,
        node_rank=cluster.node_rank, master_addr=cluster.master_addr,
        master_port=cluster.master_port, cluster_key_dir=cluster.key_dir,
        node_addr=cluster.node_addr)
