"""Which adapter each device slot holds: the planner's replicated decisions (no torch, no I/O).

Slot 0 is the base model; slots 1..num_slots hold adapters. An adapter that a starting sequence
needs goes into a free slot, else into the least recently used slot whose adapter no running
sequence reads and that is not pinned; the copy (adapter_store.py) runs beside the steps, and its
sequences start once every rank has finished it (the outcome is agreed). Every rank makes the same
choices from the same history, so no slot decision travels.
"""

from __future__ import annotations


class AdapterSlots:
    def __init__(self, num_slots: int, resident: dict[int, int] | None = None,
                 pinned: set[int] | None = None) -> None:
        """resident: adapter id -> slot of the adapters copied at start; pinned: ids never
        evicted once in a slot."""
        self.num_slots = num_slots
        self.slot_of: dict[int, int] = {}  # adapter id -> slot (ready, or its copy pending)
        self.holder = [0] * (num_slots + 1)  # slot -> adapter id; 0: free (slot 0 unused)
        self.fetching: set[int] = set()  # ids whose copy is planned and not yet agreed
        self.users: dict[int, int] = {}  # id -> running sequences that read its slot
        self._recent: dict[int, None] = {}  # ids in a slot, least recently used first
        self.pinned: set[int] = set(pinned or ())
        self.unloading: set[int] = set()  # unloaded while in use: forgotten once unused
        self._fetches: list[tuple[int, int]] = []  # this plan's (id, slot)
        self.num_loads = 0  # copies agreed, since the start (the start's own included)
        self.num_evictions = 0  # slots taken back for another adapter
        self.version = 0  # moves whenever digest_text would change
        for adapter_id, slot in (resident or {}).items():
            self._assign(adapter_id, slot)
            self.num_loads += 1

    @property
    def num_used(self) -> int:
        return len(self.slot_of)

    def is_ready(self, adapter_id: int) -> bool:
        return adapter_id in self.slot_of and adapter_id not in self.fetching

    def place(self, adapter_id: int, keep: set[int]) -> bool:
        """Plan the copy of `adapter_id` into a slot unless it has one; False when no slot can
        be had now: none free, and every adapter in one is read by a running sequence, pinned,
        being copied or in `keep` (ids that waiting sequences ahead need)."""
        if adapter_id in self.slot_of:
            return True
        slot = self._free_slot()
        if slot is None:
            victim = next((a for a in self._recent
                           if not self.users.get(a) and a not in self.pinned
                           and a not in self.fetching and a not in keep), None)
            if victim is None:
                return False
            slot = self._drop(victim)
            self.num_evictions += 1
        self._assign(adapter_id, slot)
        self.fetching.add(adapter_id)
        self._fetches.append((adapter_id, slot))
        self.version += 1
        return True

    def take_fetches(self) -> list[tuple[int, int]]:
        """This plan's copies, in the order planned."""
        fetches, self._fetches = self._fetches, []
        return fetches

    def fetched(self, adapter_id: int, slot: int, ok: bool) -> None:
        """A planned copy's agreed outcome; a failed one gives its slot back."""
        if self.slot_of.get(adapter_id) != slot or adapter_id not in self.fetching:
            raise RuntimeError(f"adapter {adapter_id}: no copy into slot {slot} is pending")
        self.fetching.discard(adapter_id)
        self.version += 1
        if ok:
            self.num_loads += 1
        if not ok or adapter_id in self.unloading:
            self._drop(adapter_id)
            self.unloading.discard(adapter_id)

    def acquire(self, adapter_id: int) -> int:
        """A sequence starts reading the (ready) adapter's slot -> the slot."""
        self.users[adapter_id] = self.users.get(adapter_id, 0) + 1
        self._recent.pop(adapter_id)
        self._recent[adapter_id] = None
        return self.slot_of[adapter_id]

    def release(self, adapter_id: int) -> None:
        left = self.users[adapter_id] - 1
        if left:
            self.users[adapter_id] = left
            return
        del self.users[adapter_id]
        if adapter_id in self.unloading:
            self.unloading.discard(adapter_id)
            self._drop(adapter_id)

    def forget(self, adapter_id: int) -> None:
        """The adapter was unloaded: its slot frees now, or when its last reader ends."""
        self.pinned.discard(adapter_id)
        if adapter_id not in self.slot_of:
            return
        if self.users.get(adapter_id) or adapter_id in self.fetching:
            self.unloading.add(adapter_id)
        else:
            self._drop(adapter_id)

    def pin(self, adapter_id: int) -> None:
        self.pinned.add(adapter_id)

    def digest_text(self) -> str:
        """The slot map, for the live-set digest: "slot:id,..." of the held slots, then the
        ids being copied."""
        held = ",".join(f"{s}:{a}" for s, a in enumerate(self.holder) if a)
        return f"{held}|{sorted(self.fetching)}"

    def _free_slot(self) -> int | None:
        return next((s for s in range(1, self.num_slots + 1) if not self.holder[s]), None)

    def _assign(self, adapter_id: int, slot: int) -> None:
        self.slot_of[adapter_id] = slot
        self.holder[slot] = adapter_id
        self._recent[adapter_id] = None

    def _drop(self, adapter_id: int) -> int:
        self.version += 1
        slot = self.slot_of.pop(adapter_id)
        self.holder[slot] = 0
        self._recent.pop(adapter_id, None)
        return slot
