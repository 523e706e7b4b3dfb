"""The private runtime folders: a fresh 0700 one per instance, and the folders of coordinators
that no longer run removed, while a live one's, a foreign name and a symlink are kept."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from lorad.protocol.sockets import make_runtime_dir, remove_stale_runtime_dirs


@pytest.fixture
def short_tmp():
    path = Path(tempfile.mkdtemp(prefix="lrt"))  # ipc paths must stay short
    yield path
    shutil.rmtree(path)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_fresh_private_folder(short_tmp):
    path, instance_id = make_runtime_dir(str(short_tmp), "tiny")
    assert path.name == f"lorad-{instance_id}" and instance_id.startswith(f"tiny-{os.getpid()}-")
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


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


def test_missing_parent_is_not_an_error(tmp_path):
    assert remove_stale_runtime_dirs(str(tmp_path / "not-yet")) == []
