"""A position's bits on the CPU do not depend on how its prompt was chunked: one prompt prefilled
whole, in chunks of several sizes, token by token (decode steps), and beside another sequence
gives the same logits, the same K/V in every layer and the same final hidden state at every
position, bit for bit, for the base model and an adapter, in fp32 and bf16, at one torch thread
and at two (whose bits are one thread's: batch.product_rows). What a prefix-cache hit relies on:
blocks computed by one request's steps are the blocks a cold prefill of another would compute.
"""

from __future__ import annotations

import random

import pytest
import torch

from lorad.workers.batch import ForwardBatch
from tests.model_steps import Stream, build_model, kv_of, prefill_rows
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama

BLOCK_SIZE = 4
PROMPT_LEN = 230  # past 193 keys, where MKL's sum over the context changes its blocking
PER_STREAM = -(-PROMPT_LEN // BLOCK_SIZE)
# Steps of 9 to 11 rows (and attention products of 10 query rows: 5 tokens x 2 queries per KV
# head) are where threaded MKL splits a product differently on this project's CPU (cpu_threads.py).
CHUNKINGS = ([None], [64, 64, 64, 38], [7] * 32 + [6], [1] * PROMPT_LEN, [229, 1], [100, 130],
             [9] * 25 + [5], [10] * 23, [11] * 20 + [10], [5] * 46)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunking")
    checkpoint = make_tiny_llama(root / "llama", with_tokenizer=False, seed=5)
    return checkpoint, make_peft_adapter(checkpoint, root / "a1", r=4, seed=31, magnitude=0.1)


def prefill(model, prompt: list[int], sizes: list, slot: int, stream_index: int,
            neighbour: Stream | None = None
            ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """-> (the last position's logits, each layer's K and V of the prompt's positions, every
    position's final hidden state)."""
    blocks = list(range(1 + stream_index * PER_STREAM, 1 + (stream_index + 1) * PER_STREAM))
    stream = Stream(list(prompt), slot, blocks, BLOCK_SIZE)
    logits, hidden = prefill_rows(model, stream, sizes, BLOCK_SIZE, neighbour=neighbour)
    return logits, kv_of(model, blocks, PROMPT_LEN), hidden


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_chunking_gives_the_same_bits(files, dtype, threads):
    try:
        check_chunkings(files, dtype, threads)
    finally:
        torch.set_num_threads(1)  # the module's rule (its one_thread fixture)


def check_chunkings(files, dtype, threads):
    checkpoint, adapter = files
    model = build_model(checkpoint, [adapter], dtype, torch.device("cpu"), 10 * PER_STREAM + 2,
                        BLOCK_SIZE)
    rng = random.Random(9)
    prompt = [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]
    with torch.inference_mode():
        for slot in (0, 1):
            torch.set_num_threads(1)  # the reference: one thread, the whole prompt at once
            want_logits, want_kv, want_hidden = prefill(model, prompt, [None], slot, 0)
            runs = [(sizes, None) for sizes in CHUNKINGS[1:]]
            # Beside a decoding neighbour of the other slot, in steps of 16 tokens.
            neighbour = Stream(prompt[:50], 1 - slot, list(range(1 + 8 * PER_STREAM,
                                                               1 + 9 * PER_STREAM)), BLOCK_SIZE)
            model.forward(ForwardBatch.build([neighbour.prefill_chunk()], BLOCK_SIZE))
            runs.append(([16] * 14 + [6], neighbour))
            torch.set_num_threads(threads)
            for index, (sizes, beside) in enumerate(runs, start=1):
                logits, kv, hidden = prefill(model, prompt, sizes, slot, index % 7, beside)
                assert torch.equal(logits, want_logits), (slot, sizes[:3])
                differ = (hidden != want_hidden).any(1).nonzero().flatten().tolist()
                assert not differ, (slot, sizes[:3], "final hidden states differ at", differ[:8])
                for i, (got, want) in enumerate(zip(kv, want_kv)):
                    assert torch.equal(got, want), (slot, sizes[:3], i)
