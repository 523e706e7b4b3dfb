"""A position's bits on the CPU do not depend on how its prompt was chunked: one prompt prefilled
whole, in chunks of several sizes, token by token (decode steps), and beside another sequence
gives the same logits and the same K/V in every layer, bit for bit, for the base model and an
adapter, in fp32 and bf16. What a prefix-cache hit relies on: blocks computed by one request's
steps are the blocks a cold prefill of another would compute.
"""

from __future__ import annotations

import random

import pytest
import torch

from lorad.workers.batch import ForwardBatch
from tests.model_steps import Stream, build_model
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama

BLOCK_SIZE = 4
PROMPT_LEN = 230  # past 193 keys, where MKL's sum over the context changes its blocking
PER_STREAM = -(-PROMPT_LEN // BLOCK_SIZE)
CHUNKINGS = ([None], [64, 64, 64, 38], [7] * 32 + [6], [1] * PROMPT_LEN, [229, 1], [100, 130])


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunking")
    checkpoint = make_tiny_llama(root / "llama", with_tokenizer=False, seed=5)
    return checkpoint, make_peft_adapter(checkpoint, root / "a1", r=4, seed=31, magnitude=0.1)


def prefill(model, prompt: list[int], sizes: list, slot: int, stream_index: int,
            neighbour: Stream | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """-> (the last position's logits, each layer's K and V of the prompt's positions)."""
    blocks = list(range(1 + stream_index * PER_STREAM, 1 + (stream_index + 1) * PER_STREAM))
    stream = Stream(list(prompt), slot, blocks, BLOCK_SIZE)
    logits = None
    for size in sizes:
        chunk = stream.prefill_chunk(size)
        chunks = [chunk] if neighbour is None else [neighbour.decode_chunk(11), chunk]
        out = model.forward(ForwardBatch.build(chunks, BLOCK_SIZE))
        if chunk[3]:
            logits = out[-1]
    kv = []
    for layer in model.model.layers:
        cache = layer.self_attn.kv_cache
        kv += [cache.k[blocks].flatten(0, 1)[:PROMPT_LEN].clone(),
               cache.v[blocks].flatten(0, 1)[:PROMPT_LEN].clone()]
    return logits, kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_chunking_gives_the_same_bits(files, dtype):
    checkpoint, adapter = files
    model = build_model(checkpoint, [adapter], dtype, torch.device("cpu"), 10 * PER_STREAM + 2,
                        BLOCK_SIZE)
    rng = random.Random(9)
    prompt = [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]
    with torch.inference_mode():
        for slot in (0, 1):
            want_logits, want_kv = prefill(model, prompt, [None], slot, 0)
            runs = [(sizes, None) for sizes in CHUNKINGS[1:]]
            # Beside a decoding neighbour of the other slot, in steps of 16 tokens.
            neighbour = Stream(prompt[:50], 1 - slot, list(range(1 + 8 * PER_STREAM,
                                                               1 + 9 * PER_STREAM)), BLOCK_SIZE)
            model.forward(ForwardBatch.build([neighbour.prefill_chunk()], BLOCK_SIZE))
            runs.append(([16] * 14 + [6], neighbour))
            for index, (sizes, beside) in enumerate(runs, start=1):
                logits, kv = prefill(model, prompt, sizes, slot, index % 7, beside)
                assert torch.equal(logits, want_logits), (slot, sizes[:3])
                for i, (got, want) in enumerate(zip(kv, want_kv)):
                    assert torch.equal(got, want), (slot, sizes[:3], i)
