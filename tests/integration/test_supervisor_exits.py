"""Supervisor.exited_now finds a worker's death before the event loop reaps it: a rank that
fails on a killed peer's broken connection must not be reported as the cause (the daemon names
the rank that died). Real child processes, killed and exited, read through /proc."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

from lorad.daemon.supervisor import _ended_code


def _wait_ended(pid: int, timeout_s: float = 5.0) -> None:
    """Until the process is a zombie, or gone (reaped by asyncio's child watcher thread)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                if stat.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not end")


def test_ended_code_of_running_killed_and_exited_children():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    exiter = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        assert _ended_code(sleeper.pid) == (False, None)
        os.kill(sleeper.pid, signal.SIGKILL)
        _wait_ended(sleeper.pid)
        _wait_ended(exiter.pid)
        # Not reaped yet (no wait() so far): the codes come from the zombies.
        assert _ended_code(sleeper.pid) == (True, -signal.SIGKILL)
        assert _ended_code(exiter.pid) == (True, 3)
    finally:
        for proc in (sleeper, exiter):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert sleeper.returncode == -signal.SIGKILL and exiter.returncode == 3


def test_exited_now_lists_a_killed_worker_before_first_exit_sees_it(tmp_path):
    from lorad.daemon.supervisor import Supervisor

    async def scenario():
        supervisor = Supervisor.__new__(Supervisor)  # no config needed: the processes are ours
        supervisor._procs = [await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import time; time.sleep(30)") for _ in range(2)]
        try:
            assert supervisor.exited_now() == []
            os.kill(supervisor._procs[1].pid, signal.SIGKILL)
            # Blocking the loop: its returncode is not set meanwhile, whether the child watcher's
            # thread has reaped it (the code is then unknown here) or not (a zombie's code).
            _wait_ended(supervisor._procs[1].pid)
            assert supervisor._procs[1].returncode is None
            assert supervisor.exited_now() in ([(1, -signal.SIGKILL)], [(1, None)])
            await supervisor._procs[1].wait()
            assert supervisor.exited_now() == [(1, -signal.SIGKILL)]
        finally:
            for proc in supervisor._procs:
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()
        assert supervisor.exited_now() == [(0, -signal.SIGKILL), (1, -signal.SIGKILL)]

    asyncio.run(scenario())
