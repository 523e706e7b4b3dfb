"""A fixed pool of KV cache blocks, the free list every rank walks in the same order, each used
block's reference count, and the prefix cache's index of full blocks by chain hash.

Only bookkeeping: which block ids are free, how many sequences hold each used one (the choices of
one prompt share its prefill's blocks, fork.py; prompts share a cached prefix, prefix_cache.py),
and which blocks hold the keys and values of a known chain hash. A block returns to the pool when
its last holder frees it: a cached one keeps its contents and its hash, and is the least recently
freed one to be taken back (evicted) when the uncached free blocks run out. The cache tensors
themselves belong to the model; the hashes are prefix_cache.py's.
"""

from __future__ import annotations

from collections import OrderedDict, deque


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
        self._cached: dict[bytes, int] = {}  # chain hash -> the block holding its tokens' KV
        self._hash_of: dict[int, bytes] = {}  # the inverse, for every cached block
        # Cached blocks nobody holds, least recently freed first: free, but kept until needed.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0  # cached blocks taken back for other contents, ever
        # (block, chain hash) of the blocks evicted since the planner last took them (its spill)
        self.evicted: list[tuple[int, bytes]] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: the uncached free ones and the evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold positions 0..num_tokens-1."""
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Fresh blocks for new contents: uncached free ones first, then the least recently
        freed cached ones, whose hashes are forgotten (evicted)."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} KV blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                block_hash = self._hash_of.pop(block)
                del self._cached[block_hash]
                self.evicted.append((block, block_hash))
                self.num_evictions += 1
            blocks.append(block)
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
        """One holder fewer for each block; a block nobody holds goes back to the pool (a cached
        one as the most recently freed evictable block)."""
        cached = []
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
                if block in self._hash_of:
                    cached.append(block)
                else:
                    self._free.append(block)
        # A table's last blocks are evicted before its first: a chain is only found from its
        # start, so its head is worth more than its tail.
        for block in reversed(cached):
            self._evictable[block] = None

    # --- the prefix cache's index ---------------------------------------------------------------

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest prefix of these chain hashes that the pool holds."""
        blocks = []
        for block_hash in hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of these blocks nobody holds (taking them shrinks the free pool)."""
        return sum(1 for block in blocks if block in self._evictable)

    def take_cached(self, blocks: list[int]) -> None:
        """One more holder for each of these cached blocks (cached_prefix's), held or not."""
        for block in blocks:
            if block in self._evictable:
                del self._evictable[block]
                self._refs[block] = 1
            else:
                self.share([block])

    def register(self, block: int, block_hash: bytes) -> None:
        """A used block now holds the KV of the full block this chain hash names. If another
        block already does (two prompts computed it at once), that one stays the cached one."""
        if block_hash not in self._cached and block not in self._hash_of:
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash

    def forget_cached(self) -> None:
        """Drop the whole index (a failed step: what the ranks cached may no longer agree);
        evictable blocks become plain free ones, in the order they would have been evicted."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        self._hash_of.clear()
