"""The mixed-step graph runner's CPU-testable half (workers/mixed_graph.py): row buckets, which
steps qualify, the static inputs a replay reads (every row field and the LoRA tiles, padded), and
that the padded bucket step gives the plain step's logits and KV. Without a capture the runner
runs its padded step eagerly; tests/gpu/test_mixed_graphs_gpu.py checks the replay itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lorad.workers.batch import ForwardBatch
from lorad.workers.kernels.lora_tiles import host_tiles
from lorad.workers.mixed_graph import MixedGraphs, MixedInputs, row_buckets
from tests.model_steps import build_model, kv_of, make_streams
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama

BLOCK_SIZE = 4
NUM_BLOCKS = 96
MAX_LEN = 40


@pytest.mark.parametrize("max_rows,expected", [
    (8, [8]), (20, [8, 16, 20]), (64, [8, 16, 32, 64]), (100, [8, 16, 32, 64, 100]),
    (512, [8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512]),
    (130, [8, 16, 32, 64, 128, 130])])
def test_buckets_cover_every_row_count(max_rows, expected):
    assert row_buckets(max_rows) == expected


def test_static_inputs_hold_the_step_padded_and_its_tiles():
    inputs = MixedInputs(32, torch.device("cpu"), lora_block_m=4)
    chunks = [([5, 6, 7], 0, [3], True, 2, 0.5), ([9], 4, [1, 2], True, 0),
              ([8, 8], 2, [4], False, 1)]
    # A larger step first: the smaller one must overwrite every row of its bucket.
    inputs.fill(ForwardBatch.build([([1] * 15, 0, [5, 6, 7, 8], True, 3)], BLOCK_SIZE,
                                   min_rows=16), with_lora=True)
    live = ForwardBatch.build(chunks, BLOCK_SIZE, min_rows=8)
    inputs.fill(live, with_lora=True)
    batch = inputs.batch(8, live)
    for name in ("input_ids", "positions", "slot_mapping", "row_adapter_slots", "row_strengths"):
        assert torch.equal(getattr(batch, name), getattr(live, name)), name
    assert batch.slot_mapping.tolist()[6:] == [-1, -1]
    assert inputs.rows[2, 8:16].tolist() == list(range(28, 35)) + [-1]  # past the bucket: as left
    tile_slot, tile_rows, num_tiles = batch.lora_tiles
    want_slot, want_rows, want_count = host_tiles(np.array([2, 2, 2, 0, 1, 1] + [0] * 26),
                                                  4)
    assert num_tiles.tolist() == [want_count] == [2]
    assert tile_slot.tolist() == want_slot[:8].tolist()
    assert tile_rows.tolist() == want_rows[:8].tolist()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    checkpoint = make_tiny_llama(root / "llama", with_tokenizer=False, seed=3)
    adapters = [make_peft_adapter(checkpoint, root / f"a{i}", r=2 + 2 * i, seed=20 + i,
                                  magnitude=0.1) for i in range(3)]
    return [build_model(checkpoint, adapters, torch.float32, torch.device("cpu"), NUM_BLOCKS,
                        BLOCK_SIZE) for _ in range(2)]


def test_the_padded_step_gives_the_plain_steps_logits_and_kv(models):
    padded, plain = models
    graphs = MixedGraphs(padded, 48, BLOCK_SIZE, num_adapters=3)
    assert not graphs.captured
    slots, lens = [1, 0, 3, 2], [11, 6, 23, 5]
    streams = make_streams(slots, lens, MAX_LEN, BLOCK_SIZE, NUM_BLOCKS, seed=2)
    twins = make_streams(slots, lens, MAX_LEN, BLOCK_SIZE, NUM_BLOCKS, seed=2)

    def steps(s):
        return [[s[0].prefill_chunk(7), s[1].prefill_chunk(), s[2].prefill_chunk(9)],
                [s[0].prefill_chunk(), s[1].decode_chunk(12), s[2].prefill_chunk(),
                 s[3].prefill_chunk()],
                [s[0].decode_chunk(3), s[2].decode_chunk(4), s[3].decode_chunk(5)]]

    for i, (step, twin) in enumerate(zip(steps(streams), steps(twins))):
        assert graphs.can_run(step)
        got = graphs.run(step)
        want = plain.forward(ForwardBatch.build(twin, BLOCK_SIZE))
        assert torch.equal(got, want), f"step {i}"
    for a, b in zip(streams, twins):
        for x, y in zip(kv_of(padded, a.blocks, a.num_cached), kv_of(plain, b.blocks,
                                                                     b.num_cached)):
            assert torch.equal(x, y)


def test_can_run_bounds(models):
    graphs = MixedGraphs(models[0], 20, BLOCK_SIZE, num_adapters=3)
    assert graphs.buckets == [8, 16, 20]
    assert graphs.can_run([([1] * 12, 0, [0, 1, 2], True, 0), ([2] * 8, 0, [3, 4], True, 1)])
    assert not graphs.can_run([([1] * 21, 0, [0] * 6, True, 0)])  # past the largest bucket
    assert not graphs.can_run([])
    assert [graphs.bucket_for(n) for n in (1, 8, 9, 17, 20, 21)] == [8, 8, 16, 20, 20, None]
    with pytest.raises(RuntimeError, match="CUDA device"):
        graphs.capture()
