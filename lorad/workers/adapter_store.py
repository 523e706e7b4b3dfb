"""This rank's adapters: the registry (id -> validated folder), a host cache of factor shards
(adapter_host_cache), and the jobs that register an adapter (validate, key) or copy one into a
device slot.

Jobs run in the order submitted, on one thread beside the step loop (on CUDA the copy runs on its
own stream, synchronized before the job counts as done). Their outcome is agreed by the ranks
(`report` -> agreement.agree_step -> `settle`): a job is done once every rank has finished it, and
failed everywhere if it failed on any rank, so every rank registers the same adapters and starts
the same sequences. What a job computes never depends on timing, only when it is done does.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from lorad.config import ConfigError, ModelConfig
from lorad.config.adapter_capacity import LoraCapacity
from lorad.config.adapters import WEIGHTS_FILE, AdapterSpec, read_adapter
from lorad.config.peft_config import CONFIG_FILE
from lorad.protocol.messages import LoadAdapter
from lorad.workers.adapter_host_cache import HostCache

log = logging.getLogger("lorad.worker")

# Test hook, read only when set to "RANK:SUFFIX": that rank reads a run-time adapter folder PATH
# from PATH + SUFFIX where that exists, as a host whose copy of the files differs would
# (tests/integration).
ADAPTER_PATH_SUFFIX_ENV = "LORAD_TEST_ADAPTER_PATH_SUFFIX"
STAMPED_FILES = (WEIGHTS_FILE, CONFIG_FILE)  # what the identity key and scales come from


@dataclass
class Job:
    number: int
    kind: str  # "register" (LoadAdapter) or "fetch" (into a device slot)
    adapter_id: int
    slot: int  # fetch: the device slot; register: 0
    future: Future  # -> an AdapterSpec (register) or None (fetch); raises ConfigError
    agreed_failed: bool = False
    submitted: float = 0.0  # time.monotonic() at submit
    started: float = 0.0  # when the jobs' thread took it up; 0 until then
    finished: float = 0.0  # when it returned or raised there


@dataclass(frozen=True)
class Settled:
    """One job's agreed outcome."""

    kind: str
    adapter_id: int
    slot: int
    ok: bool
    queued_ms: float = 0.0  # from submit until the jobs' thread took it up
    ran_ms: float = 0.0  # on the jobs' thread


class AdapterStore:
    def __init__(self, tables: dict, model_config: ModelConfig, capacity: LoraCapacity,
                 max_cpu_adapters: int, device: torch.device, path_suffix: str = "") -> None:
        self.tables = tables  # {(layer, module): LoraSlots}
        self.model_config = model_config
        self.capacity = capacity
        self.specs: dict[int, AdapterSpec] = {}  # registered on every rank
        self._staged: dict[int, AdapterSpec] = {}  # validated here, outcome not agreed yet
        self._host = HostCache(tables, max_cpu_adapters, pin=device.type == "cuda")
        # id -> (size, inode, mtime) of its files when their key was last computed
        self._checked: dict[int, tuple] = {}
        self._jobs: dict[int, Job] = {}
        self._next_number = 1
        self._num_settled = 0  # jobs 1..this are settled on every rank
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="adapters")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._path_suffix = path_suffix
        self.num_host_hits = 0
        self.num_disk_reads = 0
        self.version = 0  # moves whenever `specs` changes

    # --- start-up: synchronous ------------------------------------------------------------------

    def add_started(self, spec: AdapterSpec, slot: int | None) -> None:
        """An adapter validated at start (agreed by check_registry), copied into `slot` now."""
        self.specs[spec.adapter_id] = spec
        self.version += 1
        if slot is not None:
            self._copy(spec, slot)

    @contextmanager
    def lit_slot(self, slot: int):
        """Within the block, every table where `slot` edits nothing counts it at the table's
        full rank with scale 0 (its factors are zeros or another adapter's: a delta of 0 either
        way), so a warm-up step through `slot` runs every LoRA kernel."""
        lit = [t for t in self.tables.values() if t.ranks[slot] == 0] if slot else []
        for table in lit:
            rank = table.lora_a.shape[1]
            table.ranks[slot], table.rank_table[slot] = rank, rank
        try:
            yield
        finally:
            for table in lit:
                table.clear(slot)

    # --- jobs ---------------------------------------------------------------------------------

    def submit_register(self, msg: LoadAdapter) -> None:
        self._submit("register", msg.adapter_id, 0, self._register, msg)

    def submit_fetch(self, adapter_id: int, slot: int) -> None:
        spec = self.specs.get(adapter_id)
        self._submit("fetch", adapter_id, slot, self._fetch, spec, slot)

    def report(self) -> tuple[int, int]:
        """(settled, failed) for the step agreement: jobs up to `settled` finished here with
        success (or were agreed failed), and `failed` = settled + 1 when that job failed here
        (0 otherwise)."""
        done = self._num_settled
        while done + 1 in self._jobs:
            job = self._jobs[done + 1]
            if not job.future.done():
                break
            if job.future.exception() is not None and not job.agreed_failed:
                return done, done + 1
            done += 1
        return done, 0

    def local_failure(self, number: int) -> tuple[int, str] | None:
        """(adapter id, why) of a job that failed on this rank."""
        job = self._jobs.get(number)
        if job is None or not job.future.done() or job.future.exception() is None:
            return None
        return job.adapter_id, str(job.future.exception())

    def settle(self, settled: int, failed: int) -> list[Settled]:
        """The agreed minimum of every rank's settled count, and a job failed on some rank (or
        0) -> the outcomes newly agreed, in job order. A job agreed failed that this rank has
        not finished yet is settled when it finishes (its later jobs wait for it)."""
        outcomes = []
        for number in range(self._num_settled + 1, settled + 1):
            job = self._jobs.pop(number)  # an agreed failure leaves once every rank passed it
            if not job.agreed_failed:
                outcomes.append(self._outcome(job, True))
        if failed:  # settled + 1
            self._jobs[failed].agreed_failed = True
            outcomes.append(self._outcome(self._jobs[failed], False))
        self._num_settled = max(self._num_settled, settled)
        return outcomes

    def forget(self, adapter_id: int) -> None:
        """Unloaded: no new request names it; its slot is the planner's to free. The host
        cache is the jobs' thread's: its entry goes in job order."""
        self.specs.pop(adapter_id, None)
        self.version += 1
        self._executor.submit(self._host.drop, adapter_id)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=False)
        self._host.close()

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    # --- on the jobs' thread ------------------------------------------------------------------

    def _submit(self, kind: str, adapter_id: int, slot: int, fn, *args) -> None:
        number = self._next_number
        self._next_number += 1
        job = Job(number, kind, adapter_id, slot, Future(), submitted=time.monotonic())
        job.future = self._executor.submit(self._timed, job, fn, *args)
        self._jobs[number] = job

    @staticmethod
    def _timed(job: Job, fn, *args):
        job.started = time.monotonic()
        try:
            return fn(*args)
        finally:
            job.finished = time.monotonic()

    def _register(self, msg: LoadAdapter) -> AdapterSpec:
        stamp_before = _stamp_of(Path(msg.path + self._path_suffix), Path(msg.path))
        spec = self._read(msg.path, msg.name, msg.strength, msg.adapter_id)
        if _stamp(spec) == stamp_before:  # unchanged while it was read: the key holds for it
            self._checked[msg.adapter_id] = stamp_before
        if spec.key != msg.key:
            raise ConfigError(f"{spec.path}: this rank computes identity key {spec.key[:16]}..., "
                              f"the coordinator {msg.key[:16]}...: the folder differs on this "
                              "host, or changed after the coordinator read it")
        refusal = self.capacity.refusal(spec.modules)
        if refusal is not None:
            raise ConfigError(f"{spec.path}: {refusal}")
        self._staged[msg.adapter_id] = spec
        return spec

    def _fetch(self, spec: AdapterSpec | None, slot: int) -> None:
        if spec is None:
            raise ConfigError("the adapter is not registered on this rank")
        self._copy(spec, slot)

    def _copy(self, spec: AdapterSpec, slot: int) -> None:
        began = time.monotonic()
        host_slot = self._host.get(spec.adapter_id)
        source = "the host cache" if host_slot is not None else "disk"
        if host_slot is not None:
            self.num_host_hits += 1
        else:
            self._check_files(spec)
            host_slot = self._host.put(spec.adapter_id, self._host.read(spec))
            self.num_disk_reads += 1
        # The slot's previous adapter has no sequence left: its last step's reads are done, on
        # every rank (they precede that step's last all-reduce, which precedes the leader's
        # sampling, which precedes this rank planning the step that evicted it).
        read = time.monotonic()
        if self._stream is None:
            self._host.fill(slot, spec, host_slot)
        else:
            with torch.cuda.stream(self._stream):  # beside the steps; done once synchronized
                self._host.fill(slot, spec, host_slot)
            self._stream.synchronize()
        log.debug("adapter id %d into slot %d: shards from %s in %.1f ms, copied in %.1f ms",
                  spec.adapter_id, slot, source, (read - began) * 1e3,
                  (time.monotonic() - read) * 1e3)

    def _check_files(self, spec: AdapterSpec) -> None:
        """Before a read from disk (spec.path: the folder this rank registered): the files must
        still have the registered key, since a folder edited in place since its load must not
        be served under the old identity. The key is computed again only when a file's size,
        inode or modification time moved since it was last checked. (A file replaced between
        the check and the read is not caught; replace folders by rename, or reload.)"""
        stamp = _stamp(spec)
        if self._checked.get(spec.adapter_id) != stamp:
            again = read_adapter(Path(spec.path), spec.name, spec.strength, spec.adapter_id,
                                 self.model_config)
            if again.key != spec.key:
                raise ConfigError(f"{spec.path}: its files changed since it was loaded (identity "
                                  f"key {again.key[:16]}..., registered {spec.key[:16]}...); "
                                  "reload it")
            self._checked[spec.adapter_id] = stamp

    def _read(self, path: str, name: str, strength: float, adapter_id: int) -> AdapterSpec:
        folder = Path(path + self._path_suffix)
        if not self._path_suffix or not folder.is_dir():
            folder = Path(path)
        return read_adapter(folder, name, strength, adapter_id, self.model_config)

    def _outcome(self, job: Job, ok: bool) -> Settled:
        if job.kind == "register":
            spec = self._staged.pop(job.adapter_id, None)
            if ok:
                self.specs[job.adapter_id] = spec
                self.version += 1
        started = job.started or job.submitted
        return Settled(job.kind, job.adapter_id, job.slot, ok,
                       queued_ms=(started - job.submitted) * 1e3,
                       ran_ms=max(0.0, job.finished - started) * 1e3)


def _stamp(spec: AdapterSpec) -> tuple:
    """What identifies the folder's files' contents cheaply: size, inode, modification time."""
    return _stamp_of(Path(spec.path), Path(spec.path))


def _stamp_of(preferred: Path, fallback: Path) -> tuple:
    folder = preferred if preferred.is_dir() else fallback
    try:
        return tuple((st.st_size, st.st_ino, st.st_mtime_ns)
                     for st in (os.stat(folder / name) for name in STAMPED_FILES))
    except OSError:
        return ()
