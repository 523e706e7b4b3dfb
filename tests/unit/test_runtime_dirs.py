"""The private runtime folders: a fresh 0700 one per instance, and no error without a parent.
Stale folders (of a process that has exited): tests/integration/test_stale_runtime_dirs.py."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from lorad.protocol.sockets import make_runtime_dir, remove_stale_runtime_dirs


@pytest.fixture
def short_tmp():
    path = Path(tempfile.mkdtemp(prefix="lrt"))  # ipc paths must stay short
    yield path
    shutil.rmtree(path)


def test_fresh_private_folder(short_tmp):
    path, instance_id = make_runtime_dir(str(short_tmp), "tiny")
    assert path.name == f"lorad-{instance_id}" and instance_id.startswith(f"tiny-{os.getpid()}-")
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_missing_parent_is_not_an_error(tmp_path):
    assert remove_stale_runtime_dirs(str(tmp_path / "not-yet")) == []
