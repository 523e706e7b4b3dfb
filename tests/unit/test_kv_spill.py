"""The KV spill store on real files under tmp_path with its real writer thread: round trips, a
restart's LRU order, each kind of damage found with one log line (and nothing crashing), write
errors counted while the thread lives on, delete, max_pending, close, a killed writer's leftovers.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import random
import stat
import threading

import pytest

from lorad.workers.kv_spill import SpillIdentity, SpillStore
from lorad.workers.spill_format import HEADER_BYTES, MANIFEST, block_file, stored_line

IDENTITY = SpillIdentity(engine="lorad 0.1 numerics 3", model="tiny-llama sha 1f2e",
                         dtype="bfloat16", parallel=2, rank=0, block_size=4, block_bytes=64)
LOG = logging.getLogger("test.kv_spill")


def h(i: int) -> bytes:
    return hashlib.blake2b(bytes([i]), digest_size=16).digest()


def payload(i: int) -> bytes:
    return random.Random(i).randbytes(IDENTITY.block_bytes)


def open_store(directory, identity=IDENTITY, **kwargs) -> SpillStore:
    kwargs.setdefault("max_bytes", 100 * identity.block_bytes)
    return SpillStore(directory, identity, log=LOG, **kwargs)


def spill(directory, blocks, identity=IDENTITY) -> None:
    store = open_store(directory, identity)
    for i in blocks:
        store.write(h(i), payload(i))
    store.close()


def path_of(directory, i: int):
    return directory / block_file(h(i).hex())


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_round_trip_on_a_new_directory(tmp_path):
    directory = tmp_path / "spill" / "rank0"
    store = open_store(directory)
    store.write(h(1), payload(1))
    assert store.read(h(1)) == payload(1)  # waits for the pending write
    assert store.read(h(2)) is None
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert path_of(directory, 1).stat().st_size == HEADER_BYTES + IDENTITY.block_bytes
    assert store.num_bytes == IDENTITY.block_bytes
    store.close()
    store.close()
    assert dataclasses.astuple(store.counters) == (1, 0, 1, 0, 0)  # an unknown hash is no failure


def test_a_restart_finds_the_entries_least_recently_used_first(tmp_path, caplog):
    store = open_store(tmp_path)
    for i in (1, 2, 3):
        store.write(h(i), payload(i))
    assert store.read(h(1)) == payload(1)  # now the most recently used
    store.close()
    store = open_store(tmp_path)
    assert store.entries() == [h(2), h(3), h(1)]
    assert [store.read(h(i)) for i in (2, 3, 1)] == [payload(i) for i in (2, 3, 1)]
    store.close()
    header = json.loads((tmp_path / MANIFEST).read_text().splitlines()[0])
    assert header == {"format": 1, "identity": dataclasses.asdict(IDENTITY)}
    assert warnings(caplog) == []


@pytest.mark.parametrize("damage, reason", [
    ("payload bit", "fails its checksum"), ("checksum bit", "fails its checksum"),
    ("another block's file", f"holds block {h(2).hex()}"), ("missing", "is missing"),
    ("short", "has 100 bytes")])
def test_a_damaged_file_fails_its_read_with_one_line(tmp_path, caplog, damage, reason):
    store = open_store(tmp_path)
    store.write(h(1), payload(1))
    store.write(h(2), payload(2))
    assert store.read(h(2)) == payload(2)
    path = path_of(tmp_path, 1)
    data = bytearray(path.read_bytes())
    if damage == "missing":
        path.unlink()
    elif damage == "short":
        path.write_bytes(data[:100])
    elif damage == "another block's file":
        path.write_bytes(path_of(tmp_path, 2).read_bytes())
    else:
        data[HEADER_BYTES + 10 if damage == "payload bit" else 30] ^= 0x04
        path.write_bytes(data)
    assert store.read(h(1)) is None
    assert not path.exists()
    assert store.read(h(1)) is None  # the entry is gone: no second line
    assert store.counters.read_failures == 1 and store.counters.drops == 1
    [line] = warnings(caplog)
    assert str(path) in line and reason in line
    store.close()
    assert open_store(tmp_path).entries() == [h(2)]  # the drop was recorded: no line at start
    assert len(warnings(caplog)) == 1


def test_a_truncated_file_is_dropped_at_start(tmp_path, caplog):
    spill(tmp_path, (1, 2))
    with open(path_of(tmp_path, 2), "r+b") as file:
        file.truncate(HEADER_BYTES + 10)
    store = open_store(tmp_path)
    assert store.entries() == [h(1)]
    [line] = warnings(caplog)
    assert h(2).hex() in line and block_file(h(2).hex()) in line and "truncated" in line
    assert not path_of(tmp_path, 2).exists()
    assert store.counters.drops == 1


def test_bad_manifest_lines_are_dropped_one_line_each(tmp_path, caplog):
    spill(tmp_path, (1, 2, 3))
    lines = (tmp_path / MANIFEST).read_text().splitlines(keepends=True)
    upper = h(9).hex().upper()
    bad = {"{not json": "is not JSON",
           "[1, 2]": "is not a JSON object",
           json.dumps({"hash": "xyz" * 10 + "ab", "file": "x", "bytes": 64}): "not a 32-digit",
           json.dumps({"hash": upper, "file": f"{upper[:2]}/{upper}.kv", "bytes": 64}):
               "not a 32-digit",
           json.dumps({"hash": h(3).hex(), "file": "../../etc/passwd", "bytes": 64}):
               "names file '../../etc/passwd'",
           json.dumps({"hash": h(3).hex(), "file": block_file(h(3).hex()), "bytes": 65}):
               "has 65 bytes, not 64",
           json.dumps({"hash": h(5).hex(), "file": block_file(h(5).hex()), "bytes": 64}):
               "which is missing",
           '{"hash": "': "is not JSON"}  # the last: a line cut by a crash
    # After the header and the first entry: the lines around them must survive.
    text = "".join(lines[:2]) + "\n".join(bad) + "\n" + "".join(lines[2:])
    (tmp_path / MANIFEST).write_text(text)
    store = open_store(tmp_path)
    assert store.entries() == [h(1), h(2), h(3)]
    found = warnings(caplog)
    assert len(found) == len(bad) and store.counters.drops == len(bad)
    for line, reason in zip(found, sorted(bad.values(), key=lambda r: r == "which is missing")):
        assert reason in line
    store.close()
    assert len((tmp_path / MANIFEST).read_text().splitlines()) == 4  # rewritten compacted
    caplog.clear()
    assert open_store(tmp_path).entries() == [h(1), h(2), h(3)] and warnings(caplog) == []


def test_an_entry_naming_a_missing_file_is_dropped(tmp_path, caplog):
    spill(tmp_path, (1, 2))
    path_of(tmp_path, 1).unlink()
    assert open_store(tmp_path).entries() == [h(2)]
    [line] = warnings(caplog)
    assert h(1).hex() in line and "missing" in line


def test_a_duplicated_hash_keeps_the_last(tmp_path, caplog):
    spill(tmp_path, (1, 2))
    with open(tmp_path / MANIFEST, "a") as manifest:
        manifest.write(stored_line(h(1).hex(), IDENTITY.block_bytes))
    assert open_store(tmp_path).entries() == [h(2), h(1)]
    [line] = warnings(caplog)
    assert h(1).hex() in line and "again" in line


def test_a_rewrite_through_the_store_is_no_duplicate(tmp_path, caplog):
    spill(tmp_path, (1, 2, 1))
    store = open_store(tmp_path)
    assert store.entries() == [h(2), h(1)] and warnings(caplog) == []
    assert store.read(h(1)) == payload(1)


@pytest.mark.parametrize("field, value", [
    ("engine", "lorad 0.2 numerics 4"), ("model", "other"), ("dtype", "float16"),
    ("parallel", 4), ("rank", 1), ("block_size", 16), ("block_bytes", 128)])
def test_a_manifest_of_another_identity_is_discarded_whole(tmp_path, caplog, field, value):
    spill(tmp_path, (1, 2))
    other = dataclasses.replace(IDENTITY, **{field: value})
    store = open_store(tmp_path, other)
    assert store.entries() == []
    [line] = warnings(caplog)
    assert f"{field} {getattr(IDENTITY, field)!r} (this engine: {value!r})" in line
    assert not path_of(tmp_path, 1).exists() and not path_of(tmp_path, 2).exists()
    store.close()
    header = json.loads((tmp_path / MANIFEST).read_text().splitlines()[0])
    assert header["identity"][field] == value


def test_a_manifest_of_another_format_is_discarded_whole(tmp_path, caplog):
    spill(tmp_path, (1,))
    lines = (tmp_path / MANIFEST).read_text().splitlines(keepends=True)
    (tmp_path / MANIFEST).write_text(lines[0].replace('"format": 1', '"format": 2') + lines[1])
    assert open_store(tmp_path).entries() == []
    [line] = warnings(caplog)
    assert "format 2" in line and not path_of(tmp_path, 1).exists()


def test_a_write_error_is_counted_and_logged_once_and_the_thread_lives_on(tmp_path, caplog,
                                                                          monkeypatch):
    store = open_store(tmp_path)
    real_replace = os.replace

    def disk_full(source, target):
        if str(source).endswith(".kv.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", disk_full)
    store.write(h(1), payload(1))
    store.write(h(2), payload(2))
    assert store.read(h(1)) is None and store.read(h(2)) is None
    assert store.counters.write_errors == 2 and store.counters.writes == 0
    [line] = warnings(caplog)
    assert "ENOSPC" in line and h(1).hex() in line
    assert list(tmp_path.rglob("*.tmp")) == []
    monkeypatch.undo()
    store.write(h(3), payload(3))
    assert store.read(h(3)) == payload(3)
    store.close()
    assert open_store(tmp_path).entries() == [h(3)]


def test_a_read_only_directory_is_a_counted_write_error(tmp_path, caplog):
    store = open_store(tmp_path)
    tmp_path.chmod(0o500)
    try:
        if os.access(tmp_path, os.W_OK):
            pytest.skip("this process writes to a read-only directory (root's CAP_DAC_OVERRIDE)")
        store.write(h(1), payload(1))
        assert store.read(h(1)) is None
        assert store.counters.write_errors >= 1 and "EACCES" in warnings(caplog)[0]
    finally:
        tmp_path.chmod(0o700)
    store.write(h(2), payload(2))
    assert store.read(h(2)) == payload(2)
    store.close()


class _FullDisk:
    """A manifest handle on a full disk: every write fails."""

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        pass


def test_a_failed_manifest_append_is_repaired_by_the_next_rewrite(tmp_path, caplog):
    store = open_store(tmp_path)
    store._manifest = _FullDisk()
    store.write(h(1), payload(1))
    assert store.read(h(1)) == payload(1)  # the file landed; the used line is a rewrite
    assert store.counters.write_errors == 1 and "manifest append" in warnings(caplog)[0]
    store.write(h(2), payload(2))
    store.close()
    assert open_store(tmp_path).entries() == [h(1), h(2)]
    assert len(warnings(caplog)) == 1


def test_delete_removes_the_file_and_the_entry(tmp_path, caplog):
    store = open_store(tmp_path)
    for i in (1, 2):
        store.write(h(i), payload(i))
    store.delete(h(1))
    store.delete(h(7))  # unknown: nothing to do
    assert store.read(h(1)) is None  # waits for the delete
    assert not path_of(tmp_path, 1).exists() and path_of(tmp_path, 2).exists()
    store.close()
    assert store.num_processed == 4
    assert open_store(tmp_path).entries() == [h(2)] and warnings(caplog) == []


def test_max_pending_is_enforced_and_close_drains(tmp_path, monkeypatch):
    store = open_store(tmp_path, max_pending=2)
    gate, real_fsync = threading.Event(), os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (gate.wait(10), real_fsync(fd)))
    store.write(h(1), payload(1))
    store.write(h(2), payload(2))  # the thread holds the first in fsync
    with pytest.raises(RuntimeError, match="max_pending"):
        store.write(h(3), payload(3))
    with pytest.raises(RuntimeError, match="max_pending"):
        store.delete(h(1))
    assert store.num_processed == 0
    gate.set()
    store.close()
    assert store.num_processed == 2 and store.counters.writes == 2
    with pytest.raises(RuntimeError, match="closed"):
        store.write(h(3), payload(3))
    assert open_store(tmp_path).entries() == [h(1), h(2)]


def test_close_drains_every_queued_write(tmp_path):
    store = open_store(tmp_path)
    for i in range(40):
        store.write(h(i), payload(i))
    store.close()
    assert store.num_processed == 40 and store.counters.writes == 40
    store = open_store(tmp_path)
    assert store.entries() == [h(i) for i in range(40)]
    assert all(store.read(h(i)) == payload(i) for i in range(40))


def test_a_killed_writers_leftovers_are_cleaned_at_start(tmp_path, caplog):
    spill(tmp_path, (1,))
    spill(tmp_path / "elsewhere", (5,))
    leftover = path_of(tmp_path, 4).with_name(f".{h(4).hex()}.kv.tmp")
    leftover.parent.mkdir(exist_ok=True)
    leftover.write_bytes(b"lorad-kv" + bytes(20))  # killed mid-write
    orphan = path_of(tmp_path, 5)  # killed after its rename, before its manifest line
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(path_of(tmp_path / "elsewhere", 5).read_bytes())
    (tmp_path / ".manifest.jsonl.tmp").write_text("{")
    (tmp_path / "notes.txt").write_text("the operator's")
    store = open_store(tmp_path)
    assert store.entries() == [h(1)] and warnings(caplog) == []
    assert not leftover.exists() and not orphan.exists()
    assert not (tmp_path / ".manifest.jsonl.tmp").exists()
    assert (tmp_path / "notes.txt").exists()  # not named like the store's: left alone
    assert store.read(h(1)) == payload(1)


def test_used_lines_are_compacted_away(tmp_path):
    store = open_store(tmp_path)
    for i in (1, 2):
        store.write(h(i), payload(i))
    for n in range(3000):
        assert store.read(h(1 + n % 2)) == payload(1 + n % 2)
    assert store.read(h(1)) == payload(1)
    num_lines = len((tmp_path / MANIFEST).read_text().splitlines())
    store.close()
    assert num_lines < 1100
    assert open_store(tmp_path).entries() == [h(2), h(1)]


def test_one_directory_has_one_store(tmp_path):
    store = open_store(tmp_path)
    with pytest.raises(RuntimeError, match="in use"):
        open_store(tmp_path)
    store.close()
    open_store(tmp_path).close()


def test_past_max_bytes_the_write_is_still_done_with_one_line(tmp_path, caplog):
    store = open_store(tmp_path, max_bytes=IDENTITY.block_bytes)
    for i in (1, 2, 3):
        store.write(h(i), payload(i))
    assert [store.read(h(i)) for i in (1, 2, 3)] == [payload(i) for i in (1, 2, 3)]
    [line] = warnings(caplog)
    assert "max_bytes" in line


def test_bad_arguments_are_refused_in_the_callers_thread(tmp_path):
    store = open_store(tmp_path)
    with pytest.raises(ValueError, match="64 bytes"):
        store.write(h(1), payload(1)[:-1])
    with pytest.raises(TypeError, match="bytes"):
        store.write(h(1), bytearray(payload(1)))
    with pytest.raises(ValueError, match="16 bytes"):
        store.read(h(1)[:15])
    store.close()
    with pytest.raises(ValueError, match="rank"):
        dataclasses.replace(IDENTITY, rank=2)
    with pytest.raises(ValueError, match="block_bytes"):
        dataclasses.replace(IDENTITY, block_bytes=0)
