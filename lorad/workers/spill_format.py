"""The KV spill directory's on-disk format (kv_spill.py's): the identity a directory is valid for;
the manifest, JSON lines of a header (format and identity) and one line per event (a block
stored, used or deleted), with the start-up checks a restart trusts; a block file's header (its
hash and a keyed checksum); the directory's lock. Format and checks only: the writer thread and
the order of its I/O are kv_spill.py's.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

FORMAT = 1
MANIFEST = "manifest.jsonl"
MANIFEST_TEMP = ".manifest.jsonl.tmp"
LOCK_FILE = "lock"
_HEX = re.compile(r"[0-9a-f]{32}")
_SUBDIR = re.compile(r"[0-9a-f]{2}")
_BLOCK_FILE = re.compile(r"[0-9a-f]{32}\.kv")
_BLOCK_TEMP = re.compile(r"\.[0-9a-f]{32}\.kv\.tmp")
_QUOTED_CHARS = 80  # of a bad line, in its log line

# A block file: magic, the block's chain hash, a checksum of hash and payload keyed by the
# identity's fingerprint, then the payload.
MAGIC = b"lorad-kv"
HASH_BYTES = 16
DIGEST_BYTES = 32
HEADER_BYTES = len(MAGIC) + HASH_BYTES + DIGEST_BYTES


@dataclass(frozen=True)
class SpillIdentity:
    """What makes a spilled block valid for this engine: a manifest whose header differs in any
    field is discarded whole, with its files."""

    engine: str  # lorad's engine identity (version + numerics), opaque
    model: str  # the model's identity, opaque
    dtype: str  # the KV cache's, e.g. "bfloat16"
    parallel: int  # --parallel: how many ranks
    rank: int
    block_size: int  # tokens per block
    block_bytes: int  # one block's payload on this rank: its shard of K and V, every layer

    def __post_init__(self) -> None:
        for name in ("engine", "model", "dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"SpillIdentity.{name} must be a non-empty string, got {value!r}")
        for name in ("parallel", "block_size", "block_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"SpillIdentity.{name} must be a positive int, got {value!r}")
        if type(self.rank) is not int or not 0 <= self.rank < self.parallel:
            raise ValueError(f"SpillIdentity.rank must be in [0, {self.parallel}), "
                             f"got {self.rank!r}")

    def fields(self) -> dict[str, str | int]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> bytes:
        """32 bytes that key every block file's checksum, so that a file from another identity's
        store fails it even under a manifest line that names it."""
        text = json.dumps(self.fields(), sort_keys=True).encode()
        return hashlib.blake2b(text, digest_size=32).digest()


def block_file(hex_hash: str) -> str:
    """A block's file, relative to the directory. Only ever derived from the digest: no manifest
    line and no client text names a path."""
    return f"{hex_hash[:2]}/{hex_hash}.kv"


def block_header(key: bytes, block_hash: bytes, payload: bytes) -> bytes:
    """A block file's first HEADER_BYTES; `key` is the identity's fingerprint."""
    return MAGIC + block_hash + _digest(key, block_hash, payload)


def block_problem(key: bytes, block_hash: bytes, header: bytes, payload: bytes) -> str | None:
    """Why a block file read back is not this block's (None when it is)."""
    if header[:len(MAGIC)] != MAGIC:
        return "is not a lorad KV block file"
    stored_hash = header[len(MAGIC):len(MAGIC) + HASH_BYTES]
    if stored_hash != block_hash:
        return f"holds block {stored_hash.hex()}"
    if header[len(MAGIC) + HASH_BYTES:] != _digest(key, block_hash, payload):
        return "fails its checksum"
    return None


def _digest(key: bytes, block_hash: bytes, payload: bytes) -> bytes:
    digest = hashlib.blake2b(block_hash, key=key, digest_size=DIGEST_BYTES)
    digest.update(payload)
    return digest.digest()


def header_line(identity: SpillIdentity) -> str:
    return json.dumps({"format": FORMAT, "identity": identity.fields()}, sort_keys=True) + "\n"


def stored_line(hex_hash: str, num_bytes: int) -> str:
    return json.dumps({"hash": hex_hash, "file": block_file(hex_hash), "bytes": num_bytes}) + "\n"


def used_line(hex_hash: str) -> str:
    return json.dumps({"hash": hex_hash, "used": True}) + "\n"


def deleted_line(hex_hash: str) -> str:
    return json.dumps({"hash": hex_hash, "deleted": True}) + "\n"


def load(directory: Path, identity: SpillIdentity, log: logging.Logger) -> tuple[list[str], int]:
    """(the hex hashes of the valid entries, least recently used first; how many were dropped).
    Each dropped entry gets one log line; a manifest of another format or identity is dropped
    whole with one. Files are only sized here (checksums are read()'s: a start-up would otherwise
    read the whole store); the files no valid entry names are left for sweep()."""
    path = directory / MANIFEST
    try:
        # A bad byte spoils its line only: the replacement character fails the checks below.
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return [], 0
    problem = _header_problem(lines[0] if lines else "", identity)
    if problem is not None:
        num_lines = sum(1 for line in lines[1:] if line.strip())
        log.warning("spill manifest %s %s: discarded with its %d entry lines, their files removed",
                    path, problem, num_lines)
        return [], num_lines
    live: OrderedDict[str, None] = OrderedDict()
    num_dropped = 0
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            hex_hash, event = _parse(line, identity.block_bytes)
        except ValueError as error:
            log.warning("spill manifest %s line %d %s (%r): dropped", path, number, error,
                        line[:_QUOTED_CHARS])
            num_dropped += 1
            continue
        if event == "deleted":
            live.pop(hex_hash, None)
        elif event == "used":
            if hex_hash in live:
                live.move_to_end(hex_hash)
        elif hex_hash in live:  # the writer logs a delete before a rewrite: this is damage
            log.warning("spill manifest %s line %d stores %s again: the earlier entry dropped, "
                        "the last kept", path, number, hex_hash)
            num_dropped += 1
            live.move_to_end(hex_hash)
        else:
            live[hex_hash] = None
    for hex_hash in list(live):
        problem = _file_problem(directory / block_file(hex_hash),
                                HEADER_BYTES + identity.block_bytes)
        if problem is not None:
            log.warning("spill manifest %s entry %s names %s, %s: dropped", path, hex_hash,
                        block_file(hex_hash), problem)
            num_dropped += 1
            del live[hex_hash]
    return list(live), num_dropped


def _header_problem(line: str, identity: SpillIdentity) -> str | None:
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):
        return "has no JSON header"
    if not isinstance(header, dict):
        return "has no JSON header"
    if header.get("format") != FORMAT:
        return f"is format {header.get('format')!r}, this lorad reads {FORMAT}"
    theirs = header.get("identity")
    if not isinstance(theirs, dict):
        return "has no identity"
    ours = identity.fields()
    differing = [f"{name} {theirs.get(name)!r} (this engine: {value!r})"
                 for name, value in ours.items()
                 if type(theirs.get(name)) is not type(value) or theirs.get(name) != value]
    differing += [f"unknown field {name}" for name in theirs if name not in ours]
    return "is for another identity: " + ", ".join(differing) if differing else None


def _parse(line: str, block_bytes: int) -> tuple[str, str]:
    """(hex hash, "stored" | "used" | "deleted") of one entry line; ValueError saying why not."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        raise ValueError("is not JSON") from None
    if not isinstance(entry, dict):
        raise ValueError("is not a JSON object")
    hex_hash = entry.get("hash")
    if not isinstance(hex_hash, str) or not _HEX.fullmatch(hex_hash):
        raise ValueError("has a hash that is not a 32-digit lowercase hex digest")
    if entry.get("deleted") is True:
        return hex_hash, "deleted"
    if entry.get("used") is True:
        return hex_hash, "used"
    if entry.get("file") != block_file(hex_hash):
        raise ValueError(f"names file {entry.get('file')!r}, not {block_file(hex_hash)!r}")
    if type(entry.get("bytes")) is not int or entry["bytes"] != block_bytes:
        raise ValueError(f"has {entry.get('bytes')!r} bytes, not {block_bytes}")
    return hex_hash, "stored"


def _file_problem(path: Path, file_bytes: int) -> str | None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "which is missing"
    except OSError as error:
        return f"which cannot be examined ({error})"
    if not stat.S_ISREG(info.st_mode):
        return "which is not a plain file"
    if info.st_size != file_bytes:
        return f"of {info.st_size} bytes, not {file_bytes} (truncated or damaged)"
    return None


def rewrite(directory: Path, identity: SpillIdentity, hex_hashes: list[str]) -> None:
    """Replace the manifest by a compacted one: the header and one stored line per hash, in this
    order. Through a temp file, fsync and rename, so that a crash leaves the old or the new."""
    temp = directory / MANIFEST_TEMP
    try:
        with open(temp, "w", encoding="utf-8") as file:
            file.write(header_line(identity))
            file.writelines(stored_line(h, identity.block_bytes) for h in hex_hashes)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, directory / MANIFEST)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_directory(directory)


def fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable (a power cut could otherwise undo it)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sweep(directory: Path, keep: set[str], log: logging.Logger) -> int:
    """Remove the store's own files that no valid entry names (blocks of a dropped entry or
    manifest, a killed writer's temp files); -> how many. Files not named like the store's are
    left alone: the directory may be one the operator also keeps other things in."""
    doomed = [directory / MANIFEST_TEMP] if (directory / MANIFEST_TEMP).exists() else []
    for subdir in os.scandir(directory):
        if not (_SUBDIR.fullmatch(subdir.name) and subdir.is_dir(follow_symlinks=False)):
            continue
        for entry in os.scandir(subdir.path):
            name = f"{subdir.name}/{entry.name}"
            if (_BLOCK_FILE.fullmatch(entry.name) and name not in keep
                    or _BLOCK_TEMP.fullmatch(entry.name)):
                doomed.append(directory / name)
    num_removed = 0
    for path in doomed:
        try:
            path.unlink()
            num_removed += 1
        except OSError as error:
            log.warning("spill directory %s: cannot remove %s (%s)", directory, path, error)
    if num_removed:
        log.info("spill directory %s: removed %d files no valid entry names", directory,
                 num_removed)
    return num_removed


def lock_directory(directory: Path) -> int:
    """An exclusive lock on the directory for a store's life (an fd: closing it unlocks): two
    ranks or two daemons given one spill directory would discard each other's manifests."""
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"spill directory {directory} is in use by another process or store"
                           ) from None
    return fd
