"""What one model step runs: the planner's output, which the engine and the sampler read.

A plan is plain data (no tensors): each scheduled chunk of tokens with its block table, the
preemptions it made, the forks of several choices completing their prefill, the KV block copies
to make before the forward, and the spill's and adapter slots' copies. planner.py builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


# A continuation's token before the step before it has sampled it (StepPlan.token_rows): not a
# vocabulary id, so an engine that took it for one would fail at the embedding, not run on.
UNKNOWN_TOKEN = -1


class ScheduledChunk(NamedTuple):
    """Immutable as a frozen dataclass would be, and built in 0.3 us instead of 0.7: one per
    sequence per step, a quarter of plan() at 256 sequences (docs/performance-log.md:
    planner decode fast paths)."""

    request_id: str
    token_ids: list[int]  # new tokens at positions start..start+len-1
    start: int
    block_table: list[int]  # covers every position up to start+len-1
    sample: bool  # the chunk reaches the sequence's last token: sample its next one
    adapter_slot: int
    adapter_strength: float = 1.0  # the request's multiplier of its adapter's scales
    # The sequence's prompt tokens: the chunk's tokens before this position are prompt, the
    # others generated (batch.SeqChunk.num_prompt). None: told by the chunk's shape.
    prompt_len: int | None = None
    # Draft tokens (ngram_draft.py): a decode's chunk is its last token and then these guesses,
    # and every one of its 1 + num_draft rows samples; the sequence takes accepted_tokens.
    num_draft: int = 0


@dataclass(frozen=True)
class StepPlan:
    step: int
    chunks: list[ScheduledChunk]  # decodes first, then prefill chunks, each group oldest first
    preempted: list[str]  # request ids sent back to waiting by this plan
    # A sampling chunk that completes a prefill of n > 1 choices -> the other choices' ids: they
    # sample their first token from its logits row, and fork from it in apply().
    forks: dict[str, list[str]] = field(default_factory=dict)
    # (source, destination) KV blocks to copy in every layer before the forward (fork.py)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # The disk spill (spill_index.py), in the engine's order: (block, chain hash) of evicted
    # blocks to write out before anything writes into them, hashes to delete, then (block, hash)
    # to read back into fresh blocks; a read's outcome is agreed at the next step.
    spill_writes: list[tuple[int, bytes]] = field(default_factory=list)
    spill_deletes: list[bytes] = field(default_factory=list)
    spill_reads: list[tuple[int, bytes]] = field(default_factory=list)
    # (adapter id, device slot): adapters to copy into a slot (adapter_slots.py), in order; each
    # copy's outcome is agreed at a later step, and only then do its sequences start.
    adapter_fetches: list[tuple[int, int]] = field(default_factory=list)
    num_draft_tokens: int = 0  # the chunks' num_draft, summed
    # A continuation (Planner.continue_decodes), planned before the step before it was applied:
    # chunk i's token is row token_rows[i] of that step's sampled ids, which the engine reads
    # on the device (its token_ids hold UNKNOWN_TOKEN). None: every token id is known.
    token_rows: list[int] | None = None

    @property
    def sampled_request_ids(self) -> list[str]:
        """One per sampled token, in order: each sampling chunk's (1 + num_draft of them),
        then its forks'."""
        if not self.forks and not self.num_draft_tokens:
            return [c.request_id for c in self.chunks if c.sample]
        return [r for c in self.chunks if c.sample
                for r in ((c.request_id,) * (1 + c.num_draft)
                          + tuple(self.forks.get(c.request_id, ())))]

    @property
    def logits_rows(self) -> list[int]:
        """For each sampled token, its row of the forward's logits (1 + num_draft rows per
        sampling chunk; a fork's choices read their parent's last)."""
        rows: list[int] = []
        start = 0  # the chunk's first row
        for chunk in self.chunks:
            if chunk.sample:
                num = 1 + chunk.num_draft
                rows.extend(range(start, start + num))
                rows.extend([start + num - 1] * len(self.forks.get(chunk.request_id, ())))
                start += num
        return rows

    def batch_chunks(self) -> list[tuple]:
        """The plan in the form `ForwardBatch.build` takes: each chunk but its request id,
        (token_ids, start, block_table, sample, adapter_slot, adapter_strength, prompt_len,
        num_draft), by a tuple slice (5 attribute reads per chunk were a fifth of the planner's
        step at 256 sequences)."""
        return [c[1:] for c in self.chunks]
