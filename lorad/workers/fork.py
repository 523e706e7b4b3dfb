"""The choices of one prompt (Admit.n > 1): one prefill, then a fork into n sequences that share
its KV blocks, with copy on write for a shared block a choice writes into.

The planner admits a prompt's first choice as the sequence that prefills; it holds the other
choices' ids (Sequence.fork_ids). The step whose chunk completes that prefill samples every
choice's first token from the same last-position logits (StepPlan.forks names the rows), and
apply() forks the other choices off it: each gets the prompt, its own first token and the same
block table, every block's reference count raised by one. A block written while shared (the
prompt's last, partial block, at a choice's first decode) is first copied to a fresh block
(StepPlan.block_copies, which the engine performs on every rank before the step's forward). Pure
bookkeeping, as the planner is: no tensors, no sockets.
"""

from __future__ import annotations

from lorad.workers.block_manager import BlockManager
from lorad.workers.sequence import Sequence, SeqStatus


class Forks:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.unforked: dict[str, Sequence] = {}  # a choice not forked yet -> its prefilling one

    def register(self, seq: Sequence) -> None:
        for request_id in seq.fork_ids:
            self.unforked[request_id] = seq

    def cancel(self, request_id: str) -> Sequence | None:
        """Drop a choice that has not forked yet; -> the sequence it would have forked from."""
        parent = self.unforked.pop(request_id, None)
        if parent is not None:
            parent.fork_ids.remove(request_id)
        return parent

    def promote(self, seq: Sequence) -> str:
        """The prefilling choice is cancelled before its fork: the next choice takes its
        sequence over (no token was sampled yet, so no generator has drawn); -> its id."""
        request_id = seq.fork_ids.pop(0)
        del self.unforked[request_id]
        seq.request_id = request_id
        return request_id

    def fork(self, parent: Sequence) -> list[Sequence]:
        """The parent's pending choices as running sequences that share its blocks."""
        children = []
        for request_id in parent.fork_ids:
            del self.unforked[request_id]
            self.blocks.share(parent.block_table)
            children.append(Sequence(request_id, parent.prompt_ids, parent.sampling,
                                     parent.adapter_slot, parent.adapter_key, parent.arrival,
                                     output_ids=list(parent.output_ids),
                                     num_computed=parent.num_computed,
                                     block_table=list(parent.block_table),
                                     status=SeqStatus.RUNNING,
                                     cache_prompt=parent.cache_prompt,
                                     block_hashes=list(parent.block_hashes),
                                     num_indexed_blocks=parent.num_indexed_blocks,
                                     num_cached_tokens=parent.num_cached_tokens,
                                     adapter_strength=parent.adapter_strength,
                                     adapter_id=parent.adapter_id))
        parent.fork_ids = []
        return children

    def num_copies(self, seq: Sequence, num: int) -> int:
        """Shared blocks that writing `num` more tokens of `seq` would write into."""
        return sum(1 for i in self._written(seq, num) if self.blocks.is_shared(seq.block_table[i]))

    def copy_on_write(self, seq: Sequence, num: int, copies: list[tuple[int, int]]) -> None:
        """Give `seq` its own copy of every shared block the next `num` tokens write into;
        appends (source, destination) to `copies`. The pool must hold the copies
        (num_copies)."""
        table = seq.block_table
        for i in self._written(seq, num):
            block = table[i]
            if self.blocks.is_shared(block):
                (own,) = self.blocks.allocate(1)
                copies.append((block, own))
                self.blocks.free([block])  # one holder fewer; the others keep it
                table[i] = own

    def _written(self, seq: Sequence, num: int) -> range:
        """Indexes in seq.block_table of the blocks positions num_computed.. +num land in."""
        block_size = self.blocks.block_size
        return range(seq.num_computed // block_size,
                     min(len(seq.block_table), self.blocks.blocks_for(seq.num_computed + num)))
