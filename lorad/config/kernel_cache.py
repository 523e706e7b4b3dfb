"""Where the workers' Triton kernels are cached: `--kernel-cache-dir`, resolved and checked.

The coordinator picks the folder and exports it to the workers as TRITON_CACHE_DIR; it never
imports triton, and nor does the CPU path, where the variable is simply unused. Does not clear
or size the cache (docs/operations.md says how).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from lorad.config.errors import ConfigError

FLAG = "--kernel-cache-dir"
TRITON_ENV = "TRITON_CACHE_DIR"  # what Triton reads (its default: ~/.triton/cache)
# Set by systemd when the unit has CacheDirectory=: a folder that survives restarts and is
# writable under ProtectSystem=strict / ProtectHome=read-only, where ~/.triton may not be.
SYSTEMD_CACHE_ENV = "CACHE_DIRECTORY"


def resolve_kernel_cache_dir(flag_value: str | None,
                             environ: Mapping[str, str]) -> str | None:
    """-> the absolute folder for TRITON_CACHE_DIR, created and checked writable; None leaves
    Triton its own default. In order: the flag, a TRITON_CACHE_DIR already set (the operator's
    choice), $CACHE_DIRECTORY/triton (the first folder when systemd lists several)."""
    if flag_value is not None:
        folder, named = flag_value, f"{FLAG} {flag_value}"
    elif environ.get(TRITON_ENV):
        folder = environ[TRITON_ENV]
        named = f"{FLAG} (default: ${TRITON_ENV}) {folder}"
    elif environ.get(SYSTEMD_CACHE_ENV):
        folder = os.path.join(environ[SYSTEMD_CACHE_ENV].split(":")[0], "triton")
        named = f"{FLAG} (default: ${SYSTEMD_CACHE_ENV}/triton) {folder}"
    else:
        return None
    if not folder.strip():
        raise ConfigError(f"{FLAG} must name a folder, got {flag_value!r}")
    path = Path(folder).expanduser().absolute()
    check_writable(path, named)
    return str(path)


def check_writable(path: Path, named: str) -> None:
    """Create the folder (0700: compiled kernels are code the workers will load) and write a
    file in it: a read-only or foreign folder fails here, at start, rather than on the GPU's
    first compile, with the error Triton would hit."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".lorad-write-check-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"{named}: cannot create or write to this folder ({reason})") from None
