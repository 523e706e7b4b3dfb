"""`python -m lorad.workers --config RUNDIR/worker.json --rank R`: one worker process.

Sets up logging, threads and the parent-death signal, connects the sockets, starts the status
thread (status.py: reports from the first second on, through loading), starts the engine and runs
the loop; any exception becomes a WorkerFailed message and a non-zero exit (a ConfigError, a
setting or file lorad refuses, its one line without a traceback).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import zmq

from lorad.config import ConfigError, WorkerConfig, process_gc
from lorad.protocol import WorkerFailed, encode
from lorad.protocol.curve import client_keys, make_clients
from lorad.protocol.sockets import connect_pusher, connect_subscriber
from lorad.workers.cpu_threads import log_padding
from lorad.workers.startup_clock import StartupClock
from lorad.workers.status import LoopProgress, StatusThread

log = logging.getLogger("lorad.worker")

PR_SET_PDEATHSIG = 1
# glibc's mallopt parameters, and their values here: blocks up to 32 MiB (glibc's largest mmap
# threshold on 64-bit) come from the heap, and the heap is trimmed only past 2 GiB free at its top.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 2 ** 31 - 1  # an int


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lorad.workers")
    parser.add_argument("--config", required=True, help="the worker.json the coordinator wrote")
    parser.add_argument("--rank", required=True, type=int)
    parser.add_argument("--spawned-at", type=float,
                        help="the coordinator's time.monotonic() when it started this process "
                             "(default: now): where this rank's start-up report begins")
    args = parser.parse_args(argv)
    clock = StartupClock(time.monotonic() if args.spawned_at is None else args.spawned_at)
    cfg = WorkerConfig.from_json(Path(args.config).read_text(encoding="utf-8"))
    logging.basicConfig(
        stream=sys.stderr, level=cfg.log_level.upper(),
        format=f"%(asctime)s lorad.worker[rank {args.rank}] %(levelname)s %(message)s")
    # Padded batches keep a row's bits independent of its neighbours and of the thread count on
    # MKL (shared/DESIGN.md, "Numerics"; workers/batch.py); interop threads would only add
    # nondeterministic scheduling.
    on_gpu = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    torch.set_num_threads(cfg.threads(on_gpu, len(os.sched_getaffinity(0))))
    torch.set_num_interop_threads(1)
    log.info("torch threads: %d%s", torch.get_num_threads(),
             " (--threads auto)" if cfg.num_threads is None else "")
    if not on_gpu:  # which products threads split differently: measured now, not mid-step
        log_padding(torch.get_num_threads())
    _die_with_parent()
    keep_freed_memory()
    ctx = zmq.Context()
    if cfg.nnodes > 1:  # tcp:// to another host: every socket a CURVE client
        make_clients(ctx, client_keys(cfg.cluster_key_dir))
    push = connect_pusher(ctx, cfg.results_endpoint)
    sub = connect_subscriber(ctx, cfg.admit_endpoint)
    status = StatusThread(ctx, cfg.results_endpoint, args.rank, cfg.coordinator_pid,
                          LoopProgress())
    status.start()
    try:
        code = _serve(cfg, args.rank, sub, push, status.progress, clock)
    except ConfigError as exc:  # a setting or file lorad refuses: its one line says it all
        log.error("%s", exc)
        push.send(encode(WorkerFailed(args.rank, str(exc))))
        code = 1
    except Exception as exc:  # a failure is data: tell the coordinator, then exit non-zero
        log.exception("worker failed")
        push.send(encode(WorkerFailed(args.rank, f"{type(exc).__name__}: {exc}")))
        code = 1
    status.stop()
    sub.close(linger=0)
    push.close(linger=1000)  # let a final StepResult or WorkerFailed reach the coordinator
    ctx.term()
    log.info("exiting with code %d", code)
    return code


def _serve(cfg: WorkerConfig, rank: int, sub: zmq.Socket, push: zmq.Socket,
           progress: LoopProgress, clock: StartupClock) -> int:
    # Imported here so that an import error (a broken model file) is reported as WorkerFailed.
    from lorad.workers.engine import Engine
    from lorad.workers.loop import WorkerLoop

    engine = Engine.start(cfg, rank, clock)
    loop = WorkerLoop(cfg, rank, engine, sub, push, progress)
    process_gc.freeze(log)  # the model, its kernels and graphs: no collection walks them again
    try:
        return loop.run()
    finally:
        loop.close()


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM us when the coordinator dies, even mid-collective."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError as exc:
        log.warning("prctl(PR_SET_PDEATHSIG) unavailable: %s", exc)


def keep_freed_memory() -> bool:
    """Keep the memory a step frees for the next step (glibc; False elsewhere).

    A CPU step allocates the same tensors every time, many of more than glibc's default mmap
    threshold (128 KiB at start: a gathered block of keys, a product's output), so by default
    each is a fresh mmap and each of its pages a fault: ~250 minor faults per SmolLM2 step of 8
    decodes, none after this. Bounded by the largest step's working set, which stays reserved."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                    and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError, ctypes.ArgumentError) as exc:  # another C library
        log.debug("mallopt unavailable: %s", exc)
        return False


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    # Skip interpreter teardown: a process group whose peers already left can block in it.
    os._exit(code)
