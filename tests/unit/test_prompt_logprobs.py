"""Echo's prompt log probabilities on the workers (workers/prompt_logprobs.py, the planner's part):
which rows each step takes (every prompt position but the last exactly once, over chunks and a
preemption's recompute, none for sequences that did not ask), the values against a plain
log-softmax, the per-step cap, and max_tokens 0 scoring the prompt alone."""

from __future__ import annotations

import pytest
import torch

from lorad.protocol.messages import SamplingParams, SeqOutput
from lorad.workers import planner as planner_module
from lorad.workers import prompt_logprobs
from lorad.workers.block_manager import BlockManager
from lorad.workers.planner import Planner, PlannerLimits
from lorad.workers.sequence import Sequence


def params(prompt_logprobs=-1, max_tokens=4) -> SamplingParams:
    return SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0, max_tokens=max_tokens,
                          stop_token_ids=[], ignore_eos=True, prompt_logprobs=prompt_logprobs)


def seq(rid: str, prompt_len: int, arrival: int, **kw) -> Sequence:
    return Sequence(rid, [100 * arrival + i for i in range(prompt_len)], params(**kw), 0, "",
                    arrival=arrival)


def planner(num_blocks=64, block_size=4, budget=8, max_model_len=64) -> Planner:
    return Planner(PlannerLimits(8, budget, max_model_len), BlockManager(num_blocks, block_size))


def run(p: Planner, num_steps: int):
    """Step the planner as the loop does; -> per request the prompt positions taken, in order,
    the rows of each step (checked against the batch layout), and every event."""
    taken: dict[str, list[int]] = {}
    events: list[SeqOutput] = []
    for _ in range(num_steps):
        plan = p.plan()
        rows = prompt_logprobs.take_rows(plan, p)
        if rows is not None:
            starts = {}  # request id -> (first flat row, first position) of its chunk
            row = 0
            for chunk in plan.chunks:
                starts[chunk.request_id] = (row, chunk.start)
                row += len(chunk.token_ids)
            flat = []
            for request_id, first, num in rows.spans:
                taken.setdefault(request_id, []).extend(range(first, first + num))
                row, start = starts[request_id]
                flat += range(row + first - start, row + first - start + num)
            assert rows.batch_rows == flat
        events += p.apply(plan, [7] * len(plan.sampled_request_ids))
    return taken, events


def test_each_prompt_position_but_the_last_once_over_chunks_and_only_for_asking_sequences():
    p = planner(budget=8)
    p.admit(seq("echo", 19, 1, prompt_logprobs=2))
    p.admit(seq("plain", 5, 2))
    p.admit(seq("short", 1, 3, prompt_logprobs=0))  # one token: nothing before it to score
    taken, events = run(p, 8)
    assert taken == {"echo": list(range(18))}
    assert {e.request_id for e in events} == {"echo", "plain", "short"}


def test_a_preempted_prefill_recomputes_without_taking_its_positions_again():
    # 4 blocks of 4: old's decodes need the blocks that echo's long prefill holds.
    p = planner(num_blocks=4, block_size=4, budget=5, max_model_len=16)
    p.admit(seq("old", 4, 1, max_tokens=10))
    p.admit(seq("echo", 12, 2, prompt_logprobs=1, max_tokens=2))
    preempted = []
    taken: dict[str, list[int]] = {}
    for _ in range(40):
        plan = p.plan()
        preempted += plan.preempted
        rows = prompt_logprobs.take_rows(plan, p)
        for request_id, first, num in rows.spans if rows else ():
            taken.setdefault(request_id, []).extend(range(first, first + num))
        p.apply(plan, [7] * len(plan.sampled_request_ids))
    assert "echo" in preempted
    assert taken == {"echo": list(range(11))}
    assert not p.running and not p.waiting


def test_echo_chunks_share_the_per_step_cap(monkeypatch):
    monkeypatch.setattr(planner_module, "MAX_PROMPT_LOGPROBS_PER_STEP", 5)
    p = planner(budget=16)
    p.admit(seq("e1", 4, 1, prompt_logprobs=0))
    p.admit(seq("e2", 9, 2, prompt_logprobs=0))
    p.admit(seq("plain", 6, 3))
    p.admit(seq("e3", 4, 4, prompt_logprobs=0))
    plan = p.plan()
    # e1 gets 4, e2 the 1 left; the plain prompt is not capped, e3 must wait for the next step
    assert [(c.request_id, len(c.token_ids)) for c in plan.chunks] == \
        [("e1", 4), ("e2", 1), ("plain", 6)]
    p.apply(plan, [7] * len(plan.sampled_request_ids))
    plan = p.plan()
    assert [(c.request_id, len(c.token_ids)) for c in plan.chunks] == \
        [("e1", 1), ("plain", 1), ("e2", 5)]


def test_max_tokens_0_scores_the_prompt_and_generates_nothing():
    p = planner(budget=8)
    p.admit(seq("score", 10, 1, prompt_logprobs=1, max_tokens=0))
    p.admit(seq("nothing", 10, 2, max_tokens=0))  # no echo values asked: ends at once
    taken, events = run(p, 3)
    assert taken == {"score": list(range(9))}
    assert [(e.request_id, e.token_ids, e.finish_reason) for e in events] == \
        [("nothing", [], "length"), ("score", [], "length")]
    assert not p.running and not p.waiting and p.blocks.num_free_blocks == 64


def test_values_are_the_log_softmax_of_the_next_prompt_token_and_followers_only_gather(
        monkeypatch):
    monkeypatch.setattr(prompt_logprobs, "LM_HEAD_SLICE_ROWS", 3)  # several slices
    p = planner(budget=16)
    prompts = {"a": [4, 9, 33, 2, 48, 17], "b": [1, 2, 3, 4, 5], "c": [40, 41, 0, 49]}
    for arrival, (rid, k) in enumerate((("a", 3), ("b", -1), ("c", 0)), start=1):
        p.admit(Sequence(rid, prompts[rid], params(prompt_logprobs=k), 0, "", arrival=arrival))
    plan = p.plan()
    rows = prompt_logprobs.take_rows(plan, p)
    assert rows.batch_rows == [0, 1, 2, 3, 4] + [11, 12, 13]  # b's rows 6..10 are not taken
    hidden = torch.randn(len(rows.batch_rows), 8, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(50, 8, generator=torch.Generator().manual_seed(2))
    calls = []

    def lm_head(x):
        calls.append(x.shape[0])
        return x @ weight.T
    found = prompt_logprobs.compute(lm_head, hidden, rows, p, is_leader=True)
    leader_calls, calls[:] = list(calls), []
    assert prompt_logprobs.compute(lm_head, hidden, rows, p, is_leader=False) == {}
    assert calls == leader_calls == [3, 3, 2]
    reference = torch.log_softmax(hidden @ weight.T, dim=-1)  # [8, 50]
    next_ids = prompts["a"][1:] + prompts["c"][1:]
    assert set(found) == {"a", "c"} and len(found["a"]) == 5 and len(found["c"]) == 3
    for n, values in enumerate(found["a"] + found["c"]):
        assert abs(values.logprob - float(reference[n, next_ids[n]])) < 1e-5
        top = torch.topk(reference[n], 3 if n < 5 else 0)
        assert values.top_ids == top.indices.tolist()
        assert values.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)


def test_attach_gives_a_chunk_that_sampled_nothing_its_own_output():
    p = planner(budget=8)
    p.admit(seq("long", 12, 1, prompt_logprobs=0))
    p.admit(seq("done", 3, 2, prompt_logprobs=0))
    p.plan()
    values = {"long": ["x"] * 7, "done": ["y"] * 2}  # opaque here
    events = [SeqOutput("done", [7], None, 3)]
    out = prompt_logprobs.attach(events, values, p)
    assert out == [SeqOutput("done", [7], None, 3, None, ["y"] * 2),
                   SeqOutput("long", [], None, 12, None, ["x"] * 7)]
    assert prompt_logprobs.attach(events, {}, p) is events
