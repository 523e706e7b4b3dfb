"""One live request inside a worker: its tokens, how much of them the KV cache holds, its blocks.

Plain data that the step planner mutates; it knows nothing of tensors, sockets or sampling state
(the leader's per-request generator lives in the sampler).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from lorad.protocol.messages import SamplingParams


class SeqStatus(Enum):
    WAITING = "waiting"  # holds no KV blocks; prefills (or recomputes) from position 0
    RUNNING = "running"  # holds the blocks for positions 0..num_computed-1 (and maybe more)
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    # The device slot its rows read (0: the base model). With an adapter id, the planner places
    # the adapter in a slot when the sequence starts (adapter_slots.py) and sets this.
    adapter_slot: int
    adapter_key: str  # the adapter's identity key, "" for the base model
    arrival: int  # the Admit's seq number: orders admission and preemption on every rank
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache (positions 0..num_computed-1)
    block_table: list[int] = field(default_factory=list)  # KV block ids, in position order
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    # The request ids of the other choices of its prompt, until its prefill completes and they
    # fork from it (fork.py); empty for n = 1 and for every sequence after its first sample.
    fork_ids: list[str] = field(default_factory=list)
    # Echo: prompt positions 0..num_prompt_logprobs-1 have had their log probabilities computed
    # (prompt_logprobs.py); a recompute after preemption does not send them again.
    num_prompt_logprobs: int = 0
    # Prefix caching (prefix_cache.py): whether this request reads and fills the cache; the
    # chain hashes of its first full blocks (prompt and output tokens), as far as computed; how
    # many of its blocks are in the cache's index; and the prompt tokens its first start found
    # cached (usage's cached_tokens).
    cache_prompt: bool = True
    block_hashes: list[bytes] = field(default_factory=list)
    num_indexed_blocks: int = 0
    num_cached_tokens: int = 0
    # The request's multiplier of its adapter's scales (lorad's "adapter_strength"); 1.0 for the
    # base model, whose requests cannot carry one.
    adapter_strength: float = 1.0
    # The adapter's registry id (0: the base model); None: adapter_slot is fixed as given (a
    # planner without device slot management, as in unit tests).
    adapter_id: int | None = None
    # N-gram drafting (ngram_draft.py): whether the planner may draft for it (the request allows
    # it and asks for nothing drafting leaves out), and its n-gram index, made at its first draft.
    draft: bool = False
    ngrams: object | None = None
    # After a draft of which nothing was taken, the decodes that skip drafting before the next
    # try (draft_backoff, doubling up to ngram_draft.MAX_BACKOFF), and how many are left.
    draft_backoff: int = 0
    draft_skips_left: int = 0
    # The most draft tokens its next draft may have (its last one's accepted count + 1, after a
    # partly taken draft); 0: the planner's limit (--speculative-ngram).
    draft_limit: int = 0
    # Its last draft was wholly taken: it may draft into rows that cost a step time
    # (PlannerLimits.draft_free_rows).
    draft_taken_whole: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next sample (1 while decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.status is SeqStatus.RUNNING and self.num_pending == 1

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Token ids at positions start..stop-1 of prompt + output."""
        num_prompt = len(self.prompt_ids)
        if stop <= num_prompt:
            return self.prompt_ids[start:stop]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt:stop - num_prompt]
        return self.prompt_ids[start:] + self.output_ids[:stop - num_prompt]
