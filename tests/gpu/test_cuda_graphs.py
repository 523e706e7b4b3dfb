"""CUDA graphs of decode steps on a tiny random bf16 model with three adapters: replaying a
bucket's graph gives the bits of the same padded step run eagerly, stays within bf16 noise of the
plain eager step for every mixture of adapter slots, and padding writes no KV.
"""

from __future__ import annotations

import pytest
import torch

from lorad.workers.batch import ForwardBatch
from lorad.workers.cuda_graph import DecodeGraphs
from lorad.workers.kernels import pdl
from lorad.workers.tuning import replaced
from tests.model_steps import build_model, make_streams
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
BLOCK_SIZE = 4
NUM_BLOCKS = 300
MAX_LEN = 64
MAX_NUM_SEQS = 16
# max|graph - eager| / max|eager| over a step's logits. The only difference is the plain step's
# smaller matmul shapes (cuBLAS picks kernels by batch size), rounded in bf16.
BF16_REL_TOL = 5e-2
# Slots of the streams (0 = base), mixed so every bucket below holds several adapters.
SLOTS = [1, 0, 2, 3, 1, 2, 0, 3, 3, 1, 2, 0, 1, 3, 2, 1]
PROMPT_LENS = [5, 9, 3, 12, 7, 4, 10, 6, 8, 2, 11, 5, 3, 9, 6, 7]
# Live sequences per decode step: every bucket, partly and fully filled.
STEP_SIZES = (11, 16, 3, 1, 9, 5, 2, 8, 16, 4, 7)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    checkpoint = make_tiny_llama(root / "llama", with_tokenizer=False, seed=4)
    adapters = [make_peft_adapter(checkpoint, root / f"a{i}", r=2 + 3 * i, seed=30 + i,
                                  magnitude=0.2) for i in range(3)]
    return build_model(checkpoint, adapters, torch.bfloat16, CUDA, NUM_BLOCKS, BLOCK_SIZE)


def _kv_blocks_written(model, before: list[torch.Tensor]) -> set[int]:
    after = [t for layer in model.model.layers
             for t in (layer.self_attn.kv_cache.k, layer.self_attn.kv_cache.v)]
    written = set()
    for old, new in zip(before, after):  # [num_blocks, block_size, kv_heads, head_dim]
        written |= set(torch.nonzero((old != new).flatten(1).any(1)).flatten().tolist())
    return written


def _kv_snapshot(model) -> list[torch.Tensor]:
    return [t.clone() for layer in model.model.layers
            for t in (layer.self_attn.kv_cache.k, layer.self_attn.kv_cache.v)]


@pytest.fixture(scope="module")
def decode_run(model):
    """Prefill 16 streams, then decode steps of STEP_SIZES live streams three ways: the captured
    graph, the same padded step eagerly (an uncaptured runner), and the plain eager step."""
    graphs = DecodeGraphs(model, MAX_NUM_SEQS, MAX_LEN, BLOCK_SIZE, num_adapters=3)
    graphs.capture()
    padded_eager = DecodeGraphs(model, MAX_NUM_SEQS, MAX_LEN, BLOCK_SIZE, num_adapters=3)
    streams = make_streams(SLOTS, PROMPT_LENS, MAX_LEN, BLOCK_SIZE, NUM_BLOCKS, seed=2)
    model.forward(ForwardBatch.build([s.prefill_chunk() for s in streams], BLOCK_SIZE, CUDA))
    gen = torch.Generator().manual_seed(5)
    records = []
    for num_seqs in STEP_SIZES:
        live = streams[:num_seqs]
        chunks = [s.decode_chunk(int(torch.randint(3, 384, (), generator=gen))) for s in live]
        assert graphs.can_run(chunks)
        before = _kv_snapshot(model)
        replayed = graphs.run(chunks)
        written = _kv_blocks_written(model, before)
        expected_blocks = {s.blocks[(s.num_cached - 1) // BLOCK_SIZE] for s in live}
        eager_padded = padded_eager.run(chunks)
        plain = model.forward(ForwardBatch.build(chunks, BLOCK_SIZE, CUDA))
        records.append((num_seqs, replayed, eager_padded, plain, written, expected_blocks))
    return records


def test_graph_replay_matches_the_eager_step(decode_run):
    for num_seqs, replayed, _, plain, _, _ in decode_run:
        assert replayed.shape == plain.shape == (num_seqs, plain.shape[1])
        assert torch.isfinite(replayed).all()
        rel = ((replayed - plain).abs().max() / plain.abs().max()).item()
        assert rel < BF16_REL_TOL, (num_seqs, rel)


def test_graph_replay_is_bitwise_the_padded_step_run_eagerly(decode_run):
    """The same shapes and kernels, captured or not: the same bits."""
    mismatched = [(n, (r - e).abs().max().item()) for n, r, e, _, _, _ in decode_run
                  if not torch.equal(r, e)]
    assert not mismatched, mismatched


def test_padding_writes_no_kv(decode_run):
    for num_seqs, _, _, _, written, expected in decode_run:
        assert written <= expected, (num_seqs, sorted(written - expected))
        assert written, num_seqs  # the real rows did write


def test_programmatic_dependent_launch_changes_no_bit(model):
    """A graph captured with the kernels launched under PDL (kernels/pdl.py), the LoRA kernels
    letting their dependants launch at their end, gives the bits of the same padded step with
    them launched plainly (a Tuning whose PDL row limits are 0), eagerly."""
    if not pdl.use_pdl(CUDA, MAX_NUM_SEQS, model.tuning.pdl.max_rows):
        pytest.skip("PDL needs compute capability 9.0 (and steps within the PDL row limit)")
    with_pdl = model.tuning
    without_pdl = replaced(with_pdl, "pdl.max_rows=0+pdl.max_rows_with_lora=0")
    graphs = DecodeGraphs(model, MAX_NUM_SEQS, MAX_LEN, BLOCK_SIZE, num_adapters=3)
    graphs.capture()
    plain = DecodeGraphs(model, MAX_NUM_SEQS, MAX_LEN, BLOCK_SIZE, num_adapters=3)
    streams = make_streams(SLOTS, PROMPT_LENS, MAX_LEN, BLOCK_SIZE, NUM_BLOCKS, seed=3)
    model.forward(ForwardBatch.build([s.prefill_chunk() for s in streams], BLOCK_SIZE, CUDA))
    for num_seqs, token in ((16, 40), (5, 7), (1, 300)):
        chunks = [s.decode_chunk(token) for s in streams[:num_seqs]]
        replayed = graphs.run(chunks)
        model.tune(without_pdl)
        try:
            launched_plainly = plain.run(chunks)
        finally:
            model.tune(with_pdl)
        assert torch.equal(replayed, launched_plainly), num_seqs


def test_graphs_serve_any_adapter_mixture(model):
    """One stream's decode logits are the same whatever slots its neighbours use in the bucket."""
    graphs = DecodeGraphs(model, 8, MAX_LEN, BLOCK_SIZE, num_adapters=3)
    graphs.capture()
    results = []
    for neighbours in ([0, 0, 0], [1, 2, 3], [3, 3, 3], [2, 0, 1]):
        streams = make_streams([2] + neighbours, [6, 5, 7, 4], MAX_LEN, BLOCK_SIZE, NUM_BLOCKS,
                               seed=9)
        model.forward(ForwardBatch.build([s.prefill_chunk() for s in streams], BLOCK_SIZE,
                                         CUDA))
        results.append(graphs.run([s.decode_chunk(17) for s in streams])[0])
    for other in results[1:]:
        assert torch.equal(results[0], other)


def test_a_base_row_gets_the_same_bits_from_the_base_graph_and_the_lora_graph(model):
    """All rows on slot 0 replay the graph without LoRA launches; one adapter row among them
    replays the any-mixture graph. The base row must not notice which one ran."""
    graphs = DecodeGraphs(model, 8, MAX_LEN, BLOCK_SIZE, num_adapters=3)
    graphs.capture()
    assert graphs.graph_for(4, False) is not graphs.graph_for(4, True)
    results = []
    for neighbours in ([0, 0, 0], [1, 2, 3]):
        streams = make_streams([0] + neighbours, [6, 5, 7, 4], MAX_LEN, BLOCK_SIZE, NUM_BLOCKS,
                               seed=9)
        model.forward(ForwardBatch.build([s.prefill_chunk() for s in streams], BLOCK_SIZE,
                                         CUDA))
        results.append(graphs.run([s.decode_chunk(17) for s in streams])[0])
    assert torch.equal(results[0], results[1])
