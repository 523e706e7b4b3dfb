"""Log probabilities on the leader: the model's own fp32 log-softmax of a step's logits, for the
rows whose request asked (SamplingParams.num_logprobs >= 0), before the grammar mask and the
sampler's warpers touch them.

Only the asking rows are copied out (an index copy, so the mask's in-place write never reaches
them); rows that did not ask cost nothing and their logits, hence their tokens, are unchanged.
Mapping ids to text is the coordinator's (daemon/logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorad.protocol.messages import SamplingParams, TokenLogprobs


@dataclass
class PendingLogprobs:
    """A step's log-softmax of its asking rows, waiting for their sampled ids."""

    rows: list[int]  # positions in the step's sampled rows, ascending
    log_probs: torch.Tensor  # [len(rows), vocab] fp32
    top_values: torch.Tensor  # [len(rows), max_k] fp32, most likely first
    top_ids: torch.Tensor  # [len(rows), max_k] int64
    num_top: list[int]  # each row's own k (<= max_k)


def compute(logits: torch.Tensor, params: list[SamplingParams]) -> PendingLogprobs | None:
    """logits: [num_sampled, vocab], untouched by any mask yet -> the asking rows' values, or
    None when no row asked (the common step: nothing is computed)."""
    rows = [i for i, p in enumerate(params) if p.num_logprobs >= 0]
    if not rows:
        return None
    log_probs = torch.log_softmax(logits[rows].float(), dim=-1)  # [n, vocab], a copy
    num_top = [params[i].num_logprobs for i in rows]
    top = torch.topk(log_probs, max(num_top), dim=-1)  # k = 0 gives [n, 0]
    return PendingLogprobs(rows, log_probs, top.values, top.indices, num_top)


def complete(pending: PendingLogprobs | None, request_ids: list[str],
             sampled: list[int]) -> dict[str, TokenLogprobs]:
    """-> request id -> its sampled token's log probability and top alternatives, for the rows
    that asked; sampled holds one id per row of the step, in row order."""
    if pending is None:
        return {}
    chosen_ids = torch.tensor([sampled[i] for i in pending.rows], dtype=torch.int64,
                              device=pending.log_probs.device)
    chosen = pending.log_probs.gather(1, chosen_ids[:, None])[:, 0].tolist()  # [n]
    # One device-to-host copy each, not one per row.
    values, ids = pending.top_values.tolist(), pending.top_ids.tolist()
    return {request_ids[row]: TokenLogprobs(chosen[n], ids[n][:k], values[n][:k])
            for n, (row, k) in enumerate(zip(pending.rows, pending.num_top))}
