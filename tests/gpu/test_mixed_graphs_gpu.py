"""Piecewise CUDA graphs of steps with prompt chunks (workers/mixed_graph.py) on a tiny random bf16
model with three adapters: every step, prompt chunks of mixed lengths beside decodes and with
base-only rows, gives the logits and KV of the same step run eagerly, bit for bit (matmul plans
measured first, as the engine does, so the bucket's padding rows change no row's bits); and
the deltas added in place after the matmul (a step of prompt-chunk size, LoraRows.in_place) give
the bits of the fp32 deltas that the next kernels add.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lorad.workers.batch import ForwardBatch
from lorad.workers.kernels.configs import ExpandSteps
from lorad.workers.mixed_graph import MixedGraphs
from lorad.workers.tuning import Tuning
from tests.model_steps import build_model, kv_of, make_streams
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
BLOCK_SIZE = 4
NUM_BLOCKS = 400
MAX_LEN = 96
MAX_ROWS = 128


def _model(root):
    checkpoint = make_tiny_llama(root / "llama", with_tokenizer=False, seed=4)
    adapters = [make_peft_adapter(checkpoint, root / f"a{i}", r=2 + 3 * i, seed=30 + i,
                                  magnitude=0.2) for i in range(3)]
    model = build_model(checkpoint, adapters, torch.bfloat16, CUDA, NUM_BLOCKS, BLOCK_SIZE)
    model.plan_matmuls(MAX_ROWS)
    return model


def _steps(streams):
    """Steps as a burst makes them: chunks of 13 and whole prompts beside decodes, a base-only
    step, a chunk alone, a step of decodes (also runnable through these graphs)."""
    s = streams
    steps = [[s[0].prefill_chunk(13), s[1].prefill_chunk(), s[2].prefill_chunk(5)],
             [s[0].prefill_chunk(), s[1].decode_chunk(17), s[2].prefill_chunk()],
             [s[3].prefill_chunk(), s[4].prefill_chunk(40)],  # base rows only (slots 0)
             [s[0].decode_chunk(5), s[1].decode_chunk(6), s[4].prefill_chunk(),
              s[2].decode_chunk(7), s[3].decode_chunk(9)],
             [s[5].prefill_chunk()],
             [x.decode_chunk(20 + i) for i, x in enumerate(s[:6])]]
    return [[list(chunk) for chunk in step] for step in steps]


def _twin_streams(seed: int):
    """Two identical sets of six streams (adapter slots 1, 2, 3, none, none, 2), one per model,
    the adapters' at strengths 0.7, 1.3, 1 and 0.45: a strength not 1.0 multiplies the delta
    before it is added, so a fused multiply-add there would show."""
    slots, lens = [1, 2, 3, 0, 0, 2], [29, 9, 17, 12, 70, 45]
    strengths = [0.7, 1.3, None, None, None, 0.45]
    return tuple(make_streams(slots, lens, MAX_LEN, BLOCK_SIZE, NUM_BLOCKS, seed=seed,
                              strengths=strengths) for _ in range(2))


def test_a_replayed_step_gives_the_eager_steps_bits(tmp_path):
    graphed, eager = _model(tmp_path / "g"), _model(tmp_path / "e")
    graphs = MixedGraphs(graphed, MAX_ROWS, BLOCK_SIZE, num_adapters=3)
    graphs.capture()
    streams, twins = _twin_streams(seed=3)
    ran = 0
    for step, twin in zip(_steps(streams), _steps(twins)):
        assert graphs.can_run(step)
        got = graphs.run(step)
        want = eager.forward(ForwardBatch.build(twin, BLOCK_SIZE, CUDA))
        assert torch.equal(got, want), f"step {ran}: the replay gave other logits"
        ran += 1
    for a, b in zip(streams, twins):
        assert a.num_cached == b.num_cached
        for x, y in zip(kv_of(graphed, a.blocks, a.num_cached),
                        kv_of(eager, b.blocks, b.num_cached)):
            assert torch.equal(x, y), "the replayed steps wrote other KV"
    assert ran == 6 and graphs.captured


def _in_place_rows(rows: int) -> Tuning:
    return dataclasses.replace(Tuning(), expand=ExpandSteps(in_place_rows=rows))


def test_deltas_added_in_place_give_the_deltas_bits(tmp_path):
    """Every step with prompt chunks adding its LoRA deltas into the base outputs in place
    (in_place_rows 1), eagerly and replayed, against the same steps with fp32 deltas left to the
    consumer kernels (in_place_rows 0): the same logits and KV, bit for bit."""
    in_place, deltas = _model(tmp_path / "p"), _model(tmp_path / "d")
    in_place.tune(_in_place_rows(1))
    deltas.tune(_in_place_rows(0))
    graphs = MixedGraphs(in_place, MAX_ROWS, BLOCK_SIZE, num_adapters=3)
    graphs.capture()
    streams, twins = _twin_streams(seed=5)
    for i, (step, twin) in enumerate(zip(_steps(streams), _steps(twins))):
        want = deltas.forward(ForwardBatch.build(twin, BLOCK_SIZE, CUDA))
        # Odd steps replayed, even ones eager: both in place.
        got = (graphs.run(step) if i % 2 else
               in_place.forward(ForwardBatch.build(step, BLOCK_SIZE, CUDA)))
        assert torch.equal(got, want), f"step {i}: in place gave other logits than the deltas"
    for a, b in zip(streams, twins):
        for x, y in zip(kv_of(in_place, a.blocks, a.num_cached),
                        kv_of(deltas, b.blocks, b.num_cached)):
            assert torch.equal(x, y), "in place wrote other KV than the deltas"
