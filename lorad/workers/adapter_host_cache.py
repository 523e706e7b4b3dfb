"""Adapter factors on their way into a device slot: read from the weights file, kept in the host
cache (`--max-cpu-adapters`: the adapters most recently copied into a slot, so that the next copy
of one skips the disk), and copied from there into a slot.

All of it runs on the adapter jobs' thread beside the step loop, and every torch call there gives
up the GIL and waits for it back while the loop runs Python: a copy made of thousands of calls (a
slice, a view, a copy per factor) took 0.3-0.9 s beside busy steps against tens of ms alone
(benchmarks.probe_adapter_copy). So a copy here is a handful of calls, whatever the adapter's
size: the file is read in one call into a staging buffer whose views are made once per file
layout; a host slot mirrors a device slot (every table at its full rank, zeros past an adapter's
rank) and its views are made once; a device slot's views are made once.

A host slot is one buffer the size of a device slot, allocated at its first use and kept,
page-locked on a GPU, so the copy into a device slot is an asynchronous DMA a factor. It holds the
factors in the tables' dtype (converted once, on the way in: the tables' dtype holds the file's
values exactly, see lora.table_dtype); torch would otherwise convert on the host, into a pageable
temporary, before every copy. With `--max-cpu-adapters 0` one host slot stages each copy and
keeps nothing. A host slot is written only by `put`, after the previous copy out of it has been
synchronized (AdapterStore._copy), and the staging buffer only by `read`, after `put` used it.
"""

from __future__ import annotations

import mmap
import weakref
from collections import OrderedDict

import torch

from lorad.config import ConfigError
from lorad.config.adapters import AdapterSpec
from lorad.config.safetensors_header import read_open_safetensors_header
from lorad.workers.loader import WholeTensor
from lorad.workers.lora import STORED_DTYPES, write_ranks_and_scales

ALIGN = 64  # bytes: each factor starts at a multiple of this, so any dtype's view is aligned
MAX_LAYOUTS = 8  # file layouts whose staging views are kept (adapters of one recipe share one)
# --max-cpu-adapters auto (auto_capacity): the share of the host memory available at the start
# that the host caches of this host's ranks may fill, and the capacity where that is not known.
AUTO_SHARE = 0.25
DEFAULT_CAPACITY = 64


class HostCache:
    def __init__(self, tables: dict, max_adapters: int, pin: bool) -> None:
        self.tables = tables  # {(layer, module): LoraSlots}
        self.max_adapters = max_adapters
        self.pin = pin  # page-lock each host slot (cudaHostRegister) as it is allocated
        self._offsets, self.slot_bytes = _slot_layout(tables)
        self._buffers: list[torch.Tensor] = []  # host slots allocated so far
        self._full: list[dict] = []  # per host slot: where -> (A, B) at the tables' full rank
        self._ranked: list[dict] = []  # per host slot: (where, rank) -> (A[:rank], B[:, :rank])
        self._holds: list[tuple | None] = []  # per host slot: the layout its zeros fit
        self._entries: OrderedDict[int, int] = OrderedDict()  # id -> host slot, least
        # recently used first
        self._device: dict[int, dict] = {}  # device slot -> where -> its views
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._staged: OrderedDict[tuple, dict] = OrderedDict()  # file layout -> shard views
        # Page-locked host slots are unregistered before their memory is unmapped: a range
        # still registered when unmapped stays registered, and a later mapping at the same
        # address (another engine in this process) could not be registered (cudaError 712).
        self._registered: list[int] = []  # data pointers of the page-locked host slots
        self._unpin = weakref.finalize(self, _unregister, self._registered)

    def close(self) -> None:
        """Unpin the host slots (once every copy out of them is synchronized); no use after."""
        self._unpin()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        """Host memory the allocated host slots take."""
        return len(self._buffers) * self.slot_bytes

    # --- the file -----------------------------------------------------------------------------

    def read(self, spec: AdapterSpec) -> dict:
        """This rank's shards of the adapter's factors ({(layer, module): (A, B)}, as
        LoraSlots.shard cuts them), read from its weights file in one call: views of the
        staging buffer, valid until the next read. ConfigError names the file."""
        label = f"adapter {spec.name!r} ({spec.weights_file})"
        try:
            with open(spec.weights_file, "rb") as f:
                header = read_open_safetensors_header(f, label)  # f is at the data now
                size = header.file_size - header.data_start
                if size > self._staging.numel():
                    self._staging = torch.empty(size, dtype=torch.uint8)
                    self._staged.clear()
                got = f.readinto(memoryview(self._staging.numpy())[:size])  # without the GIL
        except OSError as exc:
            raise ConfigError(f"{label}: cannot read: {exc.strerror or exc}") from None
        if got != size:
            raise ConfigError(f"{label}: read {got} of its {size} data bytes")
        key = (header.data_start, *((m.layer, m.module, m.rank, header.tensors.get(m.a_tensor),
                                     header.tensors.get(m.b_tensor)) for m in spec.modules))
        shards = self._staged.get(key)
        if shards is None:
            shards = self._stage_views(spec, header, label)
            self._staged[key] = shards
            while len(self._staged) > MAX_LAYOUTS:
                self._staged.popitem(last=False)
        self._staged.move_to_end(key)
        return shards

    def _stage_views(self, spec: AdapterSpec, header, label: str) -> dict:
        shards = {}
        try:
            for m in spec.modules:
                table = self.tables.get((m.layer, m.module))
                if table is None:
                    raise ValueError(f"{m.full_name} has no slot table here")
                pair = []
                for name in (m.a_tensor, m.b_tensor):
                    entry = header.tensors.get(name)
                    if entry is None:
                        raise ValueError(f"no tensor {name!r}")
                    if entry.dtype not in STORED_DTYPES:
                        raise ValueError(f"{name} is {entry.dtype}, not one of "
                                         f"{', '.join(STORED_DTYPES)}")
                    start = entry.start - header.data_start
                    pair.append(WholeTensor(self._staging[start:start + entry.num_bytes]
                                            .view(STORED_DTYPES[entry.dtype])
                                            .view(entry.shape)))
                shards[(m.layer, m.module)] = table.shard(m, *pair)
        except ValueError as exc:
            raise ConfigError(f"{label}: {exc}") from None
        return shards

    # --- the host slots -----------------------------------------------------------------------

    def get(self, adapter_id: int) -> int | None:
        """The adapter's host slot, now the most recently used; None when not cached."""
        slot = self._entries.get(adapter_id)
        if slot is not None:
            self._entries.move_to_end(adapter_id)
        return slot

    def put(self, adapter_id: int, shards: dict) -> int:
        """Shards ({(layer, module): (A, B)} in the file's dtype, `read`'s) -> the host slot
        now holding the same values, in the tables' dtype. Cached as the most recent entry,
        evicting the least recent one when full; with a capacity of 0 it stays valid until the
        next put."""
        self.drop(adapter_id)
        slot = self._take_slot()
        layout = tuple((where, a.shape[0]) for where, (a, _) in shards.items())
        if self._holds[slot] != layout:  # zeros past each rank, where this layout reads
            if self._holds[slot] is not None:
                self._buffers[slot].zero_()
            self._holds[slot] = layout
        ranked, dsts, srcs = self._ranked[slot], [], []
        for where, rank in layout:
            views = ranked.get((where, rank))
            if views is None:
                a, b = self._full[slot][where]
                views = ranked[(where, rank)] = (a[:rank], b[:, :rank])
            dsts += views
            srcs += shards[where]
        torch._foreach_copy_(dsts, srcs)  # widens exactly where the tables' dtype is wider
        if self.max_adapters:
            self._entries[adapter_id] = slot
        return slot

    def drop(self, adapter_id: int) -> None:
        """Forget an adapter's entry (unloaded, or read again); its host slot is kept."""
        self._entries.pop(adapter_id, None)

    # --- into a device slot -------------------------------------------------------------------

    def fill(self, slot: int, spec: AdapterSpec, host_slot: int) -> None:
        """Copy a host slot's adapter into device slot `slot` with the modules' ranks and
        scales; the tables it does not edit get rank 0 (what fill_tables gives, in a handful of
        torch calls: the factors at full rank, zeros past the rank included). Asynchronous on
        CUDA: the caller synchronizes its stream."""
        views = self._device.get(slot)
        if views is None:
            views = self._device[slot] = {
                where: (t.lora_a[slot], t.lora_b[slot], t.rank_table[slot:slot + 1],
                        t.scale_table[slot:slot + 1]) for where, t in self.tables.items()}
        full = self._full[host_slot]
        by_where = {(m.layer, m.module): m for m in spec.modules}
        dsts, srcs, rank_views, scale_views, ranks, scales = [], [], [], [], [], []
        for where, table in self.tables.items():
            a, b, rank_view, scale_view = views[where]
            module = by_where.get(where)
            r, scale = (0, 0.0) if module is None else (module.rank, module.scale)
            if module is not None:
                dsts += (a, b)
                srcs += full[where]
            table.ranks[slot], table.scales[slot] = r, scale
            rank_views.append(rank_view)
            scale_views.append(scale_view)
            ranks.append(r)
            scales.append(scale)
        if dsts:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        write_ranks_and_scales(rank_views, scale_views, ranks, scales)

    # --- allocation ---------------------------------------------------------------------------

    def _take_slot(self) -> int:
        """A host slot no entry holds: a free one, a new one while fewer than the capacity (or
        the one staging slot) exist, else the least recently used entry's."""
        used = set(self._entries.values())
        free = next((slot for slot in range(len(self._buffers)) if slot not in used), None)
        if free is not None:
            return free
        if len(self._buffers) < max(1, self.max_adapters):
            return self._allocate()
        return self._entries.popitem(last=False)[1]

    def _allocate(self) -> int:
        # Zeros in whole pages of its own (an anonymous mapping): two page-locked ranges must
        # not share a page, and torch's pin_memory would round the size up to a power of two.
        buffer = torch.frombuffer(mmap.mmap(-1, self.slot_bytes), dtype=torch.uint8)
        if self.pin:
            # Unregistered by close() or when this cache is collected (before its buffers are).
            error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), self.slot_bytes,
                                                              0))
            if error:
                raise RuntimeError(f"page-locking {self.slot_bytes} bytes of host memory for the "
                                   f"adapter host cache failed (cudaError {error})")
            self._registered.append(buffer.data_ptr())
        full = {}
        for where, table in self.tables.items():
            a_start, b_start = self._offsets[where]
            full[where] = tuple(
                buffer[start:start + t.nbytes].view(t.dtype).view(t.shape)
                for start, t in ((a_start, table.lora_a[0]), (b_start, table.lora_b[0])))
        self._buffers.append(buffer)
        self._full.append(full)
        self._ranked.append({})
        self._holds.append(None)
        return len(self._buffers) - 1


def host_slot_bytes(tables: dict) -> int:
    """The bytes of one host slot: every table's A and B of one device slot, aligned."""
    return _slot_layout(tables)[1]


def auto_capacity(tables: dict, available_bytes: int | None, num_host_ranks: int) -> int:
    """--max-cpu-adapters auto: the host slots that fill AUTO_SHARE of the host memory available
    at the start (MemAvailable), split evenly between this host's ranks; DEFAULT_CAPACITY where
    that cannot be told. Host slots are allocated as adapters first come in, so a capacity
    never reached costs nothing."""
    slot_bytes = host_slot_bytes(tables)
    if not slot_bytes:
        return 0
    if available_bytes is None:
        return DEFAULT_CAPACITY
    return int(available_bytes * AUTO_SHARE) // max(1, num_host_ranks) // slot_bytes


def _slot_layout(tables: dict) -> tuple[dict, int]:
    """-> ({where: (A's offset, B's offset)}, the slot's bytes): each table's A [max_rank, in]
    and B [out, max_rank], as in a device slot."""
    offsets, offset = {}, 0
    for where, table in tables.items():
        a_bytes, b_bytes = table.lora_a[0].nbytes, table.lora_b[0].nbytes
        offsets[where] = (offset, offset + _round_up(a_bytes, ALIGN))
        offset += _round_up(a_bytes, ALIGN) + _round_up(b_bytes, ALIGN)
    return offsets, _round_up(offset, mmap.PAGESIZE)


def _unregister(pointers: list[int]) -> None:
    for pointer in pointers:
        torch.cuda.cudart().cudaHostUnregister(pointer)
    pointers.clear()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
