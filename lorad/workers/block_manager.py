"""A fixed pool of KV cache blocks, the free list every rank walks in the same order, and each
used block's reference count.

Only bookkeeping: which block ids are free and how many sequences hold each used one (the choices
of one prompt share its prefill's blocks, fork.py); a block returns to the free list when its
last holder frees it. The cache tensors themselves belong to the model; prefix hashes are not
done here yet.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need a positive pool, got {num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Lowest ids first, freed blocks go to the back: the same history gives the same ids on
        # every rank, which the KV slot mapping (and the live-set digest) rely on.
        self._free: deque[int] = deque(range(num_blocks))
        self._refs: dict[int, int] = {}  # used block -> how many sequences hold it
        self.num_shared = 0  # used blocks held by more than one sequence

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold positions 0..num_tokens-1."""
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of these used blocks."""
        for block in blocks:
            refs = self._refs.get(block)
            if refs is None:
                raise RuntimeError(f"KV block {block} shared but not allocated")
            self._refs[block] = refs + 1
            if refs == 1:
                self.num_shared += 1

    def is_shared(self, block: int) -> bool:
        return self._refs.get(block, 0) > 1

    def ref_count(self, block: int) -> int:
        return self._refs.get(block, 0)

    def free(self, blocks: list[int]) -> None:
        """One holder fewer for each block; a block nobody holds goes back to the free list."""
        for block in blocks:
            refs = self._refs.get(block)
            if refs is None:
                raise RuntimeError(f"KV block {block} freed twice or never allocated")
            if refs > 1:
                self._refs[block] = refs - 1
                if refs == 2:
                    self.num_shared -= 1
            else:
                del self._refs[block]
                self._free.append(block)
