"""A tiny Qwen2-MoE on CUDA (fused MoE kernel, LoRA kernels, decode graphs): logits against
transformers' Qwen2MoeForCausalLM + peft, graph replay against the same padded step run eagerly
(bit for bit) and against the plain eager step. The CPU suite checks the same model family against transformers in fp32 at 1e-5
(tests/integration/test_qwen2_moe_logits.py); here the GPU's kernels do the arithmetic.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorad.workers.batch import ForwardBatch
from lorad.workers.cuda_graph import DecodeGraphs
from lorad.workers.tuning import replaced
from tests.model_steps import (build_model, check_scenario_against_reference, make_streams,
                               rel_error)
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_qwen2_moe

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
BF16_REL_TOL = 5e-2  # as test_gpu_model.py's, against the fp32 reference
FP32_REL_TOL = 1e-4
BLOCK_SIZE = 4
MAX_LEN = 64
MAX_NUM_SEQS = 16
# Each of MAX_NUM_SEQS streams owns MAX_LEN // BLOCK_SIZE blocks; blocks 0 and the last are never
# handed out (make_streams).
NUM_BLOCKS = MAX_NUM_SEQS * (MAX_LEN // BLOCK_SIZE) + 2
MAX_ROWS = 128  # the matmul plans' row counts: past every step here
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, list[Path]]:
    """A tiny Qwen2-MoE (head_dim 16 for the kernels; 16 experts, top 4, a dense layer among
    the sparse ones) and two adapters: every servable projection, and the two writers (o_proj,
    the shared expert's down_proj) alone."""
    root = tmp_path_factory.mktemp("moe_gpu")
    checkpoint = make_tiny_qwen2_moe(root / "moe", with_tokenizer=False, hidden_size=96,
                                     num_experts=16, num_experts_per_tok=4, seed=11)
    adapters = [make_peft_adapter(checkpoint, root / "a1", r=4, seed=51, magnitude=0.1),
                make_peft_adapter(checkpoint, root / "a2", r=8, lora_alpha=16, seed=52,
                                  magnitude=0.1,
                                  target_modules=("o_proj", "shared_expert.down_proj"))]
    return checkpoint, adapters


@pytest.mark.parametrize("dtype,tol", [("bfloat16", BF16_REL_TOL), ("float32", FP32_REL_TOL)])
def test_logits_match_transformers_and_peft(tiny, dtype, tol):
    checkpoint, adapters = tiny
    model = build_model(checkpoint, adapters, DTYPES[dtype], CUDA, NUM_BLOCKS, BLOCK_SIZE)
    graphs = DecodeGraphs(model, 8, MAX_LEN, BLOCK_SIZE, num_adapters=len(adapters))
    graphs.capture()
    streams = make_streams([0, 1, 2, 1, 0], [7, 12, 5, 9, 3], MAX_LEN, BLOCK_SIZE, NUM_BLOCKS,
                           seed=3)
    check_scenario_against_reference(model, graphs, checkpoint, adapters, streams, BLOCK_SIZE,
                                     CUDA, tol, adapter_moves=10 * BF16_REL_TOL)


@pytest.mark.parametrize("pdl", [False, True])
def test_graph_replay_is_the_eager_step(tiny, pdl):
    """bf16 decode steps of 1 to 16 sequences (base and both adapters mixed): the captured
    graph's logits are bit for bit the same padded step run eagerly. (Not compared with the
    plain eager step, as the dense family's test does: its smaller matmuls round differently,
    and a router near a tie then sends a row to another expert, a change of any size.)"""
    checkpoint, adapters = tiny
    model = build_model(checkpoint, adapters, torch.bfloat16, CUDA, NUM_BLOCKS, BLOCK_SIZE)
    # The MoE blocks' kernels with PDL or without (MoeConfig.pdl, on by default).
    model.tune(replaced(model.tuning, f"moe.pdl={pdl}"))
    # As the engine starts. Without plans this test failed twice on an H100; a suspect: cuBLAS's
    # split-K products (the shared expert's fp32 partial sums) inside a capture.
    model.plan_matmuls(MAX_ROWS)
    graphs = DecodeGraphs(model, MAX_NUM_SEQS, MAX_LEN, BLOCK_SIZE, num_adapters=2)
    graphs.capture()
    padded_eager = DecodeGraphs(model, MAX_NUM_SEQS, MAX_LEN, BLOCK_SIZE, num_adapters=2)
    slots = [1, 0, 2, 1, 2, 0, 1, 2, 2, 1, 0, 1, 2, 0, 1, 2]
    streams = make_streams(slots, [5, 9, 3, 12, 7, 4, 10, 6, 8, 2, 11, 5, 3, 9, 6, 7], MAX_LEN,
                           BLOCK_SIZE, NUM_BLOCKS, seed=2)
    model.forward(ForwardBatch.build([s.prefill_chunk() for s in streams], BLOCK_SIZE, CUDA))
    gen = torch.Generator().manual_seed(5)
    for num_seqs in (11, 16, 3, 1, 9, 5):
        live = streams[:num_seqs]
        chunks = [s.decode_chunk(int(torch.randint(3, 384, (), generator=gen))) for s in live]
        assert graphs.can_run(chunks)
        replayed = graphs.run(chunks)
        assert torch.isfinite(replayed).all(), num_seqs
        eager = padded_eager.run(chunks)
        assert torch.equal(replayed, eager), (num_seqs, rel_error(replayed, eager))
