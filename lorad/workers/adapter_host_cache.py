"""The host cache of adapter factors (`--max-cpu-adapters`): the shards of the adapters most
recently copied into a device slot, kept so that the next copy of one skips the disk.

Each cached adapter lives in a host slot: one buffer the size of a device slot (every table at
its full rank), allocated at its first use and kept, page-locked on a GPU, so that the copy into
a device slot is one asynchronous DMA a factor, with no staging by the driver. The factors are
stored in the tables' dtypes (converted once, when read from disk: the tables' dtype holds the
file's values exactly, see lora.table_dtype), since torch converts a host tensor of another
dtype on the host, into a pageable temporary, before it copies it to the device. With
`--max-cpu-adapters 0` one host slot stages each copy and keeps nothing.

Used on the adapter jobs' thread only. A host slot is written only by `put`, which runs after the
previous copy out of it has been synchronized (AdapterStore._copy).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

ALIGN = 64  # bytes: each factor starts at a multiple of this, so any dtype's view is aligned
PAGE = 4096


class HostCache:
    def __init__(self, tables: dict, max_adapters: int, pin: bool) -> None:
        self.tables = tables  # {(layer, module): LoraSlots}
        self.max_adapters = max_adapters
        self.pin = pin  # page-lock each host slot (cudaHostRegister) as it is allocated
        self.slot_bytes = _round_up(sum(_round_up(t.lora_a[0].nbytes, ALIGN)
                                        + _round_up(t.lora_b[0].nbytes, ALIGN)
                                        for t in tables.values()), PAGE)
        self._buffers: list[torch.Tensor] = []  # host slots allocated so far
        self._entries: OrderedDict[int, tuple[int, dict]] = OrderedDict()  # id -> (host slot,
        # {(layer, module): (A, B)}), least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        """Host memory the allocated host slots take."""
        return len(self._buffers) * self.slot_bytes

    def get(self, adapter_id: int) -> dict | None:
        """The adapter's cached shards, now the most recently used; None when not cached."""
        entry = self._entries.get(adapter_id)
        if entry is None:
            return None
        self._entries.move_to_end(adapter_id)
        return entry[1]

    def put(self, adapter_id: int, shards: dict) -> dict:
        """Shards read from disk ({(layer, module): (A, B)}, LoraSlots.shard, in the file's
        dtype) -> the same values in a host slot, in the tables' dtypes: what fill_slot copies
        from. Cached as the most recent entry, evicting the least recent one when full; with a
        capacity of 0 they stay valid until the next put."""
        self.drop(adapter_id)
        slot = self._take_slot()
        buffer = self._buffers[slot]
        offset, views, dsts, srcs = 0, {}, [], []
        for where, pair in shards.items():
            table = self.tables[where]
            shaped = []
            for src in pair:
                shaped.append(buffer[offset:offset + src.numel() * table.lora_a.element_size()]
                              .view(table.lora_a.dtype).view(src.shape))
                offset += _round_up(shaped[-1].nbytes, ALIGN)
            views[where] = tuple(shaped)
            dsts += shaped
            srcs += pair
        assert offset <= self.slot_bytes, "an adapter above the tables' ranks reached the cache"
        torch._foreach_copy_(dsts, srcs)  # widens exactly where the tables' dtype is wider
        if self.max_adapters:
            self._entries[adapter_id] = (slot, views)
        return views

    def drop(self, adapter_id: int) -> None:
        """Forget an adapter's entry (unloaded, or read again); its host slot is kept."""
        self._entries.pop(adapter_id, None)

    def _allocate(self) -> int:
        # Whole pages of its own: two registrations must not share a page.
        buffer = torch.empty(self.slot_bytes + PAGE, dtype=torch.uint8)
        start = -buffer.data_ptr() % PAGE
        buffer = buffer[start:start + self.slot_bytes]
        if self.pin:
            # Registered for the process's life: the driver releases it at exit. torch's
            # pin_memory would round the size up to a power of two.
            error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), self.slot_bytes,
                                                              0))
            if error:
                raise RuntimeError(f"page-locking {self.slot_bytes} bytes of host memory for the "
                                   f"adapter host cache failed (cudaError {error})")
        self._buffers.append(buffer)
        return len(self._buffers) - 1

    def _take_slot(self) -> int:
        """A host slot no entry holds: a free one, a new one while fewer than the capacity (or
        the one staging slot) exist, else the least recently used entry's."""
        used = {slot for slot, _ in self._entries.values()}
        free = next((slot for slot in range(len(self._buffers)) if slot not in used), None)
        if free is not None:
            return free
        if len(self._buffers) < max(1, self.max_adapters):
            return self._allocate()
        return self._entries.popitem(last=False)[1][0]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
