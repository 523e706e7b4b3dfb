"""Step agreement: what keeps every rank's live set identical (shared/DESIGN.md, "Step agreement").

The inbox buffers coordinator messages by `seq`; each step the ranks all-gather (watermark,
live-set digest) as one int64 tensor on the gloo cpu group, apply messages up to the minimum
watermark and, when they applied any, all-gather their digests again before the model runs. At
start they all-gather the registry digest, then, if the adapters differ, one digest per adapter
so the refusal names it. Tensor collectives only, never object collectives (they pickle); at world
size 1 no torch.distributed call is made at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from struct import pack as _pack
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol

import torch
import torch.distributed as dist

from lorad.config.adapter_capacity import LoraCapacity
from lorad.config.model import ModelConfig
from lorad.workers.sequence import Sequence, SeqStatus

WORKERS_DIR = Path(__file__).resolve().parent


class CpuGroup(Protocol):
    """The part of `TensorParallel` agreement needs."""

    rank: int
    world_size: int
    cpu_group: object  # gloo ProcessGroup; None at world size 1


class Inbox:
    """Coordinator messages (Admit/Cancel/Shutdown) by seq, released in order up to a watermark."""

    def __init__(self) -> None:
        self._pending: dict[int, object] = {}
        self.watermark = 0  # highest seq such that 1..seq have all been received
        self._taken = 0  # highest seq handed out by take_upto

    def __len__(self) -> int:
        return len(self._pending)

    def put(self, msg) -> bool:
        """Buffer a message; False for a repeat or a seq already applied (it is ignored)."""
        if msg.seq <= self._taken or msg.seq in self._pending:
            return False
        self._pending[msg.seq] = msg
        while self.watermark + 1 in self._pending:
            self.watermark += 1
        return True

    @property
    def applied(self) -> int:
        """The highest seq handed out by take_upto."""
        return self._taken

    def take_upto(self, seq: int) -> list:
        """Remove and return the messages numbered `_taken+1 .. seq`, in order."""
        if seq > self.watermark:
            raise RuntimeError(f"cannot apply up to {seq}: only {self.watermark} received")
        taken = [self._pending.pop(n) for n in range(self._taken + 1, seq + 1)]
        self._taken = max(self._taken, seq)
        return taken


# --- digests ----------------------------------------------------------------------------------

def to_int64(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little", signed=True)


_STATUS_TEXT = {status: status.value for status in SeqStatus}  # an Enum's .value is a slow lookup


class _PackedTables:
    """Each live sequence's block table as little-endian int64s, packed again only when its
    content changed (a list compare): a decode's table grows one block every block_size steps,
    and packing every table every step was a third of the digest at 256 sequences. The bytes
    are always the table's own; entries of sequences no longer live are dropped each call."""

    def __init__(self) -> None:
        self._by_id: dict[str, tuple[list[int], bytes]] = {}

    def packed(self, live: list[Sequence]) -> list[bytes]:
        old, fresh, packed = self._by_id, {}, []
        for seq in live:
            table = seq.block_table
            entry = old.get(seq.request_id)
            if entry is None or entry[0] != table:
                entry = (list(table), _pack(f"<{len(table)}q", *table))  # a copy: tables grow
            fresh[seq.request_id] = entry
            packed.append(entry[1])
        self._by_id = fresh
        return packed


_TABLES = _PackedTables()


def live_digest(live: Iterable[Sequence], registry: bytes = b"") -> int:
    """sha256 of the live set in arrival order: ids, adapter slot, key and strength, token
    positions and KV blocks (a fork's shared blocks in each holder's table), and the choices
    still to fork. Every step, on every rank: the strings go in length-prefixed, the block table as
    little-endian int64s (a JSON text per sequence cost 7 us each, 0.45 ms a step at 64
    sequences). One buffer hashed once, the tables packed when they change: 30% less than an
    update and an array per sequence, for the same bytes (docs/performance-log.md: live
    digest packed once). `registry`: the adapter registry and slot map as this rank holds them
    (Worker loop's registry_text), so a registry change or slot choice that one rank made
    differently fails the step too."""
    live = list(live)
    parts: list[bytes] = [registry]
    for seq, table_bytes in zip(live, _TABLES.packed(live)):
        request_id, key = seq.request_id, seq.adapter_key
        parts.append(f"{len(request_id)}:{request_id}{len(key)}:{key}{seq.arrival},"
                     f"{seq.adapter_slot},{seq.adapter_strength!r},{_STATUS_TEXT[seq.status]},"
                     f"{len(seq.prompt_ids) + len(seq.output_ids)},{seq.num_computed},"
                     f"{len(seq.block_table)};".encode())
        parts.append(table_bytes)
        if seq.fork_ids:  # the choices still to fork from it (n > 1), by id
            parts.append(("|" + ",".join(seq.fork_ids) + ";").encode())
    return to_int64(hashlib.sha256(b"".join(parts)).digest())


@dataclass(frozen=True)
class RegistryDigest:
    """What every rank must agree on before it serves, one sha256 per part."""

    model: bytes  # the base model's config
    engine: bytes  # the lorad/workers source files
    # each start adapter's id, name, identity key and strength, in order, and the slot tables'
    # capacity (device slots, run-time adapters, rank)
    adapters: bytes
    # (what to call it, sha256 of its id, name, key and strength) per adapter, in id order
    adapter_parts: tuple[tuple[str, bytes], ...] = ()

    PARTS = ("base model config", "engine source (lorad/workers)", "adapter registry")

    @classmethod
    def compute(cls, model_config: ModelConfig,
                adapters: tuple[tuple[int, str, str, float], ...] = (),
                capacity: LoraCapacity | None = None) -> "RegistryDigest":
        """adapters: (id, name, identity key, strength) of each start adapter, in id order."""
        model = json.dumps(dataclasses.asdict(model_config), sort_keys=True).encode()
        parts = tuple((f"adapter {name!r} (id {adapter_id})",
                       hashlib.sha256(json.dumps([adapter_id, name, key, strength]).encode()
                                      ).digest())
                      for adapter_id, name, key, strength in adapters)
        held = [list(a) for a in adapters]
        if capacity is not None:
            held.append(dataclasses.astuple(capacity))
        return cls(hashlib.sha256(model).digest(), engine_digest(),
                   hashlib.sha256(json.dumps(held).encode()).digest(), parts)

    def hex(self) -> str:
        return hashlib.sha256(self.model + self.engine + self.adapters).hexdigest()

    def as_int64s(self) -> list[int]:
        return [to_int64(self.model), to_int64(self.engine), to_int64(self.adapters)]


def engine_digest(root: Path = WORKERS_DIR) -> bytes:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.digest()


# --- collectives ------------------------------------------------------------------------------

def all_gather_int64(tp: CpuGroup, values: list[int]) -> list[list[int]]:
    """Every rank's `values` (same length on all ranks), indexed by rank."""
    if tp.world_size == 1:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.int64)  # [len(values)]
    gathered = [torch.empty_like(mine) for _ in range(tp.world_size)]
    dist.all_gather(gathered, mine, group=tp.cpu_group)
    return [t.tolist() for t in gathered]


@dataclass(frozen=True)
class StepAgreement:
    watermark: int  # apply messages up to here (the minimum over ranks)
    digests_agree: bool
    digests: list[int]  # each rank's live-set digest, by rank
    spill_finished: int = 0  # the disk spill's operations every rank has finished (minimum)
    spill_read_failures: int = 0  # the last plan's spill reads that failed on some rank (OR)
    # Adapter jobs (adapter_store.py): 1..adapter_settled succeeded on every rank (minimum);
    # adapter_failed (= adapter_settled + 1, or 0) failed on the ranks adapter_failed_ranks.
    adapter_settled: int = 0
    adapter_failed: int = 0
    adapter_failed_ranks: tuple[int, ...] = ()


def agree_step(tp: CpuGroup, watermark: int, digest: int, spill_finished: int = 0,
               spill_read_failures: int = 0, adapter_jobs: tuple[int, int] = (0, 0)
               ) -> StepAgreement:
    """adapter_jobs: this rank's AdapterStore.report()."""
    rows = all_gather_int64(tp, [watermark, digest, spill_finished, spill_read_failures,
                                 *adapter_jobs])
    digests = [row[1] for row in rows]
    failures = 0
    for row in rows:
        failures |= row[3]
    settled = min(row[4] for row in rows)
    failed_ranks = tuple(r for r, row in enumerate(rows) if row[5] == settled + 1)
    return StepAgreement(min(row[0] for row in rows), len(set(digests)) == 1, digests,
                         min(row[2] for row in rows), failures, settled,
                         settled + 1 if failed_ranks else 0, failed_ranks)


def compare_digests(tp: CpuGroup, agreed: StepAgreement, digest: int) -> StepAgreement:
    """`agreed` with each rank's live-set digest gathered again (after the messages it agreed on
    were applied in the same step): a second, smaller all-gather."""
    digests = [row[0] for row in all_gather_int64(tp, [digest])]
    return dataclasses.replace(agreed, digests_agree=len(set(digests)) == 1, digests=digests)


def check_registry(tp: CpuGroup, registry: RegistryDigest) -> str | None:
    """None when every rank has the same registry, else a message naming what differs where."""
    num_adapters = len(registry.adapter_parts)
    rows = all_gather_int64(tp, registry.as_int64s() + [num_adapters])
    problems = []
    for part, name in enumerate(RegistryDigest.PARTS):
        ranks = [r for r, row in enumerate(rows) if row[part] != rows[0][part]]
        if ranks:
            problems.append(f"{name} differs from rank 0 on rank(s) {ranks}")
    counts = [row[-1] for row in rows]
    if len(set(counts)) > 1:
        problems.append(f"the number of adapters differs (by rank: {counts})")
    elif num_adapters and any(row[2] != rows[0][2] for row in rows):
        # Every rank takes this branch or none (the rows are the same everywhere), so the
        # second collective is matched on every rank.
        per_adapter = all_gather_int64(tp, [to_int64(d) for _, d in registry.adapter_parts])
        for i, (label, _) in enumerate(registry.adapter_parts):
            ranks = [r for r, row in enumerate(per_adapter) if row[i] != per_adapter[0][i]]
            if ranks:
                problems.append(f"{label} differs from rank 0 on rank(s) {ranks} (name, "
                                "identity key or strength: the ranks read different files?)")
    return "registry mismatch: " + "; ".join(problems) if problems else None


def agree_min(tp: CpuGroup, value: int) -> int:
    return min(row[0] for row in all_gather_int64(tp, [value]))


def broadcast_ids(tp: CpuGroup, ids: list[int] | None, count: int) -> list[int]:
    """The leader's sampled ids on every rank; followers pass None and the count from the plan."""
    if tp.world_size == 1 or count == 0:
        return list(ids or [])
    if tp.rank == 0:
        if len(ids) != count:
            raise RuntimeError(f"the leader sampled {len(ids)} ids for {count} sequences")
        tensor = torch.tensor(ids, dtype=torch.int64)  # [count]
    else:
        tensor = torch.empty(count, dtype=torch.int64)
    dist.broadcast(tensor, src=0, group=tp.cpu_group)
    return tensor.tolist()
