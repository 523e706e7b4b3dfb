"""Checks of the paged attention kernels against the plain-torch reference, on any device.

test_triton_interpreted.py runs them on CPU tensors under TRITON_INTERPRET=1 in a subprocess
(`python -m tests.kernels.paged_attention_checks`), so the interpreter's setting and its patches
stay out of every other test; tests/gpu/test_paged_attention_gpu.py calls them on CUDA at real
shapes. Every check takes fresh random inputs, poisons its outputs, and raises AssertionError
naming what differed.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass

import torch

from tests.kernels.triton_interpreter import run_checks


@dataclass(frozen=True)
class Shape:
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    split_size: int  # decode: context tokens per split
    tile_size: int  # keys per step inside a split / a prefill program


TINY = Shape(num_kv_heads=2, head_dim=16, block_size=4, num_blocks=512, split_size=32,
             tile_size=16)
LLAMA_8B = Shape(num_kv_heads=8, head_dim=128, block_size=16, num_blocks=40000, split_size=256,
                 tile_size=64)
# Decode context lengths around the tiny shape's tile (16) and split (32) boundaries, 0 = padding.
TINY_CONTEXTS = [0, 1, 15, 16, 17, 31, 32, 33, 64, 65, 100]
# (new tokens, context length after them): chunks across query tiles, key tiles, one-token rows.
TINY_CHUNKS = [(1, 1), (5, 5), (3, 20), (1, 37), (20, 20), (17, 70), (70, 100), (2, 129)]



def decode_config(shape: Shape, split_programs: int | None = None):
    """The decode kernels' settings for `shape`'s split and tile (split_programs None: the
    default)."""
    from lorad.workers.kernels.configs import DecodeAttentionConfig
    config = DecodeAttentionConfig(split_size=shape.split_size, tile_tokens=shape.tile_size)
    if split_programs is None:
        return config
    return DecodeAttentionConfig(split_size=shape.split_size, tile_tokens=shape.tile_size,
                                 split_programs=split_programs)

def tolerance(dtype: torch.dtype) -> float:
    # bf16: p is rounded to bf16 before P @ V, and the output to bf16 (the reference stays fp32).
    return 1e-5 if dtype == torch.float32 else 3e-2


def randn(gen: torch.Generator, *size: int, dtype=torch.float32) -> torch.Tensor:
    """Normal samples on the generator's device (a GPU draws its own multi-GB caches)."""
    return torch.randn(size, generator=gen, device=gen.device).to(dtype)


def random_cache(shape: Shape, dtype: torch.dtype, gen: torch.Generator):
    size = (shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    return randn(gen, *size, dtype=dtype), randn(gen, *size, dtype=dtype)


def random_tables(shape: Shape, context_lens: list[int], rng: random.Random, device,
                  extra_blocks: int = 2) -> torch.Tensor:
    """Each sequence its own shuffled blocks; entries past its context hold other blocks' ids,
    which the kernels must never read."""
    pool = list(range(shape.num_blocks))
    rng.shuffle(pool)
    max_blocks = max(-(-n // shape.block_size) for n in context_lens) + extra_blocks
    rows = []
    for n in context_lens:
        used = -(-n // shape.block_size)
        rows.append(pool[:used] + [rng.randrange(shape.num_blocks)
                                   for _ in range(max_blocks - used)])
        pool = pool[used:]
    return torch.tensor(rows, dtype=torch.int32, device=device)


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    assert not got.isnan().any(), f"{what}: NaN left in the output (an element never written)"
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    assert err <= tol, f"{what}: max abs error {err:.3e} > {tol:.0e}"


def check_decode_matches_reference(device="cpu", dtype=torch.float32, group=4, shape=TINY,
                                   contexts=TINY_CONTEXTS, seed=0,
                                   preload: bool | None = None) -> None:
    from lorad.workers.kernels.paged_attention import paged_decode_attention
    from lorad.workers.kernels.paged_attention_reference import paged_decode_attention_reference

    gen, rng = torch.Generator(device).manual_seed(seed), random.Random(seed)
    contexts = list(contexts)
    rng.shuffle(contexts)
    k_cache, v_cache = random_cache(shape, dtype, gen)
    tables = random_tables(shape, contexts, rng, device)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    q_heads = group * shape.num_kv_heads
    q = randn(gen, len(contexts), q_heads, shape.head_dim, dtype=dtype)
    scale = shape.head_dim ** -0.5
    # Three rows past the sequences, as a batch padded to MIN_ROWS has: written with zeros.
    padded = torch.full((len(contexts) + 3, q_heads * shape.head_dim), float("nan"), dtype=dtype,
                        device=device)
    paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out=padded,
                           config=decode_config(shape), preload=preload)
    out = padded[:len(contexts)]
    want = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
    assert_close(out, want, tolerance(dtype), f"decode {dtype} group {group} preload {preload}")
    empty = lens == 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty])), "context 0 rows not zero"
    tail = padded[len(contexts):]
    assert torch.equal(tail, torch.zeros_like(tail)), "rows past the sequences not zero"


def check_decode_rows_independent_of_batch(device="cpu", dtype=torch.float32, group=3,
                                           shape=TINY, contexts=TINY_CONTEXTS,
                                           batch_sizes=(3,), seed=1,
                                           preload: bool | None = None) -> None:
    """A row has the same bits alone, in batches of other sizes and orders, beside padding rows,
    beside a longer neighbour that widens the block table (and so the grid), and with its splits
    taken by fewer programs, each looping over several. With preload None a row alone reads its
    first block ids early and in the other batches in the loop (preload_max_seqs is 1)."""
    from lorad.workers.kernels.paged_attention import paged_decode_attention

    gen, rng = torch.Generator(device).manual_seed(seed), random.Random(seed)
    contexts = [n for n in contexts if n > 0]
    long_context = max(contexts) + 2 * shape.split_size
    k_cache, v_cache = random_cache(shape, dtype, gen)
    all_contexts = contexts + [long_context]
    tables = random_tables(shape, all_contexts, rng, device)
    lens = torch.tensor(all_contexts, dtype=torch.int32, device=device)
    q = randn(gen, len(all_contexts), group * shape.num_kv_heads, shape.head_dim, dtype=dtype)
    scale = shape.head_dim ** -0.5

    def run(rows: list[int], pad: int = 0, split_programs: int | None = None) -> torch.Tensor:
        # Only as many table columns as this batch needs: the grid changes with the batch.
        width = max(-(-all_contexts[r] // shape.block_size) for r in rows)
        batch_tables = torch.cat([tables[rows, :width],
                                  torch.zeros(pad, width, dtype=torch.int32, device=device)])
        batch_lens = torch.cat([lens[rows], torch.zeros(pad, dtype=torch.int32, device=device)])
        batch_q = torch.cat([q[rows], randn(gen, pad, *q.shape[1:], dtype=dtype)])
        return paged_decode_attention(batch_q, k_cache, v_cache, batch_tables, batch_lens, scale,
                                      config=decode_config(shape, split_programs),
                                      preload=preload)

    everyone = list(range(len(all_contexts)))
    reference = run(everyone)
    by_length = sorted(everyone, key=all_contexts.__getitem__)
    batches = [[by_length[0]], [by_length[len(everyone) // 2]], [by_length[-1]], everyone[::-1]]
    for size in batch_sizes:
        order = everyone[:]
        rng.shuffle(order)
        batches += [order[i:i + size] for i in range(0, len(order), size)]
    # None: the default; 0: one program per split; 1 and 2: programs looping over splits.
    programs = [None, 0, 1, 2]
    for i, rows in enumerate(batches):
        got = run(rows, pad=i % 3, split_programs=programs[i % 4])
        for j, r in enumerate(rows):
            assert torch.equal(got[j], reference[r]), (
                f"decode row of context {all_contexts[r]} differs in batch {rows} "
                f"(split programs {programs[i % 4]}, preload {preload})")


def check_decode_preload_same_bits(device="cpu", dtype=torch.float32, group=4, shape=TINY,
                                   contexts=TINY_CONTEXTS, seed=4) -> None:
    """Reading each split's first block ids early (paged_decode_attention's `preload`) computes
    the same tiles in the same order: the same bits as reading them in the loop, with one
    program per split and with programs that loop over several splits (block ids read in the
    loop for every split past a program's first). The block tables are wider than any context, with
    other blocks' ids past each one, which must not be read as K or V."""
    from lorad.workers.kernels.paged_attention import paged_decode_attention

    gen, rng = torch.Generator(device).manual_seed(seed), random.Random(seed)
    k_cache, v_cache = random_cache(shape, dtype, gen)
    tables = random_tables(shape, contexts, rng, device, extra_blocks=9)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    q = randn(gen, len(contexts), group * shape.num_kv_heads, shape.head_dim, dtype=dtype)
    scale = shape.head_dim ** -0.5
    for split_programs in (0, 2):  # one program per split; programs taking two or more
        late, early = (paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                              config=decode_config(shape, split_programs),
                                              preload=preload)
                       for preload in (False, True))
        for i, n in enumerate(contexts):
            assert torch.equal(early[i], late[i]), (
                f"decode row of context {n}: other bits with the block ids read early "
                f"(split programs {split_programs})")


def check_prefill_matches_reference(device="cpu", dtype=torch.float32, group=4, shape=TINY,
                                    chunks=TINY_CHUNKS, seed=2) -> None:
    from lorad.workers.kernels.paged_attention_reference import paged_prefill_attention_reference
    from lorad.workers.kernels.paged_prefill_attention import paged_prefill_attention

    gen, rng = torch.Generator(device).manual_seed(seed), random.Random(seed)
    chunks = list(chunks)
    rng.shuffle(chunks)
    k_cache, v_cache = random_cache(shape, dtype, gen)
    contexts = [n for _, n in chunks]
    tables = random_tables(shape, contexts, rng, device)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    starts_list = [0]
    for num_new, _ in chunks:
        starts_list.append(starts_list[-1] + num_new)
    starts = torch.tensor(starts_list, dtype=torch.int32, device=device)
    q_heads = group * shape.num_kv_heads
    q = randn(gen, starts_list[-1], q_heads, shape.head_dim, dtype=dtype)
    scale = shape.head_dim ** -0.5
    out = torch.full((starts_list[-1], q_heads * shape.head_dim), float("nan"), dtype=dtype,
                     device=device)
    paged_prefill_attention(q, k_cache, v_cache, tables, lens, starts,
                            max(n for n, _ in chunks), scale, out=out, tile_size=shape.tile_size)
    want = paged_prefill_attention_reference(q, k_cache, v_cache, tables, lens, starts, scale)
    assert_close(out, want, tolerance(dtype), f"prefill {dtype} group {group}")

    # A chunk's rows have the same bits alone as beside its neighbours.
    for seq in rng.sample(range(len(chunks)), 3):
        first, last = starts_list[seq], starts_list[seq + 1]
        alone = paged_prefill_attention(
            q[first:last], k_cache, v_cache, tables[seq:seq + 1], lens[seq:seq + 1],
            torch.tensor([0, last - first], dtype=torch.int32, device=device), last - first,
            scale, tile_size=shape.tile_size)
        assert torch.equal(alone, out[first:last]), f"prefill chunk {chunks[seq]} differs alone"


def check_write_kv(device="cpu", dtype=torch.float32, shape=TINY, num_rows=13, seed=3) -> None:
    from lorad.workers.kernels.kv_cache_write import write_kv
    from lorad.workers.kernels.paged_attention_reference import write_kv_reference

    gen, rng = torch.Generator(device).manual_seed(seed), random.Random(seed)
    k_cache, v_cache = random_cache(shape, dtype, gen)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    slots = rng.sample(range(shape.num_blocks * shape.block_size), num_rows)
    for row in rng.sample(range(num_rows), num_rows // 3):
        slots[row] = -1
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    size = (num_rows, shape.num_kv_heads, shape.head_dim)
    k = randn(gen, *size, dtype=dtype)
    # v as a strided view, as a fused projection's output slice would be
    v = randn(gen, num_rows, shape.num_kv_heads, 2 * shape.head_dim, dtype=dtype)
    v = v[..., :shape.head_dim]
    write_kv(k, v, slot_mapping, k_cache, v_cache)
    write_kv_reference(k, v, slot_mapping, want_k, want_v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), "KV write differs"


# Scripted steps for the attention layer: (sequence, new tokens) per chunk, in batch order.
# Prompts in chunks alone and together, a one-token row in a mixed step, decode steps padded to
# MIN_ROWS rows and one of twelve sequences (unpadded). Prompt chunks are multiplied by
# `prompt_scale` (a GPU run takes contexts past the decode split).
ATTENTION_STEPS = [
    [("A", 40)], [("A", 30), ("B", 20)], [("A", 1), ("B", 10), ("C", 5)],
    [("A", 1), ("B", 1), ("C", 1)], [("C", 1), ("A", 1), ("B", 1)],
    [(f"D{i}", 3) for i in range(9)] + [("A", 1)],
    [("A", 1), ("B", 1), ("C", 1)] + [(f"D{i}", 1) for i in range(9)],
]


def check_attention_matches_cpu_path(device="cpu", dtype=torch.float32, group=3, shape=TINY,
                                     prompt_scale=1, seed=4) -> None:
    """The model's paged_attention on `device` (the Triton kernels) against the per-sequence CPU
    path, step by step over ATTENTION_STEPS: outputs, padding rows and the written caches."""
    from lorad.workers.attention import AttentionContext, paged_attention
    from lorad.workers.attention_cuda import CudaAttentionContext
    from lorad.workers.batch import ForwardBatch
    from lorad.workers.kv_cache import PagedKVCache

    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    steps = [[(name, n if n == 1 else n * prompt_scale) for name, n in schedule]
             for schedule in ATTENTION_STEPS]
    lengths: dict[str, int] = {}
    for schedule in steps:
        for name, n in schedule:
            lengths[name] = lengths.get(name, 0) + n
    tables = random_tables(shape, list(lengths.values()), rng, "cpu")
    table_of = {name: tables[i].tolist() for i, name in enumerate(lengths)}
    caches = {name: PagedKVCache(shape.num_blocks, shape.block_size, shape.num_kv_heads,
                                 shape.head_dim, dtype, torch.device(where))
              for name, where in (("cpu", "cpu"), ("device", device))}
    init_k, init_v = random_cache(shape, dtype, gen)
    for cache in caches.values():
        cache.k.copy_(init_k)
        cache.v.copy_(init_v)
    progress = dict.fromkeys(lengths, 0)
    scale = shape.head_dim ** -0.5
    for step, schedule in enumerate(steps):
        chunks = []
        for name, n in schedule:
            chunks.append(([7] * n, progress[name], table_of[name], True, 0))
            progress[name] += n
        batch_cpu = ForwardBatch.build(chunks, shape.block_size, "cpu")
        batch_dev = ForwardBatch.build(chunks, shape.block_size, device)
        # The CPU batch may have more padding rows than the device's (product_rows at 2+ torch
        # threads): each side takes its own count of the same rows.
        rows_cpu, rows_dev = batch_cpu.input_ids.shape[0], batch_dev.input_ids.shape[0]
        num_rows, real = max(rows_cpu, rows_dev), batch_cpu.num_tokens
        q = randn(gen, num_rows, group * shape.num_kv_heads, shape.head_dim, dtype=dtype)
        k = randn(gen, num_rows, shape.num_kv_heads, shape.head_dim, dtype=dtype)
        v = randn(gen, num_rows, shape.num_kv_heads, shape.head_dim, dtype=dtype)
        want = paged_attention(q[:rows_cpu], k[:rows_cpu], v[:rows_cpu], caches["cpu"],
                               AttentionContext.build(batch_cpu, shape.block_size), scale)
        ctx = AttentionContext.build(batch_dev, shape.block_size)
        if torch.device(device).type != "cuda":
            ctx = CudaAttentionContext.build(batch_dev)  # what build() picks on CUDA
        assert isinstance(ctx, CudaAttentionContext), "CUDA did not pick the kernels' context"
        assert ctx.is_decode == all(n == 1 for _, n in schedule)
        got = paged_attention(*(t[:rows_dev].to(device) for t in (q, k, v)), caches["device"],
                              ctx, scale).cpu()
        assert_close(got[:real], want[:real], tolerance(dtype), f"attention step {step}")
        assert not got[real:].any() and not want[real:].any(), \
            f"step {step}: padding rows not zero"
        assert torch.equal(caches["device"].k.cpu(), caches["cpu"].k) and \
            torch.equal(caches["device"].v.cpu(), caches["cpu"].v), f"step {step}: caches differ"


def kind_chunks(stretch: int) -> list[tuple[int, int, int]]:
    """(start, new tokens, the sequence's prompt length) of one mixed step's chunks, positions
    `stretch` times the tiny ones: a prompt chunk across key tiles, a decode, a preempted
    sequence's prompt computed again with the 13 x stretch tokens it had generated, a prompt's
    last token alone, and a decode."""
    s = stretch
    return [(30 * s, 20 * s, 60 * s), (44 * s, 1, 10 * s), (0, 25 * s, 12 * s),
            (10 * s - 1, 1, 10 * s), (32 * s, 1, 5 * s)]


def check_token_kinds_keep_their_bits(device="cpu", dtype=torch.float32, group=4, shape=TINY,
                                      stretch=1, seed=6) -> None:
    """In a mixed step (attention_cuda's path) each generated token's row has the bits the
    decode kernel gives that token alone, and each prompt token's row the bits of its prompt
    computed whole from position 0 by the prefill kernel: a token's arithmetic is its kind's,
    whatever shares its step or however its prompt is chunked."""
    from lorad.workers.attention_cuda import CudaAttentionContext, attend_cuda
    from lorad.workers.batch import ForwardBatch
    from lorad.workers.kernels.paged_attention import paged_decode_attention
    from lorad.workers.kernels.paged_prefill_attention import paged_prefill_attention
    from lorad.workers.kv_cache import PagedKVCache

    gen, rng = torch.Generator(device).manual_seed(seed), random.Random(seed)
    cache = PagedKVCache(shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim,
                         dtype, torch.device(device))
    cache.k.copy_(randn(gen, *cache.k.shape, dtype=dtype))  # every position's K/V written
    cache.v.copy_(randn(gen, *cache.v.shape, dtype=dtype))
    plan = kind_chunks(stretch)
    ends = [start + n for start, n, _ in plan]
    tables = random_tables(shape, ends, rng, device)
    chunks = [([7] * n, start, tables[i].tolist(), True, 0, 1.0, prompt_len)
              for i, (start, n, prompt_len) in enumerate(plan)]
    batch = ForwardBatch.build(chunks, shape.block_size, device)
    q_heads = group * shape.num_kv_heads
    q = randn(gen, batch.input_ids.shape[0], q_heads, shape.head_dim, dtype=dtype)
    scale, config = shape.head_dim ** -0.5, decode_config(shape)
    ctx = CudaAttentionContext.build(batch)
    assert not ctx.is_decode
    mixed = attend_cuda(q, cache, ctx, scale, config)
    checked = {"prompt": 0, "generated": 0}
    for i, (start, n, prompt_len) in enumerate(plan):
        first_row = batch.seqs[i].token_start
        for j in range(n):
            row, pos = first_row + j, start + j
            if pos >= prompt_len:  # generated: the decode kernel, the token alone
                want = paged_decode_attention(
                    q[row:row + 1], cache.k, cache.v, tables[i:i + 1],
                    torch.tensor([pos + 1], dtype=torch.int32, device=device), scale,
                    config=config)[0]
                kind = "generated"
            else:  # prompt: the prefill kernel, positions 0..pos in one chunk, this row last
                whole = q.new_zeros(pos + 1, q_heads, shape.head_dim)
                whole[pos] = q[row]
                want = paged_prefill_attention(
                    whole, cache.k, cache.v, tables[i:i + 1],
                    torch.tensor([pos + 1], dtype=torch.int32, device=device),
                    torch.tensor([0, pos + 1], dtype=torch.int32, device=device), pos + 1,
                    scale)[pos]  # the kernel's own tile, as attend_cuda launches it
                kind = "prompt"
            if not torch.equal(mixed[row], want):
                raise AssertionError(f"chunk {plan[i]} position {pos} ({kind}): other "
                                     "bits in the mixed step")
            checked[kind] += 1
    assert checked == {"prompt": 32 * stretch + 1, "generated": 13 * stretch + 2}, checked
    assert torch.equal(mixed[batch.num_tokens:], torch.zeros_like(mixed[batch.num_tokens:]))


# The interpreter's run: every GQA group in fp32, bf16 once per kernel (it is the same code).
CHECKS = {
    **{f"decode_fp32_group{g}": (check_decode_matches_reference, dict(group=g)) for g in (1, 3, 4)},
    "decode_bf16_group4": (check_decode_matches_reference, dict(dtype=torch.bfloat16, group=4)),
    "decode_batch_invariance_fp32": (check_decode_rows_independent_of_batch,
                                     dict(contexts=(0, 1, 17, 33, 64, 100))),
    # The same with the block ids read early at every batch, and its bits against late.
    "decode_fp32_group4_preload": (check_decode_matches_reference, dict(group=4, preload=True)),
    "decode_bf16_group3_preload": (check_decode_matches_reference,
                                   dict(dtype=torch.bfloat16, group=3, preload=True)),
    "decode_batch_invariance_fp32_preload": (check_decode_rows_independent_of_batch,
                                             dict(contexts=(0, 1, 17, 33, 64, 100),
                                                  preload=True)),
    "decode_preload_same_bits_fp32": (check_decode_preload_same_bits, {}),
    **{f"prefill_fp32_group{g}": (check_prefill_matches_reference, dict(group=g))
       for g in (1, 3, 4)},
    "prefill_bf16_group3": (check_prefill_matches_reference, dict(dtype=torch.bfloat16, group=3)),
    "write_kv_fp32": (check_write_kv, dict(dtype=torch.float32)),
    "write_kv_bf16": (check_write_kv, dict(dtype=torch.bfloat16)),
    "attention_matches_cpu_path": (check_attention_matches_cpu_path, {}),
    "token_kinds_keep_their_bits_fp32": (check_token_kinds_keep_their_bits, {}),
    "token_kinds_keep_their_bits_bf16_group3": (check_token_kinds_keep_their_bits,
                                                dict(dtype=torch.bfloat16, group=3)),
}


def main(names: list[str]) -> int:
    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
