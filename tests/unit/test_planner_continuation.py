"""Planner.continue_decodes, async scheduling's plans: a step planned before the one before it is
applied gives every sequence the tokens and endings the synchronous loop gives it."""

from __future__ import annotations

from lorad.workers.step_plan import UNKNOWN_TOKEN, StepPlan
from tests.unit.test_planner import planner, seq

STOP = 2


def sampled_token(request_id: str, position: int) -> int:
    """The 'model': a token by request and position; b and d sample the stop token early."""
    if (request_id, position) in {("b", 9), ("d", 12), ("c", 25)}:
        return STOP
    return 100 + position % 50


def sampled(plan: StepPlan) -> list[int]:
    # The token a sampling chunk samples lies at the position after its last one: a
    # continuation's position is known even while its input token is not.
    return [sampled_token(c.request_id, c.start + len(c.token_ids))
            for c in plan.chunks if c.sample]


def plain_decodes(plan: StepPlan) -> bool:
    return bool(plan.chunks) and all(len(c.token_ids) == 1 and c.sample for c in plan.chunks)


ADMITS = [(0, ("a", 5, 1, {"max_tokens": 30})), (0, ("b", 3, 2, {"stop": [STOP]})),
          (0, ("c", 9, 3, {"stop": [STOP], "max_tokens": 30})),
          (6, ("d", 4, 4, {"stop": [STOP], "max_tokens": 40})),
          (9, ("e", 2, 5, {"max_tokens": 7}))]


def run(run_ahead: bool) -> tuple[dict, dict, int, int, object]:
    """The worker loop's rounds over the planner alone (loop.py's order): admissions only when
    no step is in flight; with run_ahead, a plain decode step is applied a round later, its
    continuation planned first. -> (tokens, endings, continuations, rows in vain, planner)."""
    p = planner(num_blocks=40, block_size=4, max_model_len=64)
    admits = list(ADMITS)
    tokens: dict[str, list[int]] = {}
    endings: dict[str, str] = {}
    in_flight, num_continued, num_in_vain, round_ = None, 0, 0, 0

    def record(plan: StepPlan) -> None:
        nonlocal num_in_vain
        live = {s.request_id for s in p.running}
        if plan.token_rows is not None:
            num_in_vain += sum(c.request_id not in live for c in plan.chunks)
        for event in p.apply(plan, sampled(plan)):
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
            if event.finish_reason:
                endings[event.request_id] = event.finish_reason

    while p.running or p.waiting or admits or in_flight is not None:
        due = [a for r, a in admits if r <= round_]
        if in_flight is not None:
            current, in_flight = in_flight, None
            if not due:  # a message waiting is applied between steps: nothing runs ahead
                in_flight = p.continue_decodes(current)
                num_continued += in_flight is not None
            record(current)
        else:
            for rid, prompt_len, arrival, kw in due:
                p.admit(seq(rid, prompt_len, arrival, **kw))
            admits = [(r, a) for r, a in admits if r > round_]
            plan = p.plan()
            if run_ahead and plain_decodes(plan):
                in_flight = plan
            else:
                record(plan)
        round_ += 1
    return tokens, endings, num_continued, num_in_vain, p


def test_running_ahead_gives_every_sequence_the_synchronous_tokens_and_endings():
    sync_tokens, sync_endings, _, _, _ = run(run_ahead=False)
    tokens, endings, num_continued, num_in_vain, p = run(run_ahead=True)
    assert tokens == sync_tokens and endings == sync_endings
    assert endings == {"a": "length", "b": "stop", "c": "stop", "d": "stop", "e": "length"}
    assert num_continued >= p.step // 2  # most decode steps ran ahead
    assert num_in_vain >= 2  # b, c or d ended on a stop token with its next row in flight
    assert p.blocks.num_free_blocks == p.blocks.num_blocks  # rows in vain leave no block behind


def decoding_planner(block_size=4):
    """Three sequences decoding; their last plan not applied."""
    p = planner(num_blocks=40, block_size=block_size)
    p.admit(seq("a", 3, 1, max_tokens=50))
    p.admit(seq("b", 4, 2, max_tokens=2))
    p.admit(seq("c", 6, 3, max_tokens=50))
    plan = p.plan()
    p.apply(plan, [7] * len(plan.sampled_request_ids))  # prompts done, one token each
    return p, p.plan()


def test_a_continuation_takes_each_token_from_its_row_and_grows_a_block_when_it_must():
    p, prev = decoding_planner()
    assert [(c.request_id, c.start) for c in prev.chunks] == [("a", 3), ("b", 4), ("c", 6)]
    tables = {s.request_id: list(s.block_table) for s in p.running}
    cont = p.continue_decodes(prev)
    # b has 1 of 2 tokens: prev's is its last (length), so it does not go on.
    assert [(c.request_id, c.start, c.token_ids) for c in cont.chunks] == \
        [("a", 4, [UNKNOWN_TOKEN]), ("c", 7, [UNKNOWN_TOKEN])]
    assert cont.token_rows == [0, 2] and cont.step == prev.step + 1
    a, c = (p.sequence(r) for r in ("a", "c"))
    assert len(tables["a"]) == 1 and a.block_table[:1] == tables["a"]
    assert len(a.block_table) == 2  # position 4 opens its second block
    assert c.block_table == tables["c"]  # position 7 is in its second block already
    assert [ch.block_table for ch in cont.chunks] == [a.block_table, c.block_table]
    assert p.continue_decodes(cont) is None  # not before prev is applied
    events = p.apply(prev, [11, 12, 13])
    assert [(e.request_id, e.token_ids, e.finish_reason) for e in events] == \
        [("a", [11], None), ("b", [12], "length"), ("c", [13], None)]
    events = p.apply(cont, [21, 23])
    assert [(e.request_id, e.token_ids) for e in events] == [("a", [21]), ("c", [23])]
    assert (a.num_computed, c.num_computed) == (5, 8)
    nxt = p.plan()  # the synchronous plan goes on from the continuation's tokens
    assert [(ch.request_id, ch.start, ch.token_ids) for ch in nxt.chunks] == \
        [("a", 5, [21]), ("c", 8, [23])]


def test_no_continuation_while_a_sequence_waits_or_no_block_is_free():
    p, prev = decoding_planner()
    p.admit(seq("w", 3, 9))
    assert p.continue_decodes(prev) is None
    p, prev = decoding_planner()
    while p.blocks.num_free_blocks:  # a needs a new block for position 4
        p.blocks.allocate(1)
    assert p.continue_decodes(prev) is None
    assert p.apply(prev, [1, 2, 3])  # prev is still the step to apply


def test_prefix_cache_blocks_shared_by_sequences_do_not_stop_a_continuation():
    from lorad.workers.block_manager import BlockManager
    from lorad.workers.planner import Planner, PlannerLimits
    from lorad.workers.sequence import Sequence
    from tests.unit.test_planner import params

    p = Planner(PlannerLimits(8, 32, 64), BlockManager(40, 4), prefix_cache=True)
    prompt = list(range(50, 59))  # 9 tokens: two full blocks to share, the third its own
    for i, rid in enumerate(("a", "b")):
        p.admit(Sequence(rid, prompt, params(), adapter_slot=0, adapter_key="", arrival=i))
        plan = p.plan()
        p.apply(plan, [7] * len(plan.sampled_request_ids))
    a, b = p.sequence("a"), p.sequence("b")
    assert a.block_table[:2] == b.block_table[:2] and p.blocks.num_shared == 2
    prev = p.plan()
    assert [c.request_id for c in prev.chunks] == ["a", "b"]
    cont = p.continue_decodes(prev)
    assert [(c.request_id, c.start) for c in cont.chunks] == [("a", 11), ("b", 10)]


def test_a_sequence_waiting_for_a_slot_does_not_stop_a_continuation_while_every_slot_is_taken():
    p = planner(num_blocks=40, block_size=4, max_num_seqs=2)
    for i, rid in enumerate(("a", "b", "w")):
        p.admit(seq(rid, 3, i + 1, max_tokens=3))
    plan = p.plan()
    p.apply(plan, [7] * len(plan.sampled_request_ids))
    assert [s.request_id for s in p.waiting] == ["w"]
    prev = p.plan()
    cont = p.continue_decodes(prev)  # a and b take both slots: w could not start anyway
    assert [c.request_id for c in cont.chunks] == ["a", "b"]
    p.apply(prev, [7, 7])
    p.apply(cont, [7, 7])  # a and b end by length: w starts in the next plan
    assert [(c.request_id, c.start) for c in p.plan().chunks] == [("w", 0)]
