"""The decode-graph runner's CPU-testable half: buckets, which steps qualify, the static inputs
and their padding, and that a padded bucket step gives each real row the logits of the plain step
and writes no KV for padding. Without a capture the runner runs its padded step eagerly, which is
what a graph replays on CUDA (tests/gpu/test_cuda_graphs.py checks the replay itself).
"""

from __future__ import annotations

import pytest
import torch

from lorad.workers.batch import ForwardBatch
from lorad.workers.cuda_graph import DecodeGraphs, bucket_sizes, is_decode_step, rows_of
from tests.model_steps import build_model, make_streams
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama

BLOCK_SIZE = 4
NUM_BLOCKS = 96
MAX_LEN = 40


@pytest.mark.parametrize("max_num_seqs,expected", [
    (1, [1]), (2, [1, 2]), (8, [1, 2, 4, 8]), (64, [1, 2, 4, 8, 16, 32, 64]),
    (100, [1, 2, 4, 8, 16, 32, 64, 100]), (128, [1, 2, 4, 8, 16, 32, 64, 128])])
def test_buckets_cover_every_batch_size(max_num_seqs, expected):
    assert bucket_sizes(max_num_seqs) == expected
    assert [rows_of(b) for b in (1, 4, 8, 9, 128)] == [8, 8, 8, 9, 128]


def test_only_pure_decode_steps_qualify():
    decode = ([5], 7, [0, 1], True, 0)
    assert is_decode_step([decode, ([6], 3, [2], True, 2)])
    assert not is_decode_step([])
    assert not is_decode_step([decode, ([6, 7], 3, [2], True, 0)])  # a prompt chunk
    assert not is_decode_step([([6], 3, [2], False, 0)])  # a chunk that does not sample


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    checkpoint = make_tiny_llama(root / "llama", with_tokenizer=False, seed=3)
    adapters = [make_peft_adapter(checkpoint, root / f"a{i}", r=2 + 2 * i, seed=20 + i,
                                  magnitude=0.1) for i in range(3)]
    return build_model(checkpoint, adapters, torch.float32, torch.device("cpu"), NUM_BLOCKS,
                       BLOCK_SIZE)


def test_can_run_bounds(model):
    graphs = DecodeGraphs(model, max_num_seqs=4, max_model_len=16, block_size=BLOCK_SIZE,
                          num_adapters=3)
    step = [([1], 3, [0], True, 0)] * 4
    assert graphs.can_run(step)
    assert not graphs.can_run(step + [([1], 3, [0], True, 0)])  # beyond the largest bucket
    assert not graphs.can_run([([1], 16, [0, 1, 2, 3, 4], True, 0)])  # past max_model_len
    assert [graphs.bucket_for(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]


def test_static_inputs_are_padded(model):
    graphs = DecodeGraphs(model, max_num_seqs=8, max_model_len=MAX_LEN, block_size=BLOCK_SIZE,
                          num_adapters=3)
    inputs = graphs.inputs
    # A step of 7 first, so that the smaller step after it must overwrite what it left.
    inputs.fill([([9], 5, [1, 2], True, 1, 2.5)] * 7, 8)
    chunks = [([11], 5, [3, 4], True, 2, 0.5), ([12], 0, [5], True, 0),
              ([13], 8, [6, 7, 8], True, 3, 0.0)]
    inputs.fill(chunks, 4)
    seqs = inputs.seqs(chunks, 4)
    batch = inputs.batch(4, seqs)
    assert batch.input_ids.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]
    assert batch.positions.tolist() == [5, 0, 8, 0, 0, 0, 0, 0]
    assert batch.slot_mapping.tolist() == [4 * 4 + 1, 5 * 4, 8 * 4, -1, -1, -1, -1, -1]
    assert batch.row_adapter_slots.tolist() == [2, 0, 3, 0, 0, 0, 0, 0]
    assert batch.row_strengths.tolist() == [0.5, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # pads 1.0
    assert batch.row_strengths.data_ptr() == inputs.strengths.data_ptr()  # the static tensor
    assert batch.context_lens.tolist() == [6, 1, 9, 0]
    assert batch.block_tables[0, :2].tolist() == [3, 4]
    assert batch.block_tables[1, 0].item() == 5 and batch.block_tables[2].tolist()[:3] == [6, 7, 8]
    assert batch.block_tables[3].tolist() == [0] * graphs.max_blocks_per_seq
    assert batch.query_starts.tolist() == [0, 1, 2, 3, 4]
    assert batch.sample_rows.tolist() == [0, 1, 2, 3]
    assert [(s.token_start, s.num_tokens, s.context_len, s.adapter_slot) for s in seqs] == \
        [(0, 1, 6, 2), (1, 1, 1, 0), (2, 1, 9, 3), (3, 1, 0, 0)]
    # The real part is exactly what the eager batch of the same step holds.
    plain = ForwardBatch.build(chunks, BLOCK_SIZE, "cpu", min_rows=rows_of(4))
    for name in ("input_ids", "positions", "slot_mapping", "row_adapter_slots", "row_strengths"):
        assert torch.equal(getattr(batch, name), getattr(plain, name)), name
    assert torch.equal(batch.context_lens[:3], plain.context_lens)


def test_block_tables_follow_tables_grown_in_place(model):
    """fill() skips a staging row whose table is unchanged; a table the caller grows in place
    (the same list object, one block longer) and a row that changes sequence are written."""
    graphs = DecodeGraphs(model, max_num_seqs=4, max_model_len=MAX_LEN, block_size=BLOCK_SIZE,
                          num_adapters=3)
    inputs = graphs.inputs
    table_a, table_b = [3], [7, 8]
    for pos, grow in ((2, None), (3, None), (4, 5), (5, None), (8, 6)):
        if grow is not None:
            table_a.append(grow)  # in place, as a sequence's block list grows
        inputs.fill([([1], pos, table_a, True, 0), ([2], 5, table_b, True, 1)], 2)
        assert inputs.block_tables[0, :len(table_a)].tolist() == table_a
        assert inputs.block_tables[1, :2].tolist() == [7, 8]
        assert inputs.context_lens[:2].tolist() == [pos + 1, 6]
        assert inputs.rows[2, 0].item() == table_a[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    # Other sequences in the same rows, then one sequence: the spare row's table is zeroed.
    inputs.fill([([1], 1, [9], True, 0), ([2], 1, [10], True, 0)], 2)
    assert inputs.block_tables[:2, 0].tolist() == [9, 10]
    inputs.fill([([1], 1, [11], True, 0)], 2)
    assert inputs.block_tables[0, 0].item() == 11
    assert inputs.block_tables[1].tolist() == [0] * graphs.max_blocks_per_seq
    assert inputs.context_lens[:2].tolist() == [2, 0]


def test_lora_tiles_are_the_steps_tiles(model):
    """With adapters, the static inputs hold each step's LoRA row tiles, as LoraTiles.build
    makes them from the step's row slots: after a change of adapters, after the same adapters
    again (not rewritten), after a step all on the base model (which the LoRA graphs never see,
    so the tiles stay), and in a smaller bucket after a larger one."""
    from lorad.workers.kernels.lora_tiles import LoraTiles

    graphs = DecodeGraphs(model, max_num_seqs=32, max_model_len=MAX_LEN, block_size=BLOCK_SIZE,
                          num_adapters=3)
    inputs = graphs.inputs
    steps = [[1] * 20, [1, 2, 3, 0] * 5, [1, 2, 3, 0] * 5, [0] * 6, [3, 3, 0, 2, 1],
             [2] * 17 + [1] * 15, [0, 0, 1]]
    for adapters in steps:
        chunks = [([5], 3, [i + 1], True, slot) for i, slot in enumerate(adapters)]
        bucket = graphs.bucket_for(len(chunks))
        inputs.fill(chunks, bucket)
        if not any(adapters):
            continue  # the base graph runs: it reads no tiles
        rows = rows_of(bucket)
        want = LoraTiles.build(torch.tensor(adapters + [0] * (rows - len(adapters))), rows)
        got = inputs.batch(bucket, inputs.seqs(chunks, bucket)).lora_tiles
        for name, tensor in zip(("tile_slot", "tile_rows", "num_tiles"), got):
            assert torch.equal(tensor, getattr(want, name)), (adapters, name)
    # Without adapters loaded there is nothing to hold.
    plain = DecodeGraphs(model, max_num_seqs=4, max_model_len=MAX_LEN, block_size=BLOCK_SIZE,
                         num_adapters=0)
    plain.inputs.fill([([5], 3, [1], True, 0)], 1)
    assert plain.inputs.batch(1, []).lora_tiles is None


def _kv_snapshot(model) -> list[torch.Tensor]:
    return [t.clone() for layer in model.model.layers
            for t in (layer.self_attn.kv_cache.k, layer.self_attn.kv_cache.v)]


def test_padded_step_gives_the_plain_steps_logits(model):
    """Bucket steps (3 sequences in a bucket of 4, 9 in 16) against the plain eager step: the same
    bits for every real row, with a mixture of adapters at several strengths (rows of one adapter
    at different ones), and no KV written for padding."""
    graphs = DecodeGraphs(model, max_num_seqs=16, max_model_len=MAX_LEN, block_size=BLOCK_SIZE,
                          num_adapters=3)
    streams = make_streams([0, 1, 2, 3, 1, 0, 3, 2, 2], [5, 9, 3, 7, 4, 6, 2, 8, 5], MAX_LEN,
                           BLOCK_SIZE, NUM_BLOCKS, seed=1)
    model.forward(ForwardBatch.build([s.prefill_chunk() for s in streams], BLOCK_SIZE))
    for num_seqs in (3, 9, 1, 9):
        live = streams[:num_seqs]
        chunks = [s.decode_chunk(7 + i) for i, s in enumerate(live)]
        chunks = [chunk + ((0.5, 2.0, 1.0, 0.0)[i % 4],) if i % 3 else chunk
                  for i, chunk in enumerate(chunks)]
        before = _kv_snapshot(model)
        padded = graphs.run(chunks)
        written = [(a != b).flatten(1).any(1) for a, b in zip(before, _kv_snapshot(model))]
        real_blocks = {s.blocks[(s.num_cached - 1) // BLOCK_SIZE] for s in live}
        for changed in written:  # [num_blocks] bool per layer and K/V
            assert set(torch.nonzero(changed).flatten().tolist()) <= real_blocks
        plain = model.forward(ForwardBatch.build(chunks, BLOCK_SIZE))
        assert padded.shape == plain.shape == (num_seqs, model.config.vocab_size)
        assert torch.equal(padded, plain), (num_seqs, (padded - plain).abs().max())


def test_engine_sends_decode_steps_to_the_graphs(model):
    """Engine.forward: pure decode steps that fit go to the graph runner, others to the model."""
    from lorad.workers.engine import Engine
    from lorad.workers.planner import ScheduledChunk, StepPlan

    graphs = DecodeGraphs(model, max_num_seqs=2, max_model_len=MAX_LEN, block_size=BLOCK_SIZE,
                          num_adapters=3)
    ran = []
    real_run = graphs.run
    graphs.run = lambda chunks: ran.append(len(chunks)) or real_run(chunks)
    engine = Engine(model.tp, model.config, model, None, NUM_BLOCKS, BLOCK_SIZE, (), None, {},
                    graphs)
    streams = make_streams([1, 2, 0], [4, 3, 5], MAX_LEN, BLOCK_SIZE, NUM_BLOCKS, seed=4)

    def plan(chunks) -> StepPlan:
        return StepPlan(1, [ScheduledChunk(f"r{i}", *chunk) for i, chunk in enumerate(chunks)],
                        [])

    assert engine.forward(plan([s.prefill_chunk() for s in streams])).shape[0] == 3
    assert ran == []  # a prefill
    decodes = [s.decode_chunk(9) for s in streams[:2]]
    via_graphs = engine.forward(plan(decodes))
    assert ran == [2]
    assert torch.equal(via_graphs, model.forward(ForwardBatch.build(decodes, BLOCK_SIZE)))
    engine.forward(plan([s.decode_chunk(9) for s in streams]))  # 3 > the largest bucket
    assert ran == [2]
