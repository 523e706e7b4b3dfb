"""The folders of coordinators that no longer run are removed, while a live one's, a foreign name
and a symlink are kept (a real exited process gives the dead pid)."""

from __future__ import annotations

import subprocess

from lorad.protocol.sockets import make_runtime_dir, remove_stale_runtime_dirs
from tests.unit.test_runtime_dirs import short_tmp  # noqa: F401  (a fixture)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_folders_are_removed_and_live_ones_kept(short_tmp):
    tmp_path = short_tmp
    dead = tmp_path / f"lorad-my-model-{_dead_pid()}-0123abcd"
    dead.mkdir()
    (dead / "results.sock").write_text("")
    live, _ = make_runtime_dir(str(tmp_path), "my-model")  # this process: alive
    foreign = tmp_path / "lorad-notes"
    foreign.mkdir()
    link = tmp_path / f"lorad-x-{_dead_pid()}-89abcdef"
    link.symlink_to(foreign)
    assert remove_stale_runtime_dirs(str(tmp_path)) == [dead]
    assert not dead.exists() and live.exists() and foreign.exists() and link.is_symlink()
