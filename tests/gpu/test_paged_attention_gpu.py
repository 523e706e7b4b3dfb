"""The paged attention kernels on CUDA at Llama-3-8B's shape (32 query / 8 KV heads, head_dim
128, blocks of 16 tokens, contexts up to 4096): against the plain-torch reference, a row's bits
across batches of 1 to 128 sequences, a decode step replayed from a CUDA graph with no host sync,
and the model's attention layer against the per-sequence CPU path in fp32.

The checks are tests/kernels/paged_attention_checks.py's, the ones the CPU interpreter runs on
tiny shapes.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from tests.kernels.paged_attention_checks import (
    LLAMA_8B, Shape, assert_close, check_attention_matches_cpu_path,
    check_decode_matches_reference, check_decode_preload_same_bits,
    check_decode_rows_independent_of_batch, check_prefill_matches_reference,
    check_token_kinds_keep_their_bits, check_write_kv,
    random_cache, random_tables, randn, tolerance)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton is not installed (the `gpu` extra)")]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Around the 16-token blocks, the 64-key tiles and the 256-token splits, then random up to 4096:
# 128 sequences, one of them a padding row (context 0).
_BOUNDARIES = [0, 1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 511, 512, 513, 1000, 2048, 4095,
               4096]
_rng = random.Random(2024)
CONTEXTS = _BOUNDARIES + [_rng.randrange(1, 4097) for _ in range(128 - len(_BOUNDARIES))]
# (new tokens, context length after them): long prompts, chunks of a long context, single tokens.
CHUNKS = [(1, 1), (1, 4096), (16, 16), (17, 300), (512, 512), (100, 3000), (300, 4000),
          (64, 1024), (1000, 2048), (2, 129), (255, 256)]


@pytest.mark.parametrize("group", (1, 3, 4))
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_reference(dtype, group):
    check_decode_matches_reference("cuda", DTYPES[dtype], group, LLAMA_8B, CONTEXTS)


@pytest.mark.parametrize("batch", (1, 8, 32, 64))
def test_decode_matches_reference_at_batch(batch):
    contexts = _rng.sample(CONTEXTS, batch)
    check_decode_matches_reference("cuda", torch.bfloat16, 4, LLAMA_8B, contexts, seed=batch)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_independent_of_batch(dtype):
    check_decode_rows_independent_of_batch("cuda", DTYPES[dtype], 4, LLAMA_8B, CONTEXTS,
                                           batch_sizes=(7, 32, 64))


# Each split's first block ids read early (by default only in steps of up to preload_max_seqs
# sequences): the same checks with it at every batch, and its bits against reading them in the
# loop.
def test_decode_with_early_block_ids_matches_reference():
    check_decode_matches_reference("cuda", torch.bfloat16, 4, LLAMA_8B, CONTEXTS, preload=True)


def test_decode_with_early_block_ids_rows_independent_of_batch():
    check_decode_rows_independent_of_batch("cuda", torch.bfloat16, 4, LLAMA_8B, CONTEXTS,
                                           batch_sizes=(7, 64), preload=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_early_block_ids_change_no_bit(dtype):
    check_decode_preload_same_bits("cuda", DTYPES[dtype], 4, LLAMA_8B, CONTEXTS)


@pytest.mark.parametrize("group", (1, 3, 4))
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_matches_reference(dtype, group):
    check_prefill_matches_reference("cuda", DTYPES[dtype], group, LLAMA_8B, CHUNKS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv(dtype):
    check_write_kv("cuda", DTYPES[dtype], LLAMA_8B, num_rows=128)


@pytest.mark.parametrize("prompt_scale", (1, 16))
def test_attention_layer_matches_the_cpu_path(prompt_scale):
    """fp32, through AttentionContext.build and paged_attention as the model calls them; with
    prompt_scale 16 the longest context (1126) spans five decode splits."""
    shape = Shape(num_kv_heads=8, head_dim=128, block_size=16, num_blocks=1024,
                  split_size=256, tile_size=64)
    check_attention_matches_cpu_path("cuda", torch.float32, 4, shape, prompt_scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_kinds_keep_their_bits(dtype):
    """In a mixed step a generated token's row is the decode kernel's for that token alone and
    a prompt token's the prefill kernel's for its whole prompt, bit for bit (contexts over two
    of the decode kernel's splits of 256)."""
    check_token_kinds_keep_their_bits("cuda", DTYPES[dtype], 4, LLAMA_8B, stretch=12)


def test_decode_step_replays_from_a_cuda_graph_without_host_sync():
    """Write + decode attention captured once over static buffers, replayed after the buffers
    are refilled with other contexts (padding rows among them): the same bits as an eager run."""
    from lorad.workers.attention_cuda import CudaAttentionContext, paged_attention_cuda
    from lorad.workers.kernels.paged_attention_reference import paged_decode_attention_reference
    from lorad.workers.kv_cache import PagedKVCache

    shape, dtype, group, num_seqs, max_blocks = LLAMA_8B, torch.bfloat16, 4, 16, 256
    gen, rng = torch.Generator("cuda").manual_seed(5), random.Random(5)
    cache = PagedKVCache(shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim,
                         dtype, torch.device("cuda"))
    cache.k, cache.v = random_cache(shape, dtype, gen)
    static = dict(
        q=torch.zeros(num_seqs, group * shape.num_kv_heads, shape.head_dim, dtype=dtype,
                      device="cuda"),
        k=torch.zeros(num_seqs, shape.num_kv_heads, shape.head_dim, dtype=dtype, device="cuda"),
        v=torch.zeros(num_seqs, shape.num_kv_heads, shape.head_dim, dtype=dtype, device="cuda"),
        slots=torch.full((num_seqs,), -1, dtype=torch.int64, device="cuda"),
        tables=torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device="cuda"),
        lens=torch.zeros(num_seqs, dtype=torch.int32, device="cuda"))
    ctx = CudaAttentionContext(static["slots"], static["tables"], static["lens"],
                               torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda"),
                               is_decode=True, max_query_len=1)
    scale = shape.head_dim ** -0.5

    def step() -> torch.Tensor:
        return paged_attention_cuda(static["q"], static["k"], static["v"], cache, ctx, scale)

    def fill(contexts: list[int]) -> None:
        tables = random_tables(shape, [max(n, 1) for n in contexts], rng, "cuda",
                               extra_blocks=0)
        static["tables"].zero_()
        static["tables"][:, :tables.shape[1]] = tables
        static["lens"].copy_(torch.tensor(contexts, dtype=torch.int32))
        last = [n - 1 for n in contexts]  # the new token's position
        slots = [int(tables[i, p // shape.block_size]) * shape.block_size + p % shape.block_size
                 if n > 0 else -1 for i, (n, p) in enumerate(zip(contexts, last))]
        static["slots"].copy_(torch.tensor(slots))
        for name in ("q", "k", "v"):
            static[name].copy_(randn(gen, *static[name].shape, dtype=dtype))

    fill([rng.randrange(1, 4097) for _ in range(num_seqs)])
    step()  # compiles the kernels
    torch.cuda.set_sync_debug_mode("error")  # any host sync in the step raises
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for trial in range(3):
        contexts = [0 if i % 5 == trial else rng.randrange(1, 4097) for i in range(num_seqs)]
        fill(contexts)
        k_before, v_before = cache.k.clone(), cache.v.clone()
        graph.replay()
        replayed, k_replayed, v_replayed = out.clone(), cache.k.clone(), cache.v.clone()
        cache.k.copy_(k_before)
        cache.v.copy_(v_before)
        eager = step()
        assert torch.equal(replayed, eager), f"trial {trial}: replay differs from eager"
        assert torch.equal(k_replayed, cache.k) and torch.equal(v_replayed, cache.v)
        padding = torch.tensor(contexts, device="cuda") == 0
        assert torch.equal(replayed[padding], torch.zeros_like(replayed[padding]))
        want = paged_decode_attention_reference(static["q"], cache.k, cache.v, static["tables"],
                                                static["lens"], scale)
        assert_close(replayed, want, tolerance(dtype), f"trial {trial}")
