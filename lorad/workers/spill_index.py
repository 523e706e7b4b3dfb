"""The planner's view of the disk spill (kv_spill.py does the I/O): which chain hashes every rank
holds on disk, least recently used first, the writes and deletes the planner has issued, and how
many of them every rank has finished.

Pure and replicated: every rank issues the same operations in the same order, and a written block
becomes findable only once the agreed minimum of the ranks' finished operations passes it, so the
index is the same on every rank whatever each writer thread's pace. A read that fails on any rank
drops its hash everywhere (drop). No files here, no clocks.
"""

from __future__ import annotations

from collections import OrderedDict, deque

# Reads per step, reported back as one int64 bit mask in the step agreement (bit 63 is the sign).
MAX_READS_PER_STEP = 62


class SpillIndex:
    def __init__(self, max_blocks: int, max_pending: int, entries: list[bytes] = ()) -> None:
        """max_blocks: the budget (--kv-spill-bytes over one block's bytes); max_pending: the
        store's bound on unfinished operations; entries: what every rank holds at start, least
        recently used first (the budget is restored by the first writes' deletes)."""
        if max_blocks <= 0 or max_pending <= 0:
            raise ValueError(f"a spill of {max_blocks} blocks and {max_pending} pending writes")
        self.max_blocks = max_blocks
        self.max_pending = max_pending
        self._entries: OrderedDict[bytes, None] = OrderedDict.fromkeys(entries)  # agreed, LRU first
        self._writing: set[bytes] = set()  # issued writes not yet agreed finished
        # (operation number, the hash of a write; None for a delete), oldest first
        self._ops: deque[tuple[int, bytes | None]] = deque()
        self._num_issued = 0
        self._num_agreed = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    @property
    def num_pending(self) -> int:
        return self._num_issued - self._num_agreed

    def agreed(self, num_finished: int) -> None:
        """Every rank has finished its first num_finished operations (the minimum over ranks)."""
        self._num_agreed = max(self._num_agreed, min(num_finished, self._num_issued))
        while self._ops and self._ops[0][0] < self._num_agreed:
            _, block_hash = self._ops.popleft()
            if block_hash is not None:
                self._writing.discard(block_hash)
                self._entries[block_hash] = None

    def plan_write(self, block_hash: bytes, deletes: list[bytes]) -> bool:
        """Whether to write this evicted block: not held or being written already, the store's
        queue has room, and the budget has room once the least recently used entries are
        deleted (their hashes appended to `deletes`, each an operation issued)."""
        if block_hash in self._entries or block_hash in self._writing:
            return False
        over = max(0, len(self._entries) + len(self._writing) + 1 - self.max_blocks)
        if over > len(self._entries) or self.num_pending + over + 1 > self.max_pending:
            return False
        for _ in range(over):
            old, _ = self._entries.popitem(last=False)
            deletes.append(old)
            self._issue(None)
        self._issue(block_hash)
        self._writing.add(block_hash)
        return True

    def cached_run(self, hashes: list[bytes]) -> int:
        """How many of these hashes, from the first, every rank holds on disk."""
        num = 0
        for block_hash in hashes:
            if block_hash not in self._entries:
                break
            num += 1
        return num

    def touch(self, hashes: list[bytes]) -> None:
        """These entries were just read: the most recently used now."""
        for block_hash in hashes:
            self._entries.move_to_end(block_hash)

    def drop(self, hashes: list[bytes], deletes: list[bytes]) -> None:
        """Forget entries a read failed on (on some rank), deleting them on every rank while the
        store's queue has room (else the files stay until a restart's check finds them)."""
        for block_hash in hashes:
            if block_hash in self._entries:
                del self._entries[block_hash]
                if self.num_pending < self.max_pending:
                    deletes.append(block_hash)
                    self._issue(None)

    def _issue(self, block_hash: bytes | None) -> None:
        self._ops.append((self._num_issued, block_hash))
        self._num_issued += 1
