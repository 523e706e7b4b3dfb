"""--kernel-cache-dir on a real daemon: every worker process gets the folder as TRITON_CACHE_DIR
(from the flag, else systemd's $CACHE_DIRECTORY/triton), and a folder that cannot be made is
refused with one line and exit 2 before any worker starts. The CPU workers never import triton:
the variable is there and unused, and the daemon serves as usual.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.daemons import REPO


def _worker_env(pid: int, name: str) -> str | None:
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        key, _, value = entry.decode().partition("=")
        if key == name:
            return value
    return None


def test_every_worker_gets_the_flag(start_lorad, tmp_path):
    folder = tmp_path / "kernels"
    daemon = start_lorad("--parallel", "2", "--kernel-cache-dir", str(folder),
                         env={"CACHE_DIRECTORY": str(tmp_path / "systemd")})
    pids = daemon.worker_pids()
    assert len(pids) == 2
    assert [_worker_env(pid, "TRITON_CACHE_DIR") for pid in pids] == [str(folder)] * 2
    assert folder.is_dir() and not (tmp_path / "systemd").exists()
    assert daemon.stop() == 0


def test_default_follows_systemd_cache_directory(start_lorad, tmp_path):
    # TRITON_CACHE_DIR empty: as if unset, whatever the environment running the tests holds.
    daemon = start_lorad(env={"CACHE_DIRECTORY": str(tmp_path), "TRITON_CACHE_DIR": ""})
    (pid,) = daemon.worker_pids()
    assert _worker_env(pid, "TRITON_CACHE_DIR") == str(tmp_path / "triton")
    assert (tmp_path / "triton").is_dir()
    assert daemon.stop() == 0


def test_a_folder_that_cannot_be_made_is_one_line_and_exit_2(tiny_model, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    done = subprocess.run(
        [sys.executable, "-m", "lorad.daemon", "--model", str(tiny_model),
         "--kernel-cache-dir", str(tmp_path / "file" / "kernels")],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("lorad: error: --kernel-cache-dir ")
    assert "started worker" not in done.stdout + done.stderr
