"""A fixed pool of KV cache blocks and the free list every rank walks in the same order.

Only bookkeeping: which block ids are free. The cache tensors themselves belong to the model;
prefix sharing (reference counts, hashes) is not done here yet.
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
        self._used: set[int] = set()

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
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if block not in self._used:
                raise RuntimeError(f"KV block {block} freed twice or never allocated")
            self._used.remove(block)
            self._free.append(block)
