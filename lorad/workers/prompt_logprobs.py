"""Prompt log probabilities (completions' echo): for a sequence whose request asked
(SamplingParams.prompt_logprobs >= 0), the model's fp32 log-softmax at each prompt position its
prefill chunks run, and there the log probability of the prompt's NEXT token and the k most
likely ones.

Every rank picks the same rows from the replicated plan (take_rows), gets their final hidden
states from the step's forward and runs the LM head over them in slices (its all-gather is a
collective); only the leader computes log-softmax and top-k, and sends each step's share in its
StepResult. The last prompt position's logits are the first sample's (workers/logprobs.py), so a
prompt of n tokens gets n-1 values. Rows of sequences that did not ask are never touched, and
these rows occur only in prefill chunks, which run eagerly: decode graphs are unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lorad.protocol.messages import SeqOutput, TokenLogprobs
from lorad.workers.planner import Planner, StepPlan

# Rows whose logits exist at once: [256, vocab] fp32 is 50 MB at SmolLM2's 49,152 tokens.
LM_HEAD_SLICE_ROWS = 256


@dataclass(frozen=True)
class PromptRows:
    batch_rows: list[int]  # rows of the step's flat batch, in plan order
    # (request id, first prompt position, number of positions) per asking chunk, in plan order;
    # together they cover batch_rows
    spans: list[tuple[str, int, int]]


def take_rows(plan: StepPlan, planner: Planner) -> PromptRows | None:
    """The step's rows whose prompt log probabilities are due, counted as computed from now on
    (seq.num_prompt_logprobs), so a recompute after preemption skips them; None: no row (the
    common step). The same on every rank: it reads only replicated state."""
    batch_rows: list[int] = []
    spans: list[tuple[str, int, int]] = []
    row = 0  # ForwardBatch.build lays the chunks out back to back, in plan order
    for chunk in plan.chunks:
        num = len(chunk.token_ids)
        if num == 1 and chunk.sample:  # a decode, or a prompt's last position: never a value
            row += 1
            continue
        seq = planner.sequence(chunk.request_id)
        if seq.sampling.prompt_logprobs >= 0:
            first = max(chunk.start, seq.num_prompt_logprobs)
            end = min(chunk.start + num, len(seq.prompt_ids) - 1)
            if first < end:
                batch_rows.extend(range(row + first - chunk.start, row + end - chunk.start))
                spans.append((chunk.request_id, first, end - first))
                seq.num_prompt_logprobs = end
        row += num
    return PromptRows(batch_rows, spans) if batch_rows else None


@torch.inference_mode()
def compute(lm_head, hidden: torch.Tensor, rows: PromptRows, planner: Planner,
            is_leader: bool) -> dict[str, list[TokenLogprobs]]:
    """hidden: [len(rows.batch_rows), hidden] final hidden states -> request id -> its prompt
    positions' values, in prompt order (the leader; {} on followers, which run the LM head's
    collectives only)."""
    next_ids: list[int] = []  # the prompt's token after each row's position
    num_top: list[int] = []
    for request_id, first, num in rows.spans:
        seq = planner.sequence(request_id)
        next_ids += seq.prompt_ids[first + 1:first + 1 + num]
        num_top += [seq.sampling.prompt_logprobs] * num
    max_top = max(num_top)
    chosen: list[float] = []
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    for start in range(0, len(next_ids), LM_HEAD_SLICE_ROWS):
        logits = lm_head(hidden[start:start + LM_HEAD_SLICE_ROWS])  # [n, vocab] fp32, every rank
        if not is_leader:
            continue
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        ids = torch.tensor(next_ids[start:start + LM_HEAD_SLICE_ROWS], dtype=torch.int64,
                           device=log_probs.device)
        chosen += log_probs.gather(1, ids[:, None])[:, 0].tolist()
        top = torch.topk(log_probs, max_top, dim=-1)  # k = 0 gives [n, 0]
        top_values += top.values.tolist()
        top_ids += top.indices.tolist()
    if not is_leader:
        return {}
    found: dict[str, list[TokenLogprobs]] = {}
    n = 0
    for request_id, _, num in rows.spans:
        found.setdefault(request_id, []).extend(
            TokenLogprobs(chosen[i], top_ids[i][:num_top[i]], top_values[i][:num_top[i]])
            for i in range(n, n + num))
        n += num
    return found


def attach(events: list[SeqOutput], found: dict[str, list[TokenLogprobs]],
           planner: Planner) -> list[SeqOutput]:
    """The step's events with their prompt log probabilities; a sequence whose chunk sampled
    nothing (a prefill that goes on) gets an output of its own, without tokens."""
    if not found:
        return events
    left = dict(found)
    events = [dataclasses.replace(e, prompt_logprobs=left.pop(e.request_id))
              if e.request_id in left else e for e in events]
    return events + [SeqOutput(request_id, [], None,
                               planner.sequence(request_id).num_prompt_tokens, None, values)
                     for request_id, values in left.items()]
