"""Another process's state from /proc/PID/stat (Linux), for the coordinator's supervisor and the
workers alike: an ended child stays a zombie until its parent reaps it, which kill(pid, 0) does
not tell from a running process."""

from __future__ import annotations

import os


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name, the state ("R", "S", "Z", ...) first
    (field 3 of proc(5)); None when it cannot be read: no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None


def running(pid: int) -> bool:
    """Whether process pid exists and has not ended (a zombie has); without /proc to read,
    taken as running."""
    fields = stat_fields(pid)
    if fields is None:
        return not os.path.isdir("/proc/self")
    return fields[0] not in (b"Z", b"X")
