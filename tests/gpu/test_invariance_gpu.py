"""On the GPU a token's bits do not depend on its step (issue 29's rule, tests/unit/
test_chunking_bits.py's on the CPU): a tiny bf16 Llama with an adapter, its matmul plans measured
(matmul_plan.py), its decode graphs captured.

- A prompt prefilled whole, in chunks of several sizes, with its last token alone, and beside a
  decoding neighbour gives the same last-position logits, the same K/V in every layer and the
  same final hidden state at every position (what the last layer computes reaches no KV).
- A sequence decoding through the graphs and the same sequence decoding inside mixed steps
  (beside another prompt's chunks) give the same logits at every step.
"""

from __future__ import annotations

import random

import pytest
import torch

from lorad.workers.batch import ForwardBatch
from lorad.workers.cuda_graph import DecodeGraphs
from tests.model_steps import Stream, build_model, kv_of, prefill_rows
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
BLOCK_SIZE = 4
PROMPT_LEN = 230
PER_STREAM = -(-(PROMPT_LEN + 16) // BLOCK_SIZE)
NUM_BLOCKS = 12 * PER_STREAM + 2
CHUNKINGS = ([64, 64, 64, 38], [7] * 32 + [6], [229, 1], [100, 130], [13] * 17 + [9])
MAX_ROWS = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance")
    checkpoint = make_tiny_llama(root / "llama", with_tokenizer=False, hidden_size=96,
                                 num_attention_heads=6, num_key_value_heads=3,
                                 intermediate_size=100, vocab_size=401, seed=5)
    adapter = make_peft_adapter(checkpoint, root / "a1", r=4, seed=31, magnitude=0.1)
    model = build_model(checkpoint, [adapter], torch.bfloat16, CUDA, NUM_BLOCKS, BLOCK_SIZE)
    model.plan_matmuls(MAX_ROWS)
    return model


def new_stream(prompt: list[int], slot: int, index: int) -> Stream:
    blocks = list(range(1 + index * PER_STREAM, 1 + (index + 1) * PER_STREAM))
    return Stream(list(prompt), slot, blocks, BLOCK_SIZE, prompt_len=len(prompt))


def forward(model, chunks) -> torch.Tensor:
    return model.forward(ForwardBatch.build(chunks, BLOCK_SIZE, CUDA))


def prefill(model, stream: Stream, sizes: list, neighbour: Stream | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the last position's logits, [prompt positions, hidden] final hidden states)."""
    return prefill_rows(model, stream, sizes, BLOCK_SIZE, CUDA, neighbour)


@pytest.mark.parametrize("slot", [0, 1])
def test_every_chunking_gives_the_same_bits(model, slot):
    rng = random.Random(9 + slot)
    prompt = [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]
    with torch.inference_mode():
        whole = new_stream(prompt, slot, 0)
        want_logits, want_hidden = prefill(model, whole, [None])
        want_kv = kv_of(model, whole.blocks, PROMPT_LEN)
        runs = [(sizes, None) for sizes in CHUNKINGS]
        neighbour = new_stream(prompt[:50], 1 - slot, 10)
        forward(model, [neighbour.prefill_chunk()])
        runs.append(([16] * 14 + [6], neighbour))
        for index, (sizes, beside) in enumerate(runs, start=1):
            stream = new_stream(prompt, slot, index)
            logits, hidden = prefill(model, stream, sizes, beside)
            assert torch.equal(logits, want_logits), (slot, sizes[:3])
            differ = (hidden != want_hidden).any(1).nonzero().flatten().tolist()
            assert not differ, (slot, sizes[:3], "final hidden states differ at", differ[:8])
            for i, (got, want) in enumerate(zip(kv_of(model, stream.blocks, PROMPT_LEN), want_kv)):
                assert torch.equal(got, want), (slot, sizes[:3], i)


@pytest.mark.parametrize("slot", [0, 1])
def test_a_decode_gets_the_same_bits_in_a_graph_and_beside_prompt_chunks(model, slot):
    graphs = DecodeGraphs(model, 8, PROMPT_LEN + 16, BLOCK_SIZE, num_adapters=1)
    graphs.capture()
    rng = random.Random(20 + slot)
    prompt = [rng.randrange(3, 300) for _ in range(40)]
    other = [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]
    tokens = [rng.randrange(3, 300) for _ in range(6)]
    with torch.inference_mode():
        alone, mixed = new_stream(prompt, slot, 0), new_stream(prompt, slot, 1)
        filler = new_stream(other, 1 - slot, 2)
        assert torch.equal(prefill(model, alone, [None])[0], prefill(model, mixed, [None])[0])
        for step, token in enumerate(tokens):
            chunks = [alone.decode_chunk(token)]
            assert graphs.can_run(chunks)
            in_graph = graphs.run(chunks)[0]
            beside = forward(model, [mixed.decode_chunk(token), filler.prefill_chunk(37)])[0]
            assert torch.equal(in_graph, beside), (slot, step)
