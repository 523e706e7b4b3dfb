"""A rank's disk spill of prefix-cache blocks: each block's payload (this rank's shard of its K
and V, every layer, as bytes) in a checksummed file of its own, written by one background thread
and read back on the caller's, under a manifest (spill_format.py) that a restart validates.
It decides nothing: which blocks to write, read and delete (and so what fits max_bytes) is the
caller's, the same on every rank. One directory per rank; one caller thread per store.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from lorad.workers.spill_format import (HASH_BYTES, HEADER_BYTES, MANIFEST, SpillIdentity,
                                        block_file, block_header, block_problem, deleted_line,
                                        load, lock_directory, rewrite, stored_line, sweep,
                                        used_line)

__all__ = ["SpillCounters", "SpillIdentity", "SpillStore"]  # SpillIdentity is spill_format's

log = logging.getLogger("lorad.worker")

# A manifest grown past twice its live entries (plus this) by used and deleted lines is rewritten.
COMPACT_SLACK_LINES = 1024


@dataclass(frozen=True)
class SpillCounters:
    writes: int  # blocks whose files landed
    write_errors: int  # failed file or manifest operations (each kind logged once)
    reads: int  # payloads read() returned
    read_failures: int  # entries whose file was missing, of the wrong size or failed its checksum
    drops: int  # entries dropped as invalid at start (one log line each) or by a failed read


class SpillStore:
    def __init__(self, directory: Path, identity: SpillIdentity, max_bytes: int,
                 max_pending: int = 64, log: logging.Logger = log) -> None:
        """Opens (creating, 0700) and validates the directory; OSError if it cannot be created or
        its manifest written, RuntimeError if another store holds it."""
        if type(max_bytes) is not int or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        if type(max_pending) is not int or max_pending <= 0:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        self.directory = Path(directory)
        self.identity = identity
        self.max_bytes = max_bytes
        self.max_pending = max_pending
        self._log = log
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = lock_directory(self.directory)
        try:
            hashes, self._drops = load(self.directory, identity, log)
            # Compacted before the sweep: a crash between the two leaves files no entry names.
            rewrite(self.directory, identity, hashes)
            sweep(self.directory, {block_file(h) for h in hashes}, log)
            self._manifest = open(self.directory / MANIFEST, "ab")  # None while a rewrite is owed
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._num_lines = 1 + len(hashes)
        self._key = identity.fingerprint()
        # Every held block, least recently used first; it and all below are guarded by _cond.
        self._index: OrderedDict[bytes, None] = OrderedDict.fromkeys(map(bytes.fromhex, hashes))
        self._at_start = list(self._index)
        self._cond = threading.Condition(threading.RLock())
        self._writes = self._write_errors = self._reads = self._read_failures = 0
        self._error_kinds: set[str] = set()
        self._warned_full = False
        self._pending: dict[bytes, int] = {}  # hash -> its queued or running operations
        self._num_enqueued = self._num_processed = 0
        self._closed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"kv-spill-{identity.rank}",
                                        daemon=True)
        self._thread.start()

    def entries(self) -> list[bytes]:
        """The valid hashes found at start, least recently used first. They may pass max_bytes
        (a smaller limit than last run's): the caller deletes to fit."""
        return list(self._at_start)

    @property
    def num_bytes(self) -> int:
        """Payload bytes of the blocks held now (written ones only once the thread is done)."""
        with self._cond:
            return len(self._index) * self.identity.block_bytes

    @property
    def num_processed(self) -> int:
        """write() and delete() calls the thread has finished, in the order they were made."""
        with self._cond:
            return self._num_processed

    @property
    def counters(self) -> SpillCounters:
        with self._cond:
            return SpillCounters(self._writes, self._write_errors, self._reads,
                                 self._read_failures, self._drops)

    def write(self, block_hash: bytes, payload: bytes) -> None:
        """Queue this block to be stored (a held one is rewritten); returns at once. `payload`
        must be `bytes` (a copy: the block's memory is reused once evicted). A write that takes
        the store past max_bytes is still done: the caller deletes first. I/O errors are counted
        and logged, never raised; RuntimeError if max_pending writes and deletes are unprocessed
        or the store is closed."""
        _check_hash(block_hash)
        if not isinstance(payload, bytes):
            raise TypeError(f"a spilled payload must be bytes, got {type(payload).__name__}")
        if len(payload) != self.identity.block_bytes:
            raise ValueError(f"a spilled payload has {self.identity.block_bytes} bytes on this "
                             f"rank, got {len(payload)}")
        self._enqueue("write", block_hash, payload)

    def delete(self, block_hash: bytes) -> None:
        """Queue the removal of this block's file and entry (a no-op for an unknown hash)."""
        _check_hash(block_hash)
        self._enqueue("delete", block_hash, None)

    def read(self, block_hash: bytes) -> bytes | None:
        """This block's payload, after any queued write or delete of it, marked most recently
        used; None when it is unknown or its file is missing, of the wrong size or fails its
        checksum (such a file is removed and its entry dropped, with one log line: the caller
        recomputes the block)."""
        _check_hash(block_hash)
        with self._cond:
            self._cond.wait_for(lambda: block_hash not in self._pending)
            if block_hash not in self._index:
                return None
        path = self.directory / block_file(block_hash.hex())
        payload, problem = None, None
        try:
            with open(path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                if size != HEADER_BYTES + self.identity.block_bytes:
                    problem = f"has {size} bytes, not {HEADER_BYTES + self.identity.block_bytes}"
                else:
                    header, payload = file.read(HEADER_BYTES), file.read()
                    problem = block_problem(self._key, block_hash, header, payload)
        except FileNotFoundError:
            problem = "is missing"
        except OSError as error:
            problem = f"cannot be read ({error})"
        with self._cond:
            if problem is None:
                self._reads += 1
                # Recency in call order: behind the writes queued before this read.
                if not self._closed:
                    self._queue.put(("used", block_hash, None))
                return payload
            self._read_failures += 1
            self._drops += 1
            self._index.pop(block_hash, None)
            self._append(deleted_line(block_hash.hex()))
        self._log.warning("spill file %s %s: removed, its block will be recomputed", path, problem)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        return None

    def close(self) -> None:
        """Finish every queued write and delete, stop the thread, release the directory."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join()
        with self._cond:
            self._close_manifest()
        os.close(self._lock_fd)

    # --- the writer thread ------------------------------------------------------------------------

    def _enqueue(self, kind: str, block_hash: bytes, payload: bytes | None) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"spill store {self.directory} is closed")
            if self._num_enqueued - self._num_processed >= self.max_pending:
                raise RuntimeError(f"spill store {self.directory} has {self.max_pending} writes "
                                   "and deletes unprocessed (max_pending): wait on num_processed")
            self._num_enqueued += 1
            self._pending[block_hash] = self._pending.get(block_hash, 0) + 1
            self._queue.put((kind, block_hash, payload))

    def _run(self) -> None:
        while (operation := self._queue.get()) is not None:
            kind, block_hash, payload = operation
            try:
                if kind == "write":
                    self._store(block_hash, payload)
                elif kind == "delete":
                    self._remove(block_hash)
                else:
                    self._touch(block_hash)
            except Exception as error:  # noqa: BLE001 - the thread outlives any one block
                self._failed(f"{kind} of {block_hash.hex()}", error)
            if kind == "used":
                continue  # a read's mark: not one of the caller's counted operations
            with self._cond:
                self._num_processed += 1
                if self._pending[block_hash] == 1:
                    del self._pending[block_hash]
                else:
                    self._pending[block_hash] -= 1
                self._cond.notify_all()

    def _store(self, block_hash: bytes, payload: bytes) -> None:
        hex_hash = block_hash.hex()
        final = self.directory / block_file(hex_hash)
        temp = final.with_name(f".{hex_hash}.kv.tmp")
        header = block_header(self._key, block_hash, payload)
        try:
            final.parent.mkdir(mode=0o700, exist_ok=True)
            with open(temp, "wb") as file:
                file.write(header)
                file.write(payload)
                file.flush()
                os.fsync(file.fileno())
            # Atomic: a crash leaves the old file or the whole new one. No directory fsync: a
            # rename lost to a power cut leaves an entry naming a missing file, dropped at start.
            os.replace(temp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)
            raise
        with self._cond:
            rewritten = block_hash in self._index
            self._index[block_hash] = None
            self._index.move_to_end(block_hash)
            self._writes += 1
            lines = stored_line(hex_hash, self.identity.block_bytes)
            self._append(deleted_line(hex_hash) + lines if rewritten else lines)
            num_bytes = len(self._index) * self.identity.block_bytes
            if num_bytes > self.max_bytes and not self._warned_full:
                self._warned_full = True
                self._log.warning("spill store %s holds more than max_bytes (%d): the caller "
                                  "deletes before it writes", self.directory, self.max_bytes)

    def _touch(self, block_hash: bytes) -> None:
        with self._cond:
            if block_hash in self._index:  # else deleted or dropped since it was read
                self._index.move_to_end(block_hash)
                self._append(used_line(block_hash.hex()))

    def _remove(self, block_hash: bytes) -> None:
        with self._cond:
            if block_hash not in self._index:
                return
            del self._index[block_hash]
            self._append(deleted_line(block_hash.hex()))
        # The entry goes first: a crash between the two leaves a file no entry names (swept at
        # start) rather than an entry naming a missing file (a warning at start).
        (self.directory / block_file(block_hash.hex())).unlink(missing_ok=True)

    # --- the manifest and errors (the caller holds _cond) ---------------------------------------

    def _append(self, lines: str) -> None:
        """Log events to the manifest (flushed, not fsynced: a line lost to a crash leaves a file no
        entry names, swept at start). After a failed append the file may end in a partial line, so
        the next append rewrites it whole from the index instead; the index already holds the
        events, which is why compaction can stand in for any append."""
        if self._manifest is None or self._num_lines > 2 * len(self._index) + COMPACT_SLACK_LINES:
            self._compact()
            return
        try:
            self._manifest.write(lines.encode())
            self._manifest.flush()
            self._num_lines += lines.count("\n")
        except OSError as error:
            self._close_manifest()
            self._failed("manifest append", error)

    def _compact(self) -> None:
        self._close_manifest()
        try:
            rewrite(self.directory, self.identity, [h.hex() for h in self._index])
            self._manifest = open(self.directory / MANIFEST, "ab")
            self._num_lines = 1 + len(self._index)
        except OSError as error:
            self._failed("manifest rewrite", error)

    def _close_manifest(self) -> None:
        if self._manifest is not None:
            with contextlib.suppress(OSError):  # a buffer that failed to flush fails again
                self._manifest.close()
            self._manifest = None

    def _failed(self, what: str, error: Exception) -> None:
        number = getattr(error, "errno", None)
        kind = errno.errorcode.get(number, type(error).__name__) if number else type(error).__name__
        with self._cond:
            self._write_errors += 1
            if kind in self._error_kinds:
                return
            self._error_kinds.add(kind)
        self._log.warning("spill store %s: %s failed (%s: %s); further %s errors are only counted",
                          self.directory, what, kind, error, kind)


def _check_hash(block_hash: bytes) -> None:
    if not isinstance(block_hash, bytes) or len(block_hash) != HASH_BYTES:
        raise ValueError(f"a block hash is {HASH_BYTES} bytes, got {block_hash!r}")
