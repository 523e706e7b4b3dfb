"""N-gram drafting on its own and in the planner: what is drafted, within which limits, and what
a drafted decode takes from its sampled rows (fake ids, no model)."""

from __future__ import annotations

import dataclasses

from lorad.protocol.messages import Admit, SamplingParams, TokenBias
from lorad.workers.block_manager import BlockManager
from lorad.workers.ngram_draft import NgramIndex, accepted_tokens, may_draft
from lorad.workers.planner import Planner, PlannerLimits
from lorad.workers.sequence import Sequence

GREEDY = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0, max_tokens=100,
                        stop_token_ids=[], ignore_eos=False)


def seq_of(prompt: list[int], output: list[int] = (), **sampling) -> Sequence:
    return Sequence("a", list(prompt), dataclasses.replace(GREEDY, **sampling), 0, "", 1,
                    output_ids=list(output), draft=True)


def propose(tokens: list[int], max_draft: int = 4) -> list[int]:
    return NgramIndex().propose(seq_of(tokens), max_draft)


def test_the_longest_suffix_that_occurred_before_gives_the_tokens_after_it():
    # "2 3" occurred at 1..2 and "9 2 3" nowhere: the 2-gram's continuation
    assert propose([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9, 2]
    # "1 2 3" at 0..2 beats "2 3" at 6..7 (more recent, but a shorter match)
    assert propose([1, 2, 3, 7, 8, 2, 3, 6, 1, 2, 3], 2) == [7, 8]


def test_the_most_recent_occurrence_wins_and_nothing_is_found_without_a_repeat():
    assert propose([5, 6, 1, 5, 6, 2, 5, 6], 1) == [2]
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([1, 2, 3, 1]) == []  # a lone token is below NGRAM_MIN
    assert propose([4]) == []


def test_a_loop_is_drafted_past_the_sequence_end():
    # "a b c a b c a b": the match ends 3 before the end; the draft repeats with period 3
    assert propose([1, 2, 3, 1, 2, 3, 1, 2], 6) == [3, 1, 2, 3, 1, 2]
    assert propose([7, 7, 7], 3) == [7, 7, 7]


def test_the_index_follows_a_growing_sequence():
    seq = seq_of([1, 2, 3, 4], [])
    index = NgramIndex()
    assert index.propose(seq, 3) == []
    seq.output_ids += [1, 2]
    assert index.propose(seq, 3) == [3, 4, 1]
    seq.output_ids += [9, 3, 4]
    assert index.propose(seq, 2) == [1, 2]  # "3 4" at 2..3 then "1 2" after it
    assert index.num_indexed == seq.num_tokens - 1
    assert index.propose(seq, 2) == NgramIndex().propose(seq, 2)


def test_accepted_tokens_stop_at_the_first_row_that_differs():
    assert accepted_tokens([5, 6, 7], [5, 6]) == [5, 6, 7]  # both drafts and a bonus token
    assert accepted_tokens([5, 9, 7], [5, 6]) == [5, 9]
    assert accepted_tokens([4, 6, 7], [5, 6]) == [4]


def test_requests_that_may_not_be_drafted_for():
    def admit(**kw) -> Admit:
        fields = {k: kw.pop(k) for k in ("grammar", "n", "draft") if k in kw}
        return Admit(1, "r", [1], dataclasses.replace(GREEDY, **kw), 0, "", **fields)
    assert may_draft(admit())
    refused = [admit(draft=False), admit(grammar="start: /a/"), admit(n=2),
               admit(num_logprobs=0), admit(prompt_logprobs=0), admit(presence_penalty=0.5),
               admit(repetition_penalty=1.1), admit(logit_bias=[TokenBias(3, 1.0)]),
               admit(min_tokens=2)]
    assert not any(may_draft(a) for a in refused)


# --- in the planner -------------------------------------------------------------------------

def planner(k=4, num_blocks=64, block_size=4, budget=32, max_model_len=64,
            free_rows=None) -> Planner:
    return Planner(PlannerLimits(8, budget, max_model_len, k, free_rows),
                   BlockManager(num_blocks, block_size))


def started(p: Planner, prompt: list[int], first: int, rid="a", **sampling) -> Sequence:
    """A drafting sequence admitted and prefilled, its first token `first` sampled."""
    seq = Sequence(rid, list(prompt), dataclasses.replace(GREEDY, **sampling), 0, "",
                   len(p.running) + len(p.waiting) + 1, draft=True)
    p.admit(seq)
    plan = p.plan()
    p.apply(plan, [first] * len(plan.sampled_request_ids))
    return seq


def test_a_decode_carries_its_draft_and_every_row_samples():
    p = planner()
    seq = started(p, [1, 2, 3, 4, 1, 2], 3)  # "2 3" repeats: draft 4 1 2 3
    plan = p.plan()
    (chunk,) = plan.chunks
    assert (chunk.token_ids, chunk.start, chunk.num_draft) == ([3, 4, 1, 2, 3], 6, 4)
    assert plan.sampled_request_ids == ["a"] * 5 and plan.num_draft_tokens == 4
    assert len(chunk.block_table) == 3  # positions 6..10
    events = p.apply(plan, [4, 1, 9, 5, 5])  # the first two drafts, then 9 instead of 2
    assert events[0].token_ids == [4, 1, 9] and p.num_draft_accepted == 2
    assert seq.output_ids == [3, 4, 1, 9] and seq.num_computed == 9 and seq.num_pending == 1


def test_drafts_are_capped_by_max_tokens_the_model_length_and_the_budget():
    p = planner(k=8)
    started(p, [1, 2, 1, 2, 1, 2], 1, max_tokens=4)
    assert p.plan().chunks[0].num_draft == 2  # 3 tokens left: 2 drafts and the row after
    p = planner(k=8, max_model_len=10)
    started(p, [1, 2, 1, 2, 1, 2], 1)
    assert p.plan().chunks[0].num_draft == 2  # 7 tokens, at most 10
    p = planner(k=8, budget=3)
    started(p, [1, 2, 1], 2)
    assert p.plan().chunks[0].num_draft == 2


def test_on_the_cpu_drafts_fill_the_rows_a_step_computes_anyway():
    """draft_free_rows (the CPU's MIN_ROWS): rows up to it cost nothing, so any draft may fill
    them; past them only a sequence whose last draft was wholly taken drafts."""
    p = planner(k=4, free_rows=8)
    started(p, [1, 2, 1, 2, 1, 2], 1, rid="a")
    assert p.plan().chunks[0].num_draft == 4  # 1 + 4 rows of 8
    p = planner(k=4, free_rows=8, num_blocks=128, budget=64)
    seqs = [Sequence(str(i), [1, 2, 1, 2, 1, 2], GREEDY, 0, "", i + 1, draft=True)
            for i in range(6)]
    for seq in seqs:
        p.admit(seq)
    plan = p.plan()  # the six prefills
    p.apply(plan, [1] * 6)
    plan = p.plan()  # 6 decodes leave 2 free rows: the first takes them, the rest none
    assert [c.num_draft for c in plan.chunks] == [2, 0, 0, 0, 0, 0]
    p.apply(plan, [2, 1, 7, *[7] * 5])  # "0" takes both drafts and a bonus token
    assert seqs[0].draft_taken_whole and not seqs[1].draft_taken_whole
    seqs[0].output_ids[-3:] = [1, 2, 1]  # still repeating
    plan = p.plan()  # "0" may draft past the free rows; the others still may not
    assert [c.num_draft for c in plan.chunks] == [4, 0, 0, 0, 0, 0]
    assert plan.num_draft_tokens == 4


def two_started(p: Planner) -> None:
    """Two drafting sequences of 8 tokens in a pool of 4-token blocks, each holding 2 blocks:
    its next position (7) fits them, a draft (8 on) does not."""
    for arrival, prompt in enumerate(([1, 2, 1, 2, 1, 2, 1], [5, 6, 7, 8, 5, 6, 7]), start=1):
        p.admit(Sequence("ab"[arrival - 1], prompt, GREEDY, 0, "", arrival, draft=True))
    plan = p.plan()
    p.apply(plan, [2, 8])


def test_drafts_take_only_free_blocks_and_never_preempt():
    p = planner(k=8, num_blocks=4, block_size=4, max_model_len=16)
    two_started(p)
    plan = p.plan()  # no block is free for a draft
    assert [c.num_draft for c in plan.chunks] == [0, 0]
    assert plan.preempted == [] and p.blocks.num_free_blocks == 0
    p = planner(k=8, num_blocks=5, block_size=4, max_model_len=16)
    two_started(p)
    plan = p.plan()  # a's draft takes the one free block (positions 8..11), b's finds none
    assert [c.num_draft for c in plan.chunks] == [4, 0] and p.blocks.num_free_blocks == 0
    assert plan.preempted == []


def test_a_finish_inside_the_accepted_tokens_ends_the_sequence_there():
    p = planner()
    seq = started(p, [1, 2, 3, 4, 9, 5, 1, 2], 3, stop_token_ids=[9])  # draft 4 9 5 1
    plan = p.plan()
    assert plan.chunks[0].token_ids == [3, 4, 9, 5, 1]
    events = p.apply(plan, [4, 9, 5, 1, 2])  # every draft matches; 9 is a stop token
    assert (events[0].token_ids, events[0].finish_reason) == ([4, 9], "stop")
    assert seq.output_ids == [3, 4, 9] and p.running == [] and p.blocks.num_free_blocks == 64


def test_a_sequence_that_may_not_draft_decodes_one_token():
    p = planner()
    seq = started(p, [1, 2, 1, 2], 1)
    seq.draft = False
    assert p.plan().chunks[0].token_ids == [1]


def test_drafting_matches_the_undrafted_tokens_and_blocks_of_a_greedy_rule():
    """A fake model whose next token is a function of the sequence: drafted or not, the
    sequence generates the same tokens, and the prefix cache indexes the same blocks."""
    def next_token(tokens: list[int]) -> int:
        return (tokens[-1] * 3 + len(tokens) // 5) % 7

    outputs = []
    for k in (0, 3):
        p = Planner(PlannerLimits(8, 32, 64, k), BlockManager(64, 4), prefix_cache=True)
        seq = Sequence("a", [1, 2, 3, 1, 2, 3], dataclasses.replace(GREEDY, max_tokens=40),
                       0, "", 1, draft=True)
        p.admit(seq)
        while p.running or p.waiting:
            plan = p.plan()
            sampled = []
            for chunk in plan.chunks:  # each row's token from the tokens up to and at it
                known = seq.prompt_ids + seq.output_ids
                rows = range(1 + chunk.num_draft) if chunk.sample else ()
                sampled += [next_token(known + chunk.token_ids[1:1 + i]) for i in rows]
            p.apply(plan, sampled)
        outputs.append((seq.output_ids, p.blocks.num_cached_blocks))
    assert outputs[0] == outputs[1] and len(outputs[0][0]) == 40


def test_drafts_leave_the_blocks_the_head_of_the_queue_waits_for():
    p = planner(k=8, num_blocks=6, block_size=4, max_model_len=16)
    two_started(p)
    p.admit(Sequence("c", [9] * 10, GREEDY, 0, "", 3, draft=True))  # needs 3 blocks, 2 free
    plan = p.plan()
    assert [(c.request_id, c.num_draft) for c in plan.chunks] == [("a", 0), ("b", 0)]
    assert p.blocks.num_free_blocks == 2
    p = planner(k=8, num_blocks=8, block_size=4, max_model_len=16)
    two_started(p)
    p.admit(Sequence("c", [9] * 10, GREEDY, 0, "", 3, draft=True))
    plan = p.plan()  # c starts on 3 of the 4 free blocks; a drafts into the last one
    assert [(c.request_id, c.num_draft) for c in plan.chunks] == [("a", 4), ("b", 0), ("c", 0)]


def test_a_drafted_chunk_samples_every_row_of_the_batch():
    from lorad.workers.batch import ForwardBatch
    from lorad.workers.step_plan import ScheduledChunk, StepPlan

    chunks = [ScheduledChunk("p", [1, 2, 3], 0, [0], True, 0, 1.0, 3),  # a prompt, forked
              ScheduledChunk("d", [5, 6, 7], 9, [1, 2], True, 1, 0.5, 4, 2),  # 2 drafts
              ScheduledChunk("e", [8], 4, [3], True, 0, 1.0, 2)]
    plan = StepPlan(1, chunks, [], {"p": ["p/1"]}, num_draft_tokens=2)
    assert plan.sampled_request_ids == ["p", "p/1", "d", "d", "d", "e"]
    assert plan.logits_rows == [0, 0, 1, 2, 3, 4]
    batch = ForwardBatch.build(plan.batch_chunks(), block_size=8)
    assert batch.sample_rows.tolist() == [2, 3, 4, 5, 6]
    assert [s.num_prompt for s in batch.seqs] == [3, 0, 0]


def test_a_wholly_rejected_draft_backs_off_doubling_and_a_taken_one_resets():
    p = planner()
    seq = started(p, [1, 2, 3, 1, 2, 3, 1, 2], 3)

    def decode(rows_of) -> int:
        """One step whose sequence ends in "2 3" (so a draft is found: fake ids, no model);
        rows_of(draft) -> the sampled rows. -> the step's number of draft tokens."""
        seq.output_ids[-2:] = [2, 3] if len(seq.output_ids) > 1 else seq.output_ids[-2:]
        plan = p.plan()
        (chunk,) = plan.chunks
        p.apply(plan, rows_of(chunk.token_ids[1:]))
        return chunk.num_draft

    def reject(draft):  # every row differs from its draft token: nothing taken
        return [7] * (1 + len(draft))

    def accept(draft):  # every draft token taken, then a bonus token
        return [*draft, 7]

    assert decode(reject) == 4 and seq.draft_backoff == 1
    assert decode(reject) == 0  # skipped once
    assert decode(reject) == 1 and seq.draft_backoff == 2  # 1: none taken of the last
    assert [decode(reject) for _ in range(2)] == [0, 0]  # skipped twice
    assert decode(accept) == 1 and seq.draft_backoff == 0
    assert decode(reject) == 4  # a wholly taken draft: the next decode drafts at once, whole


def test_a_partly_taken_draft_limits_the_next_to_one_more_than_it_took():
    p = planner()
    seq = started(p, [1, 2, 3, 1, 2, 3, 1, 2], 3)

    def decode(num_taken: int) -> int:
        seq.output_ids[-2:] = [2, 3] if len(seq.output_ids) > 1 else seq.output_ids[-2:]
        plan = p.plan()
        (chunk,) = plan.chunks
        draft = chunk.token_ids[1:]
        p.apply(plan, [*draft[:num_taken], 7, *[7] * (len(draft) - num_taken)])
        return chunk.num_draft

    assert decode(1) == 4  # one of four taken
    assert decode(2) == 2  # at most 1 + 1; both taken: no limit
    assert decode(4) == 4
