"""--kernel-cache-dir: which folder the workers' TRITON_CACHE_DIR gets (the flag, an inherited
TRITON_CACHE_DIR, systemd's $CACHE_DIRECTORY/triton, else none), created and checked writable;
a folder that cannot be made is one line naming the flag and exit status 2."""

from __future__ import annotations

import os
import stat

import pytest

from lorad.config import ConfigError
from lorad.config.cli import parse_args
from lorad.config.kernel_cache import resolve_kernel_cache_dir


def test_the_flag_wins_and_is_created_private(tmp_path):
    environ = {"TRITON_CACHE_DIR": str(tmp_path / "t"), "CACHE_DIRECTORY": str(tmp_path / "c")}
    folder = resolve_kernel_cache_dir(str(tmp_path / "flag" / "kernels"), environ)
    assert folder == str(tmp_path / "flag" / "kernels")
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert os.listdir(folder) == []  # the write check leaves nothing behind


def test_default_follows_systemd_cache_directory(tmp_path):
    # systemd lists several folders with ':' when the unit names several.
    environ = {"CACHE_DIRECTORY": f"{tmp_path / 'lorad'}:{tmp_path / 'other'}"}
    assert resolve_kernel_cache_dir(None, environ) == str(tmp_path / "lorad" / "triton")
    assert (tmp_path / "lorad" / "triton").is_dir()


def test_an_inherited_triton_cache_dir_is_the_operators_choice(tmp_path):
    environ = {"TRITON_CACHE_DIR": str(tmp_path / "mine"), "CACHE_DIRECTORY": str(tmp_path)}
    assert resolve_kernel_cache_dir(None, environ) == str(tmp_path / "mine")


def test_without_any_triton_keeps_its_own_default():
    assert resolve_kernel_cache_dir(None, {"HOME": "/nonexistent"}) is None


def test_relative_flag_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_kernel_cache_dir("kc", {}) == str(tmp_path / "kc")


@pytest.mark.parametrize("environ_key", ["CACHE_DIRECTORY", "TRITON_CACHE_DIR"])
def test_a_bad_default_names_where_it_came_from(tmp_path, environ_key):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ConfigError, match=rf"--kernel-cache-dir \(default: \${environ_key}"):
        resolve_kernel_cache_dir(None, {environ_key: str(tmp_path / "file" / "sub")})


def test_bad_folder_is_one_line_naming_the_flag_exit_2(tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", "m", "--kernel-cache-dir", str(tmp_path / "file" / "kc")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lorad: error: --kernel-cache-dir ")
    assert "cannot create or write to this folder (Not a directory)" in err


def test_parse_args_reads_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path))
    assert parse_args(["--model", "m"]).kernel_cache_dir == str(tmp_path / "triton")
    flagged = parse_args(["--model", "m", "--kernel-cache-dir", str(tmp_path / "k")])
    assert flagged.kernel_cache_dir == str(tmp_path / "k")
