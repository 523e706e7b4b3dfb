"""Prefix caching: the chain hash of every full KV block of a sequence, rooted in its adapter's
identity key, and the planner's use of cached and spilled blocks (PrefixReuse).

A block's hash is blake2b over its parent's hash and its token ids; the first block's parent is
the root of the sequence's adapter identity key (adapter_key.py: the factor bytes, module set and
final scales), the base model's root being the key "". Two names registered on byte-identical
folders at the same strength have one key and so share blocks; a reload with other bytes or
another strength gets another key and shares nothing; so does a request's own adapter_strength
other than 1.0 (root_hash). Pure bookkeeping, replicated on every rank:
which block holds which hash is block_manager.py's, the spill's index spill_index.py's, the I/O
spill.py's, and when a sequence starts the planner's.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable

from lorad.workers.block_manager import BlockManager
from lorad.workers.sequence import Sequence
from lorad.workers.spill_index import MAX_READS_PER_STEP, SpillIndex

_DOMAIN = b"lorad prefix cache v1\0"


def root_hash(adapter_key: str, strength: float = 1.0) -> bytes:
    """The parent of a sequence's first block: its adapter identity key's ("" for the base), with
    the request's adapter strength when it is not 1.0 (so 1.0 keeps the roots it always had, and
    two strengths of one adapter never share a block)."""
    if strength != 1.0:
        adapter_key = adapter_key + "@" + repr(float(strength))
    return hashlib.blake2b(_DOMAIN + adapter_key.encode(), digest_size=16).digest()


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The hash of a full block with these tokens after the block hashed `parent`."""
    return hashlib.blake2b(parent + array("I", token_ids).tobytes(), digest_size=16).digest()


def extend_hashes(seq: Sequence, num_blocks: int, block_size: int) -> list[bytes]:
    """seq.block_hashes grown to cover its first num_blocks full blocks (of prompt + output
    tokens; the caller keeps num_blocks * block_size within them); -> that list."""
    hashes = seq.block_hashes
    parent = hashes[-1] if hashes else root_hash(seq.adapter_key, seq.adapter_strength)
    for i in range(len(hashes), num_blocks):
        parent = block_hash(parent, seq.token_slice(i * block_size, (i + 1) * block_size))
        hashes.append(parent)
    return hashes


class PrefixReuse:
    """What the planner does with cached blocks: a starting sequence's hits in memory and on
    disk, reads from the spill over two steps (a sequence waits, holding its blocks, while its
    blocks are read; the next step, once every rank's outcome is agreed, the blocks read before
    the first failure are indexed and the sequence starts from them as from memory), the index
    of every filled block, and the writes of evicted blocks to the spill."""

    def __init__(self, blocks: BlockManager, spill: SpillIndex | None = None) -> None:
        self.blocks = blocks
        self.spill = spill
        # The last plan's reads, by waiting sequence, and which of them failed on some rank
        # (bit i: the plan's i-th read), agreed since.
        self._restores: list[tuple[Sequence, list[tuple[int, bytes]]]] = []
        self._read_failures = 0
        self._reads: list[tuple[int, bytes]] = []  # the plan being made's (block, hash) reads
        self._deletes: list[bytes] = []  # and its spill deletes

    def agree_spill(self, num_finished: int, read_failures: int) -> None:
        if self.spill is not None:
            self.spill.agreed(num_finished)
        self._read_failures = read_failures

    def begin_plan(self, still_waiting: Callable[[Sequence], bool]) -> None:
        """Settle the last plan's reads (still_waiting: whether a sequence is live and waiting)."""
        self._reads, self._deletes = [], []
        failures, self._read_failures = self._read_failures, 0
        first_bit = 0
        for seq, pairs in self._restores:
            failed = [i for i in range(len(pairs)) if failures >> (first_bit + i) & 1]
            first_bit += len(pairs)
            self.spill.drop([pairs[i][1] for i in failed], self._deletes)
            if not still_waiting(seq):
                continue  # cancelled meanwhile: its blocks went back with it
            for block, block_hash in pairs[:failed[0] if failed else len(pairs)]:
                self.blocks.register(block, block_hash)
            self.blocks.free(seq.block_table)  # cached now: it takes them back when it starts
            seq.block_table = []
        self._restores = []

    def end_plan(self) -> tuple[list[tuple[int, bytes]], list[bytes], list[tuple[int, bytes]]]:
        """-> the plan's spill writes (the blocks evicted while planning that the spill takes),
        deletes and reads, in StepPlan's order."""
        writes = []
        if self.blocks.evicted:
            if self.spill is not None:
                writes = [(block, block_hash) for block, block_hash in self.blocks.evicted
                          if self.spill.plan_write(block_hash, self._deletes)]
            self.blocks.evicted.clear()
        return writes, self._deletes, self._reads

    def lookup(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """(the cached blocks `seq` may start from, the hashes of the spilled blocks after them):
        a run of its full blocks before the one holding its last token (which runs, so that it
        is sampled), the reads within the step's share."""
        if not seq.cache_prompt or seq.sampling.prompt_logprobs >= 0:  # echo scores every row
            return [], []
        num_full = (seq.num_tokens - 1) // self.blocks.block_size
        if num_full == 0:
            return [], []
        hashes = extend_hashes(seq, num_full, self.blocks.block_size)[:num_full]
        hits = self.blocks.cached_prefix(hashes)
        rest = hashes[len(hits):]
        room = MAX_READS_PER_STEP - len(self._reads)
        if self.spill is None or not rest or room <= 0:
            return hits, []
        return hits, rest[:min(room, self.spill.cached_run(rest))]

    def take(self, seq: Sequence, blocks: list[int]) -> None:
        """Start `seq` past its cached prefix: it holds those blocks and computes the rest."""
        self.blocks.take_cached(blocks)
        seq.block_table = list(blocks)
        seq.num_computed = len(blocks) * self.blocks.block_size
        seq.num_indexed_blocks = len(blocks)
        if not seq.output_ids:  # a first start, not a recompute after preemption
            seq.num_cached_tokens = seq.num_computed

    def start_restore(self, seq: Sequence, hits: list[int], hashes: list[bytes]) -> None:
        """Read `seq`'s spilled blocks into fresh ones this step; it holds its cached ones
        meanwhile (so nothing evicts them) and stays waiting until the reads are agreed."""
        self.blocks.take_cached(hits)
        fresh = self.blocks.allocate(len(hashes))
        seq.block_table = hits + fresh
        pairs = list(zip(fresh, hashes))
        self._restores.append((seq, pairs))
        self._reads.extend(pairs)
        self.spill.touch(hashes)

    def register(self, seq: Sequence) -> None:
        """Index every block of `seq` that the step filled, under its chain hash."""
        block_size = self.blocks.block_size
        num_full = seq.num_computed // block_size
        hashes = extend_hashes(seq, num_full, block_size)
        for i in range(seq.num_indexed_blocks, num_full):
            self.blocks.register(seq.block_table[i], hashes[i])
        seq.num_indexed_blocks = num_full

    def forget(self) -> None:
        """A failed step: the memory index goes (the ranks may disagree on it); the spill's,
        agreed through the ranks' finished writes, stays."""
        self.blocks.forget_cached()
        self.blocks.evicted.clear()
        self._restores = []
