"""The planner's fast paths (bench_host_step) against the plain code they replaced: the same
plans, preemptions and events on random traces with a small pool (so decodes preempt), cancels
and stop tokens. No model, no torch."""

from __future__ import annotations

import random

from lorad.protocol.messages import SamplingParams
from lorad.workers.agreement import live_digest
from lorad.workers.block_manager import BlockManager
from lorad.workers.planner import Planner, PlannerLimits, ScheduledChunk, StepPlan
from lorad.workers.sequence import Sequence, SeqStatus

STOP = 3


class ReferencePlanner(Planner):
    """Planner with plan(), its chunks and the finish test as they were written before."""

    def plan(self) -> StepPlan:
        self.step += 1
        budget = self.limits.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[str] = []
        budget = self._decodes(budget, scheduled, preempted)
        decoding = {id(s) for s, _ in scheduled}
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING or id(seq) in decoding:
                continue
            num = self._reserve_chunk(seq, min(seq.num_pending, budget), scheduled, preempted)
            if num:
                scheduled.append((seq, num))
                budget -= num
        budget = self._start_waiting(budget, scheduled, preempted)
        return StepPlan(self.step, [self._chunk(seq, num) for seq, num in scheduled], preempted)

    def _decodes(self, budget: int, scheduled: list, preempted: list[str]) -> int:
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING or not seq.is_decoding:
                continue
            if self._reserve(seq, 1, scheduled, preempted):
                scheduled.append((seq, 1))
                budget -= 1
            else:
                self._preempt(seq, preempted)
        return budget

    def _chunk(self, seq: Sequence, num: int) -> ScheduledChunk:
        start = seq.num_computed
        return ScheduledChunk(seq.request_id, seq.token_slice(start, start + num), start,
                              list(seq.block_table), start + num == seq.num_tokens,
                              seq.adapter_slot, seq.adapter_strength, len(seq.prompt_ids))

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.sampling
        if not params.ignore_eos and token in params.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.limits.max_model_len:
            return "length"
        return None


def new_sequence(rng: random.Random, arrival: int) -> Sequence:
    params = SamplingParams(0.0, 1.0, 0, 0, rng.randrange(1, 40), [STOP], rng.random() < 0.3)
    prompt = [rng.randrange(4, 100) for _ in range(rng.randrange(1, 50))]
    return Sequence(f"r{arrival}", prompt, params, rng.randrange(3), "", arrival=arrival)


def run_trace(seed: int) -> tuple[int, int]:
    """-> (preemptions, decode chunks) of the trace."""
    rng = random.Random(seed)
    limits = PlannerLimits(rng.choice([2, 8, 64]), rng.choice([8, 32]), 64)
    num_blocks, block_size = rng.choice([(16, 4), (24, 4), (12, 8)])
    planners = [cls(limits, BlockManager(num_blocks, block_size))
                for cls in (Planner, ReferencePlanner)]
    num_preempted = num_decodes = 0
    for arrival in range(1, 200):
        if rng.random() < 0.3:
            for p in planners:
                p.admit(new_sequence(random.Random(arrival), arrival))
        if rng.random() < 0.05 and planners[0].running:
            victim = rng.choice(planners[0].running).request_id
            assert planners[0].cancel(victim) == planners[1].cancel(victim)
        fast, reference = (p.plan() for p in planners)
        assert fast == reference, (seed, arrival)
        assert fast.batch_chunks() == [(c.token_ids, c.start, c.block_table, c.sample,
                                         c.adapter_slot, c.adapter_strength, c.prompt_len,
                                         c.num_draft) for c in reference.chunks]
        num_preempted += len(fast.preempted)
        num_decodes += sum(len(c.token_ids) == 1 and c.sample for c in fast.chunks)
        sampled = [rng.choice([STOP, 5, 6, 7]) for _ in fast.sampled_request_ids]
        assert planners[0].apply(fast, sampled) == planners[1].apply(reference, sampled)
        assert live_digest(planners[0].live()) == live_digest(planners[1].live())
    return num_preempted, num_decodes


def test_fast_paths_plan_as_the_reference_does():
    totals = [run_trace(seed) for seed in range(60)]
    assert sum(p for p, _ in totals) > 50 and sum(d for _, d in totals) > 1000, totals
