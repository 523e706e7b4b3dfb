"""lorad's tensor-parallel Qwen2-MoE gives transformers' logits, at world sizes 1, 2 and 3.

Tiny random Qwen2MoeForCausalLM checkpoints made by transformers (tests/tiny_models.py): routed
experts split unevenly over 3 ranks, a dense layer among sparse ones, q/k/v biases, top-k weights
renormalised or not. The same scripted batches as test_llama_logits.py (prefill chunks, mixed
decodes, a row alone and batched) through tests/tp_runner.py's gloo ranks; each sampled row is
compared with transformers' fp32 logits at the same position of the same full sequence.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.test_llama_logits import (BF16_REL_TOL, BLOCK_SIZE, FP32_REL_TOL,
                                                 NUM_BLOCKS, SEQS, STEPS, check_ranks_agree,
                                                 check_row_bits, check_scenarios, read)
from tests.tiny_models import make_tiny_qwen2_moe
from tests.tp_runner import launch_ranks

# name -> (make_tiny_qwen2_moe arguments, world sizes, dtype)
MODELS = {
    "moe_dense1": (dict(seed=3), (1, 2, 3), "float32"),
    "moe_norm_step2_tied": (dict(norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=(),
                                 num_hidden_layers=4, num_experts=6, num_experts_per_tok=2,
                                 tie_word_embeddings=True, seed=4), (1, 2, 3), "float32"),
    "moe_dense1_bf16": (None, (2,), "bfloat16"),  # moe_dense1's checkpoint
}
CHECKPOINT_OF = {"moe_dense1_bf16": "moe_dense1"}
CASES = [(world, name) for name, (_, worlds, _) in MODELS.items() for world in worlds]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_logits")
    paths = {name: make_tiny_qwen2_moe(root / name, with_tokenizer=False, **kwargs)
             for name, (kwargs, _, _) in MODELS.items() if kwargs is not None}
    return {**paths, **{name: paths[source] for name, source in CHECKPOINT_OF.items()}}


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory) -> dict[int, Path]:
    models = {world: [{"name": name, "dir": str(checkpoints[name]), "dtype": dtype,
                       "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "scenarios": STEPS}
                      for name, (_, worlds, dtype) in MODELS.items() if world in worlds]
              for world in (1, 2, 3)}
    return launch_ranks(models, tmp_path_factory.mktemp("moe_runs"))


@pytest.fixture(scope="module")
def reference(checkpoints) -> dict[tuple[str, str], torch.Tensor]:
    """(checkpoint, sequence) -> transformers' fp32 logits [seq_len, vocab] of the sequence."""
    from transformers import Qwen2MoeForCausalLM

    refs = {}
    for name, (kwargs, _, _) in MODELS.items():
        if kwargs is None:
            continue
        model = Qwen2MoeForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32,
                                                    attn_implementation="eager").eval()
        with torch.no_grad():
            for seq, ids in SEQS.items():
                refs[(name, seq)] = model(torch.tensor([ids])).logits[0]
    return refs


@pytest.mark.parametrize("world, model", CASES, ids=[f"world{w}-{m}" for w, m in CASES])
def test_logits_match_transformers(runs, reference, world, model):
    tol = BF16_REL_TOL if MODELS[model][2] == "bfloat16" else FP32_REL_TOL
    check_scenarios(read(runs, world, model), reference, CHECKPOINT_OF.get(model, model), tol)


@pytest.mark.parametrize("world, model", [c for c in CASES if c[0] > 1],
                         ids=[f"world{w}-{m}" for w, m in CASES if w > 1])
def test_every_rank_returns_the_same_logits(runs, world, model):
    check_ranks_agree(runs, world, model)


@pytest.mark.parametrize("world, model", CASES, ids=[f"world{w}-{m}" for w, m in CASES])
def test_row_bits_do_not_depend_on_the_batch(runs, world, model):
    """X's logits are the same bits alone and batched with P and Q, whose rows share experts."""
    check_row_bits(read(runs, world, model))
