"""The CPU's paged attention batches sequences whose chunks have the same number of tokens (every
decode of a step): each sequence's rows must be, bit for bit, what the same chunk gives alone in
a step (attention.py's header), for decodes of unequal contexts, several prompt chunks, and a
mixture, in fp32 and bf16, at one and two threads (batch.product_rows)."""

from __future__ import annotations

import random

import pytest
import torch

from lorad.workers.attention import AttentionContext, paged_attention
from lorad.workers.batch import ForwardBatch
from lorad.workers.kv_cache import PagedKVCache

BLOCK_SIZE = 16
NUM_BLOCKS = 160
KV_HEADS, GROUP, HEAD_DIM = 3, 3, 64
CASES = {
    "decodes of unequal contexts": [(1, 5), (1, 63), (1, 64), (1, 65), (1, 200), (1, 0)],
    "prompt chunks": [(10, 0), (10, 100), (7, 30), (33, 64)],
    "a mixture": [(1, 140), (12, 0), (1, 9), (12, 40), (3, 3), (1, 300)],
}


def chunks_for(case: list[tuple[int, int]], rng: random.Random) -> list[tuple]:
    pool = list(range(1, NUM_BLOCKS))
    rng.shuffle(pool)
    chunks = []
    for num_tokens, start in case:
        table = [pool.pop() for _ in range(-(-(start + num_tokens) // BLOCK_SIZE))]
        chunks.append(([5] * num_tokens, start, table, True, 0))
    return chunks


def attend(chunks: list[tuple], q, k, v, cache: PagedKVCache) -> torch.Tensor:
    batch = ForwardBatch.build(chunks, BLOCK_SIZE)
    rows = batch.input_ids.shape[0]
    pad = (0, 0, 0, 0, 0, rows - q.shape[0])
    q, k, v = (torch.nn.functional.pad(t, pad) for t in (q, k, v))
    return paged_attention(q, k, v, cache, AttentionContext.build(batch, BLOCK_SIZE),
                           HEAD_DIM ** -0.5)[:batch.num_tokens]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_a_batched_sequence_gets_its_bits_alone(case, dtype, threads):
    rng = random.Random(list(CASES).index(case))
    gen = torch.Generator().manual_seed(7)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cache = PagedKVCache(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype,
                             torch.device("cpu"))
        cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
        cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
        chunks = chunks_for(CASES[case], rng)
        num_rows = sum(len(c[0]) for c in chunks)
        q = torch.randn(num_rows, KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
        k = torch.randn(num_rows, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(num_rows, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        together = attend(chunks, q, k, v, cache)
        row = 0
        for chunk in chunks:
            n = len(chunk[0])
            alone = attend([chunk], q[row:row + n], k[row:row + n], v[row:row + n], cache)
            assert torch.equal(together[row:row + n], alone), (case, chunk[:2])
            row += n
        assert together.abs().sum() > 0
    finally:
        torch.set_num_threads(before)
