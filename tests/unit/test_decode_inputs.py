"""DecodeInputs.fill, the decode graphs' inputs, on the CPU: a continuation's tokens gathered from
the step before's sampled ids (async scheduling) fill the buffers as the same ids given on the
host do."""

from __future__ import annotations

import torch

from lorad.workers.cuda_graph import DecodeInputs, bucket_sizes
from lorad.workers.step_plan import UNKNOWN_TOKEN

BLOCK_SIZE = 4


def chunks_with(tokens: list[int]) -> list[tuple]:
    # (token_ids, start, block_table, sample, adapter_slot, strength, prompt_len, num_draft)
    return [([token], 5 + 3 * i, [10 + i, 20 + i, 30 + i], True, i % 2, 1.0 - 0.25 * i, 3, 0)
            for i, token in enumerate(tokens)]


def buffers(inputs: DecodeInputs) -> list[torch.Tensor]:
    return [inputs.rows.clone(), inputs.strengths.clone(), inputs.context_lens.clone(),
            inputs.block_tables.clone()]


def test_tokens_from_the_sampled_rows_fill_as_the_same_tokens_on_the_host():
    sampled = torch.tensor([7, 301, 9, 44, 5])  # the step before's, one per its row
    rows = [1, 3, 4]  # its row 0 and 2 ended: no continuation
    bucket = next(b for b in bucket_sizes(8) if b >= 3)
    on_host, gathered = (DecodeInputs(8, 6, BLOCK_SIZE, torch.device("cpu")) for _ in range(2))
    on_host.fill(chunks_with([301, 44, 5]), bucket)
    gathered.rows.fill_(-7)  # whatever an earlier step left
    gathered.fill(chunks_with([UNKNOWN_TOKEN] * 3), bucket, (sampled, rows))
    for expected, got in zip(buffers(on_host), buffers(gathered)):
        assert torch.equal(expected, got)
    assert gathered.rows[0, :3].tolist() == [301, 44, 5]
