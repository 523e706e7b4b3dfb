"""systemd's notify protocol (sd_notify(3)) spoken directly: READY, STATUS, EXTEND_TIMEOUT_USEC,
WATCHDOG and STOPPING as one datagram each to $NOTIFY_SOCKET (a path, or '@' for an abstract
address).

Without NOTIFY_SOCKET every call is a no-op. A failed send is logged and never raised: the daemon
serves with or without its service manager. Only the coordinator speaks; the workers are started
without these variables (child_environment), so NotifyAccess=main holds.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("lorad.systemd")

NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
_failed_once: set[str] = set()  # addresses whose send error was already logged


def notify(*assignments: str) -> bool:
    """Send 'KEY=VALUE' lines as one datagram; True when it was sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        target = "\0" + address[1:]
    elif address.startswith("/"):
        target = address
    else:
        _log_once(address, "NOTIFY_SOCKET=%s: only unix socket paths and @abstract addresses are "
                  "supported; not notifying systemd", address)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(target)
            sock.sendall("\n".join(assignments).encode())
    except OSError as exc:
        _log_once(address, "cannot notify systemd at %s (%s): %s", address,
                  ", ".join(a.partition("=")[0] for a in assignments), exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None when systemd asked for
    none from this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not a number of microseconds; no watchdog pings", usec)
        return None
    return value / 2e6 if value > 0 else None


def child_environment() -> dict[str, str]:
    """This process's environment without the notify variables, for the workers."""
    return {k: v for k, v in os.environ.items() if k not in NOTIFY_ENV}


def _log_once(address: str, message: str, *args) -> None:
    if address not in _failed_once:
        _failed_once.add(address)
        log.warning(message, *args)
