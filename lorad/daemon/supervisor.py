"""Starts the worker processes, reports the first one that exits, and stops them all.

Workers run in their own session so a terminal's Ctrl-C reaches only the coordinator, which then
shuts them down in order. Each gets the kernel cache folder as TRITON_CACHE_DIR, and its spawn
time for the start-up report. Knows nothing of what the workers say (engine_client.py does).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time

from lorad.config import WorkerConfig
from lorad.config.kernel_cache import TRITON_ENV
from lorad.config.process_state import stat_fields
from lorad.daemon.systemd import child_environment

log = logging.getLogger("lorad.supervisor")

WORKER_COMMAND = (sys.executable, "-m", "lorad.workers")


def _ended_code(pid: int) -> tuple[bool, int | None]:
    """-> (whether a child that the event loop has not reaped yet has ended, its exit code:
    negative for a signal, None when unknown), from /proc/PID/stat (Linux): an ended child is a
    zombie until it is reaped."""
    fields = stat_fields(pid)
    if fields is None:
        return True, None  # reaped meanwhile: its returncode has the code
    if fields[0] != b"Z":
        return False, None
    # Field 52 (exit_code, Linux 3.5+) holds waitpid's status; this list starts at field 3.
    if len(fields) < 50:
        return True, None
    status = int(fields[49])
    return True, (-(status & 0x7F) if status & 0x7F else status >> 8)


class Supervisor:
    # This host's ranks are contiguous (lorad/config/cluster.py); process i runs rank
    # _first_rank + i. 0 unless another host runs the first ranks.
    _first_rank = 0

    def __init__(self, config: WorkerConfig, command: tuple[str, ...] = WORKER_COMMAND) -> None:
        self._config = config
        self._command = command
        self._procs: list[asyncio.subprocess.Process] = []
        self._waiters: list[asyncio.Task] = []
        self.stopping = False  # set before an orderly stop, so exits are not failures
        self.started_at: float | None = None  # time.monotonic() before the first spawn

    async def start(self) -> None:
        env = child_environment()  # only the coordinator may notify systemd
        if self._config.kernel_cache_dir is not None:
            env[TRITON_ENV] = self._config.kernel_cache_dir
        self.started_at = time.monotonic()
        self._first_rank = self._config.local_ranks.start
        for rank in self._config.local_ranks:
            # --spawned-at: CLOCK_MONOTONIC is one clock for every process of the host, so the
            # worker's "workers up" phase counts its exec and imports too.
            proc = await asyncio.create_subprocess_exec(
                *self._command, "--config", str(self._config.path), "--rank", str(rank),
                "--spawned-at", repr(time.monotonic()),
                stdin=asyncio.subprocess.DEVNULL, start_new_session=True, env=env)
            log.info("started worker rank %d (pid %d)", rank, proc.pid)
            self._procs.append(proc)
            self._waiters.append(asyncio.create_task(proc.wait(), name=f"worker-{rank}-wait"))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    async def first_exit(self) -> tuple[int, int]:
        """Wait until any worker exits; returns (rank, exit code; negative = killed by signal)."""
        if not self._waiters:
            await asyncio.Future()  # nothing started: never returns
        done, _ = await asyncio.wait(self._waiters, return_when=asyncio.FIRST_COMPLETED)
        index = min(self._waiters.index(t) for t in done)
        return self._first_rank + index, self._procs[index].returncode

    def exited_now(self) -> list[tuple[int, int | None]]:
        """The ranks whose process has ended by now, as (rank, exit code; negative = killed by
        a signal; None when unknown), counting ended processes the event loop has not reaped
        yet: when a rank is killed, its peers' reports of the broken connection can reach the
        coordinator before first_exit() sees the death."""
        ended = []
        for rank, proc in enumerate(self._procs, start=self._first_rank):
            if proc.returncode is not None:
                ended.append((rank, proc.returncode))
                continue
            has_ended, code = _ended_code(proc.pid)
            if has_ended:
                ended.append((rank, code))
        return ended

    async def stop(self, grace_s: float) -> None:
        """Give workers `grace_s` to exit by themselves, then SIGTERM, then SIGKILL."""
        self.stopping = True
        if not self._procs:
            return
        for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            running = [p for p in self._procs if p.returncode is None]
            if not running:
                break
            if sig is not None:
                log.warning("sending %s to %d worker(s)", sig.name, len(running))
                for proc in running:
                    _signal(proc, sig)
            await asyncio.wait(self._waiters, timeout=wait_s)
        for rank, proc in enumerate(self._procs, start=self._first_rank):
            if proc.returncode not in (0, None):
                log.info("worker rank %d exited with code %s", rank, proc.returncode)

    async def kill(self) -> None:
        """SIGKILL every worker still running and wait for them: for ranks that are stalled,
        blocked in a step or a collective where no message or SIGTERM handler would reach."""
        self.stopping = True
        running = [p for p in self._procs if p.returncode is None]
        if running:
            log.warning("sending SIGKILL to %d worker(s) (pids %s)", len(running),
                        [p.pid for p in running])
        for proc in running:
            _signal(proc, signal.SIGKILL)
        if self._waiters:
            await asyncio.wait(self._waiters, timeout=10.0)


def _signal(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass
