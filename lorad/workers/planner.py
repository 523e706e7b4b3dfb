"""The step planner: which tokens of which live sequences run in the next model step.

Pure and deterministic (no sockets, no torch, no clocks), so every rank that holds the same live
set and applies the same messages plans the same step. `plan()` schedules (allocating KV blocks
lazily and preempting newest-first when they run out); `apply(plan, sampled)` advances the
sequences with the sampled ids and returns the events the leader publishes. The choices of one
prompt share its prefill (fork.py). With prefix caching on, a sequence that starts takes the
cached blocks of its longest cached prefix (never the block of its last token, which must run to
be sampled) and prefills from there, and apply() registers every block a step fills
(prefix_cache.py). A sequence with an adapter id starts once its adapter is in a device slot
(adapter_slots.py): the head of the queue waits for its copy, the next ones' are started with it,
and sequences behind it whose adapters are in a slot go ahead meanwhile.
With --speculative-ngram, a decode may carry draft tokens (ngram_draft.py) from what the step
left of the budget and the free blocks, and apply() takes the ones its sampled rows accepted.
Grammar state is not handled here; echo's rows are prompt_logprobs.py's.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from lorad.protocol.messages import MAX_PROMPT_LOGPROBS_PER_STEP, SeqOutput
from lorad.workers.adapter_slots import AdapterSlots
from lorad.workers.block_manager import BlockManager
from lorad.workers.fork import Forks
from lorad.workers.ngram_draft import NgramIndex, accepted_tokens, note_outcome
from lorad.workers.prefix_cache import PrefixReuse
from lorad.workers.spill_index import SpillIndex
from lorad.workers.sequence import Sequence, SeqStatus
from lorad.workers.step_plan import UNKNOWN_TOKEN, ScheduledChunk, StepPlan

__all__ = ["Planner", "PlannerLimits", "ScheduledChunk", "StepPlan"]


@dataclass(frozen=True)
class PlannerLimits:
    max_num_seqs: int  # live sequences holding KV blocks at once
    max_num_batched_tokens: int  # tokens (decode + prefill chunks) in one step
    max_model_len: int  # prompt + output never exceeds this
    num_speculative: int = 0  # --speculative-ngram: draft tokens a decode carries at most
    # A step of up to this many rows costs what one of fewer does (the CPU's products have at
    # least cpu_threads.MIN_ROWS rows): drafts fill those rows first, and only a sequence whose
    # last draft was wholly taken drafts past them. None: no such rows (CUDA).
    draft_free_rows: int | None = None


class Planner:
    def __init__(self, limits: PlannerLimits, blocks: BlockManager,
                 prefix_cache: bool = False, spill: SpillIndex | None = None,
                 adapters: AdapterSlots | None = None) -> None:
        if blocks.num_blocks < blocks.blocks_for(limits.max_model_len):
            raise ValueError(f"a KV pool of {blocks.num_blocks} blocks of {blocks.block_size} "
                             f"cannot hold one sequence of max_model_len {limits.max_model_len}")
        self.limits = limits
        self.blocks = blocks
        # Cached and spilled blocks: None without prefix caching.
        self.reuse = PrefixReuse(blocks, spill) if prefix_cache else None
        # Device slots of adapters by registry id; None: sequences' slots are fixed as admitted.
        self.adapters = adapters
        self.step = 0
        self.waiting: list[Sequence] = []  # by arrival; no blocks but those its spill reads fill
        self.running: list[Sequence] = []  # by arrival
        self._by_id: dict[str, Sequence] = {}
        self._events: list[SeqOutput] = []  # terminal events decided between steps
        self.forks = Forks(blocks)
        self._copies: list[tuple[int, int]] = []  # this plan's copies on write
        self._prompt_rows_left = 0  # echo's share of the step being planned (_chunk_size)
        self.num_draft_accepted = 0  # draft tokens the sequences took in the last apply()
        # The step a continuation was planned after, until it is applied (continue_decodes)
        self._continued_from: int | None = None

    # --- the live set -------------------------------------------------------------------------

    def live(self) -> list[Sequence]:
        """Every live sequence, oldest first (the canonical order of the live-set digest)."""
        return sorted(self.running + self.waiting, key=lambda s: s.arrival)

    def sequence(self, request_id: str) -> Sequence:
        """A live sequence, or the one a choice not forked yet will fork from."""
        return self._by_id.get(request_id) or self.forks.unforked[request_id]

    def admit(self, seq: Sequence) -> str | None:
        """Queue a new sequence (with its other choices in seq.fork_ids); returns why it was
        refused, or None."""
        ids = [seq.request_id, *seq.fork_ids]
        for request_id in ids:
            if request_id in self._by_id or request_id in self.forks.unforked:
                return f"request id {request_id!r} is already live"
        if not seq.prompt_ids:
            return f"request {seq.request_id!r} has an empty prompt"
        if len(ids) > self.limits.max_num_seqs:
            return f"{len(ids)} choices exceed the {self.limits.max_num_seqs} sequences a step runs"
        # Echo with max_tokens 0 scores the prompt: it runs, and its one sample is dropped.
        scoring = seq.sampling.max_tokens == 0 and seq.sampling.prompt_logprobs >= 0
        if scoring and seq.fork_ids:
            return f"request {seq.request_id!r}: a scored prompt (max_tokens 0) takes n = 1"
        if not scoring and (seq.num_tokens >= self.limits.max_model_len
                            or seq.sampling.max_tokens <= 0):
            self._events.extend(SeqOutput(r, [], "length", seq.num_prompt_tokens) for r in ids)
            return None
        self._by_id[seq.request_id] = seq
        self.forks.register(seq)
        _insert_by_arrival(self.waiting, seq)
        return None

    def cancel(self, request_id: str) -> bool:
        """End a live sequence with "cancelled"; False when it is not live (already ended)."""
        seq = self._by_id.get(request_id)
        if seq is None:
            seq = self.forks.cancel(request_id)  # a choice not forked yet, or None
            if seq is None:
                return False
        elif seq.fork_ids:  # the prompt's other choices still need this prefill
            del self._by_id[request_id]
            self._by_id[self.forks.promote(seq)] = seq
        else:
            self._finish(seq, "cancelled")
        self._events.append(SeqOutput(request_id, [], "cancelled", seq.num_prompt_tokens))
        return True

    def drop_all(self) -> list[str]:
        """Fail a step: forget every live sequence; returns their ids, oldest first.

        The failed step uses up a step number, so StepFailed and StepResult never share one."""
        self.step += 1
        self._continued_from = None
        live = self.live()
        ids = [r for s in live for r in (s.request_id, *s.fork_ids)]
        for seq in live:
            self._finish(seq, "error")
        if self.reuse is not None:
            self.reuse.forget()  # what the ranks cached may be what they disagreed on
        self.forks.unforked.clear()
        self._events = []
        return ids

    # --- plan ---------------------------------------------------------------------------------

    def agree_spill(self, num_finished: int, read_failures: int) -> None:
        """What the ranks agreed on before this step: the spill operations every rank has
        finished (the minimum), and which of the last plan's reads failed on some rank."""
        if self.reuse is not None:
            self.reuse.agree_spill(num_finished, read_failures)

    def plan(self) -> StepPlan:
        self.step += 1
        self._prompt_rows_left = MAX_PROMPT_LOGPROBS_PER_STEP
        if self.reuse is not None:  # last plan's reads, now agreed: those sequences may start
            self.reuse.begin_plan(lambda seq: self._by_id.get(seq.request_id) is seq
                                  and seq.status is SeqStatus.WAITING)
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[str] = []
        budget = self._schedule_decodes(self.limits.max_num_batched_tokens, scheduled, preempted)
        if len(scheduled) < len(self.running):  # else every running sequence got its decode
            budget = self._continue_prefills(budget, scheduled, preempted)
        budget = self._start_waiting(budget, scheduled, preempted)  # 3. new and preempted ones
        drafts = self._draft(budget, scheduled) if self.limits.num_speculative else {}
        chunks = [self._chunk(seq, num, drafts.get(seq.request_id, ())) for seq, num in scheduled]
        forks = {}
        if self.forks.unforked:  # prefills of several choices that complete in this step
            forks = {seq.request_id: list(seq.fork_ids) for seq, num in scheduled
                     if seq.fork_ids and seq.num_computed + num == seq.num_tokens}
        copies, self._copies = self._copies, []
        fetches = self.adapters.take_fetches() if self.adapters is not None else []
        spill = self.reuse.end_plan() if self.reuse is not None else ([], [], [])
        return StepPlan(self.step, chunks, preempted, forks, copies, *spill, fetches,
                        sum(len(d) for d in drafts.values()))

    def continue_decodes(self, prev: StepPlan) -> StepPlan | None:
        """The step after `prev`, planned before apply(prev) so that it can run while the host
        applies prev (async scheduling, a lone rank: loop.py): each of prev's decodes again, at
        the next position, its token the one prev samples (StepPlan.token_rows; the engine
        reads it on the device). A sequence that prev ends by its length is left out; one that
        prev ends by a stop token runs a row in vain, which apply() skips. None when the step
        cannot be known before apply: prev is not plain decodes of running sequences, a
        sequence waits while fewer than max_num_seqs run, one would write into a shared block
        (a copy on write; the prefix cache shares full blocks only, which no decode writes), a
        spill takes evicted blocks (its writes run before a step), no block is free for a new
        position (plan() may preempt), or no sequence goes on."""
        # A waiting sequence may start only in plan(), and only where a running one makes room:
        # while every slot is taken, none would start (one that prev's apply frees is taken in
        # the plan after the continuation, a step later than without it).
        waits = self.waiting and len(self.running) < self.limits.max_num_seqs
        if (prev.step != self.step or self._continued_from is not None or waits
                or prev.forks or prev.block_copies or prev.num_draft_tokens
                or (self.reuse is not None and self.reuse.spill is not None)):
            return None
        block_size, going_on, num_new_blocks = self.blocks.block_size, [], 0
        for row, chunk in enumerate(prev.chunks):
            if len(chunk.token_ids) != 1 or not chunk.sample:
                return None
            seq = self._by_id.get(chunk.request_id)
            if seq is None and prev.token_rows is not None:
                continue  # a continuation's row in vain: the step before it ended the sequence
            if seq is None or seq.status is not SeqStatus.RUNNING:
                return None
            if self._at_length(seq, len(seq.output_ids) + 1):  # with prev's token
                continue
            position = chunk.start + 1
            need = self.blocks.blocks_for(position + 1) - len(seq.block_table)  # 0 or 1
            if not need and self.blocks.is_shared(seq.block_table[position // block_size]):
                return None  # a fork's: a copy on write first (plan())
            num_new_blocks += need
            going_on.append((row, seq, position, need))
        if not going_on or not self.blocks.can_allocate(num_new_blocks):
            return None
        self.step += 1
        self._continued_from = prev.step
        chunks = []
        for _, seq, position, need in going_on:
            if need:
                seq.block_table.extend(self.blocks.allocate(need))
            chunks.append(ScheduledChunk(seq.request_id, [UNKNOWN_TOKEN], position,
                                         list(seq.block_table), True, seq.adapter_slot,
                                         seq.adapter_strength, len(seq.prompt_ids)))
        return StepPlan(self.step, chunks, [], token_rows=[row for row, *_ in going_on])

    def _schedule_decodes(self, budget: int, scheduled: list, preempted: list[str]) -> int:
        """1. every decode gets its next token; -> the budget left. Runs for every sequence every
        step, hence the inlined tests (docs/performance-log.md: planner decode fast paths): a
        decode whose next position fits in the blocks it holds needs no reservation, which is
        what _reserve would find."""
        block_size, running = self.blocks.block_size, SeqStatus.RUNNING
        shared = self.blocks.num_shared > 0  # only a fork shares blocks; never made mid-plan
        for seq in list(self.running):
            if budget == 0:
                break
            if (seq.status is not running
                    or len(seq.prompt_ids) + len(seq.output_ids) - seq.num_computed != 1):
                continue  # not decoding (seq.is_decoding, inlined)
            if ((seq.num_computed < len(seq.block_table) * block_size
                 and not (shared and self.blocks.is_shared(
                     seq.block_table[seq.num_computed // block_size])))
                    or self._reserve(seq, 1, scheduled, preempted)):
                scheduled.append((seq, 1))
                budget -= 1
            else:
                self._preempt(seq, preempted)
        return budget

    def _continue_prefills(self, budget: int, scheduled: list, preempted: list[str]) -> int:
        """2. partially prefilled prompts continue; -> the budget left."""
        decoding = {id(s) for s, _ in scheduled}  # a set: a scan per sequence was quadratic
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING or id(seq) in decoding:
                continue
            num = self._reserve_chunk(seq, self._chunk_size(seq, budget), scheduled, preempted)
            if num:
                scheduled.append((seq, num))
                budget -= num
        return budget

    def _start_waiting(self, budget: int, scheduled: list, preempted: list[str]) -> int:
        """3. waiting sequences start in queue order (first come, first served), except that
        while one waits for its adapter's copy, those behind it whose adapters are in a slot
        (or that have none) may go ahead, leaving it the blocks of its prompt and its place
        among the running sequences: it starts once its copy is agreed (a bounded wait that
        nobody behind it prolongs). One whose adapter has no slot yet (none could be had) stops
        the queue: sequences behind it would hold the slots it waits for."""
        # A sequence starts only when the free pool holds its whole prompt (plus any tokens it
        # recomputes), counting what this pass already promised: starting it on a partial chunk
        # would only get it preempted again by the first decode that needs a block.
        num_promised = 0
        # Choices not forked yet count as running: a prompt starts only with room for all; so
        # do the sequences passed over while their copies run.
        num_unforked = sum(len(s.fork_ids) for s in self.running) if self.forks.unforked else 0
        i = 0
        while (i < len(self.waiting) and budget > 0 and len(self.running) + num_unforked
               + len(self.waiting[i].fork_ids) < self.limits.max_num_seqs):
            seq = self.waiting[i]
            if seq.adapter_id and not self.adapters.is_ready(seq.adapter_id):
                if i == 0:
                    self._place_adapters()
                if seq.adapter_id not in self.adapters.fetching:
                    break  # no slot could be had: nobody goes ahead of it
                num_promised += self.blocks.blocks_for(seq.num_tokens)
                num_unforked += 1 + len(seq.fork_ids)
                i += 1
                continue  # it starts once its adapter's copy is agreed, still in its place
            num_blocks = self.blocks.blocks_for(seq.num_tokens)
            hits, on_disk = self.reuse.lookup(seq) if self.reuse is not None else ([], [])
            # Cached blocks nobody holds leave the free pool when taken; held ones cost nothing.
            num_taken = num_blocks - len(hits) + (self.blocks.num_evictable(hits) if hits else 0)
            if (seq.request_id in preempted
                    or num_taken > self.blocks.num_free_blocks - num_promised):
                break  # first come, first served: nobody overtakes it
            if on_disk:  # the head starts next step, from its restored blocks, still first;
                if i == 0:  # one behind a copy does not go ahead (its restore waits its turn)
                    self.reuse.start_restore(seq, hits, on_disk)
                break
            if hits:
                self.reuse.take(seq, hits)
            num = self._chunk_size(seq, budget)
            if num == 0:  # echo's share of the step is spent
                break
            self.waiting.pop(i)
            if seq.adapter_id:
                seq.adapter_slot = self.adapters.acquire(seq.adapter_id)
            seq.status = SeqStatus.RUNNING
            _insert_by_arrival(self.running, seq)
            self._allocate_for(seq, num)
            num_promised += num_blocks - len(seq.block_table)
            num_unforked += len(seq.fork_ids)
            scheduled.append((seq, num))
            budget -= num
        return budget

    def _draft(self, budget: int, scheduled: list) -> dict[str, list[int]]:
        """4. draft tokens for the decodes that allow them -> request id -> its draft. Last, from
        what the step left: a draft never preempts, never takes a token or a block another
        sequence asked for this step, nor the blocks the head of the queue waits for, and never
        runs past max_tokens or the model's length."""
        drafts: dict[str, list[int]] = {}
        blocks, block_size = self.blocks, self.blocks.block_size
        held = blocks.blocks_for(self.waiting[0].num_tokens) if self.waiting else 0
        free_rows = self.limits.draft_free_rows
        if free_rows is not None:
            free_rows -= sum(num for _, num in scheduled)
        for seq, num in scheduled:
            if budget <= 0 or blocks.num_free_blocks <= held:
                break
            if (num != 1 or not seq.draft or not seq.output_ids
                    or seq.num_computed + 1 != seq.num_tokens):
                continue  # not a decode of a drafting sequence
            if seq.draft_skips_left:  # its last draft was wholly rejected (note_outcome)
                seq.draft_skips_left -= 1
                continue
            room = (len(seq.block_table) + blocks.num_free_blocks - held) * block_size
            max_draft = min(seq.draft_limit or self.limits.num_speculative, budget,
                            seq.sampling.max_tokens - len(seq.output_ids) - 1,
                            self.limits.max_model_len - seq.num_tokens - 1,
                            room - seq.num_computed - 1)
            if max_draft <= 0 or (blocks.num_shared and self.forks.num_copies(seq, 1 + max_draft)):
                continue
            if free_rows is not None and not seq.draft_taken_whole:
                max_draft = min(max_draft, free_rows)  # only rows that cost nothing
                if max_draft <= 0:
                    continue
            if seq.ngrams is None:
                seq.ngrams = NgramIndex()
            draft = seq.ngrams.propose(seq, max_draft)
            if draft:
                self._allocate_for(seq, 1 + len(draft))
                drafts[seq.request_id] = draft
                budget -= len(draft)
                if free_rows is not None:
                    free_rows -= len(draft)
        return drafts

    def _place_adapters(self) -> None:
        """Plan the copies of the adapters the waiting sequences need, in queue order, from the
        head on, while slots can be had without evicting what one ahead needs: the head's first,
        then the next ones' beside it (their copies overlap)."""
        keep: set[int] = set()
        for seq in self.waiting:
            if len(keep) >= self.adapters.num_slots:
                return
            if not seq.adapter_id or seq.adapter_id in keep:
                continue
            if not self.adapters.place(seq.adapter_id, keep):
                return
            keep.add(seq.adapter_id)

    def adapter_fetched(self, adapter_id: int, slot: int, ok: bool) -> list[str]:
        """A copy's agreed outcome; when it failed, the waiting sequences of that adapter end
        (never on another adapter or the base model) -> their request ids."""
        self.adapters.fetched(adapter_id, slot, ok)
        if ok:
            return []
        failed = [s for s in self.waiting if s.adapter_id == adapter_id]
        for seq in failed:
            self._finish(seq, "error")
            for request_id in seq.fork_ids:  # its choices still to fork end with it
                self.forks.unforked.pop(request_id, None)
        return [r for s in failed for r in (s.request_id, *s.fork_ids)]

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        """A prefill chunk's tokens; echo's chunks share MAX_PROMPT_LOGPROBS_PER_STEP a step."""
        num = min(seq.num_pending, budget)
        if seq.sampling.prompt_logprobs >= 0:
            num = min(num, self._prompt_rows_left)
            self._prompt_rows_left -= num
        return num

    def _reserve(self, seq: Sequence, num: int, scheduled: list, preempted: list[str]) -> bool:
        """Blocks for `num` more tokens, preempting newer unscheduled sequences if needed."""
        need = self.blocks.blocks_for(seq.num_computed + num) - len(seq.block_table)
        if self.blocks.num_shared:
            need += self.forks.num_copies(seq, num)
        while not self.blocks.can_allocate(need):
            victim = self._newest_victim(seq, scheduled)
            if victim is None:
                return False
            self._preempt(victim, preempted)
        self._allocate_for(seq, num)
        return True

    def _reserve_chunk(self, seq: Sequence, num: int, scheduled: list,
                       preempted: list[str]) -> int:
        if self._reserve(seq, num, scheduled, preempted):
            return num
        num = min(num, self._free_capacity(seq))  # what fits; it keeps its blocks and waits
        if num > 0:
            self._allocate_for(seq, num)
        return max(num, 0)

    def _newest_victim(self, seq: Sequence, scheduled: list) -> Sequence | None:
        for victim in reversed(self.running):
            if victim.arrival <= seq.arrival:
                return None  # never preempt an older sequence for a newer one
            if not any(s is victim for s, _ in scheduled):
                return victim
        return None

    def _free_capacity(self, seq: Sequence) -> int:
        """Tokens `seq` can add using its own blocks plus every free one."""
        num_blocks = len(seq.block_table) + self.blocks.num_free_blocks
        return num_blocks * self.blocks.block_size - seq.num_computed

    def _allocate_for(self, seq: Sequence, num: int) -> None:
        if self.blocks.num_shared:
            self.forks.copy_on_write(seq, num, self._copies)
        need = self.blocks.blocks_for(seq.num_computed + num) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(self.blocks.allocate(need))

    def _preempt(self, seq: Sequence, preempted: list[str]) -> None:
        # Recompute, not swap: the prompt and every generated token run again from position 0.
        self.running.remove(seq)
        if seq.adapter_id:  # it may find its adapter in another slot when it starts again
            self.adapters.release(seq.adapter_id)
        self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_indexed_blocks = 0
        seq.status = SeqStatus.WAITING
        _insert_by_arrival(self.waiting, seq)
        preempted.append(seq.request_id)

    def _chunk(self, seq: Sequence, num: int, draft=()) -> ScheduledChunk:
        start = seq.num_computed
        num_tokens = len(seq.prompt_ids) + len(seq.output_ids)
        if num == 1 and start + 1 == num_tokens:  # a decode: its last token, no slicing
            token_ids = [seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1], *draft]
        else:
            token_ids = seq.token_slice(start, start + num)
        return ScheduledChunk(seq.request_id, token_ids, start, list(seq.block_table),
                              start + num == num_tokens, seq.adapter_slot, seq.adapter_strength,
                              len(seq.prompt_ids), len(draft))

    # --- apply --------------------------------------------------------------------------------

    def apply(self, plan: StepPlan, sampled: list[int]) -> list[SeqOutput]:
        """Advance by one planned step; `sampled` holds one id per sampled row
        (plan.sampled_request_ids), in order."""
        if plan.step != self.step and plan.step != self._continued_from:
            raise RuntimeError(f"applying step {plan.step} but the last plan was {self.step}")
        if plan.step == self._continued_from:
            self._continued_from = None
        num_sampling = len(plan.sampled_request_ids)
        if len(sampled) != num_sampling:
            raise RuntimeError(f"{len(sampled)} sampled ids for {num_sampling} sampling sequences")
        events, self._events = self._events, []
        self.num_draft_accepted = 0
        tokens = iter(sampled)
        reuse, block_size = self.reuse, self.blocks.block_size
        for chunk in plan.chunks:
            seq = self._by_id.get(chunk.request_id)
            if seq is None and plan.token_rows is not None:  # the step before ended it
                next(tokens)
                continue
            if chunk.num_draft:
                rows = [next(tokens) for _ in range(1 + chunk.num_draft)]
                events.append(self._take_drafted(seq, chunk, rows))
                continue
            seq.num_computed += len(chunk.token_ids)
            if (reuse is not None and seq.num_computed // block_size > seq.num_indexed_blocks
                    and seq.cache_prompt):
                reuse.register(seq)
            if not chunk.sample:
                continue
            if seq.sampling.max_tokens == 0:  # a scored prompt (n = 1): its sample is not kept
                next(tokens)
                self._finish(seq, "length")
                events.append(SeqOutput(seq.request_id, [], "length", len(seq.prompt_ids)))
                continue
            # Forked before any choice takes its token: a choice that ends now frees only its
            # own references.
            for member in (seq, *(self._fork(seq) if seq.fork_ids else ())):
                token = next(tokens)
                member.output_ids.append(token)
                reason = self._finish_reason(member, token)
                if reason is not None:
                    self._finish(member, reason)
                events.append(SeqOutput(member.request_id, [token], reason,
                                        len(member.prompt_ids), None, None,
                                        member.num_cached_tokens))
        return events

    def _take_drafted(self, seq: Sequence, chunk: ScheduledChunk, rows: list[int]) -> SeqOutput:
        """A drafted decode takes its accepted tokens one by one, as that many decodes would,
        up to a finish. Its last token's and the accepted drafts' KV is now computed; a rejected
        draft's lies past num_computed, never read, and is overwritten before the cache could
        index its block (register() hashes computed full blocks only)."""
        taken = accepted_tokens(rows, chunk.token_ids[1:])
        self.num_draft_accepted += len(taken) - 1
        note_outcome(seq, chunk.num_draft, len(taken) - 1)
        reason, num = None, 0
        while reason is None and num < len(taken):
            seq.output_ids.append(taken[num])
            num += 1
            reason = self._finish_reason(seq, taken[num - 1])
        seq.num_computed += num
        if (self.reuse is not None and seq.cache_prompt
                and seq.num_computed // self.blocks.block_size > seq.num_indexed_blocks):
            self.reuse.register(seq)
        if reason is not None:
            self._finish(seq, reason)
        return SeqOutput(seq.request_id, taken[:num], reason, len(seq.prompt_ids), None, None,
                         seq.num_cached_tokens)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        children = self.forks.fork(seq)
        for child in children:
            if child.adapter_id:
                self.adapters.acquire(child.adapter_id)
            self._by_id[child.request_id] = child
            _insert_by_arrival(self.running, child)
        return children

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.sampling
        num_output = len(seq.output_ids)
        # The leader masks the stop tokens under min_tokens; this holds even for a row it left
        # nothing else to draw (as vLLM's stop check, which skips until min_tokens).
        if num_output >= params.min_tokens and (
                token in params.request_stop_token_ids
                or (not params.ignore_eos and token in params.stop_token_ids)):
            return "stop"
        if self._at_length(seq, num_output):
            return "length"
        return None

    def _at_length(self, seq: Sequence, num_output: int) -> bool:
        """Whether num_output output tokens end seq by its length (max_tokens or the model's)."""
        return (num_output >= seq.sampling.max_tokens
                or len(seq.prompt_ids) + num_output >= self.limits.max_model_len)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.blocks.free(seq.block_table)
            if seq.adapter_id:
                self.adapters.release(seq.adapter_id)
        else:
            self.waiting.remove(seq)
            if seq.block_table:  # a sequence waiting on its reads from the spill
                self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        del self._by_id[seq.request_id]


def _insert_by_arrival(queue: list[Sequence], seq: Sequence) -> None:
    keys = [s.arrival for s in queue]
    queue.insert(bisect.bisect_right(keys, seq.arrival), seq)
